//! One routing decision end to end, host-independent: prompt → block
//! hashes → index lookup + pool load → ranking → destination header value;
//! then `commit` records the pick (in-flight work, index entries).

use std::collections::HashSet;

use crate::config::{Baseline, Config};
use crate::discovery;
use crate::endpoint::{Endpoint, ReplicaId};
use crate::index::{Branch, Matches, PrefixIndex, RecordStats};
use crate::load::{self, LoadBoard};
use crate::prefix::{self, Checkpoint};
use crate::replicas::{HealthPolicy, Row, Table};
use crate::request::{self, Prompt};
use crate::score::{self, Candidate, LoraFit, Reason, ScoreParams};
use crate::store::Store;

pub struct Router {
    pub config: Config,
    /// The pool now: the static list, plus what discovery published.
    endpoints: Vec<Endpoint>,
    /// Discovered-only replicas wait for their first good scrape.
    discovered_only: Vec<bool>,
    discovery_token: Option<u32>,
    index: PrefixIndex,
    params: ScoreParams,
    stale_ms: u64,
}

/// A request's prefix, hashed once and kept until the stream ends: its
/// checkpoints along the whole prompt, and its length in blocks.
#[derive(Debug, Default, Clone)]
pub struct Hashed {
    pub checkpoints: Vec<Checkpoint>,
    /// The whole blocks before the request's own part (after its system,
    /// developer and tool messages); 0 without such a preamble.
    pub lead_blocks: u32,
    /// A conversation's or agent session's later turn: more than one
    /// message of its own (see [`agreed_below_lead`]).
    pub later_turn: bool,
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
        Hashed {
            checkpoints: prefix::checkpoints(seed, &prompt.text, cfg.block_bytes, &cfg.schedule()),
            lead_blocks: lead_blocks(prompt.lead_bytes, prompt.own_messages, cfg),
            later_turn: prompt.own_messages > 1,
        }
    }

    /// Parse a body and hash its whole prompt in one pass: the rendered
    /// prompt goes straight into the checkpoint hasher, never into one
    /// buffer (a long prompt costs a parse and a hash, not a copy).
    pub fn parse(
        body: &[u8],
        cfg: &Config,
    ) -> Result<(request::Header, Hashed), request::ParseError> {
        let (header, hasher) = request::extract_into(body, cfg.max_body_bytes, |h| {
            let seed = prefix::seed(&h.model, h.cache_salt.as_deref());
            prefix::Hasher::new(seed, cfg.block_bytes, &cfg.schedule())
        })?;
        let lead_blocks = lead_blocks(header.lead_bytes, header.own_messages, cfg);
        let later_turn = header.own_messages > 1;
        Ok((
            header,
            Hashed {
                checkpoints: hasher.finish(),
                lead_blocks,
                later_turn,
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
    fn placement(&self, held: u32) -> u64 {
        self.checkpoints
            .iter()
            .find(|c| c.blocks > held)
            .or(self.checkpoints.last())
            .map_or(0, |c| c.hash)
    }

    /// The last checkpoint before the request's own part begins (after its
    /// system, developer and tool messages), if it has such a preamble.
    fn lead_end(&self) -> Option<usize> {
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
    fn lead_floor(&self) -> u32 {
        self.lead_end()
            .and_then(|j| self.checkpoints.get(j))
            .map_or(0, |c| c.blocks)
    }
}

/// A request whose deepest holder is ahead of every other replica by
/// less than the new content it brings (an agent's first tool result,
/// below its task, below a tool prompt every replica holds) finds no home
/// yet: the session is still to be placed, and it is placed like new
/// content below a trunk that reaches the lead's end (`score::rank_below`),
/// by recent sessions and load, not by who is idle this instant. Left to
/// the cost, a busy holder's few blocks of lead lost to any idle replica,
/// and sessions piled up wherever the second turns found a gap (agentic,
/// 4 replicas: 1-3 sessions each, share 1.24-1.53).
#[derive(Debug, Clone, Copy)]
struct Lead {
    /// The candidate that holds the lead.
    home: usize,
    /// The depth every other candidate holds (where the placement key is).
    shared: u32,
    /// The lead's end.
    top: u32,
}

fn thin_lead(cands: &[Candidate], blocks: u32, min_new: u32) -> Option<Lead> {
    let held = |c: &Candidate| c.matched.min(blocks);
    let (home, top) = cands.iter().map(held).enumerate().max_by_key(|&(_, h)| h)?;
    let mut others = cands
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != home)
        .map(|(_, c)| held(c));
    let shared = others.next()?;
    let new = blocks - top;
    let thin = shared > 0
        && top > shared
        && top - shared < new
        && new >= min_new
        && others.all(|h| h == shared);
    thin.then_some(Lead { home, shared, top })
}

/// The depth of the shared trunk a request brings new content below (0:
/// none): the prefix where it leaves what this index holds, when that
/// prefix has forked and the request brings at least `min_new` blocks.
///
/// Where a request leaves the trunk is known only to within one
/// checkpoint gap (16 blocks at 45 KB). Below a trunk that itself sits
/// below what other replicas hold (a document below a shared preamble), a
/// question whose few blocks end a gap past the last checkpoint it shares
/// with the document's other questions is no new content: there the new
/// content counts from the request's next checkpoint. Counted from the
/// trunk's end, such questions were placed like new documents and copied
/// theirs to a second, third and fourth replica, where the copies evicted
/// other documents (long-preamble: 12% of warm requests `new_branch`, 21
/// of 64 documents on 2-4 replicas, warm TTFT p95 585-825 against 97-104).
/// Below a first trunk (a preamble) a short new part is an agent's task,
/// which must spread: there it counts from the trunk's end.
fn trunk_above(branch: Option<Branch>, hashed: &Hashed, cands: &[Candidate], min_new: u32) -> u32 {
    let Some(b) = branch else {
        return 0;
    };
    let next = hashed.checkpoints.get(b.at + 1);
    if !b.forks(next) {
        return 0;
    }
    let blocks = hashed.blocks();
    let nested = cands.iter().any(|c| c.matched > 0 && c.matched < b.held);
    let from = if nested {
        next.map_or(blocks, |c| c.blocks)
    } else {
        b.held
    };
    if blocks.saturating_sub(from) >= min_new {
        b.held
    } else {
        0
    }
}

/// With gateway instances that must agree, for a conversation's or agent
/// session's later turn: below a shared trunk that ends where its own part
/// starts (after its system and tool messages, a prefix seen to fork),
/// what lies past the trunk is credited only to the replica every instance
/// would place that content on (`score::agreed_homes`, keyed at the first
/// checkpoint past the trunk): the first of its two rendezvous candidates,
/// or either while the first is the busier by more than one request's
/// work; any other holder is credited with the trunk alone. `None`: the rule doesn't apply; `Some(0)`: an agreed
/// replica still holds more; `Some(t)`: nobody agreed does, so the request
/// is new content below a trunk of `t` blocks and goes where every
/// instance puts it.
///
/// A session can be held elsewhere by an instance that sent its first
/// turn elsewhere: a first message too short to be new content below the
/// trunk stays with the trunk's holders, an agent's task that ends before
/// the next checkpoint is keyed by its last one (its later turns by the
/// checkpoint past the trunk), a first turn that found both replicas over
/// the load bound spilled further, and one that found the first busy went
/// to the second. Another instance looks for the session on the first
/// unless that one is busy, so each instance followed what it had learned and the
/// session alternated between two replicas for its whole life,
/// re-prefilling the turns the other one served (agentic, 3 instances:
/// 2-5 of 8 sessions). Moved once, it stays. (Before requests were keyed
/// past their preamble, `Hashed::lead_floor`, this also mended each
/// instance's first conversation: multi-turn, 3 instances, hit rate 83.6%
/// against 86.6% with one instance.)
///
/// Only later turns: a conversation that alternates re-prefills what the
/// other replica served at every switch, while a document asked one
/// question at a time is whole on both of its replicas. Applied to single
/// questions too, it moved the documents that the start-up backlog had
/// spilled past their two replicas, in the middle of that backlog
/// (long-preamble, 3 instances, 4 seeds: TTFT p95 +10-34%).
fn agreed_below_lead<S: Store + ?Sized>(
    index: &PrefixIndex,
    store: &S,
    hashed: &Hashed,
    cands: &mut [Candidate],
    params: &ScoreParams,
) -> Option<u32> {
    if !hashed.later_turn {
        return None;
    }
    let cps = &hashed.checkpoints;
    let j = hashed.lead_end()?;
    let (at, next) = (cps.get(j)?, cps.get(j + 1)?);
    let trunk = at.blocks;
    // Cheap tests first: the rendezvous pair and the index read only for a
    // turn that someone holds past the trunk.
    let min_new = params.trunk_min_new_blocks;
    if hashed.blocks().saturating_sub(trunk) < min_new || cands.iter().all(|c| c.matched <= trunk) {
        return None;
    }
    // The second of the two is a home while the first is busier by more
    // than one request's work. Held to the test that places new content
    // (busier by more than a copy of the whole session would cost), the
    // second almost never was: sessions gathered on their first
    // candidates, which rendezvous deals out lumpily (agentic, 3
    // instances, 6 seeds: median TTFT p95 2,200 against 3,280, but one
    // seed put four of eight sessions on one replica, hit rate 84.6%
    // against 91.4%, p95 21,324 against 6,593). Keeping only the first
    // whenever this instance's index shows it holding the session too (so
    // that instances which learned different halves of a session meet on
    // one replica) was tried as well: agentic, 3 instances, 12 seeds,
    // median TTFT p95 1,322 against 926 real ms, hit rate 91.5% against
    // 92.8%.
    let legit = score::agreed_homes(cands, next.hash, params);
    let stray = |i: usize, c: &Candidate| c.matched > trunk && !legit.contains(&i);
    if !cands.iter().enumerate().any(|(i, c)| stray(i, c)) || !index.forked(store, at) {
        return None;
    }
    for (i, c) in cands.iter_mut().enumerate() {
        if stray(i, c) {
            c.matched = trunk;
        }
    }
    Some(if cands.iter().any(|c| c.matched > trunk) {
        0
    } else {
        trunk
    })
}

/// What the router knows about a request besides its prefix.
#[derive(Debug, Default, Clone, Copy)]
pub struct Meta<'a> {
    /// The `model` field: may name a LoRA adapter.
    pub model: Option<&'a str>,
    /// The client marked it sheddable (priority header).
    pub sheddable: bool,
    /// The replica a verified affinity token names (see `affinity`).
    pub affinity: Option<ReplicaId>,
}

/// A request the filter answers itself instead of routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub status: u32,
    pub kind: &'static str,
    pub message: String,
}

/// A routing decision: what the header write and `commit` need.
#[derive(Debug, Clone)]
pub struct Choice {
    /// Endpoint indices, best first; never empty while the pool isn't.
    pub order: Vec<usize>,
    pub reason: Reason,
    pub blocks: u32,
    /// Blocks the primary pick holds, and when it last stamped them.
    pub matched: u32,
    pub stamped: u32,
    /// Work this request adds to its replica (removed when it ends).
    pub work: u64,
    pub matches: Matches,
    /// The replica that took the session's earlier request, when this one
    /// places the session anew (`thin_lead`): the session counts as one
    /// placement, on whichever replica keeps it.
    pub home: Option<ReplicaId>,
}

/// Why a decision went the way it did: built only on request
/// (`Router::decide_explained`), for the debug header (`Router::explain`)
/// and shadow mode's baseline (`Router::shadow`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Diagnostics {
    /// Every eligible replica's cost, best first.
    pub costs: Vec<Cost>,
    /// Every eligible replica's in-flight requests, in endpoint order: what
    /// a least-request baseline decides on.
    pub requests: Vec<InFlight>,
}

