//! One routing decision end to end, host-independent: prompt → block
//! hashes (`hashed`) → index lookup + pool load → the depth a request is
//! priced and keyed at (`trunk`) → ranking (`score`) → destination header
//! value; then `commit` records the pick (in-flight work, index entries).

mod evicting;
mod hashed;
mod hot;
mod trunk;

use std::collections::HashSet;

use crate::config::{Baseline, Config};
use crate::discovery;
use crate::endpoint::{Endpoint, ReplicaId};
use crate::index::{Matches, PrefixIndex, RecordStats};
use crate::load::{self, LoadBoard, Start};
use crate::prefix::Checkpoint;
use crate::replicas::{HealthPolicy, Row, Table};
use crate::score::{self, Candidate, LoraFit, Reason, ScoreParams};
use crate::store::Store;

pub use hashed::Hashed;
use trunk::{agreed_below_lead, thin_lead, trunk_above};

pub struct Router {
    pub config: Config,
    /// The pool now: the static list, plus what discovery published.
    endpoints: Vec<Endpoint>,
    /// Discovered-only replicas wait for their first good scrape.
    discovered_only: Vec<bool>,
    discovery_token: Option<u32>,
    index: PrefixIndex,
    params: ScoreParams,
    stale_ms: u64,
}

/// What the router knows about a request besides its prefix.
#[derive(Debug, Default, Clone, Copy)]
pub struct Meta<'a> {
    /// The `model` field: may name a LoRA adapter.
    pub model: Option<&'a str>,
    /// The client marked it sheddable (priority header).
    pub sheddable: bool,
    /// The replica a verified affinity token names (see `affinity`).
    pub affinity: Option<ReplicaId>,
    /// The replica the stored response the request continues is named
    /// after (see `affinity::response`).
    pub stored: Option<ReplicaId>,
    /// Its response will be stored under the pick's name
    /// (`affinity.response_ids`).
    pub named: bool,
    /// The first turn of a conversation the model server will store, and
    /// every later turn will follow (`affinity.response_ids`): placed as
    /// a new session below its preamble (see `score::Ask::session_start`).
    pub session_start: bool,
}

/// A request the filter answers itself instead of routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub status: u32,
    pub kind: &'static str,
    pub message: String,
}

/// A routing decision: what the header write and `commit` need.
#[derive(Debug, Clone)]
pub struct Choice {
    /// Endpoint indices, best first; never empty while the pool isn't.
    pub order: Vec<usize>,
    pub reason: Reason,
    pub blocks: u32,
    /// Blocks the primary pick holds, and when it last stamped them.
    pub matched: u32,
    pub stamped: u32,
    /// Work this request adds to its replica (removed when it ends).
    pub work: u64,
    pub matches: Matches,
    /// The replica that took the session's earlier request, when this one
    /// places the session anew (`thin_lead`) or spills it (`respill`): the
    /// session counts as one placement, on whichever replica keeps it.
    pub home: Option<ReplicaId>,
    /// Replicas whose credit for this prefix was withheld because they
    /// evict more than they are credited with (`evicting`) or carry more
    /// than their share of the traffic (`hot`).
    pub withheld: u32,
    /// Eligible replicas judged to evict what they hold (`evicting`):
    /// their credit scaled down, no new prefixes for them.
    pub evicting: u32,
    /// Eligible replicas over their share of the pool's traffic, with
    /// several gateways and `traffic_balance` (`hot`).
    pub hot: u32,
    /// No replica passed its scrapes: every one was ranked, on this
    /// instance's own load and index alone (`Router::eligible_now`).
    pub blind: bool,
}

/// Who may take a request now (see `Router::eligible_now`).
struct Eligible {
    /// Endpoint indices.
    replicas: Vec<usize>,
    /// Every replica, because none passed its scrapes.
    blind: bool,
}

