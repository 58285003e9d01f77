//! Timer-driven scraping of every replica's metrics page, by whichever VM
//! holds the scraper lease, through the pool cluster with the destination
//! header set (so Envoy reaches the right replica without a cluster each).

use std::collections::HashMap;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};

use super::shared::SharedData;
use super::stats::Metric;
use crate::config::Config;
use crate::endpoint::ReplicaId;
use crate::metrics;
use crate::replicas::{self, HealthPolicy, Lease, Table};

struct ReplicaGauges {
    ok: Metric,
    failed: Metric,
    waiting: Metric,
    running: Metric,
    kv_percent: Metric,
}

pub struct Scraper {
    owner: u64,
    next_ms: u64,
    /// Call token → endpoint index, one call per replica at a time (a slow
    /// page never piles up calls).
    pending: HashMap<u32, usize>,
    gauges: Vec<ReplicaGauges>,
    eligible: Metric,
    takeovers: Metric,
    holding: bool,
}

impl Scraper {
    pub fn new(config: &Config, owner: u64) -> Scraper {
        let gauges = config
            .endpoints
            .iter()
            .map(|e| {
                let l = e.stat_label();
                let m =
                    |kind, n: &str| Metric::define(kind, &format!("prefix_router.replica.{l}.{n}"));
                ReplicaGauges {
                    ok: m(MetricType::Counter, "scrapes_ok"),
                    failed: m(MetricType::Counter, "scrapes_failed"),
                    waiting: m(MetricType::Gauge, "waiting"),
                    running: m(MetricType::Gauge, "running"),
                    kv_percent: m(MetricType::Gauge, "kv_usage_percent"),
                }
            })
            .collect();
        Scraper {
            owner,
            next_ms: 0,
            pending: HashMap::new(),
            gauges,
            eligible: Metric::define(MetricType::Gauge, "prefix_router.eligible_replicas"),
            takeovers: Metric::define(MetricType::Counter, "prefix_router.scrape.lease_takeovers"),
            holding: false,
        }
    }

    pub fn tick(&mut self, config: &Config, now_ms: u64) {
        let Some(scrape) = &config.scrape else { return };
        if now_ms < self.next_ms {
            return;
        }
        self.next_ms = now_ms + scrape.interval_ms;
        // The lease outlives two missed renewals, so a new scraper takes
        // over within three intervals of the old one stopping.
        match replicas::acquire_lease(&SharedData, self.owner, now_ms, 2 * scrape.interval_ms) {
            Lease::Other => {
                self.holding = false;
                return;
            }
            Lease::TookOver => {
                self.takeovers.inc();
                log::info!("prefix-router: this VM took over metrics scraping");
            }
            Lease::Held => {}
        }
        self.holding = true;
        self.publish_eligible(config, now_ms);
        for (i, ep) in config.endpoints.iter().enumerate() {
            if self.pending.values().any(|&p| p == i) {
                continue;
            }
            let headers = vec![
                (":method", "GET"),
                (":path", scrape.path.as_str()),
                (":authority", ep.as_str()),
                (config.destination_header.as_str(), ep.as_str()),
            ];
            let timeout = Duration::from_millis(scrape.timeout_ms);
            match hostcalls::dispatch_http_call(&scrape.cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.pending.insert(token, i);
                }
                Err(status) => {
                    log::debug!("prefix-router: scrape of {ep} not dispatched: {status:?}");
                    self.record(config, i, Err(()), now_ms);
                }
            }
        }
    }

    pub fn on_response(&mut self, config: &Config, token: u32, body_size: usize, now_ms: u64) {
        let Some(i) = self.pending.remove(&token) else {
            return;
        };
        let Some(scrape) = &config.scrape else { return };
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten();
        let outcome = if status.as_deref() != Some("200") {
            Err(format!(
                "status {}",
                status
                    .as_deref()
                    .unwrap_or("none (connect error or timeout)")
            ))
        } else if body_size > scrape.max_bytes {
            Err(format!(
                "page of {body_size} bytes is over max_metrics_bytes"
            ))
        } else {
            let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            metrics::parse(scrape.engine, &body, scrape.max_bytes).map_err(|e| e.to_string())
        };
        match outcome {
            Ok(m) => {
                if let Some(g) = self.gauges.get(i) {
                    g.waiting.record(m.waiting.max(0.0) as u64);
                    g.running.record(m.running.max(0.0) as u64);
                    g.kv_percent.record((m.kv_usage * 100.0).round() as u64);
                }
                self.record(config, i, Ok(&m), now_ms);
            }
            Err(why) => {
                if let Some(ep) = config.endpoints.get(i) {
                    log::debug!("prefix-router: scrape of {ep} failed: {why}");
                }
                self.record(config, i, Err(()), now_ms);
            }
        }
    }

    fn record(
        &self,
        config: &Config,
        i: usize,
        outcome: Result<&metrics::ReplicaMetrics, ()>,
        now_ms: u64,
    ) {
        let Some(ep) = config.endpoints.get(i) else {
            return;
        };
        let known: Vec<ReplicaId> = config.endpoints.iter().map(|e| e.id()).collect();
        if let Some(g) = self.gauges.get(i) {
            if outcome.is_ok() {
                g.ok.inc()
            } else {
                g.failed.inc()
            }
        }
        if let Err(e) = replicas::record_scrape(&SharedData, ep.id(), outcome, &known, now_ms) {
            log::debug!("prefix-router: replica table update lost: {e}");
        }
    }

    fn publish_eligible(&self, config: &Config, now_ms: u64) {
        let table = Table::load(&SharedData);
        let p = HealthPolicy {
            staleness_ms: config.staleness_ms,
            unhealthy_after: config.unhealthy_after,
        };
        let n = config
            .endpoints
            .iter()
            .filter(|e| table.eligible(e.id(), &p, now_ms))
            .count();
        self.eligible.record(n as u64);
    }
}
