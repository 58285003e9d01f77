//! A replica that evicts what the index credits it with.
//!
//! The index learns only what was sent where, never what a replica's cache
//! later dropped. When a replica holds more prefixes than its KV cache
//! fits (a smaller card in a mixed pool, or an unlucky share of long
//! documents), it evicts them in turn and misses on its own prefixes
//! again and again, while the index keeps crediting it: each request still
//! looks cheapest there (a partial chance of a hit beats none elsewhere),
//! so nothing ever moves off it. Measured on shared-prefix with one of
//! eight replicas at a quarter of the KV cache: its hit rate 57.6% against
//! 95.9% on the others, with the same ten groups each, and it set the
//! pool's TTFT tail (README, "Replicas that evict what they hold").
//!
//! The replica says so itself: its prefix cache's hit rate, from its own
//! counters (`replicas::CacheRate`), which every gateway instance reads
//! alike, against the rate the index expected of it: the share of the
//! blocks sent there lately that it was credited with (`load::Load`).
//! What it keeps of that, `measured / expected` (at most 1), is compared
//! with the pool's median: a replica under [`TRUST_BELOW`] of the median
//! keeps about `kept / median` of what it is credited with. It takes no
//! new prefixes while it is, and a fraction `1 - kept / median` of the
//! prefixes it is credited with lose their credit there, and placing one
//! there again counts a second prefill (the copy would be evicted in
//! turn). Which ones is a hash of (prefix, replica), the same on every
//! instance and for every request of a prefix, so those prefixes move to
//! another replica and the rest stay and hit again. Its credit for the
//! rest is scaled by the same ratio, so a prefix that moved stays where
//! it went (its new holder has full credit) as the replica recovers and
//! the fraction shrinks. Without that, the fraction settled where the
//! prefixes that came back kept the replica evicting (8-9 of its 10
//! groups, 69% hits).
//!
//! Against the expected rate, not the raw one: replicas' raw rates differ
//! with what they are sent. Documents below a shared system prompt (raw
//! rates of 28% and 41%: 0.7 of the median) would read as evicting
//! against the median of raw rates, and so would a replica that just took
//! cold copies of a long preamble; the index expected those misses, so
//! they don't count.

use crate::score::{rendezvous, Candidate};

use super::Hashed;

/// A rate under this share of the pool's median marks a replica that
/// evicts what it is credited with. Replicas differ anyway: those that
/// take the prefixes leaving an evicting replica prefill them cold, and
/// dip for a while. (When an evicting replica still took new prefixes,
/// one such dip went under this line and that replica lost its prefixes
/// in turn. At 0.7, a replica at a quarter of the KV cache, at 0.6-0.7 of
/// the median, was left alone half the time.)
pub(super) const TRUST_BELOW: f32 = 0.8;

/// Replicas the index expects to hit less than this share of what they
/// are sent are not judged: their traffic is mostly new content, a
/// measured rate of a few percent against an expected few percent is
/// noise, and there is little credit to lose. Judged anyway, a replica
/// at 1% against 2% would have been kept from new prompts, which is all
/// such traffic is.
const MIN_EXPECTED_RATE: f32 = 0.25;

/// Salt, so the prefixes that move are not the ones rendezvous orders
/// first on the same key.
const SALT: u64 = 0x6576_6963_7469_6e67;

/// Withholds the credit of candidates that evict what they are credited
/// with (see the module doc), for this request's prefix; returns how many.
pub(super) fn withhold(cands: &mut [Candidate], hashed: &Hashed) -> usize {
    let Some(median) = median(cands.iter().filter_map(kept)) else {
        return 0;
    };
    if median <= 0.0 {
        return 0;
    }
    let mut withheld = 0;
    for c in cands.iter_mut() {
        let Some(kept) = kept(c) else { continue };
        let trust = kept / median;
        if trust >= TRUST_BELOW {
            continue;
        }
        c.trust = trust;
        if c.matched == 0 {
            // No new prefixes for it while it evicts: the prefixes that
            // left another evicting replica landed here and made it evict
            // in turn (seed 2: a second replica drained to 169 requests).
            c.evicting = true;
            continue;
        }
        // The prefix the replica is credited with, as a key: the same for
        // every request that shares it.
        let held = hashed.checkpoint_at(c.matched).unwrap_or(0);
        let draw = rendezvous(held ^ SALT, c.id) as f64 / u64::MAX as f64;
        if draw < f64::from(1.0 - trust) {
            c.matched = 0;
            c.evicting = true;
            withheld += 1;
        }
    }
    withheld
}

