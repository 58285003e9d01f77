//! Paged KV cache with prefix reuse, in the style of vLLM's block manager.
//!
//! A block holds `block_size` tokens. A block whose tokens are fully computed
//! can be *registered* under its chained hash; later requests whose leading
//! blocks have the same hashes share it instead of recomputing. Blocks in use
//! are reference-counted; unreferenced registered blocks stay resident in an
//! LRU and are evicted only when a new allocation needs room. Every operation
//! is O(blocks touched · log n), never O(cache size).

use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

pub struct KvCache {
    ref_count: Vec<u32>,
    /// Hash under which the block is registered, if any.
    hash_of: Vec<Option<u64>>,
    /// Key of the block in `lru` while it sits there.
    lru_key: Vec<u64>,
    by_hash: HashMap<u64, BlockId>,
    /// Blocks holding nothing reusable.
    free: Vec<BlockId>,
    /// Unreferenced registered blocks, oldest release first.
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    referenced: usize,
}

/// Blocks granted to one sequence.
pub struct Allocation {
    pub blocks: Vec<BlockId>,
    /// Leading blocks that were found in cache (their KV is reused).
    pub hit_blocks: usize,
}

impl KvCache {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_count: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            lru_key: vec![0; num_blocks],
            by_hash: HashMap::with_capacity(num_blocks),
            free: (0..num_blocks as BlockId).rev().collect(),
            lru: BTreeMap::new(),
            tick: 0,
            referenced: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Fraction of blocks referenced by live sequences (vLLM's
    /// `kv_cache_usage_perc`: cached-but-idle blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            return 0.0;
        }
        self.referenced as f64 / self.num_blocks() as f64
    }

    /// Number of leading `hashes` resident in cache.
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Grants `total` blocks to a sequence whose full prompt blocks hash to
    /// `hashes`, reusing at most `max_hit` leading cached blocks. Returns
    /// `None` (changing nothing) when there is not enough room.
    pub fn allocate(&mut self, hashes: &[u64], max_hit: usize, total: usize) -> Option<Allocation> {
        let hits: Vec<BlockId> = hashes[..self.lookup(hashes).min(max_hit).min(total)]
            .iter()
            .filter_map(|h| self.by_hash.get(h).copied())
            .collect();
        // Hit blocks sitting idle in the LRU would otherwise count as room.
        let idle_hits = hits
            .iter()
            .filter(|&&b| self.ref_count[b as usize] == 0)
            .count();
        let room = self.free.len() + self.lru.len() - idle_hits;
        let fresh = total - hits.len();
        if fresh > room {
            return None;
        }
        let mut blocks = hits;
        let hit_blocks = blocks.len();
        for &b in &blocks {
            self.acquire(b);
        }
        for _ in 0..fresh {
            let b = self.take_fresh()?;
            self.acquire(b);
            blocks.push(b);
        }
        Some(Allocation { blocks, hit_blocks })
    }

    /// Publishes a fully computed block under `hash` so others can reuse it.
    /// If an identical block was registered meanwhile (two requests prefilling
    /// the same prefix at once), this one stays private and is freed later.
    pub fn register(&mut self, block: BlockId, hash: u64) {
        let i = block as usize;
        if self.hash_of[i].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.hash_of[i] = Some(hash);
        self.by_hash.insert(hash, block);
    }

    /// Drops a sequence's references. Blocks are released tail first so that
    /// the tail of a prefix is evicted before its head (a head is shared by
    /// more future requests).
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            self.ref_count[i] -= 1;
            if self.ref_count[i] > 0 {
                continue;
            }
            self.referenced -= 1;
            if self.hash_of[i].is_some() {
                self.tick += 1;
                self.lru_key[i] = self.tick;
                self.lru.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Forgets every unreferenced cached block (admin reset).
    pub fn clear_idle(&mut self) {
        while let Some((_, b)) = self.lru.pop_first() {
            self.unregister(b);
            self.free.push(b);
        }
    }

    fn acquire(&mut self, b: BlockId) {
        let i = b as usize;
        if self.ref_count[i] == 0 {
            self.referenced += 1;
            if self.hash_of[i].is_some() {
                self.lru.remove(&self.lru_key[i]);
            }
        }
        self.ref_count[i] += 1;
    }

    /// A block with no reusable content: a free one, else the least recently
    /// released cached one (evicted).
    fn take_fresh(&mut self) -> Option<BlockId> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let (_, b) = self.lru.pop_first()?;
        self.unregister(b);
        Some(b)
    }

    fn unregister(&mut self, b: BlockId) {
        if let Some(h) = self.hash_of[b as usize].take() {
            self.by_hash.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(kv: &mut KvCache, a: &Allocation, hashes: &[u64]) {
        for (b, h) in a.blocks.iter().zip(hashes) {
            kv.register(*b, *h);
        }
    }

    #[test]
    fn reuses_registered_prefix() {
        let mut kv = KvCache::new(10);
        let a = kv.allocate(&[1, 2, 3], 3, 4).unwrap();
        assert_eq!(a.hit_blocks, 0);
        publish(&mut kv, &a, &[1, 2, 3]);
        kv.release(&a.blocks);
        assert_eq!(kv.usage(), 0.0);
        let b = kv.allocate(&[1, 2, 9], 3, 4).unwrap();
        assert_eq!(b.hit_blocks, 2);
        assert_eq!(&b.blocks[..2], &a.blocks[..2]);
        assert!((kv.usage() - 0.4).abs() < 1e-9);
    }

    #[test]
    fn shared_blocks_are_refcounted() {
        let mut kv = KvCache::new(6);
        let a = kv.allocate(&[1, 2], 2, 2).unwrap();
        publish(&mut kv, &a, &[1, 2]);
        let b = kv.allocate(&[1, 2], 2, 3).unwrap();
        assert_eq!(b.hit_blocks, 2);
        kv.release(&a.blocks);
        // Still referenced by b: cannot be evicted by a big allocation.
        assert!(kv.allocate(&[], 0, 4).is_none());
        let c = kv.allocate(&[], 0, 3).unwrap();
        assert_eq!(kv.lookup(&[1, 2]), 2);
        kv.release(&c.blocks);
        kv.release(&b.blocks);
    }

    #[test]
    fn evicts_least_recently_released_first() {
        let mut kv = KvCache::new(4);
        let a = kv.allocate(&[10, 11], 2, 2).unwrap();
        publish(&mut kv, &a, &[10, 11]);
        kv.release(&a.blocks);
        let b = kv.allocate(&[20, 21], 2, 2).unwrap();
        publish(&mut kv, &b, &[20, 21]);
        kv.release(&b.blocks);
        // Touch prefix 10 again so prefix 20 becomes the LRU one.
        let a2 = kv.allocate(&[10, 11], 2, 2).unwrap();
        assert_eq!(a2.hit_blocks, 2);
        kv.release(&a2.blocks);
        let c = kv.allocate(&[], 0, 1).unwrap();
        // Tail block 21 of prefix 20 goes first; its head stays.
        assert_eq!(kv.lookup(&[20, 21]), 1);
        assert_eq!(kv.lookup(&[10, 11]), 2);
        kv.release(&c.blocks);
    }

    #[test]
    fn refuses_without_room_and_changes_nothing() {
        let mut kv = KvCache::new(2);
        let a = kv.allocate(&[1], 1, 2).unwrap();
        assert!(kv.allocate(&[], 0, 1).is_none());
        assert!((kv.usage() - 1.0).abs() < 1e-9);
        kv.release(&a.blocks);
        assert_eq!(kv.usage(), 0.0);
        assert!(kv.allocate(&[], 0, 2).is_some());
    }

    #[test]
    fn clear_idle_forgets_cached_blocks() {
        let mut kv = KvCache::new(3);
        let a = kv.allocate(&[1, 2], 2, 2).unwrap();
        publish(&mut kv, &a, &[1, 2]);
        kv.release(&a.blocks);
        assert_eq!(kv.lookup(&[1, 2]), 2);
        kv.clear_idle();
        assert_eq!(kv.lookup(&[1, 2]), 0);
        assert!(kv.allocate(&[], 0, 3).is_some());
    }
}
