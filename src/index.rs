//! The prefix index: block hash → replicas that recently received that
//! prefix, in shared data so every Envoy worker sees what every other
//! worker learned.
//!
//! Layout: a set-associative hash table of `buckets` keys
//! (`prefix-router/idx/<n>`), each holding up to `WAYS` entries; an entry is
//! a block hash and up to `REPLICAS_PER_ENTRY` (replica, last-seen second)
//! pairs. Shared-data keys can't be deleted, so the key space is fixed by
//! config: at most `capacity` entries, evicted least-recently-seen first
//! within their bucket. Memory bound: `capacity * ENTRY_BYTES` of values
//! plus Envoy's per-key overhead for `capacity / WAYS` keys (see README).
//!
//! Only every `stride`-th block is indexed (a checkpoint). A lookup
//! binary-searches the checkpoints, so it costs O(log(blocks/stride)) reads,
//! and a record writes only the checkpoints the replica doesn't hold yet;
//! matches are resolved to `stride` blocks, which is finer than any routing
//! decision needs.

use std::collections::HashMap;

use crate::endpoint::ReplicaId;
use crate::store::{update, Reader, Store, StoreError};

pub const WAYS: usize = 8;
pub const REPLICAS_PER_ENTRY: usize = 4;
/// Bytes one full entry takes in its bucket value.
pub const ENTRY_BYTES: usize = 8 + 1 + REPLICAS_PER_ENTRY * 12;
const VERSION: u8 = 1;
/// A held prefix is re-stamped at most this often, so hot entries stay
/// young (not evicted) without a write per request.
const REFRESH_S: u32 = 5;
/// Bound on shared-data reads per lookup.
const MAX_PROBES: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    hash: u64,
    holders: Vec<(ReplicaId, u32)>,
}

impl Entry {
    fn newest(&self) -> u32 {
        self.holders.iter().map(|h| h.1).max().unwrap_or(0)
    }
}

/// Decode a bucket; anything malformed reads as an empty bucket, because a
/// corrupt record must never be trusted (it only costs a cache miss).
fn decode(buf: &[u8]) -> Vec<Entry> {
    let mut r = Reader::new(buf);
    let parse = |r: &mut Reader| -> Option<Vec<Entry>> {
        if r.u8()? != VERSION {
            return None;
        }
        let n = r.u8()? as usize;
        if n > WAYS {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let hash = r.u64()?;
            let k = r.u8()? as usize;
            if k > REPLICAS_PER_ENTRY {
                return None;
            }
            let mut holders = Vec::with_capacity(k);
            for _ in 0..k {
                holders.push((r.u64()?, r.u32()?));
            }
            out.push(Entry { hash, holders });
        }
        r.is_empty().then_some(out)
    };
    parse(&mut r).unwrap_or_default()
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + entries.len() * ENTRY_BYTES);
    out.push(VERSION);
    out.push(entries.len() as u8);
    for e in entries {
        out.extend_from_slice(&e.hash.to_le_bytes());
        out.push(e.holders.len() as u8);
        for (id, ts) in &e.holders {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&ts.to_le_bytes());
        }
    }
    out
}

/// Fuzzing support: decoding arbitrary bytes never panics, and whatever
/// decodes survives an encode/decode round trip unchanged.
#[doc(hidden)]
pub fn check_codec(buf: &[u8]) {
    let entries = decode(buf);
    assert!(entries.len() <= WAYS);
    assert_eq!(decode(&encode(&entries)), entries);
}

/// Per replica: leading blocks of the request it holds, and when that was
/// last stamped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Matches {
    pub blocks: HashMap<ReplicaId, (u32, u32)>,
    pub probes: u32,
}

impl Matches {
    pub fn get(&self, id: ReplicaId) -> u32 {
        self.blocks.get(&id).map(|m| m.0).unwrap_or(0)
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
    stride: usize,
    max_retries: u32,
}

impl PrefixIndex {
    pub fn new(capacity: usize, stride: usize) -> Self {
        PrefixIndex {
            buckets: capacity.div_ceil(WAYS).max(1),
            stride: stride.max(1),
            max_retries: 4,
        }
    }

    pub fn capacity(&self) -> usize {
        self.buckets * WAYS
    }

    fn key(&self, hash: u64) -> String {
        // FNV's low bits are weak on short inputs; fold the high half in.
        let mixed = hash ^ (hash >> 29) ^ (hash >> 47);
        format!("prefix-router/idx/{}", mixed % self.buckets as u64)
    }

