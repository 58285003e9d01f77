//! Placement that independent gateway instances agree on: rendezvous
//! hashing, and the power of two choices between its first two candidates.

use super::pressure::{open_to_new, pressure, within_bound};
use super::{band, Candidate, ScoreParams};
use crate::endpoint::ReplicaId;

/// Placement that independent gateway instances agree on, without talking:
/// new content goes to its first rendezvous candidate on the placement
/// key (`by_hash`: the rendezvous order), or to the second when the first
/// is busier (load, queue, KV) by more than `margin` (for new content, what
/// a second copy of it would cost, at least one request's work), and
/// further down the rendezvous order only when both are over the load
/// bound (one request in flight never is: another instance's view of the
/// same replica may hold nothing); `None` when no candidate is within the
/// bound. Every instance computes the same two
/// candidates from the content and the replica set, so the same new
/// content lands on at most two replicas however many instances see it,
/// on one when loads are near even, and the choice still balances load
/// ("power of two choices"). Breaking near-ties between the two by this
/// instance's recent placements (`branches`) was tried: shared-prefix with
/// 3 instances went from share 1.60 to 1.19, but the instances stopped
/// agreeing on conversations, which then alternated between two replicas
/// (multi-turn hit rate 77.4% against 85.6%; with a margin of two
/// placements 82.9%, share unchanged).
///
/// Dropping the margin (new content on the first candidate unless it is
/// over the bound: consistent hashing with bounded loads) was tried too.
/// In long-preamble's start-up backlog each instance's own in-flight
/// sample crosses the margin often, so instances that meet a document at
/// different moments put it on different candidates and each keeps its
/// own: two warm copies, more than the KV caches hold. Without the margin,
/// 3 instances, pinned draws (`--replica-port 4S100`) seeds 1-3, before /
/// after: documents on more than one replica 17 / 11, 15 / 12, 8 / 7;
/// warm TTFT p95 628 / 461, 527 / 395, 99 / 99. Agentic, whose agents'
/// first turns open alike and share a key, came out mixed: draws 51100
/// to 54100 (seed 1), hit rate / p95 92.9 / 1,967 against 92.9 / 2,513,
/// 92.4 / 3,155 against 92.0 / 5,348, 91.7 / 6,408 against 92.4 / 4,862,
/// and 78.0 / 23,670 against 79.6 / 27,665 (five and six of the eight
/// sessions on one replica, 43 and 46 replica changes: a collapse with
/// either rule); in a one-report run at 2-4 instances every session sat
/// on two of the four replicas (share 2.26-2.37, p95 2.6-2.8x one
/// instance's). Shared-prefix, seeds 1-4: hit rate 95.4 / 95.2 (mean).
/// Multi-turn: the same. Not landed: no win on every workload. Dropping
/// it only for documents (a single question bringing at least 64 new
/// blocks), which leaves agents' tasks and conversations alone, was tried
/// as well: long-preamble, draws 41100 and 42100, split documents 14 / 11
/// and 19 / 12, warm p95 607 / 536 and 638 / 385; but shared-prefix's
/// groups are documents too, and with 15 keys on 8 replicas the margin is
/// what evens them out: seeds 1-4 (draws 3S210), hit rate 95.3, 94.1,
/// 93.4, 94.8 against 94.4, 93.9, 92.2, 94.7, TTFT p95 390, 803, 976, 396
/// against 711, 841, 981, 554. Not landed either.
///
/// Keying a session by the name its client gives it (`prompt_cache_key`,
/// which coding agents send: the same on every turn and every instance),
/// its first turn placed as all new content and its later turns' agreed
/// homes keyed by it, was tried (2026-12-07; 3 instances, the bench's
/// `--prompt-cache-key` sending each conversation's or session's id; hit
/// rate / TTFT p95 / share, without the key then with it): agentic seed 1
/// 93.0 / 1,941 / 1.26 against 90.9 / 9,397 / 2.13, seed 2 87.4 / 12,501
/// / 2.53 against 93.8 / 2,249 / 1.67; multi-turn seed 1 86.6 / 642 /
/// 1.45 against 85.3 / 691 / 2.47, seed 2 86.7 / 665 / 1.82 against 84.9
/// / 692 / 1.42. The names deal out as lumpily as content keys (seven of
/// eleven conversations on one replica), and a first turn that went to
/// the second candidate moved at its second turn. Not landed.
pub(super) fn two_choices(
    by_hash: &[usize],
    pressure: &[f64],
    keeps: &[bool],
    margin: f64,
) -> Option<usize> {
    let within = |i: &usize| keeps.get(*i).copied().unwrap_or(false);
    let top: Vec<usize> = by_hash.iter().take(2).copied().filter(within).collect();
    match top.as_slice() {
        &[a, b] if pressure[a] - pressure[b] > margin => Some(b),
        &[a, ..] => Some(a),
        [] => by_hash.iter().skip(2).copied().find(within),
    }
}

/// The replicas a session keyed `key` (past a trunk every replica is
/// priced as holding) belongs on, as every gateway instance computes them
/// now: the first of its two rendezvous candidates, and the second too
/// unless `two_choices`, with one request's work as the margin, would pick
/// the first.
pub fn agreed_homes(cands: &[Candidate], key: u64, p: &ScoreParams) -> Vec<usize> {
    let loads: Vec<f64> = cands.iter().map(|c| p.load_of(&c.load)).collect();
    // As for new content (`rank_below`).
    let open = open_to_new(cands, &within_bound(cands, &loads, p));
    let by_hash = rendezvous_order(cands, key);
    let pick = two_choices(&by_hash, &pressure(cands, &loads, p), &open, band(p));
    let mut homes: Vec<usize> = by_hash.into_iter().take(2).collect();
    if pick.is_some() && pick == homes.first().copied() {
        homes.truncate(1);
    }
    homes
}

/// Candidate indices by their rendezvous weight for `key`, highest first.
pub(super) fn rendezvous_order(cands: &[Candidate], key: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(rendezvous(key, cands[i].id)));
    order
}

/// Highest-random-weight hashing: each (key, replica) pair gets a weight,
/// the highest wins. Adding a replica moves only the keys it now wins
/// (about 1/N of them).
pub fn rendezvous(key: u64, replica: ReplicaId) -> u64 {
    // splitmix64 finaliser over the pair: well mixed, portable.
    let mut z = key ^ replica.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
