//! Where a load spill goes, and whom it leaves.

use super::cost::recent_sessions;
use super::pressure::{least_scraped, open_to_new, scraped};
use super::{Ask, Candidate, ScoreParams};

/// Where a load spill goes, and whom it leaves. The deepest holder has
/// more in flight than the prefill it saves is worth (or is over the load
/// bound), so the request goes to a replica that holds less. Its session
/// (or its group's next followers) then stays there: the new replica
/// holds it deepest from now on. So the spill is a placement, made like
/// one: among the replicas within the bound that take new content
/// (`pressure::open_to_new`), work (the prefill each would
/// do, and what it has in flight) that differs by less than this
/// request's own work counts as no difference, and the fewest recent
/// placements win, then the ranking. And for a session's later turn,
/// when even those would end with more sessions than the holder had, a
/// busier replica within the bound that would not, if busier only by
/// work in flight (the wait is one turn's, the deal the session's life:
/// 32 sessions on 16 replicas, dealt 2 each on 4 of 6 runs against 1 of
/// 6, share median 1.47 against 1.66; a scraped queue is no such wait,
/// and a metrics page reporting a million waiting took a spill without
/// that). A single question only copies its document, and its spills
/// went to busier replicas for nothing (long-preamble: twice the
/// spills, warm p95 94 -> 227-515 ms on seed 1). By cost alone, 10 of
/// 32 agent sessions on 16 replicas moved at their second turn (another
/// session's cold first turn was in flight on their replica) to
/// whichever was least busy that instant, and two replicas ended with
/// three sessions each (share 1.65; dealt two each, the sessions' own
/// lengths leave 1.37).
/// Only with one gateway: with several, where a session goes is what every
/// instance must compute alike.
///
/// Returns the pick and the holder it leaves; `None` when no replica is
/// within the bound to choose among, or the cost's pick is not among the
/// near-equals (a queue or KV pressure on them).
pub(super) fn respill(
    cands: &[Candidate],
    pressure: &[f64],
    keeps: &[bool],
    order: &[usize],
    ask: &Ask,
    p: &ScoreParams,
) -> Option<(usize, usize)> {
    let blocks = ask.blocks;
    // Ties go by the ranking (`order`), never by the candidates' list
    // order, which another instance may build otherwise: of equally deep
    // holders, the one ranked last (the last maximum).
    let holder = order.iter().copied().max_by_key(|&i| cands[i].matched)?;
    let within: Vec<usize> = (0..cands.len()).filter(|&i| keeps[i]).collect();
    let depth = within.iter().map(|&i| cands[i].matched).max()?;
    // What taking the request adds to each: its prefill there, the work
    // already in flight, and the scraped queue, KV and LoRA pressure at
    // the cost's exchange rate. Without the last, a replica nobody sends
    // to because its queue is deep has the fewest sessions of all, and
    // took spills (a metrics page reporting a million waiting did).
    let per_block = p.weights.load.max(f64::EPSILON);
    let extra = |i: usize| f64::from(depth - cands[i].matched.min(depth)) + pressure[i] / per_block;
    let least = within
        .iter()
        .map(|&i| extra(i))
        .fold(f64::INFINITY, f64::min);
    let own = p.work_of(blocks, depth) as f64;
    // A spill places the session anew: not where it would be evicted
    // (`open_to_new`), as for any new content.
    let open = open_to_new(cands, keeps);
    let mut near = vec![false; cands.len()];
    for &i in &within {
        near[i] = open[i] && extra(i) - least <= own;
    }
    // The cost may prefer another for its queue or KV: then it is no
    // choice among equals, and it stands.
    if !order.first().is_some_and(|&f| near[f]) {
        return None;
    }
    let recent = |i: usize| recent_sessions(&cands[i], p);
    let home = recent(holder);
    let pick = order
        .iter()
        .copied()
        .filter(|&i| near[i])
        .min_by_key(|&i| recent(i))?;
    // Busier by work in flight only (a turn or two, which this instance
    // sees end): a scraped queue beyond the turn's own work is no choice.
    let w = &p.weights;
    let calm = least_scraped(cands, keeps, w) + own * per_block;
    let pick = if recent(pick) < home || !ask.later_turn {
        pick
    } else {
        order
            .iter()
            .copied()
            .filter(|&i| open[i] && i != holder && recent(i) < home)
            .filter(|&i| scraped(&cands[i], w) <= calm)
            .min_by(|&a, &b| extra(a).total_cmp(&extra(b)))
            .unwrap_or(pick)
    };
    (pick != holder).then_some((pick, holder))
}
