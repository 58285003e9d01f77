//! Envoy stats emitted by the filter. Metrics with the same name are one
//! stat across all VMs of the process, so counters and gauge increments
//! from every worker add up (that's what makes the in-flight gauge exact).

use std::collections::{HashMap, HashSet};

pub use proxy_wasm::types::MetricType;

use crate::endpoint::{Endpoint, ReplicaId};
use crate::load::Load;
use crate::score::Reason;

/// The host's stats: the proxy-wasm metric calls (`host::Envoy`), or a
/// fake in tests. Statuses are the host's, for logging.
pub trait Metrics {
    fn define_metric(&self, kind: MetricType, name: &str) -> Result<u32, u32>;
    fn increment_metric(&self, id: u32, by: i64) -> Result<(), u32>;
    fn record_metric(&self, id: u32, value: u64) -> Result<(), u32>;
}

/// A metric id, or nothing if the host refused to define it (then every
/// update is a no-op: stats must never take the request path down).
#[derive(Debug, Clone, Copy, Default)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn define<M: Metrics + ?Sized>(m: &M, kind: MetricType, name: &str) -> Metric {
        match m.define_metric(kind, name) {
            Ok(id) => Metric(Some(id)),
            Err(status) => {
                log::warn!("prefix-router: could not define stat {name}: status {status}");
                Metric(None)
            }
        }
    }

    pub fn add<M: Metrics + ?Sized>(self, m: &M, by: i64) {
        if let Some(id) = self.0 {
            let _ = m.increment_metric(id, by);
        }
    }

    pub fn inc<M: Metrics + ?Sized>(self, m: &M) {
        self.add(m, 1);
    }

    pub fn record<M: Metrics + ?Sized>(self, m: &M, value: u64) {
        if let Some(id) = self.0 {
            let _ = m.record_metric(id, value);
        }
    }
}

pub struct ReplicaStats {
    pub routed: Metric,
    pub inflight: Metric,
    /// What this VM last recorded into `inflight` (host calls only on
    /// change).
    pub inflight_shown: Option<u64>,
    /// The share of what this instance sent the replica lately that the
    /// index credited it with, in percent: what its `cache_hit_percent`
    /// should read (see `route::evicting`).
    pub expected: Metric,
    pub expected_shown: Option<u64>,
}

impl ReplicaStats {
    fn define<M: Metrics + ?Sized>(m: &M, e: &Endpoint) -> ReplicaStats {
        let label = e.stat_label();
        let define = |kind, n: &str| Metric::define(m, kind, &format!("{P}.replica.{label}.{n}"));
        ReplicaStats {
            routed: define(MetricType::Counter, "routed"),
            inflight: define(MetricType::Gauge, "inflight"),
            inflight_shown: None,
            expected: define(MetricType::Gauge, "cache_expected_percent"),
            expected_shown: None,
        }
    }
}

/// What the scraper VM shows per replica: its scrapes, and the load its
/// last good page reported.
pub struct ScrapeGauges {
    pub ok: Metric,
    pub failed: Metric,
    pub waiting: Metric,
    pub running: Metric,
    pub kv_percent: Metric,
    pub hit_percent: Metric,
    pub traffic_share: Metric,
}

impl ScrapeGauges {
    pub fn define<M: Metrics + ?Sized>(m: &M, e: &Endpoint) -> ScrapeGauges {
        let label = e.stat_label();
        let define = |kind, n: &str| Metric::define(m, kind, &format!("{P}.replica.{label}.{n}"));
        ScrapeGauges {
            ok: define(MetricType::Counter, "scrapes_ok"),
            failed: define(MetricType::Counter, "scrapes_failed"),
            waiting: define(MetricType::Gauge, "waiting"),
            running: define(MetricType::Gauge, "running"),
            kv_percent: define(MetricType::Gauge, "kv_usage_percent"),
            hit_percent: define(MetricType::Gauge, "cache_hit_percent"),
            traffic_share: define(MetricType::Gauge, "traffic_share_percent"),
        }
    }

    /// A replica that left the pool shows no load.
    pub fn zero<M: Metrics + ?Sized>(&self, m: &M) {
        for g in [
            self.waiting,
            self.running,
            self.kv_percent,
            self.hit_percent,
            self.traffic_share,
        ] {
            g.record(m, 0);
        }
    }
}