/// One replica's cost for a request, in blocks of work (see `score`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Endpoint index.
    pub endpoint: usize,
    pub cost: f64,
}

/// Requests in flight on one replica (all workers of this instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// Endpoint index.
    pub endpoint: usize,
    pub requests: u32,
}

/// A shadow decision: where the baseline routed, and what prefix-router
/// would have done.
#[derive(Debug, Clone)]
pub struct Shadow {
    /// The choice actually routed (the baseline's pick first).
    pub routed: Choice,
    /// prefix-router's own pick and its matched blocks.
    pub ours: usize,
    pub ours_matched: u32,
}

/// A priority header value that marks a request as droppable under
/// saturation: `sheddable`/`low`/`batch`, or a negative number (the
/// Inference Extension's convention: below zero is sheddable).
pub fn is_sheddable(value: &str) -> bool {
    let v = value.trim();
    ["sheddable", "low", "batch"]
        .iter()
        .any(|s| v.eq_ignore_ascii_case(s))
        || v.parse::<i64>().is_ok_and(|n| n < 0)
}

fn lists(r: &Row, model: &str) -> bool {
    r.running_lora
        .iter()
        .chain(&r.waiting_lora)
        .any(|a| a == model)
}

fn lora_fit(row: Option<&Row>, adapter: &str) -> LoraFit {
    let Some(r) = row else {
        return LoraFit::MustEvict;
    };
    if r.running_lora.iter().any(|a| a == adapter) {
        LoraFit::Running
    } else if r.waiting_lora.iter().any(|a| a == adapter) {
        LoraFit::Waiting
    } else if (r.running_lora.len() as u32) < r.max_lora {
        LoraFit::CanLoad
    } else {
        LoraFit::MustEvict
    }
}

