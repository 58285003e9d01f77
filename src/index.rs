//! The prefix index: block hash → replicas that recently received that
//! prefix, in shared data so every Envoy worker sees what every other
//! worker learned.
//!
//! Layout: a set-associative hash table of `buckets` keys
//! (`prefix-router/<records>/idx/<n>`, see `store::shared_key`), each holding up to `WAYS` entries; an entry is
//! a block hash and up to `REPLICAS_PER_ENTRY` (replica, last-seen second)
//! pairs. Shared-data keys can't be deleted, so the key space is fixed by
//! config: at most `capacity` entries, evicted least-recently-seen first
//! within their bucket. Memory bound: `capacity * ENTRY_BYTES` of values
//! plus Envoy's per-key overhead for `capacity / WAYS` keys (see README).
//!
//! Only a request's checkpoints are indexed (see `prefix::Schedule`:
//! dense near the start, sparser deeper, one at the end). A lookup
//! binary-searches them, so it costs O(log(checkpoints)) reads, and a
//! record writes only the checkpoints the replica doesn't hold yet.

use std::collections::HashMap;

use crate::endpoint::ReplicaId;
use crate::prefix::Checkpoint;
use crate::store::{self, shared_key, update, Store, StoreError, Writer};

pub const WAYS: usize = 8;
pub const REPLICAS_PER_ENTRY: usize = 4;
/// Bytes one full entry takes in its bucket value.
pub const ENTRY_BYTES: usize = 8 + 8 + 1 + 1 + REPLICAS_PER_ENTRY * 12;
/// 2: entries carry what followed them (`child`, `forked`); 3: the
/// common record envelope (`store::Writer`).
pub(crate) const VERSION: u8 = 3;
/// A held prefix is re-stamped at most this often, so hot entries stay
/// young (not evicted) without a write per request.
const REFRESH_S: u32 = 5;
/// Bound on shared-data reads per lookup.
const MAX_PROBES: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    hash: u64,
    /// Hash of the scheduled checkpoint first seen after this one (0:
    /// none yet): a second, different one means the prefix branches.
    child: u64,
    /// Two different continuations have been seen: a shared trunk (a long
    /// system prompt or tool list with many documents or sessions below
    /// it), not one conversation's history.
    forked: bool,
    holders: Vec<Holder>,
}

/// A replica that holds an entry's prefix, and when it was last stamped
/// there (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    id: ReplicaId,
    seen_s: u32,
}

impl Entry {
    fn newest(&self) -> u32 {
        self.holders.iter().map(|h| h.seen_s).max().unwrap_or(0)
    }
}

/// Decode a bucket; anything malformed reads as an empty bucket, because a
/// corrupt record must never be trusted (it only costs a cache miss).
fn decode(buf: &[u8]) -> Vec<Entry> {
    store::decode(VERSION, buf, |r| {
        let n = usize::from(r.u8()?);
        if n > WAYS {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (hash, child) = (r.u64()?, r.u64()?);
            let forked = match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            };
            let k = usize::from(r.u8()?);
            if k > REPLICAS_PER_ENTRY {
                return None;
            }
            let mut holders = Vec::with_capacity(k);
            for _ in 0..k {
                holders.push(Holder {
                    id: r.u64()?,
                    seen_s: r.u32()?,
                });
            }
            out.push(Entry {
                hash,
                child,
                forked,
                holders,
            });
        }
        Some(out)
    })
    .unwrap_or_default()
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut w = Writer::new(VERSION, 1 + entries.len() * ENTRY_BYTES);
    w.u8(entries.len() as u8);
    for e in entries {
        w.u64(e.hash).u64(e.child).u8(u8::from(e.forked));
        w.u8(e.holders.len() as u8);
        for h in &e.holders {
            w.u64(h.id).u32(h.seen_s);
        }
    }
    w.finish()
}

