//! The depth a request is priced and keyed at, besides what it matched:
//! new content below a shared trunk (`trunk_above`), a session's
//! provisional first home (`thin_lead`), and, with gateway instances that
//! must agree, which holders of a session count (`agreed_below_lead`).

use crate::index::{Branch, PrefixIndex};
use crate::score::{self, Candidate, ScoreParams};
use crate::store::Store;

use super::Hashed;

/// A request whose deepest holder is ahead of every other replica by
/// less than the new content it brings (an agent's first tool result,
/// below its task, below a tool prompt every replica holds) finds no home
/// yet: the session is still to be placed, and it is placed like new
/// content below a trunk that reaches the lead's end (`score::rank_below`),
/// by recent sessions and load, not by who is idle this instant. Left to
/// the cost, a busy holder's few blocks of lead lost to any idle replica,
/// and sessions piled up wherever the second turns found a gap (agentic,
/// 4 replicas: 1-3 sessions each, share 1.24-1.53).
#[derive(Debug, Clone, Copy)]
pub(super) struct Lead {
    /// The candidate that holds the lead.
    pub(super) home: usize,
    /// The depth every other candidate holds (where the placement key is).
    pub(super) shared: u32,
    /// The lead's end.
    pub(super) top: u32,
}

pub(super) fn thin_lead(cands: &[Candidate], blocks: u32, min_new: u32) -> Option<Lead> {
    let held = |c: &Candidate| c.matched.min(blocks);
    let (home, top) = cands.iter().map(held).enumerate().max_by_key(|&(_, h)| h)?;
    let mut others = cands
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != home)
        .map(|(_, c)| held(c));
    let shared = others.next()?;
    let new = blocks - top;
    let thin = shared > 0
        && top > shared
        && top - shared < new
        && new >= min_new
        && others.all(|h| h == shared);
    thin.then_some(Lead { home, shared, top })
}

/// The depth of the shared trunk a request brings new content below (0:
/// none): the prefix where it leaves what this index holds, when that
/// prefix has forked and the request brings at least `min_new` blocks.
///
/// Where a request leaves the trunk is known only to within one
/// checkpoint gap (16 blocks at 45 KB). Below a trunk that itself sits
/// below what other replicas hold (a document below a shared preamble), a
/// question whose few blocks end a gap past the last checkpoint it shares
/// with the document's other questions is no new content: there the new
/// content counts from the request's next checkpoint. Counted from the
/// trunk's end, such questions were placed like new documents and copied
/// theirs to a second, third and fourth replica, where the copies evicted
/// other documents (long-preamble: 12% of warm requests `new_branch`, 21
/// of 64 documents on 2-4 replicas, warm TTFT p95 585-825 against 97-104).
/// Below a first trunk (a preamble) a short new part is an agent's task,
/// which must spread: there it counts from the trunk's end.
pub(super) fn trunk_above(
    branch: Option<Branch>,
    hashed: &Hashed,
    cands: &[Candidate],
    min_new: u32,
) -> u32 {
    let Some(b) = branch else {
        return 0;
    };
    let next = hashed.checkpoints.get(b.at + 1);
    if !b.forks(next) {
        return 0;
    }
    let blocks = hashed.blocks();
    let nested = cands.iter().any(|c| c.matched > 0 && c.matched < b.held);
    let from = if nested {
        next.map_or(blocks, |c| c.blocks)
    } else {
        b.held
    };
    if blocks.saturating_sub(from) >= min_new {
        b.held
    } else {
        0
    }
}

/// With gateway instances that must agree, for a conversation's or agent
/// session's later turn: below a shared trunk that ends where its own part
/// starts (after its system and tool messages, a prefix seen to fork),
/// what lies past the trunk is credited only to the replica every instance
/// would place that content on (`score::agreed_homes`, keyed at the first
/// checkpoint past the trunk): the first of its two rendezvous candidates,
/// or either while the first is the busier by more than one request's
/// work; any other holder is credited with the trunk alone. `None`: the
/// rule doesn't apply; `Some(0)`: an agreed replica still holds more;
/// `Some(t)`: nobody agreed does, so the request is new content below a
/// trunk of `t` blocks and goes where every instance puts it.
///
/// A session can be held elsewhere by an instance that sent its first
/// turn elsewhere: a first message too short to be new content below the
/// trunk stays with the trunk's holders, an agent's task that ends before
/// the next checkpoint is keyed by its last one (its later turns by the
/// checkpoint past the trunk), a first turn that found both replicas over
/// the load bound spilled further, and one that found the first busy went
/// to the second. Another instance looks for the session on the first
/// unless that one is busy, so each instance followed what it had learned,
/// and the session alternated between two replicas for its whole life,
/// re-prefilling the turns the other one served (agentic, 3 instances:
/// 2-5 of 8 sessions). Moved once, it stays. (Before requests were keyed
/// past their preamble, `Hashed::lead_floor`, this also mended each
/// instance's first conversation: multi-turn, 3 instances, hit rate 83.6%
/// against 86.6% with one instance.)
///
/// Only later turns: a conversation that alternates re-prefills what the
/// other replica served at every switch, while a document asked one
/// question at a time is whole on both of its replicas. Applied to single
/// questions too, it moved the documents that the start-up backlog had
/// spilled past their two replicas, in the middle of that backlog
/// (long-preamble, 3 instances, 4 seeds: TTFT p95 +10-34%).
pub(super) fn agreed_below_lead<S: Store + ?Sized>(
    index: &PrefixIndex,
    store: &S,
    hashed: &Hashed,
    cands: &mut [Candidate],
    params: &ScoreParams,
) -> Option<u32> {
    if !hashed.later_turn {
        return None;
    }
    let cps = &hashed.checkpoints;
    let j = hashed.lead_end()?;
    let (at, next) = (cps.get(j)?, cps.get(j + 1)?);
    let trunk = at.blocks;
    // Cheap tests first: the rendezvous pair and the index read only for a
    // turn that someone holds past the trunk.
    let min_new = params.trunk_min_new_blocks;
    if hashed.blocks().saturating_sub(trunk) < min_new || cands.iter().all(|c| c.matched <= trunk) {
        return None;
    }
    // The second of the two is a home while the first is busier by more
    // than one request's work. Held to the test that places new content
    // (busier by more than a copy of the whole session would cost), the
    // second almost never was: sessions gathered on their first
    // candidates, which rendezvous deals out lumpily (agentic, 3
    // instances, 6 seeds: median TTFT p95 2,200 against 3,280, but one
    // seed put four of eight sessions on one replica, hit rate 84.6%
    // against 91.4%, p95 21,324 against 6,593). Keeping only the first
    // whenever this instance's index shows it holding the session too (so
    // that instances which learned different halves of a session meet on
    // one replica) was tried as well: agentic, 3 instances, 12 seeds,
    // median TTFT p95 1,322 against 926 real ms, hit rate 91.5% against
    // 92.8%.
    let legit = score::agreed_homes(cands, next.hash, params);
    let stray = |i: usize, c: &Candidate| c.matched > trunk && !legit.contains(&i);
    if !cands.iter().enumerate().any(|(i, c)| stray(i, c)) || !index.forked(store, at) {
        return None;
    }
    for (i, c) in cands.iter_mut().enumerate() {
        if stray(i, c) {
            c.matched = trunk;
        }
    }
    Some(if cands.iter().any(|c| c.matched > trunk) {
        0
    } else {
        trunk
    })
}
