//! Plugin configuration: the JSON string in Envoy's wasm `configuration`.
//!
//! Parsing is strict on purpose: an unknown key is usually a typo that would
//! silently leave a default in force, so the plugin refuses to start and the
//! error names the key.

use std::collections::HashSet;

use serde::Deserialize;
use thiserror::Error;

use crate::endpoint::Endpoint;
pub use crate::metrics::Engine;

pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Upper bounds that keep every per-request loop and allocation bounded,
/// whatever an operator writes.
pub const MAX_ENDPOINTS: usize = 1024;
pub const MAX_FALLBACKS: usize = 8;
pub const MAX_BLOCKS: usize = 4096;
pub const MAX_INDEX_CAPACITY: usize = 16 * 1024 * 1024;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("configuration is not valid JSON for this plugin: {0}")]
    Json(#[from] serde_json::Error),
    #[error("configuration is not UTF-8")]
    NotUtf8,
    #[error("`endpoints`: {0}")]
    Endpoints(String),
    #[error("`destination_header`: `{0}` is not a valid lowercase HTTP header name")]
    HeaderName(String),
    #[error("`inference_paths`: {0}")]
    Paths(String),
    #[error("`{key}`: {why}")]
    Range { key: &'static str, why: String },
}

/// Relative weights of the score terms (see `score`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    /// Cost of one block of prefill the replica would have to do (the part of
    /// the prompt it doesn't hold).
    pub prefix: f64,
    /// Cost of one block of estimated in-flight work on the replica.
    pub load: f64,
    /// Cost (blocks) of one request waiting in the replica's queue, as last
    /// scraped.
    pub queue: f64,
    /// Cost (blocks) of a full KV cache (scaled by the scraped usage 0..1):
    /// a new prefix there evicts cached ones.
    pub kv: f64,
    /// Cost (blocks) of a replica that would have to load the requested
    /// LoRA adapter; half of it if it has a free adapter slot.
    pub lora: f64,
    /// Cost per block of new content recently placed on the replica,
    /// charged for the part of the request it doesn't hold: spreads new
    /// prefixes over the pool instead of by hash alone.
    pub spread: f64,
}

impl Default for Weights {
    fn default() -> Self {
        // A cached prefix is worth more than the prefill it saves once: the
        // group's next requests hit it too, and a copy elsewhere costs a
        // full prefill that queues whatever arrives behind it. 4:1 was the
        // best tail TTFT on the shared-prefix benchmark (README, tuning).
        Weights {
            prefix: 4.0,
            load: 1.0,
            queue: 16.0,
            kv: 32.0,
            lora: 64.0,
            spread: 0.5,
        }
    }
}

/// Route with prefix-router, or shadow a baseline policy: route with the
/// baseline and only record what prefix-router would have done.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Route,
    Shadow,
}

/// The policy shadow mode routes with.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    RoundRobin,
    #[default]
    LeastRequest,
}

/// How load is counted for scoring.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum LoadMeasure {
    /// Each in-flight request weighs its estimated prefill blocks plus
    /// `request_cost_blocks`.
    #[default]
    Work,
    /// Each in-flight request weighs `request_cost_blocks`, whatever its size.
    Requests,
}

/// Follow the pool's hosts from Envoy's admin `/clusters` instead of (or
/// besides) a static list.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Discovery {
    /// The Envoy cluster whose hosts are the replicas.
    pub cluster: String,
    /// A cluster that reaches Envoy's admin listener (see README: security).
    pub admin_cluster: String,
    #[serde(default = "default_discovery_interval")]
    pub interval_ms: u64,
}

