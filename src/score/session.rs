//! Where a stored session starts: the replica its later turns are bound to.

use super::cost::others;
use super::pressure::open_to_new;
use super::{Candidate, ScoreParams};

/// The replica for the first turn of a session whose later turns follow
/// it by name (`Ask::session_start`): among the replicas open to new
/// content, the one that took the fewest sessions lately (this instance's
/// `branches`, plus the requests other instances have running or queued
/// there), the cheapest in `order` on ties.
///
/// Where such a turn lands carries the session for its whole life, so how
/// many sessions a replica carries says more about its next minutes than
/// the turn running there now: agents think between turns, and a cold
/// first turn in flight counted as hundreds of blocks of load. Ranked by
/// cost, eight stored sessions went 3/2/2/1 on four replicas: the replica
/// with one session was mid-turn each time a new session started. Its
/// scraped queue is no reason to pass it by either: a turn waits there a
/// moment before it runs (excluding a replica with one request queued
/// beyond the calmest's gave 3/2/2/1 again). Real overload closes it
/// (`keeps`: the load bound), and with several gateways the others'
/// queued requests count as sessions.
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
    p: &ScoreParams,
) -> Option<usize> {
    let open = open_to_new(cands, keeps);
    order
        .iter()
        .copied()
        .filter(|&i| open[i])
        .min_by_key(|&i| cands[i].load.branches.saturating_add(others(&cands[i], p)))
}