    /// Indices (into the request's block list) of its checkpoints.
    fn checkpoints(&self, n_blocks: usize) -> impl Iterator<Item = usize> + '_ {
        (self.stride - 1..n_blocks).step_by(self.stride)
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
    pub fn lookup<S: Store + ?Sized>(&self, store: &S, hashes: &[u64]) -> Matches {
        let cps: Vec<usize> = self.checkpoints(hashes.len()).collect();
        let mut p = Prober {
            index: self,
            store,
            hashes,
            cps: &cps,
            cache: HashMap::new(),
        };
        // Deepest checkpoint held by anyone: [0, lo) held, [hi, m) not.
        let (mut lo, mut hi) = (0usize, cps.len());
        // Fast paths: unique prompts miss on the first checkpoint, long
        // shared prefixes usually match whole.
        if hi > 0 && p.get(0).is_none() {
            hi = 0;
        } else if hi > 1 && p.get(hi - 1).is_some() {
            lo = hi;
        } else if hi > 0 {
            lo = 1;
            hi -= 1;
        }
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if p.get(mid - 1).is_some() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let mut m = Matches::default();
        let seen: Vec<ReplicaId> = {
            let mut v: Vec<ReplicaId> = p
                .cache
                .values()
                .flatten()
                .flat_map(|e| e.holders.iter().map(|h| h.0))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for id in seen {
            let has = |e: &Option<Entry>| {
                e.as_ref()
                    .is_some_and(|e| e.holders.iter().any(|h| h.0 == id))
            };
            let snapshot: Vec<(usize, bool)> = p.cache.iter().map(|(&j, e)| (j, has(e))).collect();
            // Count of leading checkpoints this replica holds: in [rlo, rhi].
            let mut rlo = snapshot
                .iter()
                .filter(|p| p.1)
                .map(|p| p.0 + 1)
                .max()
                .unwrap_or(0);
            let mut rhi = snapshot
                .iter()
                .filter(|p| !p.1 && p.0 >= rlo)
                .map(|p| p.0)
                .min()
                .unwrap_or(cps.len());
            while rlo < rhi {
                let mid = (rlo + rhi).div_ceil(2);
                if has(&p.get(mid - 1)) {
                    rlo = mid;
                } else {
                    rhi = mid - 1;
                }
            }
            if rlo == 0 {
                continue;
            }
            let ts = p
                .get(rlo - 1)
                .and_then(|e| e.holders.iter().find(|h| h.0 == id).map(|h| h.1))
                .unwrap_or(0);
            m.blocks.insert(id, ((cps[rlo - 1] + 1) as u32, ts));
        }
        m.probes = p.cache.len() as u32;
        m
    }

    /// Stamp `replica` on every checkpoint of `hashes` it doesn't hold yet
    /// (per `matched`/`stamped` from the lookup), or on all of them when its
    /// stamp is older than the refresh period.
    pub fn record<S: Store + ?Sized>(
        &self,
        store: &S,
        hashes: &[u64],
        replica: ReplicaId,
        matched: u32,
        stamped: u32,
        now_s: u32,
    ) -> RecordStats {
        let mut stats = RecordStats::default();
        let fresh = now_s.saturating_sub(stamped) < REFRESH_S;
        let skip_below = if fresh { matched as usize } else { 0 };
        let cps: Vec<usize> = self
            .checkpoints(hashes.len())
            .filter(|cp| cp + 1 > skip_below)
            .collect();
        for cp in cps {
            let hash = hashes[cp];
            let mut outcome = (0, 0);
            let r = update(store, &self.key(hash), self.max_retries, |old| {
                let mut entries = old.map(decode).unwrap_or_default();
                outcome = stamp(&mut entries, hash, replica, now_s);
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

/// Cached checkpoint reads for one lookup.
struct Prober<'a, S: Store + ?Sized> {
    index: &'a PrefixIndex,
    store: &'a S,
    hashes: &'a [u64],
    cps: &'a [usize],
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
        let hash = self.hashes[self.cps[j]];
        let e = self
            .index
            .probe(self.store, hash)
            .filter(|e| !e.holders.is_empty());
        self.cache.insert(j, e.clone());
        e
    }
}

/// Put (replica, now) into the entry for `hash`, creating it (and evicting
/// the bucket's stalest entry when full). Returns (inserted, evicted).
fn stamp(entries: &mut Vec<Entry>, hash: u64, replica: ReplicaId, now: u32) -> (u32, u32) {
    if let Some(e) = entries.iter_mut().find(|e| e.hash == hash) {
        if let Some(h) = e.holders.iter_mut().find(|h| h.0 == replica) {
            h.1 = now;
        } else if e.holders.len() < REPLICAS_PER_ENTRY {
            e.holders.push((replica, now));
        } else if let Some(oldest) = e.holders.iter_mut().min_by_key(|h| h.1) {
            *oldest = (replica, now);
        }
        return (0, 0);
    }
    let fresh = Entry {
        hash,
        holders: vec![(replica, now)],
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
    use crate::prefix::{block_hashes, seed};
    use crate::store::MemStore;

    fn hashes(tag: &str, blocks: usize) -> Vec<u64> {
        let text = tag.repeat(64 * blocks / tag.len() + 1);
        block_hashes(seed("m", None), text.as_bytes(), 64, 256)
            .into_iter()
            .take(blocks)
            .collect()
    }

    #[test]
    fn lookup_finds_leading_blocks_per_replica() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096, 4);
        let long = hashes("doc-one ", 64);
        assert_eq!(idx.lookup(&s, &long).blocks.len(), 0);
        idx.record(&s, &long[..40], 1, 0, 0, 100);
        idx.record(&s, &long[..16], 2, 0, 0, 100);
        let m = idx.lookup(&s, &long);
        assert_eq!(m.get(1), 40);
        assert_eq!(m.get(2), 16);
        assert_eq!(m.get(3), 0);
        assert!(m.probes <= 12, "binary search, got {} probes", m.probes);
        // A different document shares nothing.
        assert!(idx.lookup(&s, &hashes("doc-two ", 64)).blocks.is_empty());
    }

    #[test]
    fn record_skips_what_is_fresh_and_refreshes_what_is_old() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(4096, 4);
        let h = hashes("abc ", 32);
        assert_eq!(idx.record(&s, &h, 1, 0, 0, 100).writes, 8);
        let m = idx.lookup(&s, &h);
        let (blocks, ts) = m.blocks[&1];
        assert_eq!(idx.record(&s, &h, 1, blocks, ts, 101).writes, 0);
        assert_eq!(idx.record(&s, &h, 1, blocks, ts, 100 + REFRESH_S).writes, 8);
    }

    #[test]
    fn entries_never_exceed_capacity_under_millions_of_inserts() {
        let s = MemStore::new();
        let idx = PrefixIndex::new(1024, 1);
        let mut total = RecordStats::default();
        for i in 0..20_000u64 {
            let h: Vec<u64> = (0..100u64)
                .map(|b| i.wrapping_mul(1_000_003) ^ (b << 40) ^ b)
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
                    &s.get(&format!("prefix-router/idx/{b}"))
                        .0
                        .unwrap_or_default(),
                )
                .len()
            })
            .sum();
        assert!(entries <= idx.capacity());
        assert_eq!(total.inserted as usize, entries);
        assert_eq!(total.inserted + total.evicted, 2_000_000);
        assert!(s.bytes() <= idx.capacity() / WAYS * (2 + WAYS * ENTRY_BYTES + 24));
    }

    #[test]
    fn eviction_takes_the_stalest_entry() {
        let mut bucket: Vec<Entry> = (0..WAYS as u64)
            .map(|i| Entry {
                hash: i,
                holders: vec![(1, 10 + i as u32)],
            })
            .collect();
        bucket[3].holders[0].1 = 1;
        assert_eq!(stamp(&mut bucket, 99, 2, 50), (0, 1));
        assert!(bucket.iter().all(|e| e.hash != 3));
        assert!(bucket.iter().any(|e| e.hash == 99));
    }

    #[test]
    fn holder_list_is_bounded_and_replaces_the_oldest() {
        let mut bucket = Vec::new();
        for r in 0..REPLICAS_PER_ENTRY as u64 + 2 {
            stamp(&mut bucket, 7, r, r as u32);
        }
        assert_eq!(bucket[0].holders.len(), REPLICAS_PER_ENTRY);
        assert!(bucket[0].holders.iter().all(|h| h.0 >= 2));
    }

    #[test]
    fn corrupt_or_truncated_buckets_read_as_empty() {
        let good = encode(&[Entry {
            hash: 5,
            holders: vec![(1, 2)],
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
        assert!(decode(&[VERSION, 200]).is_empty());
    }
}