/// The scraper VM's own stats: the pool it sees, and its handovers.
pub struct ScraperStats {
    pub eligible: Metric,
    pub takeovers: Metric,
    pub discovered: Metric,
    pub discovery_failures: Metric,
}

impl ScraperStats {
    pub fn define<M: Metrics + ?Sized>(m: &M) -> ScraperStats {
        let g = |n: &str| Metric::define(m, MetricType::Gauge, &format!("{P}.{n}"));
        let c = |n: &str| Metric::define(m, MetricType::Counter, &format!("{P}.{n}"));
        ScraperStats {
            eligible: g("eligible_replicas"),
            takeovers: c("scrape.lease_takeovers"),
            discovered: g("discovery.hosts"),
            discovery_failures: c("discovery.failures"),
        }
    }
}

pub struct Stats {
    pub requests: Metric,
    pub prefix_hit: Metric,
    pub load_spill: Metric,
    pub new_prefix: Metric,
    pub new_branch: Metric,
    pub credit_withheld: Metric,
    pub replica_evicting: Metric,
    pub replica_hot: Metric,
    pub affinity: Metric,
    pub affinity_rejected: Metric,
    /// Follow-ups of a stored response sent to the replica holding it.
    pub stored_response: Metric,
    /// Stored responses named after their replica (`affinity.response_ids`).
    pub responses_named: Metric,
    /// Follow-ups whose response id no instance minted (another key, the
    /// server's own, forged) or whose replica is gone or ineligible.
    pub responses_unknown: Metric,
    /// Named responses Envoy served (and so stored) on another replica
    /// than the one their name gives.
    pub responses_misplaced: Metric,
    pub no_prompt: Metric,
    pub parse_errors: Metric,
    pub body_too_large: Metric,
    pub client_destination_stripped: Metric,
    pub header_write_errors: Metric,
    pub request_blocks: Metric,
    pub matched_blocks: Metric,
    pub matched_blocks_total: Metric,
    pub request_blocks_total: Metric,
    pub index_entries: Metric,
    pub index_evictions: Metric,
    pub index_cas_retries: Metric,
    pub index_write_failures: Metric,
    /// Routed requests with a prompt answered with a refusal
    /// (`filter::ran_nothing`): the index no longer credits their pick
    /// with it.
    pub index_uncredited: Metric,
    pub shed_429: Metric,
    pub shadow_requests: Metric,
    pub shadow_matched: Metric,
    pub shadow_baseline_matched: Metric,
    pub shadow_agree: Metric,
    pub shadow_would_shed: Metric,
    pub unavailable_503: Metric,
    /// Requests Envoy served on another replica than the pick (a retry,
    /// the header's next address, the fallback policy).
    pub served_elsewhere: Metric,
    /// Requests ranked over every replica because none passed its scrapes.
    pub routed_blind: Metric,
    pub replicas: HashMap<ReplicaId, ReplicaStats>,
}

/// The prefix of every stat name.
pub const P: &str = "prefix_router";

