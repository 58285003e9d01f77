//! Rendered prompt bytes → checkpoint hashes along the whole prompt.
//!
//! The prompt is cut into `block_bytes` blocks (only whole blocks count:
//! the server caches whole blocks). A checkpoint closes a run of blocks,
//! and its hash chains over everything before it:
//! `h_j = H(h_{j-1}, bytes between checkpoint j-1 and j)`, seeded with the
//! model (and cache salt), so one hash names a whole prefix.
//!
//! Where the checkpoints sit is the `Schedule`: every `stride` blocks in
//! the dense window at the start (where prompts of one group diverge: a
//! question after a shared document), then gaps that double every
//! `per_doubling` checkpoints, and always one at the last whole block. So
//! the prompt's identity reaches its end (a divergence at 900 KB is seen),
//! while the checkpoints of a prompt of `n` blocks stay bounded:
//! `dense / stride + per_doubling x log2(n / dense) + 1` (257 for 1 MiB
//! with the defaults). A divergence deep in a long prompt is located
//! to within one gap, at most `1 / per_doubling` of its depth.
//!
//! H is xxh3-64 seeded with the previous hash: one call per checkpoint
//! over the whole run (bulk speed, not per block), allocation-free, and
//! identical on wasm32 and x86_64.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

/// Versioned so that a format change can't silently alias old index entries.
const SEED_TAG: &[u8] = b"prefix-router/v3";

pub fn seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let mut buf =
        Vec::with_capacity(SEED_TAG.len() + model.len() + 4 + cache_salt.map_or(0, str::len));
    buf.extend_from_slice(SEED_TAG);
    buf.push(0);
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    if let Some(s) = cache_salt {
        buf.push(1);
        buf.extend_from_slice(s.as_bytes());
    }
    xxh3_64(&buf)
}

/// Where checkpoints sit, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Gap between checkpoints in the dense window (>= 1).
    pub stride: u32,
    /// Blocks at the start checkpointed every `stride`.
    pub dense: u32,
    /// Checkpoints per doubling of the gap past the dense window (>= 1).
    pub per_doubling: u32,
}

impl Schedule {
    /// Block counts at which a prompt of `total` whole blocks is
    /// checkpointed: ascending, each > 0, the last one `total`.
    pub fn points(&self, total: u32) -> Vec<u32> {
        let mut out = self.scheduled(total);
        if out.last().is_some_and(|&l| l < total) || (out.is_empty() && total > 0) {
            out.push(total);
        }
        out
    }

    /// The scheduled points up to `total`, without the end.
    fn scheduled(&self, total: u32) -> Vec<u32> {
        self.iter().take_while(|&p| p <= total).collect()
    }

    /// Every scheduled point, ascending, whatever the prompt's length.
    fn iter(&self) -> Points {
        Points {
            s: *self,
            at: 0,
            gap: 0,
            in_gap: 0,
            sparse: false,
        }
    }
}

/// The scheduled points: dense, then sparse (ends at u32 overflow).
struct Points {
    s: Schedule,
    at: u32,
    gap: u32,
    in_gap: u32,
    sparse: bool,
}

impl Iterator for Points {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let stride = self.s.stride.max(1);
        let per = self.s.per_doubling.max(1);
        if !self.sparse {
            match self.at.checked_add(stride).filter(|&n| n <= self.s.dense) {
                Some(n) => {
                    self.at = n;
                    return Some(n);
                }
                None => {
                    // The first sparse gap is 1/per_doubling of the dense
                    // window, and it doubles whenever the depth has: the
                    // gap stays about depth / per_doubling all the way.
                    self.sparse = true;
                    self.gap = stride.saturating_mul(2).max(self.s.dense / per);
                }
            }
        }
        let next = self.at.checked_add(self.gap)?;
        self.at = next;
        self.in_gap += 1;
        if self.in_gap == per {
            self.in_gap = 0;
            self.gap = self.gap.saturating_mul(2);
        }
        Some(next)
    }
}

/// Bytes of short pieces gathered before they are hashed.
const GATHER: usize = 1024;

