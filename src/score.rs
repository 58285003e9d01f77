//! Where the decision is made: rank the eligible replicas for one request.
//!
//! Every replica gets an estimated cost in one unit, prefix blocks of
//! work: the prefill it would have to do for this request (the blocks it
//! doesn't hold) plus the work already in flight on it. Cache affinity and
//! load are then traded in the same currency, instead of a hand-tuned sum
//! of unrelated ratios. On top of that:
//! - bounded load: a replica above `bounded_load_factor` x the pool's mean
//!   load gets no prefix credit, so a hot prefix spills to the next replica
//!   (which then learns it) instead of stampeding one;
//! - placement: candidates whose cost is within one request's constant of
//!   the best are ties, broken by rendezvous hashing on the request's
//!   placement hash, so every worker and every Envoy instance puts a new
//!   prefix on the same replica when loads are (nearly) equal.

use crate::config::{LoadMeasure, Weights};
use crate::endpoint::ReplicaId;
use crate::load::Load;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: ReplicaId,
    /// Leading blocks of this request the replica holds.
    pub matched: u32,
    /// In-flight work through this Envoy (instant).
    pub load: Load,
    /// Last scraped queue depth, running requests and KV usage (0 when
    /// unknown).
    pub waiting: f32,
    pub running: f32,
    pub kv_usage: f32,
    pub lora: LoraFit,
    /// The client's verified affinity token names this replica.
    pub affinity: bool,
    /// Its prefix cache's measured hit rate, when it reports one (see
    /// `route::evicting`).
    pub hit_rate: Option<f32>,
    /// The prompt tokens it looked up lately, from every gateway instance
    /// (see `route::hot`).
    pub traffic: Option<f32>,
    /// It evicts more than the index credits it with, and this request's
    /// prefix is one of those that leave it (`route::evicting`): its
    /// credit is withheld, and placing the prefix there again costs a
    /// second prefill (the copy would be evicted in turn).
    pub evicting: bool,
    /// The share of its prefix credit it keeps (1 unless it evicts, see
    /// `route::evicting`): a prefix that left it stays where it went.
    pub trust: f32,
}

/// How well a replica fits the request's LoRA adapter, as the Inference
/// Extension's LoRA affinity scorer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraFit {
    /// Not an adapter request (or nobody reports adapters).
    #[default]
    NotApplicable,
    /// The adapter is running there.
    Running,
    /// The adapter is queued to load there.
    Waiting,
    /// A free adapter slot: it can load without evicting another.
    CanLoad,
    /// Loading it would evict another adapter.
    MustEvict,
}

