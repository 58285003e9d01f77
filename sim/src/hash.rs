//! Hashing owned by the simulator (deliberately not shared with the filter,
//! so a bug in one cannot hide the same bug in the other).

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a over bytes, continuing from `state`.
pub fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(state, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME))
}

/// Hash of a string from the standard FNV offset basis.
pub fn hash_str(s: &str) -> u64 {
    fnv1a(FNV_OFFSET, s.as_bytes())
}

/// A final avalanche step (splitmix64): FNV alone mixes the high bits of the
/// last bytes poorly, and block hashes are used as map keys.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of one full KV block chained to its predecessor: a block's identity
/// is its own tokens *and* everything before it, because attention is causal.
pub fn block_hash(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = fnv1a(FNV_OFFSET, &prev.to_le_bytes());
    for t in tokens {
        h = fnv1a(h, &t.to_le_bytes());
    }
    mix(h)
}

/// Chained hashes of every *full* block of `tokens`. `seed` separates
/// namespaces that must never share KV (e.g. different LoRA adapters).
pub fn chain_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut prev = seed;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            prev = block_hash(prev, block);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[0] = 999;
        let ha = chain_hashes(&a, 16, 0);
        let hb = chain_hashes(&b, 16, 0);
        assert_eq!(ha.len(), 3);
        // Same tokens in blocks 1 and 2, but a different first block.
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        assert_eq!(ha, chain_hashes(&a, 16, 0));
        assert_ne!(ha, chain_hashes(&a, 16, 7), "seed separates namespaces");
    }

    #[test]
    fn partial_block_is_not_hashed() {
        let t: Vec<u32> = (0..31).collect();
        assert_eq!(chain_hashes(&t, 16, 0).len(), 1);
    }
}