/// The checkpoints of a prompt fed in pieces (the renderer writes here
/// directly, so a long prompt is never copied into one buffer): the same
/// hashes as [`checkpoints`] over the concatenation. Only whole blocks
/// reach the hash state; short pieces and a partial block wait in
/// `carry`, and the partial block at the end is dropped.
pub struct Hasher {
    block_bytes: usize,
    points: Points,
    /// Next scheduled boundary, in bytes from the start.
    next: Option<u64>,
    next_blocks: u32,
    state: Xxh3,
    /// Whole-block bytes hashed so far.
    fed: u64,
    carry: Vec<u8>,
    out: Vec<Checkpoint>,
    /// Byte lengths still to probe, descending (the next one last).
    probes: Vec<u32>,
    probed: Vec<Probe>,
    /// Whether `finish_probed` also takes the prompt's end (only when
    /// probing: the affinity cookie's anchor).
    ends: bool,
}

/// The hash of a prompt's first `bytes` bytes, taken off the schedule
/// (see [`Hasher::probing`]): the hash state's digest there, the
/// partial block included. A prompt's own ([`Hasher::finish_probed`])
/// is what a probe of a longer prompt at its length equals exactly when
/// the longer one starts with all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub bytes: u32,
    pub hash: u64,
}

impl Hasher {
    pub fn new(seed: u64, block_bytes: usize, s: &Schedule) -> Hasher {
        let mut h = Hasher {
            block_bytes: block_bytes.max(1),
            points: s.iter(),
            next: None,
            next_blocks: 0,
            state: Xxh3::with_seed(seed),
            fed: 0,
            carry: Vec::with_capacity(GATHER.max(block_bytes) + block_bytes),
            out: Vec::new(),
            probes: Vec::new(),
            probed: Vec::new(),
            ends: false,
        };
        h.advance();
        h
    }

    /// Also hash the prefixes of `bytes` bytes, wherever they end (in a
    /// block, or in the partial block at the prompt's end): each probe
    /// equals the end of an earlier prompt of that many bytes that this
    /// one starts with (a conversation's previous turn, all of it: its
    /// partial last block too, where a short question after a shared
    /// system prompt lies), since that one, too, is the hash state's
    /// digest there (see `finish_probed`). A probe doesn't re-seed the
    /// chain, so the checkpoints stay as they are. Callers bound how many
    /// (the affinity cookie's sessions).
    pub fn probing(mut self, bytes: &[u32]) -> Hasher {
        self.probes = bytes.iter().copied().filter(|&b| b > 0).collect();
        self.probes.sort_unstable_by(|a, b| b.cmp(a));
        self.probes.dedup();
        self.ends = true;
        self
    }

    fn advance(&mut self) {
        match self.points.next() {
            Some(p) => {
                self.next_blocks = p;
                self.next = Some(u64::from(p) * self.block_bytes as u64);
            }
            None => self.next = None,
        }
    }

    pub fn push(&mut self, mut bytes: &[u8]) {
        let bb = self.block_bytes;
        // Short pieces (a message's framing, a short message) gather in
        // `carry` and reach the hash state a run of blocks at a time: its
        // cost is per call as much as per byte.
        if self.carry.len() + bytes.len() < GATHER.max(bb) {
            self.carry.extend_from_slice(bytes);
            return;
        }
        if !self.carry.is_empty() {
            let fill = (bb - self.carry.len() % bb) % bb;
            let (head, rest) = bytes.split_at(fill.min(bytes.len()));
            self.carry.extend_from_slice(head);
            bytes = rest;
            let whole = self.carry.len() / bb * bb;
            let mut gathered = std::mem::take(&mut self.carry);
            self.feed(gathered.get(..whole).unwrap_or_default());
            gathered.drain(..whole);
            self.carry = gathered;
        }
        let whole = bytes.len() / bb * bb;
        let (blocks, tail) = bytes.split_at(whole);
        self.feed(blocks);
        self.carry.extend_from_slice(tail);
    }