impl Router {
    pub fn new(config: Config) -> Router {
        let params = ScoreParams {
            weights: config.weights.clone(),
            load_measure: config.load_measure,
            request_cost_blocks: config.request_cost_blocks,
            bounded_load_factor: config.bounded_load_factor,
            bounded_load_slack: config.bounded_load_slack_blocks,
            trunk_min_new_blocks: config.trunk_min_new_blocks,
            gateways: config.gateways,
            clients_echo: config.affinity.as_ref().is_some_and(|a| a.clients_echo),
        };
        // A slot is dead after 10 missed heartbeats (and never sooner than
        // 2 s, so a stalled-but-alive worker isn't dropped on a hiccup).
        let stale_ms = (config.tick_ms * 10).max(2000);
        Router {
            endpoints: config.static_endpoints.clone(),
            discovered_only: vec![false; config.static_endpoints.len()],
            discovery_token: None,
            index: PrefixIndex::new(config.index_capacity),
            params,
            stale_ms,
            config,
        }
    }

    pub fn stale_ms(&self) -> u64 {
        self.stale_ms
    }

    pub fn endpoint(&self, i: usize) -> Option<&Endpoint> {
        self.endpoints.get(i)
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// Pick up a new discovered set if one was published since last time
    /// (one shared-data read; rebuilt only when its token changes).
    pub fn refresh<S: Store + ?Sized>(&mut self, store: &S) {
        if self.config.discovery.is_none() {
            return;
        }
        let Some((found, token)) = discovery::load(store) else {
            return;
        };
        if self.discovery_token == Some(token) {
            return;
        }
        self.discovery_token = Some(token);
        let mut eps = self.config.static_endpoints.clone();
        let mut only = vec![false; eps.len()];
        // A set, not a scan per host: a pool of 1,024 is 1,024 lookups.
        let mut seen: HashSet<ReplicaId> = eps.iter().map(Endpoint::id).collect();
        for e in found {
            if seen.insert(e.id()) {
                eps.push(e);
                only.push(true);
            }
        }
        self.endpoints = eps;
        self.discovered_only = only;
    }

    /// How many replicas are eligible now (for the operator's gauge).
    pub fn eligible_count<S: Store + ?Sized>(&self, store: &S, now_ms: u64) -> usize {
        let table = Table::load(store);
        let health = self.health();
        (0..self.endpoints.len())
            .filter(|&i| self.eligible(i, &table, &health, now_ms))
            .count()
    }

    /// Eligible to receive traffic: healthy per the replica table; a
    /// replica known only from discovery also needs one good scrape first
    /// (when scraping is on), so a new pod isn't sent traffic blind.
    fn eligible(&self, i: usize, table: &Table, health: &HealthPolicy, now_ms: u64) -> bool {
        let Some(ep) = self.endpoints.get(i) else {
            return false;
        };
        let needs_scrape =
            self.config.scrape.is_some() && self.discovered_only.get(i).copied().unwrap_or(false);
        if needs_scrape {
            table
                .row(ep.id())
                .is_some_and(|r| r.healthy(health, now_ms))
        } else {
            table.eligible(ep.id(), health, now_ms)
        }
    }

    fn health(&self) -> HealthPolicy {
        HealthPolicy {
            staleness_ms: self.config.staleness_ms,
            unhealthy_after: self.config.unhealthy_after,
        }
    }

    /// Rank the eligible replicas for a request (`hashed` empty when there's
    /// no prompt), or answer it: 503 when no replica is eligible, 429 when
    /// every eligible replica is saturated and the request is sheddable.
    pub fn decide<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
    ) -> Result<Choice, Reject> {
        self.decide_into(store, hashed, meta, now_ms, None)
    }

