//! Load and pressure: what is in flight, the load bound, and the scraped
//! queue, KV and LoRA pressure every gateway instance reads alike.

use super::{Candidate, ScoreParams};
use crate::config::Weights;

/// The replicas new content may go to: within the load bound (`keeps`),
/// and not evicting what they hold. Every instance reads the same
/// measured hit rates but judges them against the rate its own index
/// expected, so instances may disagree on a replica near the threshold;
/// none of them puts new content where it judges it would be evicted.
pub(super) fn open_to_new(cands: &[Candidate], keeps: &[bool]) -> Vec<bool> {
    keeps
        .iter()
        .zip(cands)
        .map(|(&k, c)| k && !c.evicting)
        .collect()
}

/// Only what differs between replicas for any new content: load, queue,
/// KV and LoRA (not the instance-local placement history).
pub(super) fn pressure(cands: &[Candidate], loads: &[f64], p: &ScoreParams) -> Vec<f64> {
    let w = &p.weights;
    cands
        .iter()
        .zip(loads)
        .map(|(c, &l)| w.load * l + scraped(c, w))
        .collect()
}

/// The pressure every gateway instance reads alike: the scraped queue,
/// KV usage and LoRA adapters, in cost units.
pub(super) fn scraped(c: &Candidate, w: &Weights) -> f64 {
    w.queue * c.waiting.max(0.0) as f64
        + w.kv * c.kv_usage.clamp(0.0, 1.0) as f64
        + c.lora.cost(w.lora)
}

/// The calmest scraped pressure among the replicas within the load bound.
pub(super) fn least_scraped(cands: &[Candidate], keeps: &[bool], w: &Weights) -> f64 {
    cands
        .iter()
        .zip(keeps)
        .filter(|&(_, &k)| k)
        .map(|(c, _)| scraped(c, w))
        .fold(f64::INFINITY, f64::min)
}

/// Whether each replica keeps the credit for what it holds: it is under
/// the load bound (`bounded_load_factor` x the pool's mean, plus the slack
/// that keeps a lightly loaded pool from treating a replica with a few
/// requests as "above the mean"). One request in flight is no overload,
/// however long: it made an agent session's holder shed a 1,800-block
/// history, to re-prefill it elsewhere, because another session's
/// 300-block turn ran there. With several gateways, exempting a session's
/// later turns from this instance's sample (unless the replica's scraped
/// queue is non-empty) was tried: on agentic with 3 instances, seeds 1-3,
/// the sessions' load spills went from 3, 1 and 6 to 0, 0 and 1, but hit
/// rate (92.6% against 92.5%, mean) and the later turns' uncached tokens
/// (+1%) didn't move: the tail there is how the sessions are dealt
/// (4/2/2/0 on seed 3), not the spills.
///
/// The factor is at most one less than the number of replicas: a replica
/// can carry at most n times the mean (all of the load), so with the
/// default 3.0 and two or three replicas the bound never bit, and a hot
/// prefix took every request (300 of 300 questions on a 1,000-block
/// document, in flight at once, stayed on its holder with two or three
/// replicas; with four the first moved at the 34th).
pub(super) fn within_bound(cands: &[Candidate], loads: &[f64], p: &ScoreParams) -> Vec<bool> {
    let n = cands.len().max(1);
    let mean = loads.iter().sum::<f64>() / n as f64;
    let factor = p.bounded_load_factor.min((n - 1).max(1) as f64);
    let bound = factor * mean + p.bounded_load_slack as f64;
    cands
        .iter()
        .zip(loads)
        .map(|(c, &load)| load <= bound || c.load.requests <= 1)
        .collect()
}