/// Why a decision went the way it did: built only on request
/// (`Router::decide_explained`), for the debug header (`Router::explain`)
/// and shadow mode's baseline (`Router::shadow`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Diagnostics {
    /// Every eligible replica's cost, best first.
    pub costs: Vec<Cost>,
    /// Every eligible replica's in-flight requests, in endpoint order: what
    /// a least-request baseline decides on.
    pub requests: Vec<InFlight>,
}

impl Diagnostics {
    fn of(eligible: &[usize], cands: &[Candidate], ranked: &score::Ranked) -> Diagnostics {
        Diagnostics {
            requests: eligible
                .iter()
                .zip(cands)
                .map(|(&endpoint, c)| InFlight {
                    endpoint,
                    requests: c.load.requests,
                })
                .collect(),
            costs: ranked
                .order
                .iter()
                .map(|&i| Cost {
                    endpoint: eligible[i],
                    cost: ranked.costs[i],
                })
                .collect(),
        }
    }
}

/// What `Router::correct` changed, for the stats (see `Choice`).
struct Corrected {
    withheld: u32,
    evicting: u32,
    hot: u32,
}

/// The depth a request is priced and keyed at (`Router::depth`).
struct Depth {
    /// Blocks above the request's own part.
    trunk: u32,
    /// The placement hash new content is placed by.
    key: u64,
    /// The replica a session placed anew came from (`Choice::home`).
    home: Option<ReplicaId>,
}

/// One replica's cost for a request, in blocks of work (see `score`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Endpoint index.
    pub endpoint: usize,
    pub cost: f64,
}

/// Requests in flight on one replica (all workers of this instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// Endpoint index.
    pub endpoint: usize,
    pub requests: u32,
}

/// A shadow decision: where the baseline routed, and what prefix-router
/// would have done.
#[derive(Debug, Clone)]
pub struct Shadow {
    /// The choice actually routed (the baseline's pick first).
    pub routed: Choice,
    /// prefix-router's own pick and its matched blocks.
    pub ours: usize,
    pub ours_matched: u32,
}

/// What committing a request counted as new content placed on its pick,
/// for spreading later new content (`load::Load::branches`): all the pick
/// didn't hold, a copy of a shared trunk included. That is a real
/// prefill, and each replica's first copy counts once; left out, only the
/// trunk's first holder was charged for it and it got a fraction of the
/// documents that followed. A session placed anew counts once: where it
/// stays, or where it moved to (and no longer at its `home`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    #[default]
    Nothing,
    /// New content (a document, a session's first turn).
    New,
    /// A session that moved off `from`, which stopped counting it.
    Moved { from: ReplicaId },
}

impl Placed {
    pub fn of(choice: &Choice, pick: ReplicaId) -> Placed {
        let new = matches!(choice.reason, Reason::NewPrefix | Reason::NewBranch)
            || (choice.reason == Reason::LoadSpill && choice.home.is_some());
        match choice.home {
            _ if !new => Placed::Nothing,
            None => Placed::New,
            Some(home) if home == pick => Placed::Nothing,
            Some(from) => Placed::Moved { from },
        }
    }

    /// It counts on the pick.
    pub fn counts(self) -> bool {
        self != Placed::Nothing
    }
}

/// A priority header value that marks a request as droppable under
/// saturation: `sheddable`/`low`/`batch`, or a negative number (the
/// Inference Extension's convention: below zero is sheddable).
pub fn is_sheddable(value: &str) -> bool {
    let v = value.trim();
    ["sheddable", "low", "batch"]
        .iter()
        .any(|s| v.eq_ignore_ascii_case(s))
        || v.parse::<i64>().is_ok_and(|n| n < 0)
}

fn lists(r: &Row, model: &str) -> bool {
    r.running_lora
        .iter()
        .chain(&r.waiting_lora)
        .any(|a| a == model)
}

fn lora_fit(row: Option<&Row>, adapter: &str) -> LoraFit {
    let Some(r) = row else {
        return LoraFit::MustEvict;
    };
    if r.running_lora.iter().any(|a| a == adapter) {
        LoraFit::Running
    } else if r.waiting_lora.iter().any(|a| a == adapter) {
        LoraFit::Waiting
    } else if (r.running_lora.len() as u32) < r.max_lora {
        LoraFit::CanLoad
    } else {
        LoraFit::MustEvict
    }
}

