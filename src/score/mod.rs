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
//!
//! The rules, one file each: `cost` (what a request costs on each replica,
//! and the order for near-ties), `pressure` (load, the load bound, and the
//! scraped pressure every instance reads alike), `spill` (where a load
//! spill goes), `gateways` (placement independent instances agree on:
//! rendezvous and two choices), `session` (where a stored session
//! starts), `stored` (where a stored response is looked for), `token`
//! (the replica an affinity token names). This file puts them together:
//! `rank_below`.

mod cost;
mod gateways;
mod pressure;
mod session;
mod spill;
mod stored;
#[cfg(test)]
mod tests;
mod token;

pub use gateways::{agreed_homes, rendezvous};

use crate::config::{LoadMeasure, Weights};
use crate::endpoint::ReplicaId;
use crate::load::Load;
use cost::{by_cost, costs};
use gateways::{rendezvous_order, two_choices};
use pressure::{open_to_new, pressure, within_bound};
use session::fewest_sessions;
use spill::respill;
use stored::looked_in;
use token::token_holder;

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
    /// Where the stored response the request continues is: the replica
    /// it is named after (see `affinity::response`), or, that one not
    /// eligible, its successors (`stored::looked_in`).
    Stored,
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
            Reason::Stored => "stored_response",
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
    /// The blocks above the request's own part that every gateway
    /// instance keys it past, whatever it has seen of them
    /// (`route::Hashed::lead_floor`; 0 without a preamble): with
    /// instances that must agree, its new content counts from there at
    /// most (see `rank_below`).
    pub lead: u32,
    pub placement: u64,
    /// A conversation's or agent session's later turn: a spill moves the
    /// whole session (the new replica holds its history deepest from now
    /// on), where a single question only copies its document.
    pub later_turn: bool,
    /// The first turn of a session whose later turns follow it by name (a
    /// stored Responses API response): they can go nowhere else, so where
    /// it lands binds the whole session, and no later request needs to
    /// find it by content. Placed as new content below its preamble, by
    /// this instance's load and placements, as with one gateway: a first
    /// question too short to count as new content stayed with the
    /// preamble's holders, and every session with it (six of six on one
    /// of four replicas, three instances).
    pub session_start: bool,
    /// Whether the model server stores the response (Responses API), and
    /// under whose name.
    pub stored: Stored,
}

/// A stored Responses API response, named after a replica (see
/// `affinity::response`): the request's fallbacks are that replica's
/// successors (`stored::looked_in`), on every instance alike.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Stored {
    /// Nothing stored, or nothing the filter names.
    #[default]
    No,
    /// Its response will be stored under the pick's name.
    Named,
    /// It continues a response named after this replica, which only that
    /// replica or one of its successors holds (and its own response, if
    /// stored, goes under the same name).
    Continues(ReplicaId),
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
    if p.agree() && !ask.session_start && matches!(reason, Reason::NewPrefix | Reason::NewBranch) {
        // Leaving the agreed replica costs another instance's copy of the
        // new content: worth it only for a bigger load difference. Its
        // preamble is no new content on any instance: one that had never
        // seen the preamble fork counted it in, one that had did not, and
        // with a queue on the first replica between the two margins they
        // put the same new session on different replicas for good.
        let new_blocks = f64::from(blocks.saturating_sub(trunk.max(ask.lead).min(blocks)));
        let margin = band.max(p.weights.prefix * new_blocks);
        let by_hash = rendezvous_order(cands, placement);
        let open = open_to_new(cands, &keeps);
        let pick = two_choices(&by_hash, &pressure(cands, &loads, p), &open, margin);
        if let Some(pick) = pick.or_else(|| order.first().copied()) {
            to_front(&mut order, pick);
        }
    }
    if ask.session_start && matches!(reason, Reason::NewPrefix | Reason::NewBranch) {
        if let Some(pick) = fewest_sessions(cands, &order, &keeps, ask, p) {
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
    match ask.stored {
        // Whatever its load: anywhere else the server answers that the
        // response doesn't exist. A home that isn't eligible leaves its
        // successors, where a create it failed went.
        Stored::Continues(home) => {
            order = looked_in(cands, home);
            reason = Reason::Stored;
        }
        Stored::Named => {
            if let Some(&pick) = order.first() {
                order = looked_in(cands, cands[pick].id);
            }
        }
        Stored::No => {}
    }
    Ranked {
        order,
        costs,
        reason,
        spilled_from,
    }
}

fn to_front(order: &mut Vec<usize>, i: usize) {
    order.retain(|&j| j != i);
    order.insert(0, i);
}

/// One request's constant in cost units: costs closer than this are ties.
fn band(p: &ScoreParams) -> f64 {
    p.request_cost_blocks.max(1) as f64 * p.weights.load.max(f64::EPSILON)
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
