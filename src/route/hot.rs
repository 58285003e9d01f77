//! A replica that carries more than its share of the pool's traffic,
//! when several gateway instances place content without talking (opt-in:
//! `traffic_balance`).
//!
//! New content goes to one of its two rendezvous candidates
//! (`score::gateways::two_choices`), and with few keys (a dozen documents or system
//! prompts in heavy use) rendezvous deals them out lumpily: on
//! shared-prefix with 15 groups on 8 replicas, one replica was the home of
//! three or four groups and two of none, and it stayed so for as long as
//! the run went on (1.5-1.9 times the mean's requests, window after
//! window). One instance evens that out with its own placement history;
//! several can't, each seeing only its own placements. What they all read
//! alike is each replica's own count of the prompt tokens it looked up
//! lately (its prefix-cache lookups, decayed like its hit rate:
//! `replicas::CacheRate::traffic`).
//!
//! For a replica whose share of that is over [`HOT_ABOVE`] times the
//! pool's mean, a fraction `1 - HOT_ABOVE / share` of the prefixes it
//! holds lose their credit there. Which ones is a hash of (prefix,
//! replica), the same on every instance and for every request of a prefix,
//! so every instance moves the same ones, and places them alike: on their
//! first rendezvous candidate but that replica. As the replica's share
//! falls, the fraction shrinks; a prefix that moved then has two holders,
//! and follows the less loaded one. New content is placed as before:
//! keeping it off hot replicas too changed where documents below a shared
//! preamble went whenever a replica crossed the line, for no measured gain.
//!
//! Only the prefixes of single questions move (a request with one message
//! of its own, or a completions prompt: a document and a question), up to
//! [`MAX_SHED_BLOCKS`]: moving one re-prefills it once on its new replica.
//! A conversation's or agent session's later turn keeps its history where
//! it is. Moved, it re-prefilled that history, and its held prefix grows
//! at every turn, so every turn was a new draw and most conversations on a
//! hot replica moved sooner or later (multi-turn with 44 conversations, 3
//! instances: hit rate 83.7-84.6% against 86.7-87.0%, TTFT p95 +46-55%).
//!
//! Off by default: it evens the load out over minutes, but every move is a
//! cold prefill and can crowd the replica it lands on (the numbers:
//! docs/measurements.md, `traffic_balance`).

use crate::replicas::traffic_shares;
use crate::score::{rendezvous, Candidate};

use super::Hashed;

/// Traffic over this multiple of the pool's mean marks a hot replica. Not
/// higher: 15 groups on 8 replicas are even at 1.07 (two groups against
/// the mean of 1.9), and three groups on one replica is 1.6.
pub(super) const HOT_ABOVE: f32 = 1.1;

/// Held prefixes longer than this (16 KiB with the default 64-byte blocks,
/// about 4,000 tokens) stay.
pub(super) const MAX_SHED_BLOCKS: u32 = 256;

/// Salt, so the prefixes that move are not those that the eviction rule
/// moves or that rendezvous orders first on the same key.
const SALT: u64 = 0x686f_745f_7368_6564;

/// What [`shed`] did to one request's candidates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Shed {
    /// Candidates over the line.
    pub hot: u32,
    /// Of those, how many lost their credit for this request's prefix.
    pub withheld: u32,
}

