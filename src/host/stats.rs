//! Envoy stats emitted by the filter. Metrics with the same name are one
//! stat across all VMs of the process, so counters and gauge increments
//! from every worker add up (that's what makes the in-flight gauge exact).

use std::collections::HashMap;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::endpoint::{Endpoint, ReplicaId};
use crate::load::Load;
use crate::score::Reason;

/// A metric id, or nothing if the host refused to define it (then every
/// update is a no-op: stats must never take the request path down).
#[derive(Clone, Copy, Default)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn define(kind: MetricType, name: &str) -> Metric {
        match abi::define_metric(kind, name) {
            Ok(id) => Metric(Some(id)),
            Err(status) => {
                log::warn!("prefix-router: could not define stat {name}: status {status}");
                Metric(None)
            }
        }
    }

    pub fn add(self, by: i64) {
        if let Some(id) = self.0 {
            let _ = abi::increment_metric(id, by);
        }
    }

    pub fn inc(self) {
        self.add(1);
    }

    pub fn record(self, value: u64) {
        if let Some(id) = self.0 {
            let _ = abi::record_metric(id, value);
        }
    }
}

pub struct ReplicaStats {
    pub routed: Metric,
    pub inflight: Metric,
    /// What this VM last recorded into `inflight` (host calls only on
    /// change).
    pub inflight_shown: Option<u64>,
}

impl ReplicaStats {
    fn define(e: &Endpoint) -> ReplicaStats {
        let label = e.stat_label();
        ReplicaStats {
            routed: Metric::define(MetricType::Counter, &format!("{P}.replica.{label}.routed")),
            inflight: Metric::define(MetricType::Gauge, &format!("{P}.replica.{label}.inflight")),
            inflight_shown: None,
        }
    }
}

pub struct Stats {
    pub requests: Metric,
    pub prefix_hit: Metric,
    pub load_spill: Metric,
    pub new_prefix: Metric,
    pub new_branch: Metric,
    pub affinity: Metric,
    pub affinity_rejected: Metric,
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
    pub shed_429: Metric,
    pub shadow_requests: Metric,
    pub shadow_matched: Metric,
    pub shadow_baseline_matched: Metric,
    pub shadow_agree: Metric,
    pub unavailable_503: Metric,
    pub replicas: HashMap<ReplicaId, ReplicaStats>,
}

const P: &str = "prefix_router";

impl Stats {
    pub fn define(endpoints: &[Endpoint]) -> Stats {
        use MetricType::{Counter, Gauge, Histogram};
        let c = |n: &str| Metric::define(Counter, &format!("{P}.{n}"));
        let replicas = endpoints
            .iter()
            .map(|e| (e.id(), ReplicaStats::define(e)))
            .collect();
        Stats {
            requests: c("requests_total"),
            prefix_hit: c("decision.prefix_hit"),
            load_spill: c("decision.load_spill"),
            new_prefix: c("decision.new_prefix"),
            new_branch: c("decision.new_branch"),
            affinity: c("decision.affinity"),
            affinity_rejected: c("affinity.rejected"),
            no_prompt: c("decision.no_prompt"),
            parse_errors: c("parse_errors"),
            body_too_large: c("body_too_large"),
            client_destination_stripped: c("client_destination_stripped"),
            header_write_errors: c("header_write_errors"),
            request_blocks: Metric::define(Histogram, &format!("{P}.request_blocks")),
            matched_blocks: Metric::define(Histogram, &format!("{P}.matched_blocks")),
            request_blocks_total: c("request_blocks_total"),
            matched_blocks_total: c("matched_blocks_total"),
            index_entries: Metric::define(Gauge, &format!("{P}.index.entries")),
            index_evictions: c("index.evictions"),
            index_cas_retries: c("index.cas_retries"),
            index_write_failures: c("index.write_failures"),
            shed_429: c("shed_429"),
            shadow_requests: c("shadow.requests"),
            shadow_matched: c("shadow.matched_blocks_total"),
            shadow_baseline_matched: c("shadow.baseline_matched_blocks_total"),
            shadow_agree: c("shadow.agree"),
            unavailable_503: c("unavailable_503"),
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
            Reason::NoPrompt => self.no_prompt,
        }
    }

    pub fn replica(&self, id: ReplicaId) -> Option<&ReplicaStats> {
        self.replicas.get(&id)
    }

    /// Set the in-flight gauges from the pool's live load slots. A gauge
    /// bumped per request by each VM would keep a dead VM's requests
    /// forever; the slots of a dead VM expire, and so do its counts here.
    pub fn show_inflight(&mut self, endpoints: &[Endpoint], load: &HashMap<ReplicaId, Load>) {
        for e in endpoints {
            self.ensure_replica(e);
            let Some(r) = self.replicas.get_mut(&e.id()) else {
                continue;
            };
            let now = load.get(&e.id()).map_or(0, |l| u64::from(l.requests));
            if r.inflight_shown != Some(now) {
                r.inflight.record(now);
                r.inflight_shown = Some(now);
            }
        }
    }

    /// Per-replica stats, defined on first use for discovered replicas.
    pub fn ensure_replica(&mut self, e: &Endpoint) {
        self.replicas
            .entry(e.id())
            .or_insert_with(|| ReplicaStats::define(e));
    }
}