    /// `decide`, and why: every eligible replica's cost and in-flight
    /// requests (for the debug header and shadow mode only; the plain
    /// decision doesn't build them).
    pub fn decide_explained<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
    ) -> Result<(Choice, Diagnostics), Reject> {
        let mut diagnostics = Diagnostics::default();
        let choice = self.decide_into(store, hashed, meta, now_ms, Some(&mut diagnostics))?;
        Ok((choice, diagnostics))
    }

    fn decide_into<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
        diagnostics: Option<&mut Diagnostics>,
    ) -> Result<Choice, Reject> {
        // Only the scraper writes the table: without scraping or discovery
        // it is empty, and the read can be skipped.
        let table = if self.config.scrape.is_some() || self.config.discovery.is_some() {
            Table::load(store)
        } else {
            Table::default()
        };
        let health = self.health();
        let eligible: Vec<usize> = (0..self.endpoints.len())
            .filter(|&i| self.eligible(i, &table, &health, now_ms))
            .collect();
        if eligible.is_empty() {
            return Err(Reject {
                status: 503,
                kind: "no_healthy_replica",
                message: format!(
                    "no healthy replica: all {} replicas failed or missed their metrics scrapes",
                    self.endpoints.len()
                ),
            });
        }
        let rows: Vec<Option<&Row>> = eligible
            .iter()
            .map(|&i| table.row(self.endpoints[i].id()))
            .collect();
        if meta.sheddable && self.saturated(&rows) {
            return Err(Reject {
                status: 429,
                kind: "saturated",
                message: format!(
                    "all {} eligible replicas are saturated (queue > {} or KV cache > {:.0}%); retry later",
                    eligible.len(),
                    self.config.queue_threshold,
                    self.config.kv_threshold * 100.0
                ),
            });
        }
        let matches = if hashed.is_empty() {
            Matches::default()
        } else {
            self.index.lookup(store, &hashed.checkpoints)
        };
        // The slot count is read every time (one host call): caching it
        // hid a just-started worker's slot, and its placements, from the
        // others for a tick.
        let loads = load::snapshot(store, now_ms, self.stale_ms);
        let adapter = meta
            .model
            .filter(|m| rows.iter().flatten().any(|r| lists(r, m)));
        let mut cands: Vec<Candidate> = eligible
            .iter()
            .zip(&rows)
            .map(|(&i, row)| {
                let id = self.endpoints[i].id();
                Candidate {
                    id,
                    matched: matches.get(id),
                    load: loads.get(&id).copied().unwrap_or_default(),
                    waiting: row.map(|r| r.waiting).unwrap_or(0.0),
                    running: row.map(|r| r.running).unwrap_or(0.0),
                    kv_usage: row.map(|r| r.kv_usage).unwrap_or(0.0),
                    lora: adapter.map(|m| lora_fit(*row, m)).unwrap_or_default(),
                    affinity: meta.affinity == Some(id),
                }
            })
            .collect();
        let blocks = hashed.blocks();
        let agreed = if self.params.agree() {
            agreed_below_lead(&self.index, store, hashed, &mut cands, &self.params)
        } else {
            None
        };
        let held = cands.iter().map(|c| c.matched).max().unwrap_or(0);
        // New content below a shared trunk is placed like a new prefix.
        let forked = agreed.unwrap_or_else(|| {
            trunk_above(
                matches.branch,
                hashed,
                &cands,
                self.params.trunk_min_new_blocks,
            )
        });
        // With instances that must agree, a lead may be just what this one
        // saw of a longer session: the index decides as for any prefix.
        let lead = (!self.params.agree())
            .then(|| thin_lead(&cands, blocks, self.params.trunk_min_new_blocks))
            .flatten();
        // The home's count of recent sessions includes this one.
        let home = lead.and_then(|l| cands.get_mut(l.home)).map(|c| {
            c.load.branches = c.load.branches.saturating_sub(1);
            c.id
        });
        let trunk = lead.map_or(forked, |l| forked.max(l.top));
        // A new session is keyed where every replica's holding ends, as an
        // instance that never saw its lead keys it.
        let floor = if self.params.agree() {
            hashed.lead_floor()
        } else {
            0
        };
        let key = hashed.placement(lead.map_or(held, |l| l.shared).max(floor));
        let ranked = score::rank_below(&cands, blocks, trunk, key, &self.params);
        let held = ranked
            .order
            .first()
            .and_then(|&i| matches.blocks.get(&cands[i].id))
            .copied()
            .unwrap_or_default();
        if let Some(d) = diagnostics {
            d.requests = eligible
                .iter()
                .zip(&cands)
                .map(|(&endpoint, c)| InFlight {
                    endpoint,
                    requests: c.load.requests,
                })
                .collect();
            d.costs = ranked
                .order
                .iter()
                .map(|&i| Cost {
                    endpoint: eligible[i],
                    cost: ranked.costs[i],
                })
                .collect();
        }
        Ok(Choice {
            order: ranked.order.iter().map(|&i| eligible[i]).collect(),
            reason: ranked.reason,
            blocks,
            matched: held.blocks,
            stamped: held.stamped,
            work: self.params.work_of(blocks, held.blocks),
            matches,
            home,
        })
    }

    /// Shadow mode: route with the baseline instead, keeping our ranking for
    /// the fallbacks and the stats. `seq` is this VM's request counter (the
    /// round-robin position; per-VM round robin is what Envoy does too).
    pub fn shadow(&self, choice: Choice, why: &Diagnostics, seq: u64) -> Shadow {
        let ours = choice.order.first().copied().unwrap_or(0);
        let ours_matched = choice.matched;
        let requests = &why.requests;
        let pick = match self.config.shadow_baseline {
            Baseline::RoundRobin => {
                let n = requests.len().max(1) as u64;
                requests.get((seq % n) as usize).map(|r| r.endpoint)
            }
            Baseline::LeastRequest => {
                // Fewest in flight; ties rotate with `seq` like Envoy's.
                let min = requests.iter().map(|r| r.requests).min().unwrap_or(0);
                let ties: Vec<usize> = requests
                    .iter()
                    .filter(|r| r.requests == min)
                    .map(|r| r.endpoint)
                    .collect();
                ties.get((seq % ties.len().max(1) as u64) as usize).copied()
            }
        }
        .unwrap_or(ours);
        let mut order = vec![pick];
        order.extend(choice.order.iter().copied().filter(|&i| i != pick));
        let id = self.endpoints.get(pick).map(|e| e.id()).unwrap_or(0);
        let held = choice.matches.blocks.get(&id).copied().unwrap_or_default();
        let routed = Choice {
            order,
            matched: held.blocks,
            stamped: held.stamped,
            work: self.params.work_of(choice.blocks, held.blocks),
            ..choice
        };
        Shadow {
            routed,
            ours,
            ours_matched,
        }
    }

    /// Every eligible replica with fresh metrics is over a threshold (and
    /// at least one has metrics: without scraping nothing is "saturated").
    fn saturated(&self, rows: &[Option<&Row>]) -> bool {
        let over = |r: &Row| {
            r.waiting as f64 > self.config.queue_threshold
                || r.kv_usage as f64 > self.config.kv_threshold
        };
        rows.iter().all(|r| r.is_some_and(over)) && !rows.is_empty()
    }

    /// The destination header value: the pick, then up to `max_fallbacks`
    /// next-best replicas, comma-separated (override_host retries in order).
    pub fn header_value(&self, choice: &Choice) -> String {
        choice
            .order
            .iter()
            .take(1 + self.config.max_fallbacks)
            .filter_map(|&i| self.endpoint(i))
            .map(Endpoint::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Record the pick: in-flight work now, index entries for its prefix.
    pub fn commit<S: Store + ?Sized>(
        &self,
        store: &S,
        board: &mut LoadBoard,
        choice: &Choice,
        hashed: &Hashed,
        now_ms: u64,
    ) -> RecordStats {
        let Some(ep) = choice.order.first().and_then(|&i| self.endpoint(i)) else {
            return RecordStats::default();
        };
        // New content placed there, for spreading later new content: all
        // the pick didn't hold, a copy of a shared trunk included. That is
        // a real prefill, and each replica's first copy counts once; left
        // out, only the trunk's first holder was charged for it and it got
        // a fraction of the documents that followed.
        let new_blocks = choice.blocks.saturating_sub(choice.matched);
        let mut branch = matches!(choice.reason, Reason::NewPrefix | Reason::NewBranch);
        if let Some(home) = choice.home {
            // A session placed anew counts once: where it stays, or where
            // it moved to (and no longer where it was).
            branch &= home != ep.id();
            if branch {
                board.withdraw_branch(home);
            }
        }
        board.start(store, ep.id(), choice.work, new_blocks, branch, now_ms);
        if hashed.is_empty() {
            return RecordStats::default();
        }
        if let Some(b) = &choice.matches.branch {
            self.index.note_branch(store, &hashed.checkpoints, b);
        }
        let now_s = (now_ms / 1000) as u32;
        self.index.record(
            store,
            &hashed.checkpoints,
            ep.id(),
            choice.matched,
            choice.stamped,
            now_s,
        )
    }

    /// A human-readable account of the decision, for the debug header.
    pub fn explain(&self, choice: &Choice, why: &Diagnostics) -> String {
        let pick = choice.order.first().and_then(|&i| self.endpoint(i));
        let costs: Vec<String> = why
            .costs
            .iter()
            .filter_map(|c| {
                let e = self.endpoint(c.endpoint)?;
                Some(format!(
                    "{}={:.1}/{}",
                    e.as_str(),
                    c.cost,
                    choice.matches.get(e.id())
                ))
            })
            .collect();
        format!(
            "replica={}; reason={}; matched={}/{}; cost/matched: {}",
            pick.map(Endpoint::as_str).unwrap_or("-"),
            choice.reason.as_str(),
            choice.matched,
            choice.blocks,
            costs.join(" ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::extract;
    use crate::store::MemStore;

    fn router(extra: &str) -> Router {
        let json = format!(
            r#"{{"endpoints":["10.0.0.1:80","10.0.0.2:80","10.0.0.3:80","10.0.0.4:80"]{extra}}}"#
        );
        Router::new(Config::parse(json.as_bytes()).unwrap())
    }

    fn hashed(r: &Router, body: &str) -> Hashed {
        Hashed::of(&extract(body.as_bytes(), 1 << 20).unwrap(), &r.config)
    }

    fn doc(group: usize, q: usize) -> String {
        let prefix = format!("Document {group}: ").repeat(200);
        format!(r#"{{"model":"m","prompt":"{prefix} Question {q}?"}}"#)
    }

    #[test]
    fn a_group_sticks_to_one_replica_and_groups_spread() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let mut homes = Vec::new();
        for g in 0..20 {
            let mut picks = Vec::new();
            for q in 0..10 {
                let h = hashed(&r, &doc(g, q));
                let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
                if q > 0 {
                    assert_eq!(c.reason, Reason::PrefixHit);
                }
                r.commit(&s, &mut board, &c, &h, 1000);
                board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
                picks.push(c.order[0]);
            }
            assert!(picks.iter().all(|&p| p == picks[0]), "group {g}: {picks:?}");
            homes.push(picks[0]);
        }
        // New prefixes go where less new content went: an even spread even
        // when requests come one at a time (no load to balance on).
        for r in 0..4 {
            let n = homes.iter().filter(|&&h| h == r).count();
            assert!(
                (4..=6).contains(&n),
                "replica {r} got {n} groups: {homes:?}"
            );
        }
    }

    /// A 40 KB shared preamble (longer than any fixed window), then one of
    /// `doc` documents (about 1,500 tokens), then a question.
    fn preambled(doc: usize, q: usize) -> String {
        let preamble =
            "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(40_000 / 64);
        let body = format!("Document {doc}: ").repeat(6_000 / 12);
        format!(r#"{{"model":"m","prompt":"{preamble}{body} Question {q}?"}}"#)
    }

    #[test]
    fn documents_below_a_long_shared_preamble_stick_and_spread() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let mut homes = std::collections::HashMap::new();
        for q in 0..5 {
            for d in 0..12 {
                let h = hashed(&r, &preambled(d, q));
                let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
                r.commit(&s, &mut board, &c, &h, 1000);
                board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
                let home = *homes.entry(d).or_insert(c.order[0]);
                assert_eq!(c.order[0], home, "document {d}, question {q}");
                if q > 0 {
                    assert_eq!(c.matched, c.blocks, "the whole document is held");
                }
            }
        }
        for replica in 0..4 {
            let n = homes.values().filter(|&&h| h == replica).count();
            assert!(
                (2..=4).contains(&n),
                "replica {replica} has {n} documents: {homes:?}"
            );
        }
    }

    #[test]
    fn a_short_question_after_a_deep_document_stays_with_it() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        // Documents of 6,000-7,020 bytes: some end just before a
        // checkpoint, so a 100-byte question crosses it. Past the dense
        // window checkpoints are 16 blocks apart at this depth.
        let ask = |d: usize, q: usize| {
            let preamble =
                "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(625);
            let doc = format!("{:>20}", format!("Document {d}: ")).repeat(300 + d);
            let question = format!("Question {q}: {}?", "why? ".repeat(18));
            format!(r#"{{"model":"m","prompt":"{preamble}{doc}{question}"}}"#)
        };
        let mut run = |d: usize, q: usize| {
            let h = hashed(&r, &ask(d, q));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            r.commit(&s, &mut board, &c, &h, 1000);
            board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
            (c, h.blocks())
        };
        let mut crossed = 0;
        for d in 0..52 {
            let home = run(d, 0).0.order[0];
            for q in 1..4 {
                let (c, blocks) = run(d, q);
                let held = c.matches.branch.map_or(0, |b| b.held);
                crossed += usize::from(blocks - held >= 16);
                assert_eq!(
                    (c.order[0], c.reason),
                    (home, Reason::PrefixHit),
                    "document {d}, question {q}: {blocks} blocks, {held} shared"
                );
            }
        }
        // Counted from the last shared checkpoint, these questions brought
        // 16 or more blocks of new content: placed like new documents.
        assert!(crossed >= 9, "{crossed} questions crossed a checkpoint");
    }

    /// An agent session's `turns`-th request: the 40 KB shared preamble,
    /// its task (about 15 blocks), then a 6 KB tool result per turn.
    fn agent(session: usize, turns: usize) -> String {
        let preamble =
            "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(40_000 / 64);
        let task = format!("Task {session}: make the build green. ").repeat(30);
        let results: String = (0..turns)
            .map(|t| format!("Result {session}.{t}: ").repeat(6_000 / 12))
            .collect();
        format!(r#"{{"model":"m","prompt":"{preamble}{task}{results}"}}"#)
    }

    #[test]
    fn agent_sessions_spread_evenly_when_their_first_result_finds_home_busy() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let id = |i: usize| r.endpoint(i).unwrap().id();
        let run = |body: &str, board: &mut LoadBoard| {
            let h = hashed(&r, body);
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            r.commit(&s, board, &c, &h, 1000);
            board.finish(&s, id(c.order[0]), c.work, 1000);
            c
        };
        // First turns: a task below the preamble, two per replica.
        let first: Vec<usize> = (0..8)
            .map(|a| run(&agent(a, 0), &mut board).order[0])
            .collect();
        // Each session's first tool result arrives while another session's
        // long turn runs on the replica that took its task. A task is no
        // home yet: the session is placed like new content, by how many
        // sessions each replica took, not by who is idle this instant.
        let mut homes = Vec::new();
        for (a, &took) in first.iter().enumerate() {
            board.start(&s, id(took), 900, 0, false, 1000);
            let c = run(&agent(a, 1), &mut board);
            board.finish(&s, id(took), 900, 1000);
            assert_eq!(c.reason, Reason::NewBranch, "session {a}");
            homes.push(c.order[0]);
        }
        for replica in 0..4 {
            let n = homes.iter().filter(|&&h| h == replica).count();
            assert_eq!(n, 2, "replica {replica}: {homes:?} (tasks on {first:?})");
            // A moved session counts where it went, once.
            let placed = load::snapshot(&s, 1000, 10_000)[&id(replica)].branches;
            assert_eq!(
                placed, 2,
                "replica {replica}: {homes:?} (tasks on {first:?})"
            );
        }
        // From then on each session stays home.
        for (a, &home) in homes.iter().enumerate() {
            let c = run(&agent(a, 2), &mut board);
            assert_eq!(
                (c.order[0], c.reason),
                (home, Reason::PrefixHit),
                "session {a}"
            );
        }
    }

    #[test]
    fn with_instances_that_must_agree_a_sessions_lead_is_followed() {
        // What one instance saw of a session may be a part of it: its lead
        // is a held prefix like any other, not a session still to place.
        for (extra, reason) in [
            ("", Reason::NewBranch),
            (r#","gateways":3"#, Reason::PrefixHit),
        ] {
            let r = router(extra);
            let s = MemStore::new();
            let mut board = LoadBoard::new(1, 10_000);
            let mut first = Vec::new();
            for a in 0..8 {
                let h = hashed(&r, &agent(a, if a == 0 { 0 } else { 1 }));
                let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
                r.commit(&s, &mut board, &c, &h, 1000);
                board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
                first.push(c.order[0]);
            }
            let c = r
                .decide(&s, &hashed(&r, &agent(0, 1)), Meta::default(), 1000)
                .unwrap();
            assert_eq!(c.reason, reason, "{extra}");
            if reason == Reason::PrefixHit {
                assert_eq!(c.order[0], first[0]);
            }
        }
    }

    /// A chat conversation's `turns`-th request (1-based): a 1.5 KB system
    /// prompt every conversation shares, then 2 KB user turns and short
    /// answers.
    fn chat(conv: usize, turns: usize) -> String {
        let system = "You are the support assistant of ACME. Be exact. ".repeat(30);
        let mut messages = vec![format!(r#"{{"role":"system","content":"{system}"}}"#)];
        for t in 0..turns {
            if t > 0 {
                let answer = format!("Answer {conv}.{t}. ").repeat(10);
                messages.push(format!(r#"{{"role":"assistant","content":"{answer}"}}"#));
            }
            let user = format!("Conversation {conv}, turn {t}: ").repeat(80);
            messages.push(format!(r#"{{"role":"user","content":"{user}"}}"#));
        }
        format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
    }

    /// One decision, committed and finished at once.
    fn run(r: &Router, s: &MemStore, board: &mut LoadBoard, body: &str) -> Choice {
        let h = hashed(r, body);
        let c = r.decide(s, &h, Meta::default(), 1000).unwrap();
        r.commit(s, board, &c, &h, 1000);
        board.finish(s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
        c
    }

    /// Endpoint indices by rendezvous weight for where conversation `conv`
    /// leaves the shared system prompt: the order every instance computes.
    fn agreed_order(r: &Router, conv: usize) -> Vec<usize> {
        let h = hashed(r, &chat(conv, 2));
        let key = h.checkpoints[h.lead_end().unwrap() + 1].hash;
        let mut order: Vec<usize> = (0..r.endpoints().len()).collect();
        order.sort_by_key(|&i| {
            std::cmp::Reverse(score::rendezvous(key, r.endpoint(i).unwrap().id()))
        });
        order
    }

    #[test]
    fn an_instances_first_conversation_goes_where_every_instance_puts_it() {
        // Three gateway instances, each with its own index. `aware` has
        // seen several conversations below the shared system prompt; a
        // fresh instance's very first request is conversation `f`, and it
        // knows nothing of the system prompt. Both must put `f` on the
        // same replica, and the fresh one must keep it there once it has
        // seen the system prompt fork. Keyed at its first checkpoint (the
        // system prompt) as an instance that knows nothing did before,
        // `f` went to the system prompt's replica instead.
        let extra = r#","gateways":3"#;
        let aware = router(extra);
        let (s_aware, mut b_aware) = (MemStore::new(), LoadBoard::new(1, 10_000));
        for other in 100..104 {
            run(&aware, &s_aware, &mut b_aware, &chat(other, 1));
        }
        let mut homes = HashSet::new();
        for f in 0..24 {
            let fresh = router(extra);
            let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
            let first = run(&fresh, &s, &mut board, &chat(f, 1));
            assert_eq!(first.reason, Reason::NewPrefix, "conversation {f}");
            let home = agreed_order(&fresh, f)[0];
            assert_eq!(first.order[0], home, "conversation {f}");
            let agreed = run(&aware, &s_aware, &mut b_aware, &chat(f, 1));
            assert_eq!((agreed.order[0], agreed.reason), (home, Reason::NewBranch));
            for other in 100..102 {
                run(&fresh, &s, &mut board, &chat(other, 1));
            }
            for turns in 2..4 {
                let c = run(&fresh, &s, &mut board, &chat(f, turns));
                assert_eq!((c.order[0], c.reason), (home, Reason::PrefixHit), "{f}");
            }
            homes.insert(home);
        }
        // The conversations' keys differ: they spread over the pool.
        assert_eq!(homes.len(), 4);
    }

    #[test]
    fn a_session_spilled_past_its_two_replicas_returns_to_them() {
        // Both replicas every instance computes for conversation 7 are
        // over the load bound when its first turn arrives, so it spills to
        // a third. Another instance would look for it on the first of the
        // two, so once they have room its next turn moves there (once),
        // and stays.
        let r = router(r#","gateways":3,"bounded_load_factor":1.2"#);
        let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
        for other in 100..102 {
            run(&r, &s, &mut board, &chat(other, 1));
        }
        let order = agreed_order(&r, 7);
        let id = |i: usize| r.endpoint(i).unwrap().id();
        for &i in &order[..2] {
            for _ in 0..2 {
                board.start(&s, id(i), 20_000, 0, false, 1000);
            }
        }
        let spilled = run(&r, &s, &mut board, &chat(7, 1));
        assert!(
            !order[..2].contains(&spilled.order[0]),
            "{:?}",
            spilled.order
        );
        for &i in &order[..2] {
            for _ in 0..2 {
                board.finish(&s, id(i), 20_000, 1000);
            }
        }
        let back = run(&r, &s, &mut board, &chat(7, 2));
        assert_eq!((back.order[0], back.reason), (order[0], Reason::NewBranch));
        let stays = run(&r, &s, &mut board, &chat(7, 3));
        assert_eq!(
            (stays.order[0], stays.reason),
            (order[0], Reason::PrefixHit)
        );
    }

    #[test]
    fn a_session_on_the_second_of_its_replicas_moves_to_the_first_once_it_has_room() {
        // The first of conversation 7's two replicas is busy when its first
        // turns arrive, so they go to the second. Other instances look for
        // it on the first whenever the first has room, so once it has, the
        // conversation moves there (once) and stays.
        let r = router(r#","gateways":3"#);
        let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
        for other in 100..102 {
            run(&r, &s, &mut board, &chat(other, 1));
        }
        let order = agreed_order(&r, 7);
        let first = r.endpoint(order[0]).unwrap().id();
        board.start(&s, first, 1_000, 0, false, 1000);
        for turns in 1..3 {
            let c = run(&r, &s, &mut board, &chat(7, turns));
            assert_eq!(c.order[0], order[1], "turn {turns}");
        }
        board.finish(&s, first, 1_000, 1000);
        let moved = run(&r, &s, &mut board, &chat(7, 3));
        assert_eq!(
            (moved.order[0], moved.reason),
            (order[0], Reason::NewBranch)
        );
        let stays = run(&r, &s, &mut board, &chat(7, 4));
        assert_eq!(
            (stays.order[0], stays.reason),
            (order[0], Reason::PrefixHit)
        );
    }

    #[test]
    fn a_conversation_with_its_own_system_prompt_stays_where_it_started() {
        // No fork at the lead: the system prompt is the conversation's own,
        // and every instance keys it there. Nothing is rehomed.
        let r = router(r#","gateways":3"#);
        let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
        let own = |turns: usize| chat(7, turns).replace("ACME", "Initech");
        let h = hashed(&r, &own(1));
        let first = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, &mut board, &first, &h, 1000);
        board.finish(
            &s,
            r.endpoint(first.order[0]).unwrap().id(),
            first.work,
            1000,
        );
        for turns in 2..6 {
            let h = hashed(&r, &own(turns));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            assert_eq!((c.order[0], c.reason), (first.order[0], Reason::PrefixHit));
            r.commit(&s, &mut board, &c, &h, 1000);
            board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
        }
    }

    #[test]
    fn work_estimates_grow_with_the_whole_prompt() {
        let r = router("");
        let s = MemStore::new();
        let short = hashed(&r, &doc(1, 1));
        let long = hashed(&r, &preambled(1, 1));
        assert!(long.blocks() > 600, "{} blocks", long.blocks());
        let ws = r.decide(&s, &short, Meta::default(), 0).unwrap().work;
        let wl = r.decide(&s, &long, Meta::default(), 0).unwrap().work;
        assert!(wl > 2 * ws, "long {wl} vs short {ws}");
        // A replica busy with three long cold prefills looks busy.
        let mut board = LoadBoard::new(1, 10_000);
        for q in 0..3 {
            let h = hashed(&r, &preambled(100 + q, q));
            let mut c = r.decide(&s, &h, Meta::default(), 0).unwrap();
            c.order = vec![0];
            r.commit(&s, &mut board, &c, &h, 0);
        }
        for q in 0..20 {
            let c = r
                .decide(&s, &hashed(&r, &doc(50 + q, 0)), Meta::default(), 0)
                .unwrap();
            assert_ne!(c.order[0], 0);
        }
    }

    #[test]
    fn index_writes_per_request_are_bounded_whatever_its_length() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let text = "x".repeat(1 << 20);
        let body = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        let h = hashed(&r, &body);
        let c = r.decide(&s, &h, Meta::default(), 0).unwrap();
        let rec = r.commit(&s, &mut board, &c, &h, 0);
        assert!(
            rec.writes <= 257,
            "{} writes for a 1 MiB prompt",
            rec.writes
        );
        assert_eq!(c.blocks, (1 << 20) / 64);
    }

    #[test]
    fn a_hot_prefix_spills_to_a_second_replica_before_a_third() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let mut used = Vec::new();
        // Requests of one 8 KiB document (about 2,000 tokens, 128 blocks)
        // that all stay in flight.
        let long = format!("Document seven: {}", "lorem ipsum dolor ".repeat(460));
        for q in 0..40 {
            let body = format!(r#"{{"model":"m","prompt":"{long} Question {q}?"}}"#);
            let h = hashed(&r, &body);
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            r.commit(&s, &mut board, &c, &h, 1000);
            if !used.contains(&c.order[0]) {
                used.push(c.order[0]);
            }
            // Holding the prefix is worth 2 x 128 blocks of cost: two holders
            // absorb about 25 in-flight requests before a third copy pays.
            if q < 20 {
                assert!(used.len() <= 2, "third replica after {q} requests");
            }
        }
        assert!(used.len() >= 2, "never spilled: {used:?}");
        assert!(used.len() <= 4);
    }

    #[test]
    fn a_busy_holders_followers_spill_over_several_replicas() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let h = hashed(&r, &doc(0, 0));
        let first = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, &mut board, &first, &h, 1000);
        let holder = first.order[0];
        // Unrelated requests in flight on the holder, well over the bound.
        for _ in 0..60 {
            let mut c = first.clone();
            c.order = vec![holder];
            r.commit(&s, &mut board, &c, &Hashed::default(), 1000);
        }
        // Questions a few blocks long, each different.
        let ask = |q: usize| {
            let question = format!("Question {q}: ").repeat(30);
            let body = format!(
                r#"{{"model":"m","prompt":"{} {question}"}}"#,
                "Document 0: ".repeat(200)
            );
            hashed(&r, &body)
        };
        let picks: HashSet<usize> = (1..40)
            .map(|q| r.decide(&s, &ask(q), Meta::default(), 1000).unwrap().order[0])
            .collect();
        assert!(!picks.contains(&holder), "{picks:?}");
        // Near-ties among the others go by each question's own key: the
        // hot document's overflow is shared by all three.
        assert_eq!(picks.len(), 3, "{picks:?} holder {holder}");
    }

    #[test]
    fn header_lists_fallbacks_best_first() {
        let r = router(r#","max_fallbacks":2"#);
        let s = MemStore::new();
        let c = r
            .decide(&s, &Hashed::default(), Meta::default(), 0)
            .unwrap();
        let v = r.header_value(&c);
        let parts: Vec<&str> = v.split(',').collect();
        assert_eq!(parts.len(), 3);
        assert!(parts
            .iter()
            .all(|p| r.config.static_endpoints.iter().any(|e| e.as_str() == *p)));
        assert_eq!(c.reason, Reason::NoPrompt);
    }

    #[test]
    fn in_flight_work_steers_requests_without_prompts() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let mut seen = Vec::new();
        for _ in 0..4 {
            let c = r
                .decide(&s, &Hashed::default(), Meta::default(), 0)
                .unwrap();
            r.commit(&s, &mut board, &c, &Hashed::default(), 0);
            seen.push(c.order[0]);
        }
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2, 3], "each idle replica gets one");
    }

    #[test]
    fn shadow_routes_with_the_baseline_and_measures_the_gap() {
        for (baseline, name) in [("round_robin", "rr"), ("least_request", "lr")] {
            let r = router(&format!(
                r#","mode":"shadow","shadow_baseline":"{baseline}""#
            ));
            let s = MemStore::new();
            let mut board = LoadBoard::new(1, 10_000);
            let (mut ours, mut base) = (0u64, 0u64);
            let mut picks = std::collections::HashSet::new();
            // 30 documents, each asked twice: the second ask finds its
            // document on one replica, which the baseline hits 1 time in 4.
            for q in 0..60 {
                let h = hashed(&r, &doc(q % 30, q));
                let (c, why) = r.decide_explained(&s, &h, Meta::default(), 1000).unwrap();
                let sh = r.shadow(c, &why, q as u64);
                picks.insert(sh.routed.order[0]);
                ours += sh.ours_matched as u64;
                base += sh.routed.matched as u64;
                r.commit(&s, &mut board, &sh.routed, &h, 1000);
                if name == "lr" {
                    let id = r.endpoint(sh.routed.order[0]).unwrap().id();
                    board.finish(&s, id, sh.routed.work, 1000);
                }
            }
            // The baseline spreads the two documents over all replicas...
            assert_eq!(picks.len(), 4, "{name}");
            // ...and our pick would have matched far more of each prefix.
            assert!(ours > base * 2, "{name}: ours {ours} vs baseline {base}");
        }
    }

    #[test]
    fn discovered_replicas_join_after_their_first_scrape_and_leave_when_gone() {
        use crate::metrics::ReplicaMetrics;
        use crate::replicas::record_scrape;
        let json = r#"{"endpoints":["10.0.0.1:80"],"cluster":"pool",
            "discovery":{"cluster":"pool","admin_cluster":"admin"}}"#;
        let mut r = Router::new(Config::parse(json.as_bytes()).unwrap());
        let s = MemStore::new();
        let new: Endpoint = "10.0.0.9:80".parse().unwrap();
        discovery::publish(&s, std::slice::from_ref(&new));
        r.refresh(&s);
        assert_eq!(r.endpoints().len(), 2);
        let picks = |r: &Router, now| {
            (0..40)
                .flat_map(|q| {
                    r.decide(&s, &hashed(r, &doc(q, 0)), Meta::default(), now)
                        .unwrap()
                        .order
                })
                .collect::<std::collections::HashSet<usize>>()
        };
        assert_eq!(picks(&r, 1000), [0].into(), "not before its first scrape");
        let ids: Vec<u64> = r.endpoints().iter().map(|e| e.id()).collect();
        record_scrape(&s, new.id(), Ok(&ReplicaMetrics::default()), &ids, 1000).unwrap();
        assert!(picks(&r, 1000).contains(&1));
        discovery::publish(&s, &[]);
        r.refresh(&s);
        assert_eq!(r.endpoints().len(), 1);
    }

    #[test]
    fn sheddable_values() {
        for yes in ["sheddable", " Sheddable ", "low", "BATCH", "-1", "-100"] {
            assert!(is_sheddable(yes), "{yes}");
        }
        for no in ["", "critical", "standard", "0", "5", "-", "sheddable-ish"] {
            assert!(!is_sheddable(no), "{no}");
        }
    }

    #[test]
    fn saturation_sheds_only_sheddable_requests_and_no_replica_is_a_503() {
        use crate::metrics::ReplicaMetrics;
        use crate::replicas::record_scrape;
        let r = router(r#","cluster":"pool""#);
        let s = MemStore::new();
        let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
        let busy = ReplicaMetrics {
            waiting: 9.0,
            ..ReplicaMetrics::default()
        };
        for &id in &ids[..3] {
            record_scrape(&s, id, Ok(&busy), &ids, 1000).unwrap();
        }
        let shed = Meta {
            sheddable: true,
            ..Meta::default()
        };
        // One replica has no metrics yet: not everyone is saturated.
        assert!(r.decide(&s, &Hashed::default(), shed, 1000).is_ok());
        record_scrape(&s, ids[3], Ok(&busy), &ids, 1000).unwrap();
        let rej = r.decide(&s, &Hashed::default(), shed, 1000).unwrap_err();
        assert_eq!(rej.status, 429);
        assert!(r
            .decide(&s, &Hashed::default(), Meta::default(), 1000)
            .is_ok());
        // Everyone stale: nothing eligible.
        let rej = r
            .decide(&s, &Hashed::default(), Meta::default(), 10_000)
            .unwrap_err();
        assert_eq!(rej.status, 503);
    }

    #[test]
    fn unhealthy_replicas_are_never_picked() {
        use crate::replicas::record_scrape;
        let r = router(r#","cluster":"pool""#);
        let s = MemStore::new();
        let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
        for _ in 0..3 {
            record_scrape(&s, ids[0], Err(()), &ids, 1000).unwrap();
        }
        for q in 0..50 {
            let h = hashed(&r, &doc(q, 0));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            assert_ne!(c.order[0], 0);
            assert!(!c.order.contains(&0));
        }
    }

    #[test]
    fn diagnostics_are_built_only_on_request_and_change_nothing() {
        let r = router("");
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        for q in 0..12 {
            let h = hashed(&r, &doc(q % 3, q));
            let plain = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            let (c, why) = r.decide_explained(&s, &h, Meta::default(), 1000).unwrap();
            assert_eq!(
                (&plain.order, plain.reason, plain.matched, plain.work),
                (&c.order, c.reason, c.matched, c.work)
            );
            // Every eligible replica, costs best first like the order.
            let by_cost: Vec<usize> = why.costs.iter().map(|c| c.endpoint).collect();
            assert_eq!(by_cost, c.order);
            let listed: Vec<usize> = why.requests.iter().map(|r| r.endpoint).collect();
            assert_eq!(listed, vec![0, 1, 2, 3]);
            r.commit(&s, &mut board, &c, &h, 1000);
        }
        let in_flight: u32 = r
            .decide_explained(&s, &Hashed::default(), Meta::default(), 1000)
            .unwrap()
            .1
            .requests
            .iter()
            .map(|r| r.requests)
            .sum();
        assert_eq!(in_flight, 12);
    }

    #[test]
    fn explain_names_the_pick() {
        let r = router("");
        let s = MemStore::new();
        let h = hashed(&r, &doc(1, 1));
        let (c, why) = r.decide_explained(&s, &h, Meta::default(), 0).unwrap();
        let text = r.explain(&c, &why);
        assert!(text.starts_with(&format!("replica={}", r.endpoint(c.order[0]).unwrap())));
        assert!(text.contains("reason=new_prefix"));
    }
}