    /// Hash whole blocks, closing a checkpoint at each scheduled boundary.
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let probe = self.probes.last().map(|&b| u64::from(b));
            let boundary = match (self.next, probe) {
                (Some(n), Some(p)) => Some(n.min(p)),
                (n, p) => n.or(p),
            };
            let Some(boundary) = boundary else {
                self.state.update(bytes);
                self.fed += bytes.len() as u64;
                return;
            };
            let room = usize::try_from(boundary - self.fed).unwrap_or(usize::MAX);
            let take = room.min(bytes.len());
            self.state.update(&bytes[..take]);
            self.fed += take as u64;
            bytes = &bytes[take..];
            if Some(self.fed) == probe {
                if let Some(bytes) = self.probes.pop() {
                    let hash = self.state.digest();
                    self.probed.push(Probe { bytes, hash });
                }
            }
            if Some(self.fed) == self.next {
                let hash = self.state.digest();
                self.out.push(Checkpoint {
                    blocks: self.next_blocks,
                    hash,
                    on_schedule: true,
                });
                self.state = Xxh3::with_seed(hash);
                self.advance();
            }
        }
    }

    /// The checkpoints, with one at the last whole block if it is off the
    /// schedule.
    pub fn finish(self) -> Vec<Checkpoint> {
        self.finish_probed().0
    }

    /// The checkpoints, the probes the prompt reached, and the prompt's
    /// own end (all its bytes, the partial block too; `None` when empty,
    /// or when not `probing`).
    pub fn finish_probed(mut self) -> (Vec<Checkpoint>, Vec<Probe>, Option<Probe>) {
        let gathered = std::mem::take(&mut self.carry);
        let whole = gathered.len() / self.block_bytes * self.block_bytes;
        self.feed(gathered.get(..whole).unwrap_or_default());
        let total = u32::try_from(self.fed / self.block_bytes as u64).unwrap_or(u32::MAX);
        if total > self.out.last().map_or(0, |c| c.blocks) {
            self.out.push(Checkpoint {
                blocks: total,
                hash: self.state.digest(),
                on_schedule: false,
            });
        }
        // The partial block: no scheduled point lies in it (they are on
        // whole blocks), so its probes and the end are digests of the
        // state with a part of it, never fed.
        let tail = gathered.get(whole..).unwrap_or_default();
        let (fed, state) = (self.fed, &self.state);
        let on_end = self.out.last().map(|c| c.hash);
        let at = |n: usize| -> Option<Probe> {
            let bytes = u32::try_from(fed + n as u64).ok()?;
            let hash = match n {
                // On the last checkpoint: its hash (before the chain
                // re-seeds, as a probe there is).
                0 => on_end?,
                _ => {
                    let mut st = state.clone();
                    st.update(tail.get(..n)?);
                    st.digest()
                }
            };
            Some(Probe { bytes, hash })
        };
        let end = if self.ends { at(tail.len()) } else { None };
        // Probes in the partial block (ascending; those past it stay).
        let mut probes = std::mem::take(&mut self.probes);
        while let Some(&p) = probes.last() {
            let n = u64::from(p).saturating_sub(fed);
            let Some(probe) = usize::try_from(n)
                .ok()
                .filter(|&n| n > 0 && n <= tail.len())
                .and_then(at)
            else {
                break;
            };
            probes.pop();
            self.probed.push(probe);
        }
        (self.out, self.probed, end)
    }
}

/// One checkpoint: the prefix of the first `blocks` blocks, and its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub blocks: u32,
    pub hash: u64,
    /// On the schedule (every prompt long enough has it), not just the end
    /// of this prompt: only these compare across prompts of other lengths.
    pub on_schedule: bool,
}

/// The checkpoints of `text` (all of it, in whole `block_bytes` blocks).
pub fn checkpoints(seed: u64, text: &[u8], block_bytes: usize, s: &Schedule) -> Vec<Checkpoint> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let total = u32::try_from(text.len() / block_bytes).unwrap_or(u32::MAX);
    let scheduled = s.scheduled(total).len();
    let mut prev = seed;
    let mut from = 0usize;
    s.points(total)
        .into_iter()
        .enumerate()
        .map(|(i, blocks)| {
            let to = blocks as usize * block_bytes;
            prev = xxh3_64_with_seed(text.get(from..to).unwrap_or_default(), prev);
            from = to;
            Checkpoint {
                blocks,
                hash: prev,
                on_schedule: i < scheduled,
            }
        })
        .collect()
}

