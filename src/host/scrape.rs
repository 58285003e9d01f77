//! Timer-driven work of the one VM holding the scraper lease: GET every
//! replica's metrics page through the pool cluster with the destination
//! header set (so Envoy reaches the right replica without a cluster each),
//! and, with discovery on, read the pool's hosts from Envoy's admin.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use super::abi;
use super::envoy::Envoy;
use super::shared::SharedData;
use crate::config::{Discovery, Scrape};
use crate::discovery;
use crate::endpoint::{Endpoint, ReplicaId};
use crate::filter::stats::{ScrapeGauges, ScraperStats};
use crate::headers;
use crate::metrics;
use crate::replicas::{self, Lease, Table};
use crate::route::Router;
use crate::scrape::{self as callout, CalloutError};
use crate::store::Scoped;

/// Largest admin `/clusters` answer read (a pool of 1,024 hosts with stats
/// is well under this).
const MAX_ADMIN_BYTES: usize = 8 << 20;

enum Call {
    Metrics(Endpoint),
    Discovery,
}

pub struct Scraper {
    owner: u64,
    /// This configuration's `replicas::config_generation`.
    generation: u64,
    scope: Rc<str>,
    next_ms: u64,
    /// Half the timer's period: a tick that early still runs its round.
    slack_ms: u64,
    next_discovery_ms: u64,
    next_scrape_ms: u64,
    /// Call token → what it fetches; one call per replica at a time, so a
    /// slow page never piles up calls.
    pending: HashMap<u32, Call>,
    /// Replicas with a metrics call in `pending`, and when it was sent (an
    /// index of it, so a tick is O(replicas), not O(replicas x pending)).
    busy: HashMap<ReplicaId, u64>,
    gauges: HashMap<ReplicaId, ScrapeGauges>,
    /// The replica table as this VM (the only writer while it holds the
    /// lease) knows it: responses update it in O(log n), and it is
    /// published whole once a round of scrapes is in (or on the next
    /// tick), not once per response.
    table: Table,
    /// Loaded from shared data since the lease was taken.
    table_loaded: bool,
    dirty: bool,
    stats: ScraperStats,
    /// The last failed scrape's replica and cause, for that warning.
    last_failure: Option<String>,
}

impl Scraper {
    /// `generation`: the configuration's (`replicas::config_generation`);
    /// `tick_ms`: the VM's timer period; `scope`: the pool's shared-data
    /// scope (`Config::scope`).
    pub fn new(owner: u64, generation: u64, tick_ms: u64, scope: Rc<str>) -> Scraper {
        Scraper {
            owner,
            generation,
            scope,
            next_ms: 0,
            slack_ms: tick_ms / 2,
            next_discovery_ms: 0,
            next_scrape_ms: 0,
            pending: HashMap::new(),
            busy: HashMap::new(),
            gauges: HashMap::new(),
            table: Table::default(),
            table_loaded: false,
            dirty: false,
            stats: ScraperStats::define(&Envoy),
            last_failure: None,
        }
    }