fn default_discovery_interval() -> u64 {
    1000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default)]
    discovery: Option<Discovery>,
    #[serde(default = "default_header")]
    destination_header: String,
    #[serde(default = "default_paths")]
    inference_paths: Vec<String>,
    #[serde(default)]
    max_fallbacks: usize,
    #[serde(default = "default_max_body")]
    max_body_bytes: usize,
    #[serde(default)]
    debug_header: bool,
    #[serde(default = "default_block_bytes")]
    block_bytes: usize,
    #[serde(default = "default_max_blocks")]
    max_blocks: usize,
    #[serde(default = "default_index_capacity")]
    index_capacity: usize,
    #[serde(default = "default_index_stride")]
    index_stride: usize,
    #[serde(default = "default_per_doubling")]
    checkpoints_per_doubling: u32,
    #[serde(default = "default_trunk_min_new")]
    trunk_min_new_blocks: u32,
    #[serde(default)]
    weights: Weights,
    #[serde(default)]
    load_measure: LoadMeasure,
    #[serde(default = "default_request_cost")]
    request_cost_blocks: u32,
    #[serde(default = "default_bounded_load")]
    bounded_load_factor: f64,
    #[serde(default = "default_bounded_slack")]
    bounded_load_slack_blocks: u32,
    #[serde(default = "default_tick_ms")]
    tick_ms: u64,
    #[serde(default)]
    cluster: Option<String>,
    #[serde(default)]
    metrics_cluster: Option<String>,
    #[serde(default = "default_metrics_path")]
    metrics_path: String,
    #[serde(default = "default_scrape_interval")]
    scrape_interval_ms: u64,
    #[serde(default = "default_scrape_timeout")]
    scrape_timeout_ms: u64,
    #[serde(default = "default_max_metrics_bytes")]
    max_metrics_bytes: usize,
    #[serde(default)]
    engine: Engine,
    #[serde(default = "default_staleness")]
    staleness_ms: u64,
    #[serde(default = "default_unhealthy_after")]
    unhealthy_after: u32,
    #[serde(default = "default_queue_threshold")]
    queue_threshold: f64,
    #[serde(default = "default_kv_threshold")]
    kv_threshold: f64,
    #[serde(default = "default_priority_header")]
    priority_header: String,
    #[serde(default)]
    mode: Mode,
    #[serde(default)]
    shadow_baseline: Baseline,
    /// Test-only fault injection, compiled in only with the
    /// `fault-injection` feature: release modules reject the key as unknown.
    #[cfg(feature = "fault-injection")]
    #[serde(default)]
    debug_trap_on_request: Option<u64>,
}

fn default_header() -> String {
    DEFAULT_DESTINATION_HEADER.to_string()
}
fn default_paths() -> Vec<String> {
    vec!["/v1/completions".into(), "/v1/chat/completions".into()]
}
fn default_max_body() -> usize {
    16 * 1024 * 1024
}
fn default_block_bytes() -> usize {
    64
}
fn default_max_blocks() -> usize {
    256
}
fn default_index_capacity() -> usize {
    65_536
}
fn default_index_stride() -> usize {
    4
}
fn default_per_doubling() -> u32 {
    8
}
fn default_trunk_min_new() -> u32 {
    16
}
fn default_request_cost() -> u32 {
    8
}
fn default_bounded_load() -> f64 {
    3.0
}
fn default_bounded_slack() -> u32 {
    64
}
fn default_tick_ms() -> u64 {
    100
}
fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_scrape_interval() -> u64 {
    100
}
fn default_scrape_timeout() -> u64 {
    1000
}
fn default_max_metrics_bytes() -> usize {
    1 << 20
}
fn default_staleness() -> u64 {
    2000
}
fn default_unhealthy_after() -> u32 {
    3
}
fn default_queue_threshold() -> f64 {
    5.0
}
fn default_kv_threshold() -> f64 {
    0.8
}
fn default_priority_header() -> String {
    "x-prefix-router-priority".into()
}