impl Stats {
    pub fn define<M: Metrics + ?Sized>(m: &M, endpoints: &[Endpoint]) -> Stats {
        use MetricType::{Counter, Gauge, Histogram};
        let c = |n: &str| Metric::define(m, Counter, &format!("{P}.{n}"));
        let replicas = endpoints
            .iter()
            .map(|e| (e.id(), ReplicaStats::define(m, e)))
            .collect();
        Stats {
            requests: c("requests_total"),
            prefix_hit: c("decision.prefix_hit"),
            load_spill: c("decision.load_spill"),
            new_prefix: c("decision.new_prefix"),
            new_branch: c("decision.new_branch"),
            credit_withheld: c("decision.credit_withheld"),
            replica_evicting: c("decision.replica_evicting"),
            replica_hot: c("decision.replica_hot"),
            affinity: c("decision.affinity"),
            affinity_rejected: c("affinity.rejected"),
            stored_response: c("decision.stored_response"),
            responses_named: c("responses.named"),
            responses_unknown: c("responses.unknown"),
            responses_misplaced: c("responses.misplaced"),
            no_prompt: c("decision.no_prompt"),
            parse_errors: c("parse_errors"),
            body_too_large: c("body_too_large"),
            client_destination_stripped: c("client_destination_stripped"),
            header_write_errors: c("header_write_errors"),
            request_blocks: Metric::define(m, Histogram, &format!("{P}.request_blocks")),
            matched_blocks: Metric::define(m, Histogram, &format!("{P}.matched_blocks")),
            request_blocks_total: c("request_blocks_total"),
            matched_blocks_total: c("matched_blocks_total"),
            index_entries: Metric::define(m, Gauge, &format!("{P}.index.entries")),
            index_evictions: c("index.evictions"),
            index_cas_retries: c("index.cas_retries"),
            index_write_failures: c("index.write_failures"),
            index_uncredited: c("index.uncredited"),
            shed_429: c("shed_429"),
            shadow_requests: c("shadow.requests"),
            shadow_matched: c("shadow.matched_blocks_total"),
            shadow_baseline_matched: c("shadow.baseline_matched_blocks_total"),
            shadow_agree: c("shadow.agree"),
            shadow_would_shed: c("shadow.would_shed"),
            unavailable_503: c("unavailable_503"),
            served_elsewhere: c("served_elsewhere"),
            routed_blind: c("routed_blind"),
            replicas,
        }
    }

    pub fn decision(&self, reason: Reason) -> Metric {
        match reason {
            Reason::PrefixHit => self.prefix_hit,
            Reason::LoadSpill => self.load_spill,
            Reason::NewPrefix => self.new_prefix,
            Reason::NewBranch => self.new_branch,
            Reason::Affinity => self.affinity,
            Reason::Stored => self.stored_response,
            Reason::NoPrompt => self.no_prompt,
        }
    }

    pub fn replica(&self, id: ReplicaId) -> Option<&ReplicaStats> {
        self.replicas.get(&id)
    }

    /// Set the in-flight and expected-hit gauges from the pool's live load
    /// slots. A gauge bumped per request by each VM would keep a dead VM's
    /// requests forever; the slots of a dead VM expire, and so do its
    /// counts here.
    pub fn show_load<M: Metrics + ?Sized>(
        &mut self,
        m: &M,
        endpoints: &[Endpoint],
        load: &HashMap<ReplicaId, Load>,
    ) {
        for e in endpoints {
            let r = self.ensure_replica(m, e);
            let now = load.get(&e.id()).map_or(0, |l| u64::from(l.requests));
            if r.inflight_shown != Some(now) {
                r.inflight.record(m, now);
                r.inflight_shown = Some(now);
            }
            // Not measured (too few hits expected lately, or no live
            // slot): 0, as documented. Left alone, the last rate stayed on
            // the dashboards as if measured, through a quiet night.
            let expected = load
                .get(&e.id())
                .and_then(Load::expected_hit_rate)
                .map_or(0, |rate| (rate * 100.0).round() as u64);
            if r.expected_shown != Some(expected) {
                r.expected.record(m, expected);
                r.expected_shown = Some(expected);
            }
        }
        self.forget_departed(m, endpoints);
    }

    /// Replicas that left the pool: their gauges go to 0 (Envoy can't
    /// delete a stat, and a gone replica's last in-flight count would
    /// stay on the dashboards), and this VM forgets them, so its map is
    /// as large as the pool, not as every address it has seen (pods come
    /// and go with each rollout and scale-up). Defined again if they
    /// return: the same name is the same Envoy stat.
    fn forget_departed<M: Metrics + ?Sized>(&mut self, m: &M, endpoints: &[Endpoint]) {
        if self.replicas.len() <= endpoints.len() {
            return;
        }
        let current: HashSet<ReplicaId> = endpoints.iter().map(Endpoint::id).collect();
        self.replicas.retain(|id, r| {
            let stays = current.contains(id);
            if !stays {
                r.inflight.record(m, 0);
                r.expected.record(m, 0);
            }
            stays
        });
    }

    /// Per-replica stats, defined on first use for discovered replicas.
    pub fn ensure_replica<M: Metrics + ?Sized>(
        &mut self,
        m: &M,
        e: &Endpoint,
    ) -> &mut ReplicaStats {
        self.replicas
            .entry(e.id())
            .or_insert_with(|| ReplicaStats::define(m, e))
    }
}