/// Fuzzing support: decoding arbitrary bytes (as a record, and as the
/// payload of one) never panics, and whatever decodes survives an
/// encode/decode round trip unchanged.
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub fn check_codec(buf: &[u8]) {
    for record in [buf, &store::seal(VERSION, buf)] {
        let entries = decode(record);
        assert!(entries.len() <= WAYS);
        assert_eq!(decode(&encode(&entries)), entries);
    }
}

/// What one replica holds of a request: its leading blocks, and the
/// oldest stamp the lookup saw on them there (seconds; what `record`
/// needs to skip a fresh prefix).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub blocks: u32,
    pub stamped: u32,
}

/// Per replica: what it holds of the request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Matches {
    pub blocks: HashMap<ReplicaId, Held>,
    pub probes: u32,
    /// Where the request leaves what anyone holds, if it does.
    pub branch: Option<Branch>,
}

/// The deepest checkpoint of a request that some replica holds, when the
/// request goes on past it (new content below a known prefix).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Branch {
    /// Index of that checkpoint in the request's list.
    pub at: usize,
    /// Blocks up to it.
    pub held: u32,
    /// Different continuations of it were seen before: a shared trunk.
    pub forked: bool,
    child: u64,
}

impl Branch {
    /// The prefix is a shared trunk for this request: forked before, or
    /// this request is its second, different continuation (the first was
    /// recorded as `child`). Without the second case the first two
    /// documents or agent sessions below a new preamble (in each gateway
    /// instance) were priced as followers of the first and piled onto the
    /// preamble's first holder. A conversation's next turn is no fork: the
    /// last turn ended there, so nothing followed it yet (or this turn's
    /// own continuation, on a retry).
    pub fn forks(&self, next: Option<&Checkpoint>) -> bool {
        self.forked
            || (self.child != 0 && next.is_some_and(|n| n.on_schedule && n.hash != self.child))
    }
}

impl Matches {
    pub fn get(&self, id: ReplicaId) -> u32 {
        self.blocks.get(&id).map_or(0, |m| m.blocks)
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RecordStats {
    pub writes: u32,
    pub inserted: u32,
    pub evicted: u32,
    pub cas_retries: u32,
    pub failed: u32,
}

pub struct PrefixIndex {
    buckets: usize,
    max_retries: u32,
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> Self {
        PrefixIndex {
            buckets: capacity.div_ceil(WAYS).max(1),
            max_retries: 4,
        }
    }

    pub fn capacity(&self) -> usize {
        self.buckets * WAYS
    }

    fn key(&self, hash: u64) -> String {
        // Bucket from the high bits too: cheap insurance against any
        // structure in the low bits of the checkpoint hashes.
        let mixed = hash ^ (hash >> 29) ^ (hash >> 47);
        format!(
            concat!(shared_key!("idx/"), "{}"),
            mixed % self.buckets as u64
        )
    }

    fn probe<S: Store + ?Sized>(&self, store: &S, hash: u64) -> Option<Entry> {
        let (value, _) = store.get(&self.key(hash));
        decode(&value?).into_iter().find(|e| e.hash == hash)
    }

    /// Longest indexed prefix per replica. Relies on what `record`
    /// maintains: a replica holding checkpoint j also holds every earlier
    /// one. So a binary search finds the deepest checkpoint anyone holds,
    /// then each replica seen along the way is refined by its own binary
    /// search between the deepest probe that had it and the shallowest that
    /// didn't. Probes are cached and capped at `MAX_PROBES`.
    pub fn lookup<S: Store + ?Sized>(&self, store: &S, cps: &[Checkpoint]) -> Matches {
        let mut p = Prober {
            index: self,
            store,
            cps,
            cache: HashMap::new(),
        };
        let deepest = p.deepest();
        let mut m = Matches {
            branch: p.branch(deepest),
            ..Matches::default()
        };
        for id in p.seen() {
            if let Some(held) = p.held_by(id) {
                m.blocks.insert(id, held);
            }
        }
        m.probes = p.cache.len() as u32;
        m
    }

    /// Stamp `replica` on every checkpoint it doesn't hold yet (per
    /// `matched`/`stamped` from the lookup), or on all of them when its
    /// stamp is older than the refresh period.
    pub fn record<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        replica: ReplicaId,
        matched: u32,
        stamped: u32,
        now_s: u32,
    ) -> RecordStats {
        let fresh = now_s.saturating_sub(stamped) < REFRESH_S;
        let skip_to = if fresh { matched } else { 0 };
        self.write_each(store, cps, skip_to, |entries, cp, child| {
            stamp(entries, cp.hash, child, replica, now_s)
        })
    }

    /// The prompt recorded on `from` was served by `to` (Envoy retried it
    /// elsewhere, took the header's next address, or fell back): `to`
    /// holds all of it now, and `from` only what it held before it was
    /// credited (`from_held` blocks). Left as recorded, the next turn
    /// looked for the prompt on the replica that had just failed it, and
    /// nowhere else. One write per checkpoint, like a record from cold.
    pub fn moved<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        from: ReplicaId,
        from_held: u32,
        to: ReplicaId,
        now_s: u32,
    ) -> RecordStats {
        self.write_each(store, cps, 0, |entries, cp, child| {
            // `from` leaves before `to` joins: in a full entry, `to`
            // joining first evicted the oldest other holder, and then
            // `from` left too, so a replica that still held the
            // checkpoint lost it.
            if cp.blocks > from_held {
                if let Some(e) = entries.iter_mut().find(|e| e.hash == cp.hash) {
                    e.holders.retain(|h| h.id != from);
                }
            }
            stamp(entries, cp.hash, child, to, now_s)
        })
    }