/// Validated configuration. Fields are only reachable through `parse`, so
/// the rest of the filter never sees an empty pool or a bad header name.
#[derive(Debug, Clone)]
pub struct Config {
    pub endpoints: Vec<Endpoint>,
    pub destination_header: String,
    pub inference_paths: Vec<String>,
    pub max_fallbacks: usize,
    pub max_body_bytes: usize,
    pub debug_header: bool,
    pub block_bytes: usize,
    pub max_blocks: usize,
    pub index_capacity: usize,
    pub index_stride: usize,
    /// Past the dense window, checkpoints per doubling of their gap.
    pub checkpoints_per_doubling: u32,
    /// New content below a forked prefix that makes it a trunk (score).
    pub trunk_min_new_blocks: u32,
    pub weights: Weights,
    pub load_measure: LoadMeasure,
    pub request_cost_blocks: u32,
    pub bounded_load_factor: f64,
    pub bounded_load_slack_blocks: u32,
    pub tick_ms: u64,
    /// Scraping, when a cluster to reach the replicas through is named.
    pub scrape: Option<Scrape>,
    pub staleness_ms: u64,
    pub unhealthy_after: u32,
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    pub priority_header: String,
    pub mode: Mode,
    pub shadow_baseline: Baseline,
    /// Test-only fault injection (`fault-injection` feature): the VM traps
    /// on its N-th request, to exercise Envoy's `failure_policy`.
    #[cfg(feature = "fault-injection")]
    pub debug_trap_on_request: Option<u64>,
    pub discovery: Option<Discovery>,
}

/// How replica metrics are scraped.
#[derive(Debug, Clone)]
pub struct Scrape {
    /// Envoy cluster the GETs go through (the destination header picks the
    /// replica, so no cluster per replica is needed).
    pub cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub max_bytes: usize,
    pub engine: Engine,
}