/// The share of the hits the index expected on a replica that it
/// measures (at most 1: hits the index didn't expect, on answers the
/// model server cached or on prefixes another gateway instance placed,
/// make up for nothing); `None` until both rates are known, and for a
/// replica expected to hit little (`MIN_EXPECTED_RATE`).
fn kept(c: &Candidate) -> Option<f32> {
    let measured = c.hit_rate?;
    let expected = c
        .load
        .expected_hit_rate()
        .filter(|&e| e >= MIN_EXPECTED_RATE)?;
    Some((measured / expected).clamp(0.0, 1.0)).filter(|k| k.is_finite())
}

/// The median of the known rates (the upper one of an even count).
fn median(rates: impl Iterator<Item = f32>) -> Option<f32> {
    let mut v: Vec<f32> = rates.filter(|r| r.is_finite()).collect();
    v.sort_by(f32::total_cmp);
    v.get(v.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{Load, MIN_EXPECTED_BLOCKS};
    use crate::prefix::Checkpoint;

    /// A replica the index expected to hit 95% of what it was sent.
    fn cand(id: u64, matched: u32, hit_rate: Option<f32>) -> Candidate {
        expecting(id, matched, hit_rate, 0.95)
    }

    fn expecting(id: u64, matched: u32, hit_rate: Option<f32>, expected: f64) -> Candidate {
        let sent = 100_000;
        Candidate {
            id,
            matched,
            load: Load {
                sent,
                placed: (f64::from(sent) * (1.0 - expected)).round() as u32,
                ..Load::default()
            },
            waiting: 0.0,
            running: 0.0,
            kv_usage: 0.0,
            lora: Default::default(),
            affinity: false,
            hit_rate,
            traffic: None,
            evicting: false,
            trust: 1.0,
        }
    }

    fn hashed(key: u64) -> Hashed {
        Hashed {
            checkpoints: vec![
                Checkpoint {
                    blocks: 4,
                    hash: key,
                    on_schedule: true,
                },
                Checkpoint {
                    blocks: 8,
                    hash: key ^ 1,
                    on_schedule: true,
                },
            ],
            ..Hashed::default()
        }
    }

    /// Over many prefixes held by a replica at `rate` (pool median 0.95):
    /// how many lose its credit.
    fn share_withheld(rate: f32) -> f64 {
        let n = 2_000;
        let mut lost = 0;
        for key in 0..n {
            let mut cands: Vec<Candidate> = (1..=7).map(|i| cand(i, 0, Some(0.95))).collect();
            cands.push(cand(8, 4, Some(rate)));
            lost += withhold(&mut cands, &hashed(key * 7919));
            assert!(cands[..7].iter().all(|c| c.matched == 0));
        }
        lost as f64 / n as f64
    }

    #[test]
    fn an_evicting_replica_loses_the_credit_of_about_its_excess() {
        // At 57% against 95%: about 40% of its prefixes move.
        let s = share_withheld(0.57);
        assert!((0.35..0.45).contains(&s), "{s}");
        // At 30%: about 70%.
        let s = share_withheld(0.285);
        assert!((0.65..0.75).contains(&s), "{s}");
        // Within the tolerance: nothing moves.
        assert_eq!(share_withheld(0.95 * TRUST_BELOW + 0.01), 0.0);
        assert_eq!(share_withheld(0.95), 0.0);
    }

    #[test]
    fn the_same_prefixes_move_for_every_request_and_instance() {
        let run = |key: u64| {
            let mut cands = vec![
                cand(1, 4, Some(0.9)),
                cand(2, 4, Some(0.3)),
                cand(3, 0, Some(0.9)),
            ];
            withhold(&mut cands, &hashed(key));
            cands.iter().map(|c| c.matched).collect::<Vec<_>>()
        };
        let mut moved = 0;
        for key in 0..500 {
            let first = run(key);
            assert_eq!(run(key), first);
            // Only the evicting replica ever loses credit.
            assert_eq!((first[0], first[2]), (4, 0));
            // And takes no new prefix.
            let mut c = vec![cand(1, 0, Some(0.9)), cand(2, 0, Some(0.3))];
            withhold(&mut c, &hashed(key));
            assert_eq!((c[0].evicting, c[1].evicting), (false, true));
            moved += usize::from(first[1] == 0);
        }
        assert!((300..400).contains(&moved), "{moved}");
    }

    #[test]
    fn no_measurement_no_change() {
        // Rates unknown (no counters, too few lookups), or nobody hits.
        for rates in [[None, None], [Some(0.0), Some(0.0)], [None, Some(0.1)]] {
            let mut cands = vec![cand(1, 4, rates[0]), cand(2, 4, rates[1])];
            assert_eq!(withhold(&mut cands, &hashed(3)), 0);
            assert!(cands.iter().all(|c| c.matched == 4));
        }
    }

    #[test]
    fn misses_the_index_expected_are_no_eviction() {
        // A short shared system prompt, then different documents: each
        // replica hits about what it was credited with, 28-41%. Raw, the
        // lowest is far under the median; against what was expected, none
        // is.
        let rates = [0.28, 0.41, 0.35, 0.40];
        let mut cands: Vec<Candidate> = (0..4)
            .map(|i| {
                expecting(
                    i + 1,
                    2,
                    Some(rates[i as usize]),
                    f64::from(rates[i as usize]),
                )
            })
            .collect();
        assert!(rates[0] / median(rates.into_iter()).unwrap() < TRUST_BELOW);
        // A replica that just took cold copies of a long preamble: it was
        // expected to miss them.
        cands.push(expecting(5, 2, Some(0.55), 0.6));
        for key in 0..200 {
            let mut c = cands.clone();
            assert_eq!(withhold(&mut c, &hashed(key)), 0);
            assert!(c.iter().all(|c| !c.evicting && c.trust == 1.0));
        }
    }

    #[test]
    fn a_rate_is_judged_only_once_enough_hits_were_expected() {
        let mut low = cand(8, 4, Some(0.2));
        low.load.sent = MIN_EXPECTED_BLOCKS;
        low.load.placed = 1;
        let mut pool: Vec<Candidate> = (1..=3).map(|i| cand(i, 0, Some(0.95))).collect();
        pool.push(low);
        assert_eq!(withhold(&mut pool.clone(), &hashed(5)), 0);
        pool[3].load.placed = 0;
        let judged = (0..200)
            .filter(|&key| withhold(&mut pool.clone(), &hashed(key)) == 1)
            .count();
        assert!((140..190).contains(&judged), "{judged}");
    }

    #[test]
    fn replicas_expected_to_hit_little_are_not_judged() {
        // Unique prompts below a short system prompt: 1% measured against
        // 2% expected is noise, not eviction.
        let mut pool: Vec<Candidate> = (1..=3).map(|i| expecting(i, 2, Some(0.1), 0.1)).collect();
        pool.push(expecting(4, 2, Some(0.01), 0.02));
        for key in 0..200 {
            let mut c = pool.clone();
            assert_eq!(withhold(&mut c, &hashed(key)), 0);
            assert!(c.iter().all(|c| !c.evicting && c.trust == 1.0));
        }
        // The same gap in a pool expected to hit most of its prompts is
        // judged.
        let mut c: Vec<Candidate> = (1..=3).map(|i| expecting(i, 2, Some(0.9), 0.9)).collect();
        c.push(expecting(4, 2, Some(0.45), 0.9));
        withhold(&mut c, &hashed(1));
        assert!(c[3].trust < TRUST_BELOW);
    }
}