    /// The prompt recorded on `replica` was refused there (a 4xx, a 503):
    /// nothing ran, so it holds only what it held before it was credited
    /// (`held` blocks). Left as recorded, every request sharing the prompt
    /// was sent to a replica that never computed it (a 429 from a replica
    /// that is rate limiting drew the next request with that prefix back).
    /// One write per checkpoint deeper than `held`; an entry left without
    /// holders reads as absent.
    pub fn uncredit<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        replica: ReplicaId,
        held: u32,
    ) -> RecordStats {
        self.write_each(store, cps, held, |entries, cp, _| {
            if let Some(e) = entries.iter_mut().find(|e| e.hash == cp.hash) {
                e.holders.retain(|h| h.id != replica);
            }
            (0, 0)
        })
    }

    /// Apply `edit` to the entry of each checkpoint deeper than `skip_to`
    /// blocks, one compare-and-swap each; `edit` gets the bucket, the
    /// checkpoint and what follows it if that is comparable (on the
    /// schedule), for free with this write.
    fn write_each<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        skip_to: u32,
        mut edit: impl FnMut(&mut Vec<Entry>, &Checkpoint, u64) -> (u32, u32),
    ) -> RecordStats {
        let mut stats = RecordStats::default();
        for (i, cp) in cps.iter().enumerate().filter(|(_, c)| c.blocks > skip_to) {
            let child = cps
                .get(i + 1)
                .filter(|n| n.on_schedule)
                .map_or(0, |n| n.hash);
            let mut outcome = (0, 0);
            let r = update(store, &self.key(cp.hash), self.max_retries, |old| {
                let mut entries = old.map(decode).unwrap_or_default();
                outcome = edit(&mut entries, cp, child);
                Some(encode(&entries))
            });
            stats.writes += 1;
            match r {
                Ok(retries) => {
                    stats.cas_retries += retries;
                    stats.inserted += outcome.0;
                    stats.evicted += outcome.1;
                }
                Err(StoreError::CasMismatch) => {
                    stats.cas_retries += self.max_retries;
                    stats.failed += 1;
                }
                Err(_) => stats.failed += 1,
            }
        }
        stats
    }
}

impl PrefixIndex {
    /// Has the prefix ending at `at` forked (different continuations were
    /// seen below it)? One read.
    pub fn forked<S: Store + ?Sized>(&self, store: &S, at: &Checkpoint) -> bool {
        self.probe(store, at.hash).is_some_and(|e| e.forked)
    }