    fn shared(&self) -> Scoped<'_, SharedData> {
        Scoped::new(&SharedData, &self.scope)
    }

    fn gauges(&mut self, ep: &Endpoint) -> &ScrapeGauges {
        self.gauges
            .entry(ep.id())
            .or_insert_with(|| ScrapeGauges::define(&Envoy, ep))
    }

    /// A round runs at the shorter of the two intervals; each job in it
    /// keeps its own (discovery ran only with the scrapes, so with
    /// `scrape_interval_ms` above `discovery.interval_ms` pods came and
    /// went that much later than configured).
    pub fn tick(&mut self, router: &Router, now_ms: u64) {
        let cfg = &router.config;
        let interval = match (&cfg.scrape, &cfg.discovery) {
            (Some(s), Some(d)) => s.interval_ms.min(d.interval_ms),
            (Some(s), None) => s.interval_ms,
            (None, Some(d)) => d.interval_ms,
            (None, None) => return,
        };
        let Some(next) = replicas::next_round(now_ms, self.next_ms, interval, self.slack_ms) else {
            return;
        };
        self.next_ms = next;
        if !self.hold_lease(now_ms, interval) {
            return;
        }
        self.publish(router);
        if let Some(d) = &cfg.discovery {
            self.discover(d, now_ms);
        }
        let Some(scrape) = &cfg.scrape else { return };
        let due = replicas::next_round(
            now_ms,
            self.next_scrape_ms,
            scrape.interval_ms,
            self.slack_ms,
        );
        let Some(next) = due else { return };
        self.next_scrape_ms = next;
        self.publish_eligible(router, now_ms);
        for ep in router.endpoints() {
            self.scrape(ep, scrape, &cfg.destination_header, now_ms);
        }
    }

    /// Whether this VM is the one that scrapes (and writes the table)
    /// this round; a takeover is counted and logged, and the table read
    /// from shared data when this VM's copy is stale. The lease outlives
    /// two missed renewals, so a new scraper takes over within three
    /// intervals of the old one stopping.
    fn hold_lease(&mut self, now_ms: u64, interval: u64) -> bool {
        let (owner, generation) = (self.owner, self.generation);
        match replicas::acquire_lease(&self.shared(), owner, generation, now_ms, 2 * interval) {
            Lease::Other => {
                // Someone else writes the table now: ours goes stale.
                self.table_loaded = false;
                self.dirty = false;
                return false;
            }
            Lease::TookOver => {
                self.stats.takeovers.inc(&Envoy);
                log::info!("prefix-router: this VM took over metrics scraping");
                // Ours may be from before another VM's turn (a VM that
                // stalled past its lease never saw `Other`): the shared
                // one is newer.
                self.table_loaded = false;
            }
            Lease::Held => {}
        }
        if !self.table_loaded {
            self.table = Table::load(&self.shared());
            self.table_loaded = true;
        }
        true
    }

    /// Ask Envoy's admin for the pool, when due and not already asked.
    fn discover(&mut self, d: &Discovery, now_ms: u64) {
        if self.pending.values().any(|c| matches!(c, Call::Discovery)) {
            return;
        }
        let due =
            replicas::next_round(now_ms, self.next_discovery_ms, d.interval_ms, self.slack_ms);
        let Some(next) = due else { return };
        self.next_discovery_ms = next;
        let asked = self.dispatch(
            &d.admin_cluster,
            &discovery::admin_path(&d.cluster),
            "admin",
            None,
            Call::Discovery,
            5000,
        );
        if !asked {
            // A misspelt `admin_cluster`: no call, so no answer would count it.
            self.stats.discovery_failures.inc(&Envoy);
            log::warn!(
                "prefix-router: discovery: Envoy refused the call to `{}` (is it a cluster?)",
                d.admin_cluster
            );
        }
    }

    /// Ask one replica for its metrics page.
    fn scrape(&mut self, ep: &Endpoint, scrape: &Scrape, destination_header: &str, now_ms: u64) {
        if let Some(&sent) = self.busy.get(&ep.id()) {
            // Still no answer after half the timeout: count a failure at
            // each scrape round from then on (a page that stalls after its
            // headers would otherwise keep the replica eligible until the
            // timeout ends it, three times over). Not sooner: counted from the
            // first tick, a page that took over `unhealthy_after`
            // intervals (300 ms by default) made its replica ineligible
            // until each late answer reset the count, 12% of the time at
            // 350 ms and 42% at 550 ms, busy replicas answering slowest.
            if now_ms.saturating_sub(sent) >= scrape.timeout_ms / 2 {
                self.last_failure = Some(format!(
                    "{ep}: no answer within {} ms",
                    scrape.timeout_ms / 2
                ));
                self.record(ep, Err(()), now_ms);
            }
            return;
        }
        let dest = Some((destination_header, ep.as_str()));
        if self.dispatch(
            &scrape.cluster,
            &scrape.path,
            ep.as_str(),
            dest,
            Call::Metrics(ep.clone()),
            scrape.timeout_ms,
        ) {
            self.busy.insert(ep.id(), now_ms);
        } else {
            self.last_failure = Some(format!(
                "{ep}: Envoy refused the call to `{}` (is it a cluster?)",
                scrape.cluster
            ));
            self.record(ep, Err(()), now_ms);
        }
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        path: &str,
        authority: &str,
        dest: Option<(&str, &str)>,
        call: Call,
        timeout_ms: u64,
    ) -> bool {
        let mut headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", authority),
        ];
        headers.extend(dest);
        // ok: the one SDK hostcall left outside abi.rs: the SDK must register
        // the callout token for its dispatcher, and it panics only on statuses
        // Envoy's proxy_http_call never returns (it answers Ok, BadArgument or
        // InternalFailure, all handled here).
        match hostcalls::dispatch_http_call(
            cluster,
            headers,
            None,
            vec![],
            Duration::from_millis(timeout_ms),
        ) {
            Ok(token) => {
                self.pending.insert(token, call);
                true
            }
            Err(status) => {
                log::debug!("prefix-router: GET {path} via {cluster} not dispatched: {status:?}");
                false
            }
        }
    }

    /// Every way a callout can end lands here, and none of them traps:
    /// headers and body are read through the panic-free ABI, and a missing
    /// status (reset mid-body, timeout, connect error), a non-200, an
    /// oversize or unreadable answer is a failed scrape, counted.
    pub fn on_response(&mut self, router: &Router, token: u32, body_size: usize, now_ms: u64) {
        let Some(call) = self.pending.remove(&token) else {
            return;
        };
        if let Call::Metrics(e) = &call {
            self.busy.remove(&e.id());
        }
        let response = abi::get_headers(MapType::HttpCallResponseHeaders);
        let status = headers::get(&response, ":status");
        let read = |limit: usize| -> Result<Vec<u8>, CalloutError> {
            callout::check(status, body_size, limit)?;
            abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok_or(CalloutError::Unreadable)
        };
        match (call, &router.config.discovery, &router.config.scrape) {
            (Call::Discovery, Some(d), _) => self.on_discovery(d, read(MAX_ADMIN_BYTES)),
            (Call::Metrics(ep), _, Some(scrape)) => {
                let page = read(scrape.max_bytes);
                self.on_metrics(router, &ep, scrape, page, now_ms);
            }
            // The config has no such calls (a VM's config is fixed).
            _ => {}
        }
    }

    fn on_discovery(&mut self, d: &Discovery, page: Result<Vec<u8>, CalloutError>) {
        let found = page
            .map_err(|e| e.to_string())
            .and_then(|b| discovery::parse_clusters(&b, &d.cluster).map_err(|e| e.to_string()));
        match found {
            Ok(eps) => {
                self.stats.discovered.record(&Envoy, eps.len() as u64);
                discovery::publish(&self.shared(), &eps);
            }
            Err(why) => {
                self.stats.discovery_failures.inc(&Envoy);
                log::warn!(
                    "prefix-router: discovery from `{}` failed: {why}",
                    d.admin_cluster
                );
            }
        }
    }

    fn on_metrics(
        &mut self,
        router: &Router,
        ep: &Endpoint,
        scrape: &Scrape,
        page: Result<Vec<u8>, CalloutError>,
        now_ms: u64,
    ) {
        let parsed = page.map_err(|e| e.to_string()).and_then(|b| {
            metrics::parse(scrape.engine, &b, scrape.max_bytes).map_err(|e| e.to_string())
        });
        match parsed {
            Ok(m) => self.record(ep, Ok(&m), now_ms),
            Err(why) => {
                log::debug!("prefix-router: scrape of {ep} failed: {why}");
                self.last_failure = Some(format!("{ep}: {why}"));
                self.record(ep, Err(()), now_ms);
            }
        }
        if !self.busy.is_empty() {
            return;
        }
        // The round is in: publish now rather than a tick later, unless
        // another VM took the lease while our timer ran late. These answers
        // are then a round behind its table, and could re-admit a replica it
        // has seen fail. (The tick publishes right after renewing the lease.)
        if replicas::holds_lease(&self.shared(), self.owner) {
            self.publish(router);
        } else {
            self.table_loaded = false;
            self.dirty = false;
        }
    }

    fn record(
        &mut self,
        ep: &Endpoint,
        outcome: Result<&metrics::ReplicaMetrics, ()>,
        now_ms: u64,
    ) {
        if !self.table_loaded {
            return;
        }
        self.table.record(ep.id(), outcome, now_ms);
        self.dirty = true;
        let g = self.gauges(ep);
        match outcome {
            Ok(_) => g.ok.inc(&Envoy),
            Err(()) => g.failed.inc(&Envoy),
        }
    }

    /// Write the table if it changed: rows of replicas that left the pool
    /// dropped (O(replicas) once per round, not per response).
    fn publish(&mut self, router: &Router) {
        if !self.dirty {
            return;
        }
        let known: HashSet<ReplicaId> = router.endpoints().iter().map(|e| e.id()).collect();
        self.table.retain(&known);
        // As `Stats::forget_departed`: 0, and forgotten.
        self.gauges.retain(|id, g| {
            let stays = known.contains(id);
            if !stays {
                g.zero(&Envoy);
            }
            stays
        });
        let scope = Rc::clone(&self.scope);
        match self.table.publish(&Scoped::new(&SharedData, &scope)) {
            Ok(()) => self.dirty = false,
            Err(e) => {
                log::debug!("prefix-router: replica table not written: {e}");
                return;
            }
        }
        self.show_rows();
    }

    /// The published rows' sanitised values, not the pages': the gauges
    /// never show what the router doesn't believe, nor show it before a
    /// decision can read it. Shares once a round, since every share
    /// depends on every row (`route::hot` compares them with its line).
    fn show_rows(&self) {
        let rows = self.table.rows();
        let traffic: Vec<Option<f32>> = rows.iter().map(|r| r.cache.traffic()).collect();
        let shares = replicas::traffic_shares(&traffic);
        for (i, row) in rows.iter().enumerate() {
            let Some(g) = self.gauges.get(&row.id) else {
                continue;
            };
            g.waiting.record(&Envoy, row.waiting as u64);
            g.running.record(&Envoy, row.running as u64);
            g.kv_percent
                .record(&Envoy, (row.kv_usage * 100.0).round() as u64);
            // Not measured (too few lookups lately, counters gone from
            // the page): 0, as documented, not the last value, which
            // stayed on the dashboards as if measured.
            let hit = row
                .cache
                .hit_rate()
                .map_or(0, |r| (r * 100.0).round() as u64);
            g.hit_percent.record(&Envoy, hit);
            let share = shares
                .as_ref()
                .and_then(|s| s.get(i))
                .map_or(0, |s| (s * 100.0).round() as u64);
            g.traffic_share.record(&Envoy, share);
        }
    }

    /// The eligible count, and a warning when none is left (the router
    /// then ranks every replica blind) or one is back: once each way for
    /// the process (`replicas::blind_news`), with the last failure's
    /// cause, not once per failed scrape.
    fn publish_eligible(&mut self, router: &Router, now_ms: u64) {
        let n = router.eligible_count(&self.shared(), now_ms);
        self.stats.eligible.record(&Envoy, n as u64);
        let blind = n == 0
            && !router.endpoints().is_empty()
            && !router.awaiting_first_scrapes(&self.shared());
        let news = replicas::blind_news(&self.shared(), blind);
        if news == Some(true) {
            let path = router
                .config
                .scrape
                .as_ref()
                .map_or("", |s| s.path.as_str());
            log::warn!(
                "prefix-router: no replica passed its metrics scrapes (`{path}`, last failure: {}); \
                 routing over all {} replicas on load and the prefix index until one does",
                self.last_failure.as_deref().unwrap_or("none yet"),
                router.endpoints().len()
            );
        } else if news == Some(false) {
            log::warn!("prefix-router: {n} replicas pass their metrics scrapes again");
        }
    }
}
