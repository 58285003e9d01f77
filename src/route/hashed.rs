//! A request's prefix as routing keeps it: checkpoints along the whole
//! prompt, where its own part starts, and the keys placement derives.

use crate::config::Config;
use crate::prefix::{self, Checkpoint, Probe};
use crate::request::{self, Prompt};

/// A request's prefix, hashed once and kept until the stream ends: its
/// checkpoints along the whole prompt, and its length in blocks.
#[derive(Debug, Default, Clone)]
pub struct Hashed {
    pub checkpoints: Vec<Checkpoint>,
    /// The whole blocks before the request's own part (after its system,
    /// developer and tool messages); 0 without such a preamble.
    pub lead_blocks: u32,
    /// A conversation's or agent session's later turn: more than one
    /// message of its own (see `trunk::agreed_below_lead`).
    pub later_turn: bool,
    /// The prefixes asked for by `parse_probing` that the prompt reaches.
    pub probes: Vec<Probe>,
    /// The whole prompt's length in bytes and hash (its partial last
    /// block too): what a later prompt that starts with all of it probes
    /// equal to (the affinity cookie's anchor).
    pub end: Option<Probe>,
}

fn lead_blocks(lead_bytes: usize, own_messages: u32, cfg: &Config) -> u32 {
    if own_messages == 0 {
        return 0;
    }
    u32::try_from(lead_bytes / cfg.block_bytes.max(1)).unwrap_or(u32::MAX)
}

impl Hashed {
    pub fn of(prompt: &Prompt, cfg: &Config) -> Hashed {
        let seed = prefix::seed(&prompt.model, prompt.cache_salt.as_deref());
        let cps = prefix::checkpoints(seed, &prompt.text, cfg.block_bytes, &cfg.schedule());
        Hashed {
            end: prefix::end(seed, &prompt.text, cfg.block_bytes, &cps),
            checkpoints: cps,
            lead_blocks: lead_blocks(prompt.lead_bytes, prompt.own_messages, cfg),
            later_turn: prompt.own_messages > 1,
            probes: Vec::new(),
        }
    }

    /// Parse a body and hash its whole prompt in one pass: the rendered
    /// prompt goes straight into the checkpoint hasher, never into one
    /// buffer (a long prompt costs a parse and a hash, not a copy).
    pub fn parse(
        body: &[u8],
        cfg: &Config,
    ) -> Result<(request::Header, Hashed), request::ParseError> {
        Self::parse_probing(body, cfg, None)
    }

    /// `parse`, also hashing the prefixes of `probes` bytes and the
    /// prompt's end when asked (see `prefix::Hasher::probing`: the
    /// affinity cookie's).
    pub fn parse_probing(
        body: &[u8],
        cfg: &Config,
        probes: Option<&[u32]>,
    ) -> Result<(request::Header, Hashed), request::ParseError> {
        let (header, hasher) = request::extract_into(body, cfg.max_body_bytes, |h| {
            let seed = prefix::seed(&h.model, h.cache_salt.as_deref());
            let hasher = prefix::Hasher::new(seed, cfg.block_bytes, &cfg.schedule());
            match probes {
                Some(p) => hasher.probing(p),
                None => hasher,
            }
        })?;
        let lead_blocks = lead_blocks(header.lead_bytes, header.own_messages, cfg);
        let later_turn = header.own_messages > 1;
        let (checkpoints, probes, end) = hasher.finish_probed();
        Ok((
            header,
            Hashed {
                checkpoints,
                lead_blocks,
                later_turn,
                probes,
                end,
            },
        ))
    }

    /// Whole blocks in the prompt (the last checkpoint ends there).
    pub fn blocks(&self) -> u32 {
        self.checkpoints.last().map_or(0, |c| c.blocks)
    }

    pub fn is_empty(&self) -> bool {
        self.checkpoints.is_empty()
    }

    /// The hash of the prefix of `blocks` blocks, if a checkpoint ends
    /// there (what an index match names).
    pub(super) fn checkpoint_at(&self, blocks: u32) -> Option<u64> {
        self.checkpoints
            .binary_search_by_key(&blocks, |c| c.blocks)
            .ok()
            .and_then(|i| self.checkpoints.get(i))
            .map(|c| c.hash)
    }

    /// The placement key of a request: the hash at its first checkpoint
    /// no replica holds (the whole prompt's if every one is held). Content
    /// below a shared trunk is keyed by where it diverges, not by the trunk,
    /// so new documents after one long preamble spread over the pool, and
    /// the same content gets the same key wherever it is seen.
    ///
    /// A short continuation of a held prefix (a question on a document) is
    /// keyed by its own new content too, so when the prefix's holder is
    /// too busy its requests spill over several replicas. Keying them by
    /// the held prefix instead, so they all spill to one agreed replica
    /// (fewer copies, and the same one in every gateway instance), was
    /// tried: the hot documents of long-preamble queued behind their two
    /// homes (TTFT p95 1,659-1,778 against 1,308-1,347), and it showed no
    /// clear gain with three instances. Pricing a document's second
    /// rendezvous home as holding it, so that every instance splits its
    /// questions between the same two replicas, was tried for several
    /// gateways: on shared-prefix with 15 groups and 3 instances the share
    /// went from 1.60 to 1.32, but the second copies overfilled the KV
    /// caches (hit rate 89.5% against 95.5%, TTFT p95 1,378 against 126).
    ///
    /// With instances that must agree, a request with a preamble is keyed
    /// no higher than where its own part starts (`lead_floor`).
    pub(super) fn placement(&self, held: u32) -> u64 {
        self.checkpoints
            .iter()
            .find(|c| c.blocks > held)
            .or(self.checkpoints.last())
            .map_or(0, |c| c.hash)
    }

    /// The last checkpoint before the request's own part begins (after its
    /// system, developer and tool messages), if it has such a preamble.
    pub(super) fn lead_end(&self) -> Option<usize> {
        self.checkpoints
            .iter()
            .rposition(|c| c.blocks <= self.lead_blocks)
    }

    /// Where a request with a preamble is keyed at the shallowest, with
    /// instances that must agree: its key is the first checkpoint past the
    /// preamble, where an instance that has seen the preamble fork keys it.
    /// An instance that knows nothing of a prompt otherwise keys it at its
    /// first checkpoint: the first conversation or agent session it ever
    /// saw below a system prompt shared by all was keyed by that system
    /// prompt, while the instances that had seen the prompt fork keyed it
    /// where it diverges, and put it elsewhere (multi-turn, 3 instances,
    /// seeds 1-3: 2-3 of 11 conversations on two replicas, hit rate
    /// 84.7-85.3%; keyed past the preamble none, 86.6-86.7%, as with one
    /// instance). Own parts that open alike up to the next checkpoint (a
    /// template line) share a key on an instance that hasn't yet seen them
    /// differ.
    pub(super) fn lead_floor(&self) -> u32 {
        self.lead_end()
            .and_then(|j| self.checkpoints.get(j))
            .map_or(0, |c| c.blocks)
    }
}