    /// Remember what followed the branch point of a request (its next
    /// checkpoint, if that one is on the schedule, so two requests are
    /// compared at the same depth): a second, different continuation marks
    /// the prefix as a shared trunk. At most two writes per checkpoint
    /// ever: none once it is forked or when the continuation is the known
    /// one (a conversation's next turn).
    pub fn note_branch<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        b: &Branch,
    ) -> bool {
        let (Some(at), Some(next)) = (cps.get(b.at), cps.get(b.at + 1)) else {
            return false;
        };
        if b.forked || !next.on_schedule || b.child == next.hash {
            return false;
        }
        update(store, &self.key(at.hash), self.max_retries, |old| {
            let mut entries = old.map(decode).unwrap_or_default();
            let e = entries.iter_mut().find(|e| e.hash == at.hash)?;
            match e.child {
                0 => e.child = next.hash,
                c if c != next.hash && !e.forked => e.forked = true,
                _ => return None,
            }
            Some(encode(&entries))
        })
        .is_ok()
    }
}

/// Cached checkpoint reads for one lookup.
struct Prober<'a, S: Store + ?Sized> {
    index: &'a PrefixIndex,
    store: &'a S,
    cps: &'a [Checkpoint],
    cache: HashMap<usize, Option<Entry>>,
}