impl Router {
    pub fn new(config: Config) -> Router {
        let params = ScoreParams {
            weights: config.weights.clone(),
            load_measure: config.load_measure,
            request_cost_blocks: config.request_cost_blocks,
            bounded_load_factor: config.bounded_load_factor,
            bounded_load_slack: config.bounded_load_slack_blocks,
            trunk_min_new_blocks: config.trunk_min_new_blocks,
            gateways: config.gateways,
            clients_echo: config.affinity.as_ref().is_some_and(|a| a.clients_echo),
        };
        // A slot is dead after 10 missed heartbeats (and never sooner than
        // 2 s, so a stalled-but-alive worker isn't dropped on a hiccup).
        let stale_ms = (config.tick_ms * 10).max(2000);
        Router {
            endpoints: config.static_endpoints.clone(),
            discovered_only: vec![false; config.static_endpoints.len()],
            discovery_token: None,
            index: PrefixIndex::new(config.index_capacity),
            params,
            stale_ms,
            config,
        }
    }

    pub fn stale_ms(&self) -> u64 {
        self.stale_ms
    }

    pub fn endpoint(&self, i: usize) -> Option<&Endpoint> {
        self.endpoints.get(i)
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// Pick up a new discovered set if one was published since last time
    /// (one shared-data read; rebuilt only when its token changes).
    pub fn refresh<S: Store + ?Sized>(&mut self, store: &S) {
        if self.config.discovery.is_none() {
            return;
        }
        let Some((found, token)) = discovery::load(store) else {
            return;
        };
        if self.discovery_token == Some(token) {
            return;
        }
        self.discovery_token = Some(token);
        let mut eps = self.config.static_endpoints.clone();
        let mut only = vec![false; eps.len()];
        // A set, not a scan per host: a pool of 1,024 is 1,024 lookups.
        let mut seen: HashSet<ReplicaId> = eps.iter().map(Endpoint::id).collect();
        for e in found {
            if seen.insert(e.id()) {
                eps.push(e);
                only.push(true);
            }
        }
        self.endpoints = eps;
        self.discovered_only = only;
    }

    /// How many replicas are eligible now (for the operator's gauge).
    pub fn eligible_count<S: Store + ?Sized>(&self, store: &S, now_ms: u64) -> usize {
        let table = Table::load(store);
        let health = self.health();
        (0..self.endpoints.len())
            .filter(|&i| self.eligible(i, &table, &health, now_ms))
            .count()
    }

    /// Every replica is one known only from discovery that no scrape has
    /// answered yet (each start with `discovery`, for a scrape round):
    /// none is eligible, but nothing failed, so it is no news for the
    /// operator (the scraper's "no replica passed its metrics scrapes"
    /// warning, with no failure to name, came at every start).
    pub fn awaiting_first_scrapes<S: Store + ?Sized>(&self, store: &S) -> bool {
        let table = Table::load(store);
        self.config.scrape.is_some()
            && self
                .endpoints
                .iter()
                .zip(&self.discovered_only)
                .all(|(ep, &only)| only && table.row(ep.id()).is_none())
    }

    /// Eligible to receive traffic: healthy per the replica table; a
    /// replica known only from discovery also needs one good scrape first
    /// (when scraping is on), so a new pod isn't sent traffic blind.
    fn eligible(&self, i: usize, table: &Table, health: &HealthPolicy, now_ms: u64) -> bool {
        let Some(ep) = self.endpoints.get(i) else {
            return false;
        };
        let needs_scrape =
            self.config.scrape.is_some() && self.discovered_only.get(i).copied().unwrap_or(false);
        if needs_scrape {
            table
                .row(ep.id())
                .is_some_and(|r| r.healthy(health, now_ms))
        } else {
            table.eligible(ep.id(), health, now_ms)
        }
    }

    fn health(&self) -> HealthPolicy {
        HealthPolicy {
            staleness_ms: self.config.staleness_ms,
            unhealthy_after: self.config.unhealthy_after,
        }
    }

    /// Rank the eligible replicas for a request (`hashed` empty when there's
    /// no prompt), or answer it: 503 when the pool is empty, 429 when every
    /// eligible replica is saturated and the request is sheddable.
    pub fn decide<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
    ) -> Result<Choice, Reject> {
        self.decide_into(store, hashed, meta, now_ms, None)
    }

