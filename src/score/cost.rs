//! What a request costs on each replica, in blocks of work, and the order
//! of the candidates by it.

use super::pressure::scraped;
use super::{rendezvous, Candidate, ScoreParams};

/// Each candidate's cost for a request of `blocks` below a `trunk` every
/// replica is priced as holding, in blocks of work: the prefill it would
/// do (no credit for what it holds when it is over the load bound, a
/// second prefill when it evicts this prefix), the work in flight on it,
/// its scraped queue, KV and LoRA pressure, and the spread of new content.
/// The tie-break for new content (`by_cost`) belongs to the same policy,
/// described here.
///
/// New content (nobody holds more than the trunk) decides where its
/// followers go from then on: a document's questions, a session's
/// turns. For it, in-flight work within the load slack of the least
/// loaded replica is no difference (one agent turn in flight says
/// little about the replica's next minute), and near-ties go to the
/// replica that took the fewest new prefixes or branches lately,
/// whatever their size (with several gateways, plus the requests the
/// other instances sent there: `others`), then to rendezvous. In the
/// cost, the spread term is scaled by this request's new blocks: for an
/// agent's task a few dozen, too little to tell a replica running two
/// sessions from an idle one (agentic: 1-3 sessions per replica, share
/// 1.5-1.7). A tie band as wide as the new content's prefill was tried:
/// it sent first turns to busier replicas (multi-turn TTFT p95 +13%,
/// long-preamble +15-25%).
pub(super) fn costs(
    cands: &[Candidate],
    loads: &[f64],
    keeps: &[bool],
    (blocks, trunk): (u32, u32),
    fresh: bool,
    p: &ScoreParams,
) -> Vec<f64> {
    let placed_mean = cands.iter().map(|c| c.load.placed as f64).sum::<f64>() / cands.len() as f64;
    let least = loads.iter().copied().fold(f64::INFINITY, f64::min);
    cands
        .iter()
        .zip(loads)
        .zip(keeps)
        .map(|((c, &load), &keeps)| {
            let felt = if fresh {
                (load - least - f64::from(p.bounded_load_slack)).max(0.0)
            } else {
                load
            };
            let held =
                (f64::from(c.matched.min(blocks)) * f64::from(c.trust.clamp(0.0, 1.0))) as u32;
            let credit = if keeps { held } else { 0 }.max(trunk.min(blocks));
            let w = &p.weights;
            let evicts = if c.evicting { blocks } else { 0 };
            w.prefix * (blocks.saturating_sub(credit) + evicts) as f64
                + w.load * felt
                + scraped(c, w)
                + spread_cost(
                    w.spread,
                    c.load.placed,
                    placed_mean,
                    blocks.saturating_sub(credit),
                )
        })
        .collect()
}

/// The candidates cheapest first. Near-ties (within one request's
/// constant, `band`) go to rendezvous hashing on `placement`; for new
/// content (`fresh`), first to the fewest recent sessions, then to the
/// least recent new content. A wider band for new prefixes (so
/// independent Envoy instances agree more often) was tried: it cost the
/// even spread of groups over replicas and didn't measurably help two
/// instances' hit rate.
pub(super) fn by_cost(
    cands: &[Candidate],
    costs: &[f64],
    band: f64,
    fresh: bool,
    placement: u64,
    p: &ScoreParams,
) -> Vec<usize> {
    let best = costs.iter().copied().fold(f64::INFINITY, f64::min);
    // Computed once, not per comparison.
    let recent: Vec<(u32, u32)> = if fresh {
        cands
            .iter()
            .map(|c| (recent_sessions(c, p), c.load.placed))
            .collect()
    } else {
        Vec::new()
    };
    // A replica that evicts what it is credited with takes no new content
    // (`pressure::open_to_new`): its second prefill may be less than the
    // band (a prompt of a block or two), so it is no tie, unless every
    // replica evicts.
    let all_evict = cands.iter().all(|c| c.evicting);
    let tie = |i: usize| (all_evict || !cands[i].evicting) && costs[i] - best < band;
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| {
        let tie_a = tie(a);
        let tie_b = tie(b);
        tie_b
            .cmp(&tie_a)
            .then_with(|| {
                if !(tie_a && tie_b) {
                    costs[a].total_cmp(&costs[b])
                } else {
                    recent.get(a).cmp(&recent.get(b))
                }
            })
            .then_with(|| {
                rendezvous(placement, cands[b].id).cmp(&rendezvous(placement, cands[a].id))
            })
    });
    order
}

/// The sessions (new prefixes or branches) a replica took lately: this
/// instance's, plus the requests other instances have on it (`others`).
pub(super) fn recent_sessions(c: &Candidate, p: &ScoreParams) -> u32 {
    c.load.branches.saturating_add(others(c, p))
}

/// Requests on a replica that other gateway instances sent: the scraped
/// running and queued requests beyond this instance's own in flight. With
/// one gateway, 0. New content is placed where the fewest new sessions went
/// lately; with several instances each knows only its own placements, and
/// the others' show up here within a scrape (a new session's first turn is
/// a cold prefill, running for a while), which is what keeps three
/// instances that each spread their own sessions from stacking them on the
/// same replicas.
fn others(c: &Candidate, p: &ScoreParams) -> u32 {
    if p.gateways <= 1 {
        return 0;
    }
    // `as` saturates (NaN to 0): the scraped values are already sanitised.
    let scraped = (c.running.max(0.0) + c.waiting.max(0.0)).round() as u32;
    scraped.saturating_sub(c.load.requests)
}

/// New content goes preferably where less new content went lately
/// (sglang's "smallest tree" idea). The term compares a replica's recent
/// new content with the pool's mean, clamped to +-1, and scales it by the
/// blocks this request would add there: at most `spread` x the request's
/// new blocks either way. Bounded on purpose: as a raw count it grew with
/// traffic (30k-300k blocks) until it drowned the scraped queue and KV
/// penalties, and a replica with 50 queued requests kept getting half of
/// the new prompts.
fn spread_cost(weight: f64, placed: u32, mean: f64, new_blocks: u32) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    let relative = (placed as f64 / mean - 1.0).clamp(-1.0, 1.0);
    weight * relative * new_blocks as f64
}