impl Config {
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| ConfigError::NotUtf8)?;
        let raw: RawConfig = serde_json::from_str(text)?;
        if let Some(d) = &raw.discovery {
            for (key, v) in [
                ("discovery.cluster", &d.cluster),
                ("discovery.admin_cluster", &d.admin_cluster),
            ] {
                if v.is_empty() || v.len() > 256 {
                    return Err(ConfigError::Range {
                        key,
                        why: "must be a non-empty Envoy cluster name".into(),
                    });
                }
            }
            range("discovery.interval_ms", d.interval_ms, 50, 3_600_000)?;
        }
        // With discovery the static list may be empty: the pool comes
        // from Envoy.
        let endpoints = if raw.endpoints.is_empty() && raw.discovery.is_some() {
            Vec::new()
        } else {
            parse_endpoints(&raw.endpoints)?
        };
        let destination_header = check_header(&raw.destination_header)?;
        let inference_paths = check_paths(raw.inference_paths)?;
        range(
            "max_fallbacks",
            raw.max_fallbacks as u64,
            0,
            MAX_FALLBACKS as u64,
        )?;
        range("max_body_bytes", raw.max_body_bytes as u64, 1, 1 << 30)?;
        range("block_bytes", raw.block_bytes as u64, 8, 65_536)?;
        range("max_blocks", raw.max_blocks as u64, 1, MAX_BLOCKS as u64)?;
        range(
            "index_capacity",
            raw.index_capacity as u64,
            64,
            MAX_INDEX_CAPACITY as u64,
        )?;
        range(
            "index_stride",
            raw.index_stride as u64,
            1,
            raw.max_blocks as u64,
        )?;
        range(
            "checkpoints_per_doubling",
            u64::from(raw.checkpoints_per_doubling),
            1,
            64,
        )?;
        range(
            "trunk_min_new_blocks",
            u64::from(raw.trunk_min_new_blocks),
            1,
            1 << 20,
        )?;
        range(
            "request_cost_blocks",
            u64::from(raw.request_cost_blocks),
            0,
            1 << 20,
        )?;
        range(
            "bounded_load_slack_blocks",
            u64::from(raw.bounded_load_slack_blocks),
            0,
            1 << 24,
        )?;
        // A dead VM's load counts expire after 10 missed heartbeats: the tick
        // bounds how long they linger.
        range("tick_ms", raw.tick_ms, 10, 1000)?;
        if !(raw.bounded_load_factor.is_finite() && raw.bounded_load_factor >= 1.0) {
            return Err(ConfigError::Range {
                key: "bounded_load_factor",
                why: format!("{} must be a number >= 1.0", raw.bounded_load_factor),
            });
        }
        for (key, w) in [
            ("weights.prefix", raw.weights.prefix),
            ("weights.load", raw.weights.load),
            ("weights.queue", raw.weights.queue),
            ("weights.kv", raw.weights.kv),
            ("weights.lora", raw.weights.lora),
            ("weights.spread", raw.weights.spread),
        ] {
            if !(w.is_finite() && (0.0..=1000.0).contains(&w)) {
                return Err(ConfigError::Range {
                    key,
                    why: format!("{w} must be between 0 and 1000"),
                });
            }
        }
        let priority_header =
            check_header(&raw.priority_header).map_err(|_| ConfigError::Range {
                key: "priority_header",
                why: format!(
                    "`{}` is not a valid lowercase header name",
                    raw.priority_header
                ),
            })?;
        let scrape = match raw.metrics_cluster.or(raw.cluster) {
            None => None,
            Some(cluster) => {
                if cluster.is_empty() || cluster.len() > 256 {
                    return Err(ConfigError::Range {
                        key: "cluster",
                        why: "must be a non-empty Envoy cluster name".into(),
                    });
                }
                if !raw.metrics_path.starts_with('/') {
                    return Err(ConfigError::Range {
                        key: "metrics_path",
                        why: format!("`{}` must start with /", raw.metrics_path),
                    });
                }
                range("scrape_interval_ms", raw.scrape_interval_ms, 10, 600_000)?;
                range("scrape_timeout_ms", raw.scrape_timeout_ms, 10, 600_000)?;
                range(
                    "max_metrics_bytes",
                    raw.max_metrics_bytes as u64,
                    1024,
                    64 << 20,
                )?;
                Some(Scrape {
                    cluster,
                    path: raw.metrics_path,
                    interval_ms: raw.scrape_interval_ms,
                    timeout_ms: raw.scrape_timeout_ms,
                    max_bytes: raw.max_metrics_bytes,
                    engine: raw.engine,
                })
            }
        };
        range("staleness_ms", raw.staleness_ms, 10, 3_600_000)?;
        range("unhealthy_after", u64::from(raw.unhealthy_after), 1, 1000)?;
        if !(raw.queue_threshold.is_finite() && raw.queue_threshold >= 0.0) {
            return Err(ConfigError::Range {
                key: "queue_threshold",
                why: format!("{} must be a number >= 0", raw.queue_threshold),
            });
        }
        if !(raw.kv_threshold.is_finite() && (0.0..=1.0).contains(&raw.kv_threshold)) {
            return Err(ConfigError::Range {
                key: "kv_threshold",
                why: format!("{} must be between 0 and 1", raw.kv_threshold),
            });
        }
        Ok(Config {
            endpoints,
            destination_header,
            inference_paths,
            max_fallbacks: raw.max_fallbacks,
            max_body_bytes: raw.max_body_bytes,
            debug_header: raw.debug_header,
            block_bytes: raw.block_bytes,
            max_blocks: raw.max_blocks,
            index_capacity: raw.index_capacity,
            index_stride: raw.index_stride,
            checkpoints_per_doubling: raw.checkpoints_per_doubling,
            trunk_min_new_blocks: raw.trunk_min_new_blocks,
            weights: raw.weights,
            load_measure: raw.load_measure,
            request_cost_blocks: raw.request_cost_blocks,
            bounded_load_factor: raw.bounded_load_factor,
            bounded_load_slack_blocks: raw.bounded_load_slack_blocks,
            tick_ms: raw.tick_ms,
            scrape,
            staleness_ms: raw.staleness_ms,
            unhealthy_after: raw.unhealthy_after,
            queue_threshold: raw.queue_threshold,
            kv_threshold: raw.kv_threshold,
            priority_header,
            mode: raw.mode,
            shadow_baseline: raw.shadow_baseline,
            #[cfg(feature = "fault-injection")]
            debug_trap_on_request: raw.debug_trap_on_request,
            discovery: raw.discovery,
        })
    }

    /// Where a prompt's checkpoints sit (see `prefix`): every
    /// `index_stride` blocks in the first `max_blocks`, then sparser.
    pub fn schedule(&self) -> crate::prefix::Schedule {
        crate::prefix::Schedule {
            stride: u32::try_from(self.index_stride).unwrap_or(u32::MAX),
            dense: u32::try_from(self.max_blocks).unwrap_or(u32::MAX),
            per_doubling: self.checkpoints_per_doubling,
        }
    }

    /// Exact match on the path without its query string.
    pub fn is_inference_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or("");
        self.inference_paths.iter().any(|p| p == path)
    }
}