    /// `decide`, and why: every eligible replica's cost and in-flight
    /// requests (for the debug header and shadow mode only; the plain
    /// decision doesn't build them).
    pub fn decide_explained<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
    ) -> Result<(Choice, Diagnostics), Reject> {
        let mut diagnostics = Diagnostics::default();
        let choice = self.decide_into(store, hashed, meta, now_ms, Some(&mut diagnostics))?;
        Ok((choice, diagnostics))
    }

    /// The decision in its steps: who may take the request (or why none
    /// may), what each candidate holds and carries, the corrections for
    /// replicas that evict or run hot, the depth the request is priced and
    /// keyed at, and the ranking (`score`), where the pick is made.
    fn decide_into<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        meta: Meta,
        now_ms: u64,
        diagnostics: Option<&mut Diagnostics>,
    ) -> Result<Choice, Reject> {
        // Only the scraper writes the table: without scraping or discovery
        // it is empty, and the read can be skipped.
        let table = if self.config.scrape.is_some() || self.config.discovery.is_some() {
            Table::load(store)
        } else {
            Table::default()
        };
        let Eligible {
            replicas: eligible,
            blind,
        } = self.eligible_now(&table, now_ms)?;
        // Failed scrapes' rows hold stale or no load: ranked without them.
        let rows: Vec<Option<&Row>> = eligible
            .iter()
            .map(|&i| table.row(self.endpoints[i].id()).filter(|_| !blind))
            .collect();
        if meta.sheddable && self.saturated(&rows) {
            return Err(self.saturated_reject(eligible.len()));
        }
        let matches = if hashed.is_empty() {
            Matches::default()
        } else {
            self.index.lookup(store, &hashed.checkpoints)
        };
        let mut cands = self.candidates(store, &eligible, &rows, &matches, meta, now_ms);
        let corrected = self.correct(&mut cands, hashed);
        let depth = self.depth(store, hashed, &matches, &mut cands);
        let blocks = hashed.blocks();
        let ask = score::Ask {
            blocks,
            trunk: match meta.session_start {
                true => depth.trunk.max(hashed.lead_blocks.min(blocks)),
                false => depth.trunk,
            },
            lead: hashed.lead_floor(),
            // No prompt, no key: ties would go to the same replica on
            // every worker and instance (1,000 GETs in a row, all to one of
            // eight). The clock spreads them instead; and a stored session's
            // first turn, which no other request needs to agree with.
            placement: match hashed.is_empty() || meta.session_start {
                true => xxhash_rust::xxh3::xxh3_64(&now_ms.to_le_bytes()),
                false => depth.key,
            },
            later_turn: hashed.later_turn,
            session_start: meta.session_start,
            stored: match (meta.stored, meta.named) {
                (Some(home), _) => score::Stored::Continues(home),
                (None, true) => score::Stored::Named,
                (None, false) => score::Stored::No,
            },
        };
        let ranked = score::rank_below(&cands, &ask, &self.params);
        let held = ranked
            .order
            .first()
            .and_then(|&i| matches.blocks.get(&cands[i].id))
            .copied()
            .unwrap_or_default();
        if let Some(d) = diagnostics {
            *d = Diagnostics::of(&eligible, &cands, &ranked);
        }
        Ok(Choice {
            order: ranked.order.iter().map(|&i| eligible[i]).collect(),
            reason: ranked.reason,
            blocks,
            matched: held.blocks,
            stamped: held.stamped,
            work: self.params.work_of(blocks, held.blocks),
            matches,
            // A spill moves what its replica held (`score::spill::respill`).
            home: depth
                .home
                .or_else(|| ranked.spilled_from.and_then(|i| cands.get(i)).map(|c| c.id)),
            withheld: corrected.withheld,
            evicting: corrected.evicting,
            hot: corrected.hot,
            blind,
        })
    }

    /// The replicas that may take a request now (endpoint indices), and
    /// whether that is every replica because none passed its scrapes
    /// (`Eligible::blind`); the 503 when the pool is empty.
    ///
    /// Failing open, as Envoy's panic mode does: when every replica fails
    /// its scrapes at once, the cause is more often the scrape (a wrong
    /// `engine` or `metrics_path`, metrics turned off, the pool's
    /// connection limit reached under load, pages grown past
    /// `max_metrics_bytes`) than the whole pool, and a 503 for every
    /// request would make a metrics problem an outage. Envoy still fails
    /// what is really down.
    fn eligible_now(&self, table: &Table, now_ms: u64) -> Result<Eligible, Reject> {
        if self.endpoints.is_empty() {
            return Err(Reject {
                status: 503,
                kind: "no_replica",
                message: "no replica: the pool is empty".to_string(),
            });
        }
        let health = self.health();
        let healthy: Vec<usize> = (0..self.endpoints.len())
            .filter(|&i| self.eligible(i, table, &health, now_ms))
            .collect();
        Ok(match healthy.is_empty() {
            false => Eligible {
                replicas: healthy,
                blind: false,
            },
            true => Eligible {
                replicas: (0..self.endpoints.len()).collect(),
                blind: true,
            },
        })
    }

    fn saturated_reject(&self, eligible: usize) -> Reject {
        Reject {
            status: 429,
            kind: "saturated",
            message: format!(
                "all {eligible} eligible replicas are saturated (queue > {} or KV cache > {:.0}%); retry later",
                self.config.queue_threshold,
                self.config.kv_threshold * 100.0
            ),
        }
    }

    /// Each eligible replica as the ranking sees it: what it holds of this
    /// request, its in-flight work through this instance, its scraped row.
    fn candidates<S: Store + ?Sized>(
        &self,
        store: &S,
        eligible: &[usize],
        rows: &[Option<&Row>],
        matches: &Matches,
        meta: Meta,
        now_ms: u64,
    ) -> Vec<Candidate> {
        // The slot count is read every time (one host call): caching it
        // hid a just-started worker's slot, and its placements, from the
        // others for a tick.
        let loads = load::snapshot(store, now_ms, self.stale_ms);
        let adapter = meta
            .model
            .filter(|m| rows.iter().flatten().any(|r| lists(r, m)));
        eligible
            .iter()
            .zip(rows)
            .map(|(&i, row)| {
                let id = self.endpoints[i].id();
                Candidate {
                    id,
                    matched: matches.get(id),
                    load: loads.get(&id).copied().unwrap_or_default(),
                    waiting: row.map(|r| r.waiting).unwrap_or(0.0),
                    running: row.map(|r| r.running).unwrap_or(0.0),
                    kv_usage: row.map(|r| r.kv_usage).unwrap_or(0.0),
                    lora: adapter.map(|m| lora_fit(*row, m)).unwrap_or_default(),
                    affinity: meta.affinity == Some(id),
                    evicting: false,
                    trust: 1.0,
                    hit_rate: row.and_then(|r| r.cache.hit_rate()),
                    traffic: row.and_then(|r| r.cache.traffic()),
                }
            })
            .collect()
    }

    /// Credit the index gives that the replicas' own counters say they
    /// don't keep (`evicting`) or shouldn't take (`hot`).
    fn correct(&self, cands: &mut [Candidate], hashed: &Hashed) -> Corrected {
        let withheld = if self.config.hit_rate_feedback {
            evicting::withhold(cands, hashed) as u32
        } else {
            0
        };
        let shed = if self.config.traffic_balance && self.params.agree() {
            hot::shed(cands, hashed)
        } else {
            hot::Shed::default()
        };
        Corrected {
            withheld: withheld + shed.withheld,
            evicting: cands.iter().filter(|c| c.trust < 1.0).count() as u32,
            hot: shed.hot,
        }
    }

    /// Where the request's own part starts (`trunk`: what lies past it is
    /// new content, placed like a new prefix), the checkpoint its
    /// placement is keyed by, and a new session's first home. Adjusts
    /// `cands` on the way: credit below the trunk that only agreed homes
    /// keep (`agreed_below_lead`), and the home's count of recent sessions,
    /// which includes this one.
    fn depth<S: Store + ?Sized>(
        &self,
        store: &S,
        hashed: &Hashed,
        matches: &Matches,
        cands: &mut [Candidate],
    ) -> Depth {
        let blocks = hashed.blocks();
        let agree = self.params.agree();
        let agreed = if agree {
            agreed_below_lead(&self.index, store, hashed, cands, &self.params)
        } else {
            None
        };
        let held = cands.iter().map(|c| c.matched).max().unwrap_or(0);
        // New content below a shared trunk is placed like a new prefix.
        let forked = agreed.unwrap_or_else(|| {
            trunk_above(
                matches.branch,
                hashed,
                cands,
                self.params.trunk_min_new_blocks,
            )
        });
        // With instances that must agree, a lead may be just what this one
        // saw of a longer session: the index decides as for any prefix.
        let lead = (!agree)
            .then(|| thin_lead(cands, blocks, self.params.trunk_min_new_blocks))
            .flatten();
        // The home's count of recent sessions includes this one.
        let home = lead.and_then(|l| cands.get_mut(l.home)).map(|c| {
            c.load.branches = c.load.branches.saturating_sub(1);
            c.id
        });
        // A new session is keyed where every replica's holding ends, as an
        // instance that never saw its lead keys it.
        let floor = if agree { hashed.lead_floor() } else { 0 };
        Depth {
            trunk: lead.map_or(forked, |l| forked.max(l.top)),
            key: hashed.placement(lead.map_or(held, |l| l.shared).max(floor)),
            home,
        }
    }

    /// Shadow mode: route with the baseline instead, keeping our ranking for
    /// the fallbacks and the stats. `seq` is this VM's request counter (the
    /// round-robin position; per-VM round robin is what Envoy does too).
    pub fn shadow(&self, choice: Choice, why: &Diagnostics, seq: u64) -> Shadow {
        let ours = choice.order.first().copied().unwrap_or(0);
        let ours_matched = choice.matched;
        let requests = &why.requests;
        let pick = match self.config.shadow_baseline {
            Baseline::RoundRobin => {
                let n = requests.len().max(1) as u64;
                requests.get((seq % n) as usize).map(|r| r.endpoint)
            }
            Baseline::LeastRequest => {
                // Fewest in flight; ties rotate with `seq` like Envoy's.
                let min = requests.iter().map(|r| r.requests).min().unwrap_or(0);
                let ties: Vec<usize> = requests
                    .iter()
                    .filter(|r| r.requests == min)
                    .map(|r| r.endpoint)
                    .collect();
                ties.get((seq % ties.len().max(1) as u64) as usize).copied()
            }
        }
        .unwrap_or(ours);
        let mut order = vec![pick];
        order.extend(choice.order.iter().copied().filter(|&i| i != pick));
        let id = self.endpoints.get(pick).map(|e| e.id()).unwrap_or(0);
        let held = choice.matches.blocks.get(&id).copied().unwrap_or_default();
        let routed = Choice {
            order,
            matched: held.blocks,
            stamped: held.stamped,
            work: self.params.work_of(choice.blocks, held.blocks),
            ..choice
        };
        Shadow {
            routed,
            ours,
            ours_matched,
        }
    }

    /// Every eligible replica with fresh metrics is over a threshold (and
    /// at least one has metrics: without scraping nothing is "saturated").
    fn saturated(&self, rows: &[Option<&Row>]) -> bool {
        let over = |r: &Row| {
            r.waiting as f64 > self.config.queue_threshold
                || r.kv_usage as f64 > self.config.kv_threshold
        };
        rows.iter().all(|r| r.is_some_and(over)) && !rows.is_empty()
    }

    /// The destination header value: the pick, then up to `max_fallbacks`
    /// next-best replicas, comma-separated (override_host retries in order).
    pub fn header_value(&self, choice: &Choice) -> String {
        self.header_endpoints(choice)
            .map(Endpoint::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The replicas the destination header lists, in order.
    pub fn listed(&self, choice: &Choice) -> Vec<ReplicaId> {
        self.header_endpoints(choice).map(Endpoint::id).collect()
    }

    fn header_endpoints<'a>(&'a self, choice: &'a Choice) -> impl Iterator<Item = &'a Endpoint> {
        choice
            .order
            .iter()
            .take(1 + self.config.max_fallbacks)
            .filter_map(|&i| self.endpoint(i))
    }

    /// Record the pick: in-flight work now, index entries for its prefix,
    /// and what it counted as new content placed there.
    pub fn commit<S: Store + ?Sized>(
        &self,
        store: &S,
        board: &mut LoadBoard,
        choice: &Choice,
        hashed: &Hashed,
        now_ms: u64,
    ) -> (RecordStats, Placed) {
        let Some(ep) = choice.order.first().and_then(|&i| self.endpoint(i)) else {
            return (RecordStats::default(), Placed::Nothing);
        };
        let placed = Placed::of(choice, ep.id());
        if let Placed::Moved { from } = placed {
            board.withdraw_branch(from);
        }
        let started = Start {
            work: choice.work,
            blocks: choice.blocks,
            held: choice.matched,
            branch: placed.counts(),
        };
        board.start(store, ep.id(), started, now_ms);
        if hashed.is_empty() {
            return (RecordStats::default(), placed);
        }
        if let Some(b) = &choice.matches.branch {
            self.index.note_branch(store, &hashed.checkpoints, b);
        }
        let now_s = (now_ms / 1000) as u32;
        let rec = self.index.record(
            store,
            &hashed.checkpoints,
            ep.id(),
            choice.matched,
            choice.stamped,
            now_s,
        );
        (rec, placed)
    }

    /// A request committed to `from` was served by `to`: its prompt moves
    /// in the index (see `PrefixIndex::moved`). `from_held` is what `from`
    /// held before the commit (`Choice::matched`).
    pub fn served_elsewhere<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        from: ReplicaId,
        from_held: u32,
        to: ReplicaId,
        now_ms: u64,
    ) -> RecordStats {
        let now_s = (now_ms / 1000) as u32;
        self.index.moved(store, cps, from, from_held, to, now_s)
    }

    /// The leading blocks of a prompt (its checkpoints) the index credits
    /// `replica` with now.
    pub fn held<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        replica: ReplicaId,
    ) -> u32 {
        self.index.lookup(store, cps).get(replica)
    }

    /// A request committed to `replica` was refused there: its prompt
    /// leaves the index (see `PrefixIndex::uncredit`).
    pub fn uncredit<S: Store + ?Sized>(
        &self,
        store: &S,
        cps: &[Checkpoint],
        replica: ReplicaId,
        held: u32,
    ) -> RecordStats {
        self.index.uncredit(store, cps, replica, held)
    }

    /// A human-readable account of the decision, for the debug header.
    pub fn explain(&self, choice: &Choice, why: &Diagnostics) -> String {
        let pick = choice.order.first().and_then(|&i| self.endpoint(i));
        let costs: Vec<String> = why
            .costs
            .iter()
            .filter_map(|c| {
                let e = self.endpoint(c.endpoint)?;
                Some(format!(
                    "{}={:.1}/{}",
                    e.as_str(),
                    c.cost,
                    choice.matches.get(e.id())
                ))
            })
            .collect();
        format!(
            "replica={}; reason={}; matched={}/{}; cost/matched: {}",
            pick.map(Endpoint::as_str).unwrap_or("-"),
            choice.reason.as_str(),
            choice.matched,
            choice.blocks,
            costs.join(" ")
        )
    }
}

#[cfg(test)]
pub(crate) mod tests;