impl<S: Store + ?Sized> Prober<'_, S> {
    /// Entry of checkpoint `j` if it has holders; reads past `MAX_PROBES`
    /// answer "absent" (a shorter match, never a wrong one).
    fn get(&mut self, j: usize) -> Option<Entry> {
        if let Some(e) = self.cache.get(&j) {
            return e.clone();
        }
        if self.cache.len() >= MAX_PROBES {
            return None;
        }
        let hash = self.cps.get(j)?.hash;
        let e = self
            .index
            .probe(self.store, hash)
            .filter(|e| !e.holders.is_empty());
        self.cache.insert(j, e.clone());
        e
    }

    /// How many leading checkpoints anyone holds (a binary search: [0, lo)
    /// held, [hi, len) not).
    fn deepest(&mut self) -> usize {
        let (mut lo, mut hi) = (0usize, self.cps.len());
        // Fast paths: unique prompts miss on the first checkpoint, long
        // shared prefixes usually match whole.
        if hi > 0 && self.get(0).is_none() {
            hi = 0;
        } else if hi > 1 && self.get(hi - 1).is_some() {
            lo = hi;
        } else if hi > 0 {
            lo = 1;
            hi -= 1;
        }
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.get(mid - 1).is_some() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Where the request leaves what is held, when it holds some of it
    /// and brings more: the last checkpoint held (`deepest` of them).
    fn branch(&mut self, deepest: usize) -> Option<Branch> {
        if deepest == 0 || deepest >= self.cps.len() {
            return None;
        }
        let e = self.get(deepest - 1)?;
        let cp = self.cps.get(deepest - 1)?;
        Some(Branch {
            at: deepest - 1,
            held: cp.blocks,
            forked: e.forked,
            child: e.child,
        })
    }

    /// Every replica the probes so far named, once each.
    fn seen(&self) -> Vec<ReplicaId> {
        let mut v: Vec<ReplicaId> = self
            .cache
            .values()
            .flatten()
            .flat_map(|e| e.holders.iter().map(|h| h.id))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// How much of the request `id` holds: its own binary search between
    /// the deepest probe that had it and the shallowest after that didn't.
    fn held_by(&mut self, id: ReplicaId) -> Option<Held> {
        let has = |e: &Option<Entry>| {
            e.as_ref()
                .is_some_and(|e| e.holders.iter().any(|h| h.id == id))
        };
        let snapshot: Vec<(usize, bool)> = self.cache.iter().map(|(&j, e)| (j, has(e))).collect();
        // Count of leading checkpoints this replica holds: in [lo, hi].
        let mut lo = snapshot
            .iter()
            .filter(|p| p.1)
            .map(|p| p.0 + 1)
            .max()
            .unwrap_or(0);
        let mut hi = snapshot
            .iter()
            .filter(|p| !p.1 && p.0 >= lo)
            .map(|p| p.0)
            .min()
            .unwrap_or(self.cps.len());
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if has(&self.get(mid - 1)) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        if lo == 0 {
            return None;
        }
        // The oldest stamp of it seen (the first checkpoint's, the deepest
        // one's, and those probed between), not the deepest one's alone: a
        // session whose turns come quicker than `REFRESH_S` finds its last
        // turn's end freshly stamped every time, and if that were all
        // `record` looked at, its first checkpoints (which every lookup
        // starts from) would never be re-stamped and would be evicted
        // first however hot they are. (Every checkpoint below `lo` that
        // was read is in the cache: `lo` comes from a probe.)
        let stamped = (self.cache.iter())
            .filter(|(&j, _)| j < lo)
            .filter_map(|(_, e)| e.as_ref()?.holders.iter().find(|h| h.id == id))
            .map(|h| h.seen_s)
            .min()
            .unwrap_or(0);
        let blocks = self.cps.get(lo - 1).map_or(0, |c| c.blocks);
        Some(Held { blocks, stamped })
    }
}

/// Put (replica, now) into the entry for `hash`, creating it (and evicting
/// the bucket's stalest entry when full). Returns (inserted, evicted).
fn stamp(
    entries: &mut Vec<Entry>,
    hash: u64,
    child: u64,
    replica: ReplicaId,
    now: u32,
) -> (u32, u32) {
    // A stamp ahead of now was written before the wall clock stepped back
    // (NTP): as the newest, it outlived every entry written since, for as
    // long as the step.
    for h in entries.iter_mut().flat_map(|e| e.holders.iter_mut()) {
        h.seen_s = h.seen_s.min(now);
    }
    if let Some(e) = entries.iter_mut().find(|e| e.hash == hash) {
        if e.child == 0 {
            e.child = child;
        } else if child != 0 && child != e.child {
            e.forked = true;
        }
        let holder = Holder {
            id: replica,
            seen_s: now,
        };
        if let Some(h) = e.holders.iter_mut().find(|h| h.id == replica) {
            h.seen_s = now;
        } else if e.holders.len() < REPLICAS_PER_ENTRY {
            e.holders.push(holder);
        } else if let Some(oldest) = e.holders.iter_mut().min_by_key(|h| h.seen_s) {
            *oldest = holder;
        }
        return (0, 0);
    }
    let fresh = Entry {
        hash,
        child,
        forked: false,
        holders: vec![Holder {
            id: replica,
            seen_s: now,
        }],
    };
    if entries.len() < WAYS {
        entries.push(fresh);
        return (1, 0);
    }
    let victim = entries
        .iter()
        .enumerate()
        .min_by_key(|(_, e)| e.newest())
        .map(|(i, _)| i)
        .unwrap_or(0);
    entries[victim] = fresh;
    (0, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock steps back: an entry written since is not the first to
    /// go because entries from before the step carry later stamps.
    #[test]
    fn a_clock_step_back_does_not_evict_the_newest_entries_first() {
        let mut entries = Vec::new();
        for h in 1..WAYS as u64 {
            stamp(&mut entries, h, 0, 7, 1_000);
        }
        stamp(&mut entries, 100, 0, 7, 100);
        assert_eq!(stamp(&mut entries, 101, 0, 7, 101), (0, 1));
        let kept: Vec<u64> = entries.iter().map(|e| e.hash).collect();
        assert!(kept.contains(&100) && kept.contains(&101), "{kept:?}");
        assert!(entries.iter().all(|e| e.newest() <= 101));
    }
    use crate::prefix::{checkpoints, seed, Schedule};
    use crate::store::MemStore;

    const S: Schedule = Schedule {
        stride: 4,
        dense: 256,
        per_doubling: 8,
    };

    /// Checkpoints of a prompt of `blocks` blocks of `tag` repeated.
    fn hashes(tag: &str, blocks: usize) -> Vec<Checkpoint> {
        let text = tag.repeat(64 * blocks / tag.len() + 1);
        checkpoints(seed("m", None), &text.as_bytes()[..64 * blocks], 64, &S)
    }

    fn upto(cps: &[Checkpoint], blocks: u32) -> &[Checkpoint] {
        &cps[..cps.iter().take_while(|c| c.blocks <= blocks).count()]
    }

    #[test]
    fn lookup_finds_leading_blocks_per_replica() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let long = hashes("doc-one ", 64);
        assert_eq!(idx.lookup(&s, &long).blocks.len(), 0);
        idx.record(&s, upto(&long, 40), 1, 0, 0, 100);
        idx.record(&s, upto(&long, 16), 2, 0, 0, 100);
        let m = idx.lookup(&s, &long);
        assert_eq!(m.get(1), 40);
        assert_eq!(m.get(2), 16);
        assert_eq!(m.get(3), 0);
        assert!(m.probes <= 12, "binary search, got {} probes", m.probes);
        // A different document shares nothing.
        assert!(idx.lookup(&s, &hashes("doc-two ", 64)).blocks.is_empty());
    }

    #[test]
    fn a_prefix_with_two_continuations_is_a_trunk_one_that_grows_is_not() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let trunk = "system prompt and tools ".repeat(200);
        let cps = |tail: &str| {
            let t = format!("{trunk}{tail}");
            checkpoints(seed("m", None), t.as_bytes(), 64, &S)
        };
        let first = cps(&"document one ".repeat(100));
        idx.record(&s, &first, 1, 0, 0, 100);
        // A conversation's next turn: the same continuation, longer.
        let turn = cps(&format!(
            "{}{}",
            "document one ".repeat(100),
            "reply ".repeat(50)
        ));
        let b = idx.lookup(&s, &turn).branch.unwrap();
        assert!(!b.forked);
        // The first continuation past the end of what was recorded.
        assert!(idx.note_branch(&s, &turn, &b));
        let later = cps(&format!(
            "{}{}",
            "document one ".repeat(100),
            "reply ".repeat(90)
        ));
        let b = idx.lookup(&s, &later).branch.unwrap();
        assert!(!b.forked);
        assert!(
            !idx.note_branch(&s, &later, &b),
            "same continuation: no write"
        );
        assert!(!b.forks(later.get(b.at + 1)), "a conversation's next turn");
        // Another document below the same trunk.
        let second = cps(&"document two ".repeat(100));
        let b = idx.lookup(&s, &second).branch.unwrap();
        assert!(b.held >= trunk.len() as u32 / 64 - 32 && !b.forked);
        // Not marked yet, but this request is the second continuation.
        assert!(b.forks(second.get(b.at + 1)));
        assert!(idx.note_branch(&s, &second, &b));
        let third = cps(&"document three ".repeat(100));
        let b = idx.lookup(&s, &third).branch.unwrap();
        assert!(b.forked, "two different continuations seen: a trunk");
        assert!(!idx.note_branch(&s, &third, &b));
    }

    #[test]
    fn a_prompt_served_elsewhere_moves_to_the_replica_that_served_it() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let long = hashes("doc-one ", 64);
        // Replica 1 held 16 blocks of it and was credited with all 64;
        // replica 2 served them.
        idx.record(&s, upto(&long, 16), 1, 0, 0, 100);
        idx.record(&s, &long, 1, 16, 100, 101);
        assert_eq!(idx.lookup(&s, &long).get(1), 64);
        let r = idx.moved(&s, &long, 1, 16, 2, 102);
        assert_eq!(r.writes as usize, long.len());
        assert_eq!(r.failed, 0);
        let m = idx.lookup(&s, &long);
        assert_eq!(m.get(2), 64, "the replica that served it holds it all");
        assert_eq!(m.get(1), 16, "the pick keeps what it held before");
        // Another replica's hold is untouched.
        idx.record(&s, upto(&long, 40), 3, 0, 0, 103);
        idx.moved(&s, &long, 2, 0, 1, 104);
        let m = idx.lookup(&s, &long);
        assert_eq!((m.get(1), m.get(2), m.get(3)), (64, 0, 40));
    }

    #[test]
    fn a_refused_prompt_leaves_only_what_its_replica_held_before() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let long = hashes("doc-three ", 64);
        // Replica 1 held 16 blocks and was credited with all 64; replica 2
        // holds 40 of them on its own.
        idx.record(&s, upto(&long, 16), 1, 0, 0, 100);
        idx.record(&s, upto(&long, 40), 2, 0, 0, 100);
        idx.record(&s, &long, 1, 16, 100, 101);
        let r = idx.uncredit(&s, &long, 1, 16);
        assert_eq!(r.failed, 0);
        assert!(r.writes as usize <= long.len() && r.writes > 0);
        let m = idx.lookup(&s, &long);
        assert_eq!((m.get(1), m.get(2)), (16, 40));
        // Nobody else held the rest: it reads as absent, not as a holder.
        assert_eq!(m.branch.map(|b| b.held), Some(40));
    }

    #[test]
    fn a_move_into_a_full_entry_keeps_every_other_holder() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let doc = hashes("doc-two ", 32);
        // Four replicas hold it (a full entry), the oldest first; replica
        // 4 was credited last and replica 9 served it.
        for (r, t) in [(1, 90), (2, 95), (3, 98), (4, 100)] {
            idx.record(&s, &doc, r, 0, 0, t);
        }
        idx.moved(&s, &doc, 4, 0, 9, 101);
        let m = idx.lookup(&s, &doc);
        let held: Vec<u32> = [1, 2, 3, 4, 9].iter().map(|&r| m.get(r)).collect();
        assert_eq!(held, [32, 32, 32, 0, 32]);
    }

    #[test]
    fn record_skips_what_is_fresh_and_refreshes_what_is_old() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let h = hashes("abc ", 32);
        assert_eq!(idx.record(&s, &h, 1, 0, 0, 100).writes, 8);
        let m = idx.lookup(&s, &h);
        let Held { blocks, stamped } = m.blocks[&1];
        assert_eq!(idx.record(&s, &h, 1, blocks, stamped, 101).writes, 0);
        assert_eq!(
            idx.record(&s, &h, 1, blocks, stamped, 100 + REFRESH_S)
                .writes,
            8
        );
    }

    #[test]
    fn entries_never_exceed_capacity_under_millions_of_inserts() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(1024);
        let mut total = RecordStats::default();
        for i in 0..20_000u64 {
            let h: Vec<Checkpoint> = (0..100u64)
                .map(|b| Checkpoint {
                    blocks: b as u32 + 1,
                    hash: i.wrapping_mul(1_000_003) ^ (b << 40) ^ b,
                    on_schedule: true,
                })
                .collect();
            let st = idx.record(&s, &h, i % 7, 0, 0, i as u32);
            total.inserted += st.inserted;
            total.evicted += st.evicted;
        }
        // 2,000,000 inserts into 1,024 entries.
        assert!(s.len() <= idx.capacity() / WAYS);
        let entries: usize = (0..idx.capacity() / WAYS)
            .map(|b| {
                decode(
                    &s.get(&format!(concat!(shared_key!("idx/"), "{}"), b))
                        .0
                        .unwrap_or_default(),
                )
                .len()
            })
            .sum();
        assert!(entries <= idx.capacity());
        assert_eq!(total.inserted as usize, entries);
        assert_eq!(total.inserted + total.evicted, 2_000_000);
        let bucket = store::HEADER_BYTES + 1 + WAYS * ENTRY_BYTES;
        assert!(s.bytes() <= idx.capacity() / WAYS * (bucket + 24));
    }

    /// An agent session whose turns come less than `REFRESH_S` apart: each
    /// turn's lookup finds the last turn's end freshly stamped, so `record`
    /// wrote only the new checkpoints, and the session's first ones kept
    /// their first stamp however hot they were. A bucket under pressure
    /// then evicted the session's first checkpoint before entries nobody
    /// had used since long after, and the lookup (which starts at the
    /// first checkpoint) lost the whole session.
    #[test]
    fn a_session_with_quick_turns_keeps_its_start_young() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096);
        let turn = |k: usize| hashes("agent turn ", 4 * k);
        let go = |k: usize, now: u32| {
            let cps = turn(k);
            let held = idx
                .lookup(&s, &cps)
                .blocks
                .get(&1)
                .copied()
                .unwrap_or_default();
            idx.record(&s, &cps, 1, held.blocks, held.stamped, now);
        };
        let first = turn(1)[0].hash;
        let bucket = idx.key(first);
        // Other prompts in the bucket of the session's first checkpoint,
        // never used again: filled to the brim at t=140.
        let mut cold = (1u64..).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut fill = |now: u32, n: usize| {
            for _ in 0..n {
                let h = cold.by_ref().find(|&h| idx.key(h) == bucket).unwrap();
                let cp = Checkpoint {
                    blocks: 4,
                    hash: h,
                    on_schedule: true,
                };
                idx.record(&s, &[cp], 2, 0, 0, now);
            }
        };
        for k in 1..=20 {
            go(k, 100 + 2 * k as u32); // t = 102 ..= 140
        }
        let len = decode(&s.get(&bucket).0.unwrap_or_default()).len();
        fill(140, WAYS - len);
        for k in 21..=30 {
            go(k, 100 + 2 * k as u32); // t = 142 ..= 160
        }
        // One new prompt in that bucket: the stalest entry goes, and that
        // is one of the cold ones (t=140), not the session's start.
        fill(161, 1);
        let m = idx.lookup(&s, &turn(31));
        assert_eq!(m.get(1), 4 * 30, "the session's history is still found");
    }

    #[test]
    fn eviction_takes_the_stalest_entry() {
        let mut bucket: Vec<Entry> = (0..WAYS as u64)
            .map(|i| Entry {
                hash: i,
                child: 0,
                forked: false,
                holders: vec![Holder {
                    id: 1,
                    seen_s: 10 + i as u32,
                }],
            })
            .collect();
        bucket[3].holders[0].seen_s = 1;
        assert_eq!(stamp(&mut bucket, 99, 0, 2, 50), (0, 1));
        assert!(bucket.iter().all(|e| e.hash != 3));
        assert!(bucket.iter().any(|e| e.hash == 99));
    }

    #[test]
    fn holder_list_is_bounded_and_replaces_the_oldest() {
        let mut bucket = Vec::new();
        for r in 0..REPLICAS_PER_ENTRY as u64 + 2 {
            stamp(&mut bucket, 7, 0, r, r as u32);
        }
        assert_eq!(bucket[0].holders.len(), REPLICAS_PER_ENTRY);
        assert!(bucket[0].holders.iter().all(|h| h.id >= 2));
    }

    #[test]
    fn corrupt_or_truncated_buckets_read_as_empty() {
        let good = encode(&[Entry {
            hash: 5,
            child: 6,
            forked: true,
            holders: vec![Holder { id: 1, seen_s: 2 }],
        }]);
        assert_eq!(decode(&good).len(), 1);
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_empty());
        }
        let mut extra = good.clone();
        extra.push(0);
        assert!(decode(&extra).is_empty());
        let mut bad_version = good.clone();
        bad_version[0] = 9;
        assert!(decode(&bad_version).is_empty());
        assert!(decode(&store::seal(VERSION, &[200])).is_empty());
        // The version-2 layout (no envelope) of the same bucket.
        assert!(decode(&[2, 1, 5, 0, 0, 0, 0, 0, 0, 0]).is_empty());
    }
}