impl LoraFit {
    fn cost(self, w: f64) -> f64 {
        match self {
            LoraFit::NotApplicable | LoraFit::Running => 0.0,
            LoraFit::Waiting => w / 4.0,
            LoraFit::CanLoad => w / 2.0,
            LoraFit::MustEvict => w,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The pick holds the longest cached prefix of the request.
    PrefixHit,
    /// Another replica holds more of the prefix but is too loaded.
    LoadSpill,
    /// Nobody holds any of the prefix: placed by load and rendezvous.
    NewPrefix,
    /// New content below a shared trunk: placed like a new prefix.
    NewBranch,
    /// The client's session-affinity token named the replica.
    Affinity,
    /// No prompt to hash (no body, not an inference path, parse error).
    NoPrompt,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PrefixHit => "prefix_hit",
            Reason::LoadSpill => "load_spill",
            Reason::NewPrefix => "new_prefix",
            Reason::NewBranch => "new_branch",
            Reason::Affinity => "affinity",
            Reason::NoPrompt => "no_prompt",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ScoreParams {
    pub weights: Weights,
    pub load_measure: LoadMeasure,
    pub request_cost_blocks: u32,
    pub bounded_load_factor: f64,
    /// Absolute headroom (blocks) under which no replica counts as
    /// overloaded: at low load, the cost comparison alone decides.
    pub bounded_load_slack: u32,
    /// New content (blocks) a request must bring below a forked prefix to
    /// be placed as new content below a trunk (see `rank_below`); shorter
    /// continuations (a question) stay with the prefix's holders. Below a
    /// trunk nested in another it counts from the request's first
    /// checkpoint past the trunk (`route::trunk_above`).
    pub trunk_min_new_blocks: u32,
    /// Independent gateway instances in front of the same replicas: above
    /// 1, new content is placed by `two_choices` so that they agree.
    pub gateways: u32,
    /// Clients send the affinity token back on a session's later turns
    /// (`affinity.clients_echo`): with many gateways, new content is then
    /// placed by this instance's ranking as with one gateway, not where
    /// every instance would put it.
    pub clients_echo: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    /// Indices into the candidate slice, best first.
    pub order: Vec<usize>,
    /// Cost per candidate (same indexing as the input), for the debug header.
    pub costs: Vec<f64>,
    pub reason: Reason,
    /// For a load spill with one gateway: the candidate it leaves (the
    /// deepest holder). What it held moves with the request (`respill`).
    pub spilled_from: Option<usize>,
}

impl ScoreParams {
    /// A request's load contribution on a replica where it matched
    /// `matched` of `blocks` (what `LoadBoard::start` records).
    pub fn work_of(&self, blocks: u32, matched: u32) -> u64 {
        let base = self.request_cost_blocks as u64;
        match self.load_measure {
            LoadMeasure::Work => base + blocks.saturating_sub(matched) as u64,
            LoadMeasure::Requests => base,
        }
    }

    /// New content goes where every gateway instance would put it: there
    /// are several, and no token leads a session's later turns back.
    pub fn agree(&self) -> bool {
        self.gateways > 1 && !self.clients_echo
    }

    fn load_of(&self, l: &Load) -> f64 {
        match self.load_measure {
            LoadMeasure::Work => l.work as f64,
            LoadMeasure::Requests => l.requests as f64 * self.request_cost_blocks.max(1) as f64,
        }
    }
}

/// Rank `cands` for a request of `blocks` prefix blocks. `placement` is the
/// request's placement hash (0 when it has none). Empty input → empty order.
pub fn rank(cands: &[Candidate], blocks: u32, placement: u64, p: &ScoreParams) -> Ranked {
    let ask = Ask {
        blocks,
        placement,
        ..Ask::default()
    };
    rank_below(cands, &ask, p)
}

/// What a request asks of the ranking: its prefix length in blocks, the
/// shared trunk above its own content (0 without one), its placement hash
/// (0 without one), and whether it is a session's later turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    pub blocks: u32,
    pub trunk: u32,
    pub placement: u64,
    /// A conversation's or agent session's later turn: a spill moves the
    /// whole session (the new replica holds its history deepest from now
    /// on), where a single question only copies its document.
    pub later_turn: bool,
}

/// `rank` for a request that brings new content below a shared trunk of
/// `trunk` blocks (a prefix that already branched: a long system prompt
/// or tool list with many documents or sessions below it). Every replica
/// is priced as if it held the trunk: a copy costs one prefill, once per
/// replica, while piling every new document onto the replicas that hold
/// the trunk stampedes them. So new content below a trunk is placed by
/// load, recent placements and rendezvous, like a new prefix; the
/// followers of each document then stick to it as usual.
pub fn rank_below(cands: &[Candidate], ask: &Ask, p: &ScoreParams) -> Ranked {
    let Ask {
        blocks,
        trunk,
        placement,
        ..
    } = *ask;
    if cands.is_empty() {
        return Ranked {
            order: Vec::new(),
            costs: Vec::new(),
            reason: Reason::NoPrompt,
            spilled_from: None,
        };
    }
    // With many gateways the in-flight counts are this instance's share
    // only. Scaling them up by `gateways` was tried: it turned one local
    // cold prefill into a load over the bound and voided the prefix credit
    // of every group on that replica (shared-prefix, 3 instances: hit rate
    // 85-88% scaled, 95% not). Dividing only the bound's slack by it, tried
    // again once one request in flight no longer counted as an overload,
    // cost the same way elsewhere: conversations' later turns lost their
    // credit and moved (multi-turn, 3 instances: hit rate 81.9% against
    // 83.9%). Unscaled they count as the sample they are; the scraped
    // queue and KV usage are what every instance sees alike.
    let loads: Vec<f64> = cands.iter().map(|c| p.load_of(&c.load)).collect();
    let fresh = blocks > 0 && cands.iter().all(|c| c.matched <= trunk.min(blocks));
    let keeps = within_bound(cands, &loads, p);
    let costs = costs(cands, &loads, &keeps, (blocks, trunk), fresh, p);
    let band = band(p);
    let mut order = by_cost(cands, &costs, band, fresh, placement, p);
    let mut reason = match reason(cands, &order, blocks) {
        Reason::LoadSpill | Reason::PrefixHit if trunk > 0 => Reason::NewBranch,
        r => r,
    };
    // With several gateways, new content goes where any instance would
    // put it (`two_choices`), since a later request for it may reach
    // another instance without a token. Clients that echo the affinity
    // token (`clients_echo`) find their session by it, so new content is
    // placed as with one gateway, counting the other instances' sessions
    // through the scraped counts (`others`). Restricting that to the two
    // rendezvous candidates was tried: multi-turn, 3 instances, share
    // 1.45 against 1.09.
    if p.agree() && matches!(reason, Reason::NewPrefix | Reason::NewBranch) {
        // Leaving the agreed replica costs another instance's copy of the
        // new content: worth it only for a bigger load difference.
        let new_blocks = f64::from(blocks.saturating_sub(trunk.min(blocks)));
        let margin = band.max(p.weights.prefix * new_blocks);
        let by_hash = rendezvous_order(cands, placement);
        let open = open_to_new(cands, &keeps);
        let pick = two_choices(&by_hash, &pressure(cands, &loads, p), &open, margin);
        if let Some(pick) = pick.or_else(|| order.first().copied()) {
            to_front(&mut order, pick);
        }
    }
    let mut spilled_from = None;
    if reason == Reason::LoadSpill && !p.agree() {
        let pressure = pressure(cands, &loads, p);
        if let Some((pick, holder)) = respill(cands, &pressure, &keeps, &order, ask, p) {
            to_front(&mut order, pick);
            spilled_from = Some(holder);
        }
    }
    if let Some(a) = token_holder(cands, &keeps, blocks, p) {
        to_front(&mut order, a);
        reason = Reason::Affinity;
    }
    Ranked {
        order,
        costs,
        reason,
        spilled_from,
    }
}

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
fn costs(
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
fn by_cost(
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
            .map(|c| (c.load.branches.saturating_add(others(c, p)), c.load.placed))
            .collect()
    } else {
        Vec::new()
    };
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| {
        let tie_a = costs[a] - best < band;
        let tie_b = costs[b] - best < band;
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

fn to_front(order: &mut Vec<usize>, i: usize) {
    order.retain(|&j| j != i);
    order.insert(0, i);
}

/// Where a load spill goes, and whom it leaves. The deepest holder has
/// more in flight than the prefill it saves is worth (or is over the load
/// bound), so the request goes to a replica that holds less. Its session
/// (or its group's next followers) then stays there: the new replica
/// holds it deepest from now on. So the spill is a placement, made like
/// one: among the replicas within the bound, work (the prefill each would
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
fn respill(
    cands: &[Candidate],
    pressure: &[f64],
    keeps: &[bool],
    order: &[usize],
    ask: &Ask,
    p: &ScoreParams,
) -> Option<(usize, usize)> {
    let blocks = ask.blocks;
    let holder = (0..cands.len()).max_by_key(|&i| cands[i].matched)?;
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
    let mut near = vec![false; cands.len()];
    for &i in &within {
        near[i] = extra(i) - least <= own;
    }
    // The cost may prefer another for its queue or KV: then it is no
    // choice among equals, and it stands.
    if !order.first().is_some_and(|&f| near[f]) {
        return None;
    }
    let recent = |i: usize| cands[i].load.branches.saturating_add(others(&cands[i], p));
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
        (0..cands.len())
            .filter(|&i| keeps[i] && i != holder && recent(i) < home)
            .filter(|&i| scraped(&cands[i], w) <= calm)
            .min_by(|&a, &b| extra(a).total_cmp(&extra(b)))
            .unwrap_or(pick)
    };
    (pick != holder).then_some((pick, holder))
}

/// The replica a session's affinity token names (another instance may
/// have issued it, so this one may not know the session's prompt): it
/// wins while within the load bound (work in flight is the bound's
/// business) and its scraped queue, KV and LoRA pressure exceed the
/// least by less than holding the whole prompt saves. So a dying
/// replica's queue turns its sessions away, as it turns away hits.
fn token_holder(
    cands: &[Candidate],
    keeps: &[bool],
    blocks: u32,
    p: &ScoreParams,
) -> Option<usize> {
    let a = (0..cands.len()).find(|&i| cands[i].affinity && keeps[i])?;
    let w = &p.weights;
    let saved = w.prefix * f64::from(blocks);
    (scraped(&cands[a], w) - least_scraped(cands, keeps, w) <= saved).then_some(a)
}

/// One request's constant in cost units: costs closer than this are ties.
fn band(p: &ScoreParams) -> f64 {
    p.request_cost_blocks.max(1) as f64 * p.weights.load.max(f64::EPSILON)
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

fn reason(cands: &[Candidate], order: &[usize], blocks: u32) -> Reason {
    if blocks == 0 {
        return Reason::NoPrompt;
    }
    let longest = cands.iter().map(|c| c.matched).max().unwrap_or(0);
    let picked = order.first().map(|&i| cands[i].matched).unwrap_or(0);
    if longest == 0 {
        Reason::NewPrefix
    } else if picked >= longest {
        Reason::PrefixHit
    } else {
        Reason::LoadSpill
    }
}

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
fn two_choices(by_hash: &[usize], pressure: &[f64], keeps: &[bool], margin: f64) -> Option<usize> {
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

/// The replicas new content may go to: within the load bound (`keeps`),
/// and not evicting what they hold (every instance reads the same hit
/// rates, so none puts new content where it would be evicted).
fn open_to_new(cands: &[Candidate], keeps: &[bool]) -> Vec<bool> {
    keeps
        .iter()
        .zip(cands)
        .map(|(&k, c)| k && !c.evicting)
        .collect()
}

/// Only what differs between replicas for any new content: load, queue,
/// KV and LoRA (not the instance-local placement history).
fn pressure(cands: &[Candidate], loads: &[f64], p: &ScoreParams) -> Vec<f64> {
    let w = &p.weights;
    cands
        .iter()
        .zip(loads)
        .map(|(c, &l)| w.load * l + scraped(c, w))
        .collect()
}

/// The pressure every gateway instance reads alike: the scraped queue,
/// KV usage and LoRA adapters, in cost units.
fn scraped(c: &Candidate, w: &Weights) -> f64 {
    w.queue * c.waiting.max(0.0) as f64
        + w.kv * c.kv_usage.clamp(0.0, 1.0) as f64
        + c.lora.cost(w.lora)
}

/// The calmest scraped pressure among the replicas within the load bound.
fn least_scraped(cands: &[Candidate], keeps: &[bool], w: &Weights) -> f64 {
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
fn within_bound(cands: &[Candidate], loads: &[f64], p: &ScoreParams) -> Vec<bool> {
    let mean = loads.iter().sum::<f64>() / cands.len().max(1) as f64;
    let bound = p.bounded_load_factor * mean + p.bounded_load_slack as f64;
    cands
        .iter()
        .zip(loads)
        .map(|(c, &load)| load <= bound || c.load.requests <= 1)
        .collect()
}

/// Candidate indices by their rendezvous weight for `key`, highest first.
fn rendezvous_order(cands: &[Candidate], key: u64) -> Vec<usize> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> ScoreParams {
        ScoreParams {
            weights: Weights::default(),
            load_measure: LoadMeasure::Work,
            request_cost_blocks: 8,
            bounded_load_factor: 1.5,
            bounded_load_slack: 64,
            trunk_min_new_blocks: 16,
            gateways: 1,
            clients_echo: false,
        }
    }

    fn cand(id: u64, matched: u32, requests: u32, work: u64) -> Candidate {
        Candidate {
            id,
            matched,
            load: Load {
                requests,
                work,
                ..Load::default()
            },
            waiting: 0.0,
            running: 0.0,
            kv_usage: 0.0,
            lora: LoraFit::NotApplicable,
            affinity: false,
            hit_rate: None,
            traffic: None,
            evicting: false,
            trust: 1.0,
        }
    }

    #[test]
    fn a_spilled_session_goes_where_fewer_sessions_are_among_the_near_idle() {
        // The session's replica (640 blocks of it) is busy; the others
        // hold the shared 624-block tool prompt. The least busy one carries
        // three sessions, another two and one busier by less than this
        // turn's own work, the last is busy.
        let mut c = vec![
            cand(1, 640, 6, 6_000),
            cand(2, 624, 1, 100),
            cand(3, 624, 1, 150),
            cand(4, 624, 2, 1_500),
        ];
        c[1].load.branches = 3;
        c[2].load.branches = 2;
        let r = rank(&c, 770, 7, &params());
        assert_eq!(r.reason, Reason::LoadSpill);
        assert_eq!((r.order[0], r.spilled_from), (2, Some(0)));
        // Equal counts: the ranking's pick stands (least busy first).
        c[2].load.branches = 3;
        let r = rank(&c, 770, 7, &params());
        assert_eq!((r.order[0], r.spilled_from), (1, Some(0)));
        // More apart than the turn's own work: the busier one is no choice.
        c[2].load.branches = 0;
        c[2].load.work = 100 + params().work_of(770, 624) + 1;
        assert_eq!(rank(&c, 770, 7, &params()).order[0], 1);
        // A scraped queue is work too: the replica with no sessions but
        // a deep queue is no choice, however idle its in-flight count.
        c[2].load.work = 150;
        c[2].waiting = 1_000_000.0;
        assert_eq!(rank(&c, 770, 7, &params()).order[0], 1);
        c[2].waiting = 0.0;
        assert_eq!(rank(&c, 770, 7, &params()).order[0], 2);
        // With several gateways, where a session goes is the agreed
        // placement's business: no re-pick, nothing moved.
        let p = ScoreParams {
            gateways: 3,
            ..params()
        };
        assert_eq!(rank(&c, 770, 7, &p).spilled_from, None);
    }

    #[test]
    fn a_spill_does_not_leave_its_new_replica_with_more_sessions_than_its_home() {
        // A session's later turn. Home (two sessions) is busy; the idle
        // replica has two sessions too, a busier one within the bound has
        // one.
        let mut c = vec![
            cand(1, 640, 6, 6_000),
            cand(2, 624, 1, 100),
            cand(3, 624, 2, 1_500),
        ];
        c[0].load.branches = 2;
        c[1].load.branches = 2;
        c[2].load.branches = 1;
        let turn = Ask {
            blocks: 770,
            placement: 7,
            later_turn: true,
            ..Ask::default()
        };
        let r = rank_below(&c, &turn, &params());
        assert_eq!(
            (r.reason, r.order[0], r.spilled_from),
            (Reason::LoadSpill, 2, Some(0))
        );
        // A single question only copies its document: no wait for that.
        let question = Ask {
            later_turn: false,
            ..turn
        };
        assert_eq!(rank_below(&c, &question, &params()).order[0], 1);
        // Nothing to gain from the wait: the idle one.
        c[2].load.branches = 2;
        assert_eq!(rank_below(&c, &turn, &params()).order[0], 1);
        // Busier by a scraped queue: no choice either.
        c[2].load.branches = 1;
        c[2].waiting = 1_000.0;
        assert_eq!(rank_below(&c, &turn, &params()).order[0], 1);
    }

    #[test]
    fn new_content_is_not_placed_where_it_would_be_evicted() {
        // Whatever the key: with one gateway by cost, with several by the
        // agreed two choices; the evicting replica only as a last resort.
        for gateways in [1, 3] {
            let p = ScoreParams {
                gateways,
                ..params()
            };
            for key in 0..200u64 {
                let mut c: Vec<Candidate> = (1..=4).map(|i| cand(i, 0, 0, 0)).collect();
                let first = rank(&c, 100, key, &p).order[0];
                c[first].evicting = true;
                let r = rank(&c, 100, key, &p);
                assert_ne!(r.order[0], first, "key {key}, {gateways} gateways");
                assert_eq!(r.order.last(), Some(&first));
                for e in &mut c {
                    e.evicting = true;
                }
                assert_eq!(rank(&c, 100, key, &p).order.len(), 4);
            }
        }
    }

    #[test]
    fn a_scraped_queue_steers_new_work_away() {
        let mut c = [cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        c[0].waiting = 20.0;
        for key in 0..50 {
            assert_eq!(rank(&c, 10, key, &params()).order[0], 1);
        }
        // ...but not away from a long cached prefix over a short queue.
        c[0].waiting = 2.0;
        c[0].matched = 128;
        assert_eq!(rank(&c, 130, 1, &params()).order[0], 0);
    }

    #[test]
    fn recent_placements_never_outweigh_a_scraped_queue() {
        // Replica 0: idle by its metrics but with a lot of recent new
        // content; replica 1: queue 50, KV 95%, nothing placed lately.
        let mut c = [cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        c[0].load.placed = 300_000;
        c[1].load.placed = 0;
        c[1].waiting = 50.0;
        c[1].kv_usage = 0.95;
        let busy = (0..1000u64)
            .filter(|&k| rank(&c, 256, k, &params()).order[0] == 1)
            .count();
        assert_eq!(busy, 0, "the loaded replica won {busy} of 1000 new prompts");
        // Among equals the term still spreads new content.
        c[1].waiting = 0.0;
        c[1].kv_usage = 0.0;
        for k in 0..100 {
            assert_eq!(rank(&c, 256, k, &params()).order[0], 1);
        }
    }

    #[test]
    fn instances_with_different_local_loads_agree_on_two_replicas_at_most() {
        // Three gateway instances, each seeing its own share of the
        // in-flight work: for any new content, their picks fall within the
        // content's two rendezvous candidates.
        let mut p = params();
        p.gateways = 3;
        let views: Vec<Vec<Candidate>> = (0..3u64)
            .map(|inst| {
                (1..=8u64)
                    .map(|id| cand(id, 0, 1, (id * 7 + inst * 13) % 40))
                    .collect()
            })
            .collect();
        let mut spread = std::collections::HashMap::new();
        for key in 0..2000u64 {
            let picks: std::collections::HashSet<u64> = views
                .iter()
                .map(|v| v[rank(v, 64, key, &p).order[0]].id)
                .collect();
            assert!(picks.len() <= 2, "key {key}: {picks:?}");
            *spread
                .entry(views[0][rank(&views[0], 64, key, &p).order[0]].id)
                .or_insert(0) += 1;
        }
        // ...and still spread over the pool (the most loaded replica in
        // this view loses every pair it is in).
        assert!(spread.len() >= 7, "{spread:?}");
        assert!(spread.values().all(|&n| n < 2000 * 2 / 8), "{spread:?}");
        // With one instance the pick is always within the load slack and
        // one request's constant of the least loaded replica.
        p.gateways = 1;
        let mut v = views[0].clone();
        for c in &mut v {
            c.load.work *= 5;
        }
        let least = v.iter().map(|c| c.load.work).min().unwrap();
        let mut picks = std::collections::HashSet::new();
        for k in 0..200u64 {
            let picked = v[rank(&v, 64, k, &p).order[0]].load.work;
            assert!(picked < least + 64 + 8, "key {k}: work {picked} vs {least}");
            picks.insert(picked);
        }
        assert!(picks.len() > 1, "new content all went to one replica");
    }

    #[test]
    fn new_content_goes_where_the_fewest_branches_went() {
        // Four replicas that each hold the trunk (624 blocks); an agent's
        // task adds 30. One turn in flight (100 blocks of work) on the
        // replica with no session yet; the others run nothing but took
        // one, two and three sessions.
        let mut c: Vec<Candidate> = (1..=4).map(|id| cand(id, 624, 0, 0)).collect();
        for (i, n) in [0u32, 1, 2, 3].into_iter().enumerate() {
            c[i].load.branches = n;
            c[i].load.placed = 30 * n;
        }
        c[0].load = Load {
            requests: 1,
            work: 100,
            ..c[0].load
        };
        let ask = |placement| Ask {
            blocks: 654,
            trunk: 624,
            placement,
            later_turn: false,
        };
        for key in 0..100 {
            let r = rank_below(&c, &ask(key), &params());
            assert_eq!(r.reason, Reason::NewBranch);
            assert_eq!(r.order[0], 1, "key {key}: {:?}", r.costs);
        }
        // In-flight work within the load slack (64 blocks) is no
        // difference: the replica without a session gets the next one.
        c[0].load.work = 50;
        for key in 0..100 {
            assert_eq!(rank_below(&c, &ask(key), &params()).order[0], 0);
        }
        // Followers are not new content: they stay with the holder.
        c[1].matched = 654;
        c[1].load.work = 0;
        assert_eq!(rank(&c, 660, 7, &params()).order[0], 1);
    }

    #[test]
    fn a_replica_that_takes_no_new_content_is_not_the_only_agreed_home() {
        // A session's later turn is judged by where new content would go
        // now: with its first candidate taking none (it evicts what it is
        // credited with), a session on the second is where every instance
        // would have put it, and stays.
        let mut p = params();
        p.gateways = 3;
        for key in 0..100u64 {
            let mut c: Vec<Candidate> = (1..=4u64).map(|id| cand(id, 0, 0, 0)).collect();
            let by_hash = rendezvous_order(&c, key);
            assert_eq!(agreed_homes(&c, key, &p), vec![by_hash[0]]);
            c[by_hash[0]].evicting = true;
            assert_eq!(agreed_homes(&c, key, &p), vec![by_hash[0], by_hash[1]]);
            assert_eq!(rank(&c, 100, key, &p).order[0], by_hash[1]);
        }
    }

    #[test]
    fn two_choices_spill_past_overloaded_candidates() {
        let mut p = params();
        p.gateways = 2;
        let mut c: Vec<Candidate> = (1..=4u64).map(|id| cand(id, 0, 0, 0)).collect();
        let key = 99;
        let by_hash = rendezvous_order(&c, key);
        // Both rendezvous candidates far over the bound.
        for &i in &by_hash[..2] {
            c[i].load = Load {
                requests: 4,
                work: 5000,
                ..Load::default()
            };
        }
        let pick = rank(&c, 10, key, &p).order[0];
        assert!(pick == by_hash[2] || pick == by_hash[3], "{pick}");
        // One long request in flight on the first is no overload: a
        // conversation new to this instance (600 blocks) goes where another
        // instance that saw it before would have put it.
        c[by_hash[0]].load.requests = 1;
        c[by_hash[0]].load.work = 700;
        c[by_hash[1]].load = Load::default();
        assert_eq!(rank(&c, 600, key, &p).order[0], by_hash[0]);
    }

    #[test]
    fn echoing_clients_let_new_sessions_go_where_the_fewest_went_on_any_instance() {
        let mut p = params();
        p.gateways = 3;
        let mut c: Vec<Candidate> = (1..=4u64).map(|id| cand(id, 0, 0, 0)).collect();
        let key = 4242;
        let by_hash = rendezvous_order(&c, key);
        // This instance placed a session on the first candidate lately;
        // other instances' first turns run on the second (two) and the
        // third (one), seen in the scraped running counts.
        c[by_hash[0]].load.branches = 1;
        c[by_hash[1]].running = 2.0;
        c[by_hash[2]].running = 1.0;
        // A new 600-block conversation: without echoing clients it stays
        // where an instance without a token would put it.
        assert_eq!(rank(&c, 600, key, &p).order[0], by_hash[0]);
        // With them it goes where the fewest sessions went, counting the
        // other instances' (any replica, not only the two candidates).
        p.clients_echo = true;
        let r = rank(&c, 600, key, &p);
        assert_eq!((r.order[0], r.reason), (by_hash[3], Reason::NewPrefix));
        // Scraped requests that are this instance's own in-flight ones
        // are not counted twice.
        c[by_hash[3]].running = 2.0;
        c[by_hash[3]].load.requests = 2;
        c[by_hash[3]].load.work = 20;
        assert_eq!(rank(&c, 600, key, &p).order[0], by_hash[3]);
        // One more scraped request there ties it with the first and third
        // (one session each): rendezvous then picks the first.
        c[by_hash[3]].running = 3.0;
        assert_eq!(rank(&c, 600, key, &p).order[0], by_hash[0]);
        // With one gateway scraped counts are no sessions: the replicas
        // without a recent placement tie, and rendezvous picks the second.
        p.gateways = 1;
        assert_eq!(rank(&c, 600, key, &p).order[0], by_hash[1]);
    }

    #[test]
    fn absurd_scraped_counts_and_histories_still_give_an_order() {
        let mut p = params();
        p.gateways = 3;
        p.clients_echo = true;
        let mut c: Vec<Candidate> = (1..=4u64).map(|id| cand(id, 0, 0, 0)).collect();
        c[0].running = f32::INFINITY;
        c[0].load.branches = u32::MAX;
        c[1].running = f32::NAN;
        c[1].waiting = -5.0;
        c[1].kv_usage = f32::NAN;
        c[1].load.branches = 1;
        c[2].running = 1e30;
        c[2].load.placed = u32::MAX;
        let mut order = rank(&c, 600, 7, &p).order;
        order.sort_unstable();
        assert_eq!(order, vec![0, 1, 2, 3]);
        // The one replica with nothing scraped and nothing placed wins.
        assert_eq!(rank(&c, 600, 7, &p).order[0], 3);
    }

    #[test]
    fn an_affinity_token_wins_unless_its_replica_is_over_the_bound() {
        let mut c = [cand(1, 0, 0, 0), cand(2, 128, 0, 0), cand(3, 0, 0, 0)];
        c[0].affinity = true;
        let r = rank(&c, 130, 5, &params());
        assert_eq!((r.order[0], r.reason), (0, Reason::Affinity));
        // One long request in flight is no overload: still followed.
        c[0].load = Load {
            requests: 1,
            work: 5000,
            ..Load::default()
        };
        assert_eq!(rank(&c, 130, 5, &params()).reason, Reason::Affinity);
        // Far over the bound with a queue: the token is not followed.
        c[0].load.requests = 12;
        let r = rank(&c, 130, 5, &params());
        assert_eq!((r.order[0], r.reason), (1, Reason::PrefixHit));
        // Within the bound but with a scraped queue worth more than the
        // whole prompt's prefill (130 blocks x 4 = 520 = 32.5 waiting):
        // not followed; a shorter queue is.
        c[0].load = Load::default();
        c[0].waiting = 33.0;
        assert_ne!(rank(&c, 130, 5, &params()).reason, Reason::Affinity);
        c[0].waiting = 32.0;
        assert_eq!(rank(&c, 130, 5, &params()).reason, Reason::Affinity);
    }

    #[test]
    fn one_long_request_in_flight_does_not_shed_a_held_history() {
        // Replica 0 holds a session's 1,800 blocks; another session's
        // 300-block turn runs there, the pool is otherwise nearly idle.
        let c = [
            cand(1, 1800, 1, 300),
            cand(2, 624, 0, 0),
            cand(3, 624, 1, 20),
        ];
        let r = rank(&c, 1820, 7, &params());
        assert_eq!((r.order[0], r.reason), (0, Reason::PrefixHit));
        // Two turns in flight there are a queue over the bound: it spills.
        let c = [
            cand(1, 1800, 2, 600),
            cand(2, 624, 0, 0),
            cand(3, 624, 1, 20),
        ];
        assert_eq!(rank(&c, 1820, 7, &params()).reason, Reason::LoadSpill);
    }

    #[test]
    fn full_kv_costs_more() {
        let mut c = [cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        c[1].kv_usage = 0.95;
        for key in 0..50 {
            assert_eq!(rank(&c, 10, key, &params()).order[0], 0);
        }
    }

    #[test]
    fn lora_affinity_prefers_running_then_free_slot() {
        let mut c = [cand(1, 0, 0, 0), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        c[0].lora = LoraFit::MustEvict;
        c[1].lora = LoraFit::CanLoad;
        c[2].lora = LoraFit::Running;
        assert_eq!(rank(&c, 10, 5, &params()).order, vec![2, 1, 0]);
    }

    #[test]
    fn idle_pool_goes_to_the_prefix_holder() {
        let c = [cand(1, 0, 0, 0), cand(2, 100, 0, 0), cand(3, 20, 0, 0)];
        let r = rank(&c, 128, 42, &params());
        assert_eq!(r.order[0], 1);
        assert_eq!(r.reason, Reason::PrefixHit);
        assert_eq!(r.order[1], 2, "next best holds some of it");
    }

    #[test]
    fn least_work_wins_without_a_prompt() {
        let c = [cand(1, 0, 3, 30), cand(2, 0, 1, 9), cand(3, 0, 2, 20)];
        let r = rank(&c, 0, 0, &params());
        assert_eq!(r.order, vec![1, 2, 0]);
        assert_eq!(r.reason, Reason::NoPrompt);
    }

    #[test]
    fn bounded_load_spills_a_hot_prefix() {
        // Replica 0 holds the prefix but carries most of the pool's work.
        let c = [cand(1, 128, 20, 300), cand(2, 0, 1, 10), cand(3, 0, 1, 10)];
        let r = rank(&c, 130, 7, &params());
        assert_ne!(r.order[0], 0);
        assert_eq!(r.reason, Reason::LoadSpill);
        // ...and a second holder is preferred over a cold replica.
        let c = [
            cand(1, 128, 20, 300),
            cand(2, 128, 1, 10),
            cand(3, 0, 1, 10),
        ];
        assert_eq!(rank(&c, 130, 7, &params()).order[0], 1);
    }

    #[test]
    fn work_measure_sees_long_prefills() {
        // Same request counts; replica 0 is prefilling three 8k documents.
        let c = [cand(1, 0, 3, 3 * 136), cand(2, 0, 3, 3 * 9)];
        assert_eq!(rank(&c, 4, 1, &params()).order[0], 1);
        let mut p = params();
        p.load_measure = LoadMeasure::Requests;
        // Request counting can't tell them apart: placement alone decides,
        // so both replicas get picked across keys.
        let picks: std::collections::HashSet<usize> =
            (0..64).map(|k| rank(&c, 4, k, &p).order[0]).collect();
        assert_eq!(picks.len(), 2);
    }

    #[test]
    fn new_prefix_placement_agrees_across_callers() {
        let c = [
            cand(1, 0, 0, 0),
            cand(2, 0, 0, 0),
            cand(3, 0, 0, 0),
            cand(4, 0, 0, 0),
        ];
        let mut hits = [0u32; 4];
        for key in 0..4000u64 {
            let a = rank(&c, 10, key, &params());
            // A second router with the same view decides the same.
            let b = rank(&c, 10, key, &params());
            assert_eq!(a.order[0], b.order[0]);
            assert_eq!(a.reason, Reason::NewPrefix);
            hits[a.order[0]] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }

    #[test]
    fn small_load_differences_do_not_break_placement() {
        let even = [cand(1, 0, 0, 0), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let skew = [cand(1, 0, 0, 3), cand(2, 0, 0, 0), cand(3, 0, 0, 5)];
        for key in 0..100 {
            assert_eq!(
                rank(&even, 10, key, &params()).order[0],
                rank(&skew, 10, key, &params()).order[0]
            );
        }
    }

    #[test]
    fn with_many_gateways_adding_a_replica_moves_about_one_in_n_too() {
        let mut p = params();
        p.gateways = 3;
        let ids3: Vec<Candidate> = (1..=3).map(|id| cand(id, 0, 0, 0)).collect();
        let ids4: Vec<Candidate> = (1..=4).map(|id| cand(id, 0, 0, 0)).collect();
        let mut moved = 0;
        for key in 0..4000u64 {
            let a = ids3[rank(&ids3, 10, key, &p).order[0]].id;
            let b = ids4[rank(&ids4, 10, key, &p).order[0]].id;
            if a != b {
                assert_eq!(b, 4, "a key moved between old replicas");
                moved += 1;
            }
        }
        assert!((800..1200).contains(&moved), "moved {moved} of 4000");
    }

    #[test]
    fn adding_a_replica_moves_about_one_in_n() {
        let ids3 = [cand(1, 0, 0, 0), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let ids4 = [
            cand(1, 0, 0, 0),
            cand(2, 0, 0, 0),
            cand(3, 0, 0, 0),
            cand(4, 0, 0, 0),
        ];
        let mut moved = 0;
        for key in 0..4000u64 {
            let a = ids3[rank(&ids3, 10, key, &params()).order[0]].id;
            let b = ids4[rank(&ids4, 10, key, &params()).order[0]].id;
            if a != b {
                assert_eq!(b, 4, "a key moved between old replicas");
                moved += 1;
            }
        }
        assert!((800..1200).contains(&moved), "moved {moved} of 4000");
    }

    #[test]
    fn empty_pool_ranks_nothing() {
        assert!(rank(&[], 10, 1, &params()).order.is_empty());
    }
}