/// Checked in u64 whatever the field's type: a `usize` is 32 bits in the
/// wasm, and a u64 value cast to it would wrap (4294967306 -> 10) and pass.
fn range(key: &'static str, v: u64, lo: u64, hi: u64) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(ConfigError::Range {
            key,
            why: format!("{v} is outside {lo}..={hi}"),
        });
    }
    Ok(())
}

fn parse_endpoints(raw: &[String]) -> Result<Vec<Endpoint>, ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::Endpoints("the list is empty".into()));
    }
    if raw.len() > MAX_ENDPOINTS {
        return Err(ConfigError::Endpoints(format!(
            "{} entries, at most {MAX_ENDPOINTS}",
            raw.len()
        )));
    }
    let mut seen = HashSet::new();
    let mut ids = HashSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for s in raw {
        let ep: Endpoint = s
            .parse()
            .map_err(|e: crate::endpoint::BadEndpoint| ConfigError::Endpoints(e.to_string()))?;
        if !seen.insert(ep.as_str().to_string()) {
            return Err(ConfigError::Endpoints(format!("`{s}` is listed twice")));
        }
        if !ids.insert(ep.id()) {
            return Err(ConfigError::Endpoints(format!(
                "`{s}` collides with another endpoint's 64-bit id; rename one"
            )));
        }
        out.push(ep);
    }
    Ok(out)
}

/// RFC 7230 token characters, lowercase only: Envoy stores header names in
/// lowercase, and a name with uppercase would never match.
fn check_header(name: &str) -> Result<String, ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(':')
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        });
    if ok {
        Ok(name.to_string())
    } else {
        Err(ConfigError::HeaderName(name.to_string()))
    }
}