/// The end of `text` (see [`Probe`]), given its checkpoints `cps`: the
/// chain from its last scheduled checkpoint before its end over the rest,
/// partial block and all, in one call; what [`Hasher::finish_probed`]
/// gives when probing. `None` for no text.
pub fn end(seed: u64, text: &[u8], block_bytes: usize, cps: &[Checkpoint]) -> Option<Probe> {
    let bytes = u32::try_from(text.len()).ok().filter(|&b| b > 0)?;
    let bb = block_bytes.max(1);
    let (from, prev) = cps
        .iter()
        .rev()
        .map(|c| (c.blocks as usize * bb, c))
        .find(|(at, c)| c.on_schedule && *at < text.len())
        .map_or((0, seed), |(at, c)| (at, c.hash));
    let hash = xxh3_64_with_seed(text.get(from..)?, prev);
    Some(Probe { bytes, hash })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Schedule = Schedule {
        stride: 4,
        dense: 256,
        per_doubling: 8,
    };

    fn hashes(text: &[u8]) -> Vec<Checkpoint> {
        checkpoints(seed("m", None), text, 64, &S)
    }

    #[test]
    fn golden_values_are_stable_across_platforms() {
        let s = seed("llama-3-8b", None);
        let c = checkpoints(s, &[b'a'; 64 * 9 + 5], 64, &S);
        // Fixed values: a change here means every index entry in a running
        // fleet changes meaning. Bump SEED_TAG if that's intended.
        assert_eq!(s, 15023179666319042219);
        let got: Vec<(u32, u64)> = c.iter().map(|c| (c.blocks, c.hash)).collect();
        assert_eq!(
            got,
            vec![
                (4, 12685756713379647248),
                (8, 7237895646621333217),
                (9, 7471578846549884847)
            ]
        );
    }

    #[test]
    fn schedule_is_dense_then_doubles_and_ends_at_the_last_block() {
        let p = S.points(2000);
        assert_eq!(&p[..3], &[4, 8, 12]);
        assert_eq!(p[63], 256);
        // Gap 32 (256 / 8) for eight checkpoints, then 64...
        assert_eq!(&p[64..66], &[288, 320]);
        assert_eq!(p[71], 512);
        assert_eq!(p[72], 576);
        assert_eq!(*p.last().unwrap(), 2000);
        assert!(p.windows(2).all(|w| w[0] < w[1]));
        assert!(S.points(0).is_empty());
        assert_eq!(S.points(3), vec![3]);
        assert_eq!(S.points(4), vec![4]);
    }

    #[test]
    fn checkpoints_per_request_are_bounded_by_the_log_of_its_length() {
        for (bytes, most) in [
            (16 << 10, 64),
            (256 << 10, 97),
            (1 << 20, 113),
            (16 << 20, 145),
        ] {
            let n = S.points((bytes / 64) as u32).len();
            assert!(n <= most, "{bytes} bytes: {n} checkpoints");
        }
    }

    #[test]
    fn a_divergence_at_any_depth_is_told_apart() {
        let base: Vec<u8> = (0..1_000_000u32).map(|i| b'a' + (i % 23) as u8).collect();
        let a = hashes(&base);
        for at in [20_000usize, 100_000, 900_000] {
            let mut other = base.clone();
            other[at] = b'#';
            let b = hashes(&other);
            assert_ne!(a.last(), b.last(), "divergence at {at}");
            // Everything before the divergence still matches...
            let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            let depth = a[shared - 1].blocks as usize * 64;
            assert!(depth <= at, "{depth} > {at}");
            // ...located to within one gap (1/8 of the depth).
            assert!(at - depth <= at / 8 + 64 * 4, "at {at}: matched to {depth}");
        }
    }

    #[test]
    fn chain_identifies_the_whole_prefix() {
        let a = hashes(&[b'x'; 64 * 12]);
        let mut t = vec![b'x'; 64 * 12];
        t[3] = b'y';
        let b = hashes(&t);
        assert!(a.iter().zip(&b).all(|(x, y)| x.hash != y.hash));
        // A longer prompt with the same start shares its checkpoints.
        let c = hashes(&[b'x'; 64 * 20 + 7]);
        assert_eq!(&c[..3], &a[..3]);
    }

    #[test]
    fn model_and_salt_change_every_hash() {
        let text = [7u8; 512];
        let base = checkpoints(seed("m1", None), &text, 64, &S);
        for other in [
            seed("m2", None),
            seed("m1", Some("s")),
            seed("m1", Some("")),
        ] {
            let o = checkpoints(other, &text, 64, &S);
            assert!(base.iter().zip(&o).all(|(a, b)| a.hash != b.hash));
        }
    }

    #[test]
    fn hashing_in_pieces_gives_the_same_checkpoints() {
        let text: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whole = hashes(&text[..]);
        for piece in [1usize, 7, 64, 100, 4096, 65_537] {
            let mut h = Hasher::new(seed("m", None), 64, &S);
            for chunk in text.chunks(piece) {
                h.push(chunk);
            }
            assert_eq!(h.finish(), whole, "pieces of {piece}");
        }
        // Pieces of mixed sizes (framing, short and long texts), so the
        // gathered bytes end anywhere in a block when a long piece comes;
        // and blocks larger than the gathering.
        for bb in [16usize, 64, 2048] {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut h = Hasher::new(seed("m", None), bb, &S);
            let mut rest = &text[..];
            while !rest.is_empty() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let len = match x % 4 {
                    0 => x as usize % 8,
                    1 => x as usize % 300,
                    2 => x as usize % 3000,
                    _ => x as usize % 20_000,
                };
                let (piece, tail) = rest.split_at(len.min(rest.len()));
                h.push(piece);
                rest = tail;
            }
            assert_eq!(
                h.finish(),
                checkpoints(seed("m", None), &text, bb, &S),
                "mixed pieces, blocks of {bb}"
            );
        }
        // Ends exactly on a scheduled point, and shorter than one block.
        for len in [256 * 64, 63, 0] {
            let mut h = Hasher::new(seed("m", None), 64, &S);
            h.push(&text[..len]);
            assert_eq!(h.finish(), hashes(&text[..len]), "{len} bytes");
        }
    }

    /// The end of `text` as the hasher sees it (fed in pieces of 777).
    fn end_of(text: &[u8], bb: usize) -> Option<Probe> {
        let mut h = Hasher::new(seed("m", None), bb, &S).probing(&[]);
        text.chunks(777).for_each(|c| h.push(c));
        let streamed = h.finish_probed().2;
        // The same in one call.
        let cps = checkpoints(seed("m", None), text, bb, &S);
        let one_call = end(seed("m", None), text, bb, &cps);
        assert_eq!(streamed, one_call, "{} bytes", text.len());
        streamed
    }

    #[test]
    fn a_probe_is_the_end_of_the_shorter_prompt() {
        let text: Vec<u8> = (0..200_037u32).map(|i| (i * 13 % 251) as u8).collect();
        let whole = hashes(&text);
        // On a block off the schedule, on it (256, 576 blocks), inside a
        // block, in the partial block at the end, at the end, past it.
        let at = [
            5u32 * 64,
            256 * 64,
            300 * 64 + 17,
            576 * 64,
            1999 * 64 + 1,
            200_010,
            200_037,
            200_038,
        ];
        let mut h = Hasher::new(seed("m", None), 64, &S).probing(&at);
        for chunk in text.chunks(777) {
            h.push(chunk);
        }
        let (cps, probed, end) = h.finish_probed();
        assert_eq!(cps, whole, "probes leave the checkpoints alone");
        assert_eq!(end, end_of(&text, 64));
        let want: Vec<Probe> = at[..7]
            .iter()
            .map(|&b| end_of(&text[..b as usize], 64).unwrap())
            .collect();
        assert_eq!(probed, want);
        // Off whole blocks, the end is the chain from the last scheduled
        // checkpoint over the rest, partial block and all (as `checkpoints`
        // hashes, one call).
        for len in [300 * 64 + 17, 1999 * 64 + 1, 200_010, 63] {
            let cps = hashes(&text[..len]);
            let last = cps.iter().rev().find(|c| c.on_schedule);
            let (from, prev) =
                last.map_or((0, seed("m", None)), |c| (c.blocks as usize * 64, c.hash));
            let want = xxh3_64_with_seed(&text[from..len], prev);
            assert_eq!(
                end_of(&text[..len], 64).map(|e| e.hash),
                Some(want),
                "{len}"
            );
        }
        // On whole blocks, the end is the last checkpoint.
        for b in [5usize, 256, 576, 1999] {
            let last = hashes(&text[..b * 64]).pop().unwrap();
            assert_eq!(end_of(&text[..b * 64], 64).map(|e| e.hash), Some(last.hash));
        }
        // Another start: no probe matches.
        let mut other = text.clone();
        other[10] ^= 1;
        let mut h = Hasher::new(seed("m", None), 64, &S).probing(&at);
        h.push(&other);
        let (_, probed, _) = h.finish_probed();
        assert!(probed.iter().zip(&want).all(|(a, b)| a.hash != b.hash));
        // The same whole blocks, another partial block: another end.
        assert_ne!(
            end_of(&text[..64 * 24 + 10], 64),
            end_of(&other[..64 * 24 + 10], 64)
        );
        let mut tail = text[..64 * 24 + 10].to_vec();
        tail[64 * 24 + 3] ^= 1;
        assert_ne!(end_of(&text[..64 * 24 + 10], 64), end_of(&tail, 64));
        // Nothing: no end; and none taken when not probing.
        assert_eq!(end_of(&[], 64), None);
        let mut h = Hasher::new(seed("m", None), 64, &S);
        h.push(&text);
        assert_eq!(h.finish_probed().2, None);
    }

    #[test]
    fn probes_agree_with_ends_for_any_pieces_and_blocks() {
        let text: Vec<u8> = (0..60_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for bb in [8usize, 64, 1000, 2048] {
            for _ in 0..20 {
                let len = rnd() as usize % text.len();
                let mut at: Vec<u32> = (0..6).map(|_| (rnd() % (len as u64 + 3)) as u32).collect();
                let blocks = (len / bb) as u32;
                at.extend(S.points(blocks).iter().take(3).map(|&b| b * bb as u32));
                at.extend([0, len as u32, blocks * bb as u32]);
                let mut h = Hasher::new(seed("m", None), bb, &S).probing(&at);
                let mut rest = &text[..len];
                while !rest.is_empty() {
                    let n = match rnd() % 3 {
                        0 => rnd() as usize % 8,
                        1 => rnd() as usize % 300,
                        _ => rnd() as usize % 5000,
                    };
                    let (piece, tail) = rest.split_at(n.min(rest.len()));
                    h.push(piece);
                    rest = tail;
                }
                let (cps, probed, _) = h.finish_probed();
                assert_eq!(cps, checkpoints(seed("m", None), &text[..len], bb, &S));
                let mut want: Vec<u32> = at
                    .iter()
                    .copied()
                    .filter(|&b| b > 0 && b as usize <= len)
                    .collect();
                want.sort_unstable();
                want.dedup();
                assert_eq!(probed.iter().map(|p| p.bytes).collect::<Vec<_>>(), want);
                for p in probed {
                    assert_eq!(
                        Some(p),
                        end_of(&text[..p.bytes as usize], bb),
                        "blocks of {bb}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_whole_blocks_count() {
        assert!(hashes(&[1; 63]).is_empty());
        assert_eq!(hashes(&[1; 64]).len(), 1);
        assert!(checkpoints(1, &[1; 64], 0, &S).is_empty());
    }
}
