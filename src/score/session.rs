//! Where a stored session starts: the replica its later turns are bound to.

use super::cost::recent_sessions;
use super::pressure::{least_scraped, open_to_new, scraped};
use super::{Ask, Candidate, ScoreParams};

/// The replica for the first turn of a session whose later turns follow
/// it by name (`Ask::session_start`): among the replicas open to new
/// content whose scraped queue, KV and LoRA pressure is within this
/// turn's own work of the calmest's, the one that took the fewest
/// sessions lately (`recent_sessions`), the cheapest in `order` on ties.
///
/// Where such a turn lands carries the session for its whole life, so how
/// many sessions a replica carries says more about its next minutes than
/// the turn running there now: agents think between turns, and a cold
/// first turn in flight counted as hundreds of blocks of load. Ranked by
/// cost, eight stored sessions went 3/2/2/1 on four replicas: the replica
/// with one session was mid-turn each time a new session started. A
/// request waiting there a moment is no reason to pass it by (excluding
/// a replica with one request queued beyond the calmest's gave 3/2/2/1
/// again); a deep queue is (a replica nobody sends to because of its
/// queue has the fewest sessions of all, as in `spill`), and so is work
/// in flight over the load bound (`keeps`).
///
/// With several gateways each instance counts only the sessions it
/// started, and sessions start faster than the others' show: three
/// instances still dealt eight sessions 3/2/2/1 (agentic-responses, seeds
/// 1-3). Counting instead the blocks this instance sent each replica
/// lately (`sent`: every instance routes a sample of every session's
/// turns) or the prompt tokens each replica looked up (scraped: what all
/// instances see) did worse: 3/2/2/1, 3/2/2/1, 3/3/1/1, and 3/2/2/1,
/// 3/3/1/1, 4/2/1/1.
pub(super) fn fewest_sessions(
    cands: &[Candidate],
    order: &[usize],
    keeps: &[bool],
    ask: &Ask,
    p: &ScoreParams,
) -> Option<usize> {
    let open = open_to_new(cands, keeps);
    let w = &p.weights;
    let own = p.work_of(ask.blocks, ask.trunk.min(ask.blocks)) as f64 * w.load;
    let calm = least_scraped(cands, &open, w) + own;
    order
        .iter()
        .copied()
        .filter(|&i| open[i] && scraped(&cands[i], w) <= calm)
        .min_by_key(|&i| recent_sessions(&cands[i], p))
}