fn check_paths(paths: Vec<String>) -> Result<Vec<String>, ConfigError> {
    if paths.is_empty() {
        return Err(ConfigError::Paths("the list is empty".into()));
    }
    for p in &paths {
        if !p.starts_with('/') || p.contains('?') || p.len() > 1024 {
            return Err(ConfigError::Paths(format!(
                "`{p}` must be an absolute path without a query string"
            )));
        }
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::parse(br#"{"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}"#).unwrap();
        assert_eq!(c.endpoints.len(), 2);
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!(
            c.inference_paths,
            vec!["/v1/completions", "/v1/chat/completions"]
        );
        assert_eq!(c.max_fallbacks, 0);
        assert_eq!(c.block_bytes, 64);
        assert_eq!(c.max_blocks, 256);
        assert!(!c.debug_header);
    }

    #[test]
    fn accepts_ipv6() {
        let c = Config::parse(br#"{"endpoints": ["[::1]:8000", "[fd00::2]:8001"]}"#).unwrap();
        assert_eq!(c.endpoints[1].as_str(), "[fd00::2]:8001");
    }

    #[test]
    fn errors_name_the_key() {
        assert!(err(r#"{"endpoints":["10.0.0.1:1"],"endpoint":[]}"#)
            .contains("unknown field `endpoint`"));
        assert!(err(r#"{"endpoints":[]}"#).contains("`endpoints`: the list is empty"));
        assert!(err(r#"{"endpoints":["10.0.0.1:1","10.0.0.1:1"]}"#).contains("listed twice"));
        assert!(err(r#"{"endpoints":["host:1"]}"#).contains("`host:1` is not an `ip:port`"));
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"destination_header":"X Bad"}"#)
                .contains("`destination_header`")
        );
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"max_fallbacks":99}"#).contains("`max_fallbacks`")
        );
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"inference_paths":["v1"]}"#)
                .contains("`inference_paths`")
        );
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"weights":{"prefix":-1}}"#)
                .contains("weights.prefix")
        );
        assert!(err(r#"{"endpoints":["10.0.0.1:1"],"weights":{"bogus":1}}"#).contains("bogus"));
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"bounded_load_factor":0.5}"#)
                .contains("bounded_load_factor")
        );
        assert!(err(r#"{"endpoints":"10.0.0.1:1"}"#).contains("invalid type"));
        assert!(err("").contains("JSON"));
        assert!(Config::parse(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn discovery_allows_an_empty_static_list() {
        let c =
            Config::parse(br#"{"discovery":{"cluster":"pool","admin_cluster":"admin"}}"#).unwrap();
        assert!(c.endpoints.is_empty());
        assert_eq!(c.discovery.unwrap().interval_ms, 1000);
        assert!(err(r#"{"discovery":{"cluster":"","admin_cluster":"a"}}"#)
            .contains("discovery.cluster"));
        assert!(err(r#"{"discovery":{"cluster":"p"}}"#).contains("admin_cluster"));
        assert!(err(r#"{}"#).contains("`endpoints`: the list is empty"));
    }

    #[test]
    fn discovery_as_a_json_array_is_the_struct_in_order() {
        // Found by fuzzing: serde accepts a struct as a sequence. The result
        // is a valid discovery config (cluster, admin_cluster), not a crash.
        let c = Config::parse(br#"{"discovery":["pool","admin"]}"#).unwrap();
        let d = c.discovery.unwrap();
        assert_eq!(
            (d.cluster.as_str(), d.admin_cluster.as_str()),
            ("pool", "admin")
        );
        assert!(c.endpoints.is_empty());
    }

    #[test]
    fn shadow_mode_keys() {
        let c = Config::parse(
            br#"{"endpoints":["10.0.0.1:1"],"mode":"shadow","shadow_baseline":"round_robin"}"#,
        )
        .unwrap();
        assert_eq!(c.mode, Mode::Shadow);
        assert_eq!(c.shadow_baseline, Baseline::RoundRobin);
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"mode":"yolo"}"#).contains("unknown variant `yolo`")
        );
    }

    #[test]
    fn u64_ranges_are_checked_whole_on_32_bit_targets_too() {
        // 4294967306 = 2^32 + 10: cast to a wasm32 usize it read as 10 and
        // passed. These tests also run compiled to wasm32.
        for key in [
            "tick_ms",
            "staleness_ms",
            "scrape_interval_ms",
            "scrape_timeout_ms",
        ] {
            let json =
                format!(r#"{{"endpoints":["10.0.0.1:1"],"cluster":"p","{key}":4294967306}}"#);
            assert!(err(&json).contains(&format!("`{key}`")), "{key}");
        }
        let json = r#"{"discovery":{"cluster":"p","admin_cluster":"a","interval_ms":4294967306}}"#;
        assert!(err(json).contains("discovery.interval_ms"));
        assert!(err(r#"{"endpoints":["10.0.0.1:1"],"tick_ms":5000}"#).contains("`tick_ms`"));
    }

    #[cfg(not(feature = "fault-injection"))]
    #[test]
    fn release_builds_have_no_fault_injection_key() {
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"debug_trap_on_request":5}"#)
                .contains("unknown field `debug_trap_on_request`")
        );
    }

    #[test]
    fn inference_path_ignores_query() {
        let c = Config::parse(br#"{"endpoints":["10.0.0.1:1"]}"#).unwrap();
        assert!(c.is_inference_path("/v1/completions?x=1"));
        assert!(c.is_inference_path("/v1/chat/completions"));
        assert!(!c.is_inference_path("/v1/completions/render"));
        assert!(!c.is_inference_path("/health"));
    }
}