/// Withholds hot candidates' credit for this request's prefix when it is
/// one of those that move (see the module doc).
pub(super) fn shed(cands: &mut [Candidate], hashed: &Hashed) -> Shed {
    let traffic: Vec<Option<f32>> = cands.iter().map(|c| c.traffic).collect();
    let Some(shares) = traffic_shares(&traffic) else {
        return Shed::default();
    };
    let mut shed = Shed::default();
    for (c, share) in cands.iter_mut().zip(shares) {
        // Shares are finite: sanitised counts over a mean of at least
        // MIN_MEAN_TRAFFIC.
        if share <= HOT_ABOVE {
            continue;
        }
        shed.hot += 1;
        if c.matched == 0 || hashed.later_turn || c.matched > MAX_SHED_BLOCKS {
            continue;
        }
        let held = hashed.checkpoint_at(c.matched).unwrap_or(0);
        let draw = rendezvous(held ^ SALT, c.id) as f64 / u64::MAX as f64;
        if draw < f64::from(1.0 - HOT_ABOVE / share) {
            c.matched = 0;
            c.evicting = true;
            shed.withheld += 1;
        }
    }
    shed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Load;
    use crate::prefix::Checkpoint;

    fn cand(id: u64, matched: u32, traffic: Option<f32>) -> Candidate {
        Candidate {
            id,
            matched,
            load: Load::default(),
            waiting: 0.0,
            running: 0.0,
            kv_usage: 0.0,
            lora: Default::default(),
            affinity: false,
            hit_rate: None,
            traffic,
            evicting: false,
            trust: 1.0,
        }
    }

    /// A prefix of 8 blocks keyed `key` (checkpoints at 4 and 8).
    fn hashed(key: u64) -> Hashed {
        let cp = |blocks, hash| Checkpoint {
            blocks,
            hash,
            on_schedule: true,
        };
        Hashed {
            checkpoints: vec![cp(4, key), cp(8, key ^ 1)],
            ..Hashed::default()
        }
    }

    /// Replica 1 holds the prefix; 100k tokens of traffic each, replica 1
    /// `hot` times that.
    fn pool(hot: f32, matched: u32) -> Vec<Candidate> {
        let t = 100_000.0;
        vec![
            cand(1, matched, Some(t * hot)),
            cand(2, 0, Some(t)),
            cand(3, 0, Some(t)),
            cand(4, 0, Some(t)),
        ]
    }

    /// The keys among `keys` whose prefix loses its credit on replica 1.
    fn moved(hot: f32, keys: std::ops::Range<u64>) -> Vec<u64> {
        keys.filter(|&k| {
            let mut c = pool(hot, 8);
            shed(&mut c, &hashed(k)).withheld == 1
        })
        .collect()
    }

    #[test]
    fn an_even_pool_moves_nothing() {
        for k in 0..200 {
            let mut c = pool(1.05, 8);
            assert_eq!(shed(&mut c, &hashed(k)).withheld, 0);
            assert_eq!(c[0].matched, 8);
            assert!(c.iter().all(|c| !c.evicting));
        }
    }

    #[test]
    fn the_hot_replicas_share_above_the_line_moves_and_the_same_on_every_call() {
        // Shares: 3 / 1.5 = 2 for replica 1 (the mean is 150k), 0.67 for
        // the rest: 1 - 1.1 / 2 = 45% of its prefixes move.
        let first = moved(3.0, 0..2000);
        let share = first.len() as f64 / 2000.0;
        assert!((0.40..0.50).contains(&share), "{share}");
        // A hash, not a coin: another instance (another call) moves the
        // same prefixes.
        assert_eq!(moved(3.0, 0..2000), first);
        // Less hot, fewer move, and only ones that moved when it was
        // hotter: a prefix doesn't come back while its replica cools.
        let cooler = moved(1.6, 0..2000);
        assert!(!cooler.is_empty() && cooler.len() < first.len());
        assert!(cooler.iter().all(|k| first.contains(k)));
    }

    #[test]
    fn a_moved_prefix_loses_its_credit_and_new_content_is_placed_as_ever() {
        let k = moved(3.0, 0..100)[0];
        let mut c = pool(3.0, 8);
        let got = shed(&mut c, &hashed(k));
        assert_eq!((got.hot, got.withheld), (1, 1));
        assert_eq!(c[0].matched, 0);
        // Not placed back there (see `score::gateways::two_choices`).
        assert!(c[0].evicting);
        assert!(c[1..].iter().all(|c| !c.evicting && c.matched == 0));
        // Content nobody holds goes where it would have.
        let mut c = pool(3.0, 0);
        let got = shed(&mut c, &hashed(k));
        assert_eq!((got.hot, got.withheld), (1, 0));
        assert!(c.iter().all(|c| !c.evicting));
    }

    #[test]
    fn a_conversations_later_turn_stays_where_it_is() {
        for k in moved(3.0, 0..100) {
            let turn = Hashed {
                later_turn: true,
                ..hashed(k)
            };
            let mut c = pool(3.0, 8);
            assert_eq!(
                shed(&mut c, &turn),
                Shed {
                    hot: 1,
                    withheld: 0
                }
            );
            assert_eq!(c[0].matched, 8);
            assert!(!c[0].evicting);
        }
    }

    #[test]
    fn long_histories_stay_where_they_are() {
        for k in 0..200 {
            let mut c = pool(3.0, MAX_SHED_BLOCKS + 1);
            assert_eq!(shed(&mut c, &hashed(k)).withheld, 0);
            assert_eq!(c[0].matched, MAX_SHED_BLOCKS + 1);
            assert!(!c[0].evicting);
        }
    }

    #[test]
    fn instances_that_list_the_replicas_in_another_order_judge_them_alike() {
        // The same scraped counts, the candidates built in another order
        // (another instance's endpoint list): the hot replica's share is
        // the same, so every instance sheds alike. Summed in f32 in list
        // order, the small counts vanished into the big one's rounding
        // on one instance and not on the other: a share of 1.1000001
        // (hot) on one, 1.1 (not) on the other.
        let t = [5_831_736.5_f32, 15_374_570.0, 2.0, 5.0];
        let here: Vec<Candidate> = (0..4)
            .map(|i| cand(i + 1, 0, Some(t[i as usize])))
            .collect();
        let there: Vec<Candidate> = here.iter().rev().copied().collect();
        let mut a = here.clone();
        let mut b = there.clone();
        assert_eq!(shed(&mut a, &hashed(1)), shed(&mut b, &hashed(1)));
        let ta: Vec<Option<f32>> = here.iter().map(|c| c.traffic).collect();
        let tb: Vec<Option<f32>> = there.iter().map(|c| c.traffic).collect();
        let mut sb = traffic_shares(&tb).unwrap_or_default();
        sb.reverse();
        assert_eq!(traffic_shares(&ta), Some(sb));
    }

    #[test]
    fn no_rule_until_every_replica_reports_enough_traffic() {
        let k = moved(3.0, 0..100)[0];
        // One replica without counters: shares would be guesses.
        let mut c = pool(3.0, 8);
        c[3].traffic = None;
        assert_eq!(shed(&mut c, &hashed(k)), Shed::default());
        assert!(c.iter().all(|c| !c.evicting));
        // A quiet pool: a few prompts are not a measurement.
        let mut c = pool(3.0, 8);
        for c in &mut c {
            c.traffic = c.traffic.map(|t| t / 10.0);
        }
        assert_eq!(shed(&mut c, &hashed(k)), Shed::default());
        // An idle replica that reports counts as idle: the others are
        // measured against it.
        let mut c = pool(3.0, 8);
        c[3].traffic = Some(0.0);
        assert_eq!(shed(&mut c, &hashed(k)).withheld, 1);
    }
}
