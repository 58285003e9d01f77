//! Plugin configuration: the JSON string in Envoy's wasm `configuration`.
//!
//! One struct, deserialized as it stands: every key's default is in
//! `Default`, and `validate` checks what types can't (ranges, header
//! names, the endpoint list). Parsing is strict on purpose: an unknown key
//! is usually a typo that would silently leave a default in force, so the
//! plugin refuses to start and the error names the key.

use std::collections::HashSet;
use std::fmt;

use serde::Deserialize;
use thiserror::Error;

use crate::endpoint::Endpoint;
pub use crate::metrics::Engine;

pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const DEFAULT_AFFINITY_HEADER: &str = "x-prefix-router-affinity";
/// Upper bounds that keep every per-request loop and allocation bounded,
/// whatever an operator writes.
pub const MAX_ENDPOINTS: usize = 1024;
pub const MAX_FALLBACKS: usize = 8;
pub const MAX_BLOCKS: usize = 4096;
pub const MAX_INDEX_CAPACITY: usize = 16 * 1024 * 1024;
pub const MAX_GATEWAYS: u32 = 64;
/// Shortest affinity key: HMAC-SHA256 is only as strong as a key of its
/// output size.
pub const MIN_AFFINITY_KEY_BYTES: usize = 32;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("configuration is not valid JSON for this plugin: {0}")]
    Json(#[from] serde_json::Error),
    #[error("configuration is not UTF-8")]
    NotUtf8,
    #[error("`{key}`: {why}")]
    Invalid { key: &'static str, why: String },
}

/// The plugin configuration. JSON keys are the field names, except
/// `endpoints` (`static_endpoints` here). Built by `parse`, so the rest of
/// the filter never sees an empty pool or a bad header name.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The replicas listed in the configuration (JSON `endpoints`). The
    /// live pool, which discovery extends, is `Router::endpoints()`.
    #[serde(rename = "endpoints")]
    pub static_endpoints: Vec<Endpoint>,
    pub discovery: Option<Discovery>,
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
    // The scraping keys, read through `scrape`.
    cluster: Option<String>,
    metrics_cluster: Option<String>,
    /// `None` until `parse` fills in the engine's (`Engine::metrics_path`).
    metrics_path: Option<String>,
    engine: Engine,
    scrape_interval_ms: u64,
    scrape_timeout_ms: u64,
    max_metrics_bytes: usize,
    /// Scraping, when a cluster to reach the replicas through is named
    /// (`cluster` or `metrics_cluster`): set by `parse` from the keys above.
    #[serde(skip)]
    pub scrape: Option<Scrape>,
    pub staleness_ms: u64,
    pub unhealthy_after: u32,
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    pub priority_header: String,
    pub mode: Mode,
    pub shadow_baseline: Baseline,
    /// Independent Envoy instances (gateway pods) in front of the same
    /// replicas.
    pub gateways: u32,
    /// Move prefixes off replicas whose own prefix-cache hit rate says
    /// they evict what they are credited with (`route::evicting`).
    pub hit_rate_feedback: bool,
    /// With several gateways, move prefixes off replicas that carry more
    /// than their share of the pool's scraped prompt traffic
    /// (`route::hot`; opt-in).
    pub traffic_balance: bool,
    /// Session affinity across gateway instances, when configured.
    pub affinity: Option<Affinity>,
    /// Names this pool's records in shared data (see `scope`).
    pub pool: Option<String>,
    /// The prefix of every shared-data key this config reads and writes
    /// (`store::Scoped`): a digest of `pool`, else of the discovery
    /// cluster, else of the static list. Two configs in one Envoy (one
    /// `vm_id`) that name different pools never share records; the same
    /// config shares them across workers, reloads and releases.
    #[serde(skip)]
    pub scope: String,
    /// Test-only fault injection, compiled in only with the
    /// `fault-injection` feature (release modules reject the key as
    /// unknown): the VM traps on its N-th request, to exercise Envoy's
    /// `failure_policy`.
    #[cfg(feature = "fault-injection")]
    pub debug_trap_on_request: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            static_endpoints: Vec::new(),
            discovery: None,
            destination_header: DEFAULT_DESTINATION_HEADER.into(),
            inference_paths: vec![
                "/v1/completions".into(),
                "/v1/chat/completions".into(),
                "/v1/messages".into(),
            ],
            max_fallbacks: 0,
            max_body_bytes: 16 << 20,
            debug_header: false,
            block_bytes: 64,
            max_blocks: 256,
            index_capacity: 65_536,
            index_stride: 4,
            checkpoints_per_doubling: 32,
            trunk_min_new_blocks: 16,
            weights: Weights::default(),
            load_measure: LoadMeasure::default(),
            request_cost_blocks: 8,
            bounded_load_factor: 3.0,
            bounded_load_slack_blocks: 64,
            tick_ms: 100,
            cluster: None,
            metrics_cluster: None,
            metrics_path: None,
            engine: Engine::default(),
            scrape_interval_ms: 100,
            scrape_timeout_ms: 1000,
            max_metrics_bytes: 1 << 20,
            scrape: None,
            staleness_ms: 2000,
            unhealthy_after: 3,
            queue_threshold: 5.0,
            kv_threshold: 0.8,
            priority_header: "x-prefix-router-priority".into(),
            mode: Mode::default(),
            shadow_baseline: Baseline::default(),
            gateways: 1,
            hit_rate_feedback: true,
            traffic_balance: false,
            affinity: None,
            pool: None,
            scope: String::new(),
            #[cfg(feature = "fault-injection")]
            debug_trap_on_request: None,
        }
    }
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
        // best tail TTFT on the shared-prefix benchmark (2:1 doubled to
        // tripled it: docs/operators-guide.md, tuning).
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
#[serde(deny_unknown_fields, default)]
pub struct Discovery {
    /// The Envoy cluster whose hosts are the replicas (required).
    pub cluster: String,
    /// A cluster that reaches Envoy's admin listener (see README: security;
    /// required).
    pub admin_cluster: String,
    pub interval_ms: u64,
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery {
            cluster: String::new(),
            admin_cluster: String::new(),
            interval_ms: 1000,
        }
    }
}

/// Session affinity that survives a hop between gateway instances (see
/// `affinity`): a token in `header`, signed with `key`, honoured for
/// `max_age_s`.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Affinity {
    /// The header carrying the token (lowercase).
    pub header: String,
    /// The HMAC key every gateway instance shares (required, at least
    /// `MIN_AFFINITY_KEY_BYTES` bytes).
    pub key: String,
    /// Age after which a token is no longer honoured.
    pub max_age_s: u64,
    /// Every client that continues a session sends the token back (an
    /// agent framework or SDK you control). With several gateways, new
    /// content is then placed by this instance's ranking as with one
    /// gateway (load, recent placements, other instances' requests seen
    /// in the scrapes), since a session's later turns find their replica
    /// by the token; without it, new content stays on its first
    /// rendezvous candidate unless that is much busier, so that an
    /// instance without the token agrees. Content that clients without a
    /// token share (documents asked about by many users) may then be
    /// copied once per instance.
    pub clients_echo: bool,
    /// Also carry the session in this cookie, for clients that keep
    /// cookies but don't echo headers (an OpenAI SDK client, a browser).
    /// A cookie is followed only by a prompt that continues the one it
    /// was set for (see `affinity::cookie`): one client's jar may serve
    /// several sessions.
    pub cookie: Option<String>,
    /// Sessions one cookie remembers (a jar several sessions share keeps
    /// the latest this many), at most `affinity::cookie::MAX_SESSIONS`.
    pub cookie_sessions: usize,
    /// Name each stored Responses API response after the replica that
    /// holds it (see `affinity::response`): the filter sets the
    /// request's `request_id`, which vLLM and SGLang use as the
    /// response's id, so a follow-up by `previous_response_id` (or a
    /// `GET /v1/responses/{id}`) reaches that replica from any instance.
    pub response_ids: bool,
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity {
            header: DEFAULT_AFFINITY_HEADER.into(),
            key: String::new(),
            max_age_s: 3600,
            clients_echo: false,
            cookie: None,
            cookie_sessions: 16,
            response_ids: false,
        }
    }
}

/// Never prints the key: configurations end up in logs.
impl fmt::Debug for Affinity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Affinity")
            .field("header", &self.header)
            .field("key", &format_args!("<{} bytes>", self.key.len()))
            .field("max_age_s", &self.max_age_s)
            .field("clients_echo", &self.clients_echo)
            .field("cookie", &self.cookie)
            .field("cookie_sessions", &self.cookie_sessions)
            .field("response_ids", &self.response_ids)
            .finish()
    }
}

impl Config {
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| ConfigError::NotUtf8)?;
        let mut config: Config = serde_json::from_str(text)?;
        let engine = config.engine;
        (config.metrics_path).get_or_insert_with(|| engine.metrics_path().to_string());
        config.validate()?;
        config.scrape = config.scrape_keys();
        config.scope = config.pool_scope();
        Ok(config)
    }

    /// See `scope`. A static list names its pool by its sorted addresses,
    /// so an edit of the list starts the pool's records anew (the old
    /// ones, at most about `index_capacity` x 66 bytes, stay until Envoy
    /// restarts), unless `pool` names it.
    fn pool_scope(&self) -> String {
        let name = match (&self.pool, &self.discovery) {
            (Some(p), _) => format!("pool\0{p}"),
            (None, Some(d)) => format!("discovery\0{}", d.cluster),
            (None, None) => {
                let mut eps: Vec<&str> =
                    self.static_endpoints.iter().map(Endpoint::as_str).collect();
                eps.sort_unstable();
                format!("static\0{}", eps.join(","))
            }
        };
        format!("{:016x}/", xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
    }

    /// What serde can't check: ranges, names, the endpoint list.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.discovery {
            cluster_name("discovery.cluster", &d.cluster)?;
            cluster_name("discovery.admin_cluster", &d.admin_cluster)?;
            range("discovery.interval_ms", d.interval_ms, 50, 3_600_000)?;
        }
        // With discovery the static list may be empty: the pool comes
        // from Envoy.
        if !(self.static_endpoints.is_empty() && self.discovery.is_some()) {
            check_endpoints(&self.static_endpoints)?;
        }
        header_name("destination_header", &self.destination_header)?;
        check_paths(&self.inference_paths)?;
        self.validate_numbers()?;
        header_name("priority_header", &self.priority_header)?;
        if let Some(p) = &self.pool {
            if p.is_empty() || p.len() > 256 {
                return Err(invalid("pool", "must be a name of 1 to 256 bytes"));
            }
        }
        self.validate_scrape()?;
        self.validate_affinity()
    }

    /// Every number's range.
    fn validate_numbers(&self) -> Result<(), ConfigError> {
        // A dead VM's load counts expire after 10 missed heartbeats: the
        // tick bounds how long they linger.
        #[rustfmt::skip]
        let ranges: [(&'static str, u64, u64, u64); 14] = [
            ("max_fallbacks", self.max_fallbacks as u64, 0, MAX_FALLBACKS as u64),
            ("max_body_bytes", self.max_body_bytes as u64, 1, 1 << 30),
            ("block_bytes", self.block_bytes as u64, 8, 65_536),
            ("max_blocks", self.max_blocks as u64, 1, MAX_BLOCKS as u64),
            ("index_capacity", self.index_capacity as u64, 64, MAX_INDEX_CAPACITY as u64),
            ("index_stride", self.index_stride as u64, 1, self.max_blocks as u64),
            ("checkpoints_per_doubling", self.checkpoints_per_doubling.into(), 1, 64),
            ("trunk_min_new_blocks", self.trunk_min_new_blocks.into(), 1, 1 << 20),
            // 0 made a full hit weigh nothing: no load ever built up.
            ("request_cost_blocks", self.request_cost_blocks.into(), 1, 1 << 20),
            ("bounded_load_slack_blocks", self.bounded_load_slack_blocks.into(), 0, 1 << 24),
            ("tick_ms", self.tick_ms, 10, 1000),
            ("staleness_ms", self.staleness_ms, 10, 3_600_000),
            ("unhealthy_after", self.unhealthy_after.into(), 1, 1000),
            ("gateways", self.gateways.into(), 1, MAX_GATEWAYS.into()),
        ];
        for (key, v, lo, hi) in ranges {
            range(key, v, lo, hi)?;
        }
        let w = &self.weights;
        #[rustfmt::skip]
        let reals = [
            ("bounded_load_factor", self.bounded_load_factor, 1.0, f64::INFINITY),
            ("queue_threshold", self.queue_threshold, 0.0, f64::INFINITY),
            ("kv_threshold", self.kv_threshold, 0.0, 1.0),
            ("weights.prefix", w.prefix, 0.0, 1000.0),
            ("weights.load", w.load, 0.0, 1000.0),
            ("weights.queue", w.queue, 0.0, 1000.0),
            ("weights.kv", w.kv, 0.0, 1000.0),
            ("weights.lora", w.lora, 0.0, 1000.0),
            ("weights.spread", w.spread, 0.0, 1000.0),
        ];
        for (key, v, lo, hi) in reals {
            real(key, v, lo, hi)?;
        }
        Ok(())
    }

    /// The scrape keys, when a cluster to scrape is named.
    fn validate_scrape(&self) -> Result<(), ConfigError> {
        let Some(s) = self.scrape_keys() else {
            return Ok(());
        };
        let key = match self.metrics_cluster {
            Some(_) => "metrics_cluster",
            None => "cluster",
        };
        cluster_name(key, &s.cluster)?;
        if !s.path.starts_with('/') {
            let why = format!("`{}` must start with /", s.path);
            return Err(invalid("metrics_path", why));
        }
        range("scrape_interval_ms", s.interval_ms, 10, 600_000)?;
        range("scrape_timeout_ms", s.timeout_ms, 10, 600_000)?;
        range("max_metrics_bytes", s.max_bytes as u64, 1024, 64 << 20)?;
        // A round scrapes every replica at once, so with rounds further
        // apart than this every row went stale together between them: a
        // blind pool for part of each round.
        if self.staleness_ms < 2 * s.interval_ms {
            let why = format!(
                "{} ms is under 2 x `scrape_interval_ms` ({} ms): every replica would go stale between scrapes",
                self.staleness_ms, s.interval_ms
            );
            return Err(invalid("staleness_ms", why));
        }
        Ok(())
    }

    /// The affinity keys, when session affinity is on.
    fn validate_affinity(&self) -> Result<(), ConfigError> {
        let Some(a) = &self.affinity else {
            return Ok(());
        };
        header_name("affinity.header", &a.header)?;
        if a.header == self.destination_header {
            let why = "must differ from `destination_header`";
            return Err(invalid("affinity.header", why));
        }
        // The token's header is removed from every request and replaced on
        // every 2xx response: never one that carries something else.
        const CARRIES_OTHER: [&str; 16] = [
            "cookie",
            "set-cookie",
            "authorization",
            "proxy-authorization",
            "content-length",
            "content-type",
            "content-encoding",
            "transfer-encoding",
            "host",
            "connection",
            "te",
            "upgrade",
            "keep-alive",
            "location",
            "x-forwarded-for",
            "x-forwarded-proto",
        ];
        let other = CARRIES_OTHER.contains(&a.header.as_str())
            || a.header.starts_with("x-envoy-")
            || a.header == self.priority_header
            || a.header == crate::filter::DEBUG_HEADER;
        if other {
            let why = format!(
                "`{}` carries something else; name a header of its own",
                a.header
            );
            return Err(invalid("affinity.header", why));
        }
        if a.key.len() < MIN_AFFINITY_KEY_BYTES {
            let why = format!(
                "required: a secret of at least {MIN_AFFINITY_KEY_BYTES} bytes (got {})",
                a.key.len()
            );
            return Err(invalid("affinity.key", why));
        }
        range("affinity.max_age_s", a.max_age_s, 1, 604_800)?;
        if let Some(c) = &a.cookie {
            cookie_name("affinity.cookie", c)?;
        }
        let (n, most) = (a.cookie_sessions, crate::affinity::cookie::MAX_SESSIONS);
        range("affinity.cookie_sessions", n as u64, 1, most as u64)?;
        // Only bodies on a Responses path are named or followed: without
        // one (the default paths) the option did nothing, silently.
        let responses = self
            .inference_paths
            .iter()
            .any(|p| p.ends_with("/responses"));
        if a.response_ids && !responses {
            let why = "names stored responses only on a Responses API path: add `/v1/responses` \
                       (an entry ending in `/responses`) to `inference_paths`";
            return Err(invalid("affinity.response_ids", why));
        }
        Ok(())
    }

    /// The scraping set-up the keys describe, if a cluster is named.
    fn scrape_keys(&self) -> Option<Scrape> {
        Some(Scrape {
            cluster: self
                .metrics_cluster
                .clone()
                .or_else(|| self.cluster.clone())?,
            path: (self.metrics_path.clone()).unwrap_or_else(|| self.engine.metrics_path().into()),
            interval_ms: self.scrape_interval_ms,
            timeout_ms: self.scrape_timeout_ms,
            max_bytes: self.max_metrics_bytes,
            engine: self.engine,
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

    /// Session affinity, when it names stored responses after their
    /// replicas (`affinity.response_ids`).
    pub fn response_ids(&self) -> Option<&Affinity> {
        self.affinity.as_ref().filter(|a| a.response_ids)
    }

    /// The start-up line that tells the operator the plugin loaded, and
    /// with which pool. With `discovery` it names the cluster followed:
    /// "configured with 0 replicas" read as a pool left empty.
    pub fn started(&self) -> String {
        let pool = match &self.discovery {
            Some(d) => format!(
                "{} static replicas and the hosts of cluster `{}` (discovered through `{}`)",
                self.static_endpoints.len(),
                d.cluster,
                d.admin_cluster
            ),
            None => format!("{} replicas", self.static_endpoints.len()),
        };
        format!(
            "prefix-router: configured with {pool}, header `{}`",
            self.destination_header
        )
    }

    /// Settings that are valid but work against each other, for the
    /// operator to read once when the plugin starts.
    pub fn advice(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.response_ids().is_some() && self.max_fallbacks == 0 {
            // The plugin's default: a stored create its pick refuses is
            // then retried by the cluster's fallback policy, anywhere, and
            // no follow-up looks there (a 404 for the rest of the
            // conversation).
            notes.push(
                "`affinity.response_ids` with `max_fallbacks` 0: a stored response whose \
                 replica refuses its create is stored where no follow-up looks \
                 (`responses.misplaced`); with override_host, set `max_fallbacks` >= 1 \
                 and a retry policy on the route"
                    .to_string(),
            );
        }
        if let Some(s) = self
            .scrape
            .as_ref()
            .filter(|s| s.timeout_ms > self.staleness_ms)
        {
            // Valid (a slow page is waited for), but its replica reads as
            // stale between a late answer and the next.
            notes.push(format!(
                "`scrape_timeout_ms` ({} ms) is above `staleness_ms` ({} ms): a replica whose \
                 metrics page takes longer than `staleness_ms` goes stale, and out of the pool, \
                 for part of every round; raise `staleness_ms` with the timeout",
                s.timeout_ms, self.staleness_ms
            ));
        }
        if self.traffic_balance {
            // It reads the replicas' own prefix-cache lookup counters
            // (vLLM's), and evens out only what instances that can't see
            // each other's placements dealt out lumpily.
            let missing = match &self.scrape {
                _ if self.gateways <= 1 => Some("`gateways` above 1"),
                None => Some("scraping (`cluster`)"),
                Some(s) if s.engine != Engine::Vllm => Some("`engine` vllm"),
                Some(_) => None,
            };
            if let Some(missing) = missing {
                notes.push(format!(
                    "`traffic_balance` is on but needs {missing} (and the replicas' \
                     prefix-cache lookup counters): it does nothing here"
                ));
            }
        }
        notes
    }

    /// Exact match on the path without its query string.
    pub fn is_inference_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or("");
        self.inference_paths.iter().any(|p| p == path)
    }
}

fn invalid(key: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        why: why.into(),
    }
}

/// Checked in u64 whatever the field's type: a `usize` is 32 bits in the
/// wasm, and a u64 value cast to it would wrap (4294967306 -> 10) and pass.
fn range(key: &'static str, v: u64, lo: u64, hi: u64) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(invalid(key, format!("{v} is outside {lo}..={hi}")));
    }
    Ok(())
}

/// A finite number in `lo..=hi` (`hi` may be infinite: no upper bound).
fn real(key: &'static str, v: f64, lo: f64, hi: f64) -> Result<(), ConfigError> {
    if v.is_finite() && (lo..=hi).contains(&v) {
        return Ok(());
    }
    Err(invalid(
        key,
        if hi.is_finite() {
            format!("{v} must be between {lo} and {hi}")
        } else {
            format!("{v} must be a number >= {lo}")
        },
    ))
}

fn check_endpoints(eps: &[Endpoint]) -> Result<(), ConfigError> {
    if eps.is_empty() {
        return Err(invalid("endpoints", "the list is empty"));
    }
    if eps.len() > MAX_ENDPOINTS {
        let why = format!("{} entries, at most {MAX_ENDPOINTS}", eps.len());
        return Err(invalid("endpoints", why));
    }
    let mut seen = HashSet::new();
    let mut ids = HashSet::new();
    for ep in eps {
        if !seen.insert(ep.as_str()) {
            return Err(invalid("endpoints", format!("`{ep}` is listed twice")));
        }
        if !ids.insert(ep.id()) {
            let why = format!("`{ep}` collides with another endpoint's 64-bit id; rename one");
            return Err(invalid("endpoints", why));
        }
    }
    Ok(())
}

/// RFC 7230 token characters, lowercase only: Envoy stores header names in
/// lowercase, and a name with uppercase would never match.
fn header_name(key: &'static str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(':')
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        });
    if !ok {
        let why = format!("`{name}` is not a valid lowercase HTTP header name");
        return Err(invalid(key, why));
    }
    Ok(())
}

/// A cookie name is an HTTP token (RFC 6265), of any case.
fn cookie_name(key: &'static str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !ok {
        let why = format!("`{name}` is not a valid cookie name");
        return Err(invalid(key, why));
    }
    Ok(())
}

fn cluster_name(key: &'static str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > 256 {
        return Err(invalid(key, "must be a non-empty Envoy cluster name"));
    }
    Ok(())
}

fn check_paths(paths: &[String]) -> Result<(), ConfigError> {
    if paths.is_empty() {
        return Err(invalid("inference_paths", "the list is empty"));
    }
    for p in paths {
        if !p.starts_with('/') || p.contains('?') || p.len() > 1024 {
            let why = format!("`{p}` must be an absolute path without a query string");
            return Err(invalid("inference_paths", why));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pool_has_its_own_shared_data_scope() {
        let scope = |json: &str| Config::parse(json.as_bytes()).unwrap().scope;
        let disc =
            |c: &str| format!(r#"{{"discovery":{{"cluster":"{c}","admin_cluster":"admin"}}}}"#);
        let a = scope(r#"{"endpoints":["10.0.0.1:80","10.0.0.2:80"]}"#);
        assert_eq!(a.len(), 17);
        assert!(a.ends_with('/'));
        // The same pool, however listed, and whatever else the config says.
        assert_eq!(
            a,
            scope(r#"{"endpoints":["10.0.0.2:80","10.0.0.1:80"],"max_fallbacks":1}"#)
        );
        assert_ne!(a, scope(r#"{"endpoints":["10.0.0.1:80","10.0.0.3:80"]}"#));
        assert_eq!(scope(&disc("pool-a")), scope(&disc("pool-a")));
        assert_ne!(scope(&disc("pool-a")), scope(&disc("pool-b")));
        // A named pool keeps its scope when its list is edited.
        let named = |eps: &str| scope(&format!(r#"{{"endpoints":[{eps}],"pool":"llama"}}"#));
        assert_eq!(
            named(r#""10.0.0.1:80""#),
            named(r#""10.0.0.1:80","10.0.0.2:80""#)
        );
        assert_ne!(named(r#""10.0.0.1:80""#), a);
        let e = Config::parse(br#"{"endpoints":["10.0.0.1:80"],"pool":""}"#).unwrap_err();
        assert!(e.to_string().contains("`pool`"), "{e}");
        // Only `parse` sets it: the JSON can't.
        assert!(Config::parse(br#"{"endpoints":["10.0.0.1:80"],"scope":"x/"}"#).is_err());
    }

    fn err(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn the_start_up_line_names_a_discovered_pool() {
        let fixed = Config::parse(br#"{"endpoints":["10.0.0.1:80","10.0.0.2:80"]}"#).unwrap();
        assert_eq!(
            fixed.started(),
            "prefix-router: configured with 2 replicas, header `x-gateway-destination-endpoint`"
        );
        let found =
            Config::parse(br#"{"discovery":{"cluster":"pool","admin_cluster":"envoy_admin"}}"#)
                .unwrap();
        assert_eq!(
            found.started(),
            "prefix-router: configured with 0 static replicas and the hosts of cluster `pool` \
             (discovered through `envoy_admin`), header `x-gateway-destination-endpoint`"
        );
    }

    #[test]
    fn stored_responses_without_a_fallback_address_are_advised_against() {
        let key = "0123456789abcdef0123456789abcdef-test";
        let with = |extra: &str| {
            let json = format!(
                r#"{{"endpoints":["10.0.0.1:80"],"inference_paths":["/v1/responses"],"affinity":{{"key":"{key}","response_ids":true}}{extra}}}"#
            );
            Config::parse(json.as_bytes()).unwrap().advice()
        };
        let advice = with("");
        assert_eq!(advice.len(), 1);
        assert!(advice[0].contains("`max_fallbacks`"), "{advice:?}");
        assert!(with(r#","max_fallbacks":1"#).is_empty());
        let plain = Config::parse(br#"{"endpoints":["10.0.0.1:80"]}"#).unwrap();
        assert!(plain.advice().is_empty());
    }

    /// Review finding: only bodies on an `inference_paths` entry ending
    /// in `/responses` are named or followed, and the default paths have
    /// none, so `response_ids` alone parsed and did nothing at all: every
    /// follow-up on another replica than its create's got a 404, as
    /// without the option.
    #[test]
    fn stored_responses_need_a_responses_path() {
        let with = |paths: &str| {
            format!(
                r#"{{"endpoints":["10.0.0.1:80"],{paths}"affinity":{{"key":"{KEY}","response_ids":true}}}}"#
            )
        };
        let e = err(&with(""));
        assert!(
            e.contains("`affinity.response_ids`") && e.contains("`inference_paths`"),
            "{e}"
        );
        let e = err(&with(r#""inference_paths":["/v1/chat/completions"],"#));
        assert!(e.contains("`affinity.response_ids`"), "{e}");
        let ok = with(r#""inference_paths":["/v1/completions","/openai/v1/responses"],"#);
        assert!(Config::parse(ok.as_bytes()).is_ok());
        // Off, the paths don't matter.
        let off = format!(r#"{{"endpoints":["10.0.0.1:80"],"affinity":{{"key":"{KEY}"}}}}"#);
        assert!(Config::parse(off.as_bytes()).is_ok());
    }

    /// Review finding: `traffic_balance` acts only with several gateways
    /// and scraped vLLM lookup counters; set anywhere else it parsed and
    /// did nothing, without a word.
    #[test]
    fn traffic_balance_where_it_cannot_act_is_advised_against() {
        let with = |extra: &str| {
            let json = format!(r#"{{"endpoints":["10.0.0.1:80"],"traffic_balance":true{extra}}}"#);
            Config::parse(json.as_bytes()).unwrap().advice()
        };
        for extra in [
            r#","cluster":"pool""#,
            r#","gateways":3"#,
            r#","gateways":3,"cluster":"pool","engine":"sglang""#,
            r#","gateways":3,"cluster":"pool","engine":"trtllm""#,
        ] {
            let advice = with(extra);
            assert_eq!(advice.len(), 1, "{extra}: {advice:?}");
            assert!(advice[0].contains("`traffic_balance`"), "{advice:?}");
        }
        assert!(with(r#","gateways":3,"cluster":"pool""#).is_empty());
    }

    #[test]
    fn a_scrape_timeout_above_the_staleness_is_advised_against() {
        let with = |extra: &str| {
            let json = format!(r#"{{"endpoints":["10.0.0.1:80"],"cluster":"pool"{extra}}}"#);
            Config::parse(json.as_bytes()).unwrap().advice()
        };
        assert!(with("").is_empty(), "the defaults");
        let advice = with(r#","scrape_timeout_ms":3000"#);
        assert_eq!(advice.len(), 1);
        assert!(advice[0].contains("`staleness_ms` (2000 ms)"), "{advice:?}");
        assert!(with(r#","scrape_timeout_ms":3000,"staleness_ms":4000"#).is_empty());
    }

    /// The README's configuration table states each key's default, and
    /// its samples (and the operators' guide's) are what operators paste:
    /// both must hold for this
    /// build (a default changed in code, a key renamed, a stale sample).
    #[test]
    fn the_readme_states_the_real_defaults_and_its_samples_parse() {
        let readme = include_str!("../README.md");
        let base = r#""endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]"#;
        let parse = |extra: &str| Config::parse(format!("{{{base}{extra}}}").as_bytes());
        let default = format!("{:?}", parse("").unwrap());
        let mut checked = Vec::new();
        for row in readme.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split(" | ").collect();
            let (Some(key), Some(value)) = (cells.first(), cells.get(1)) else {
                continue;
            };
            let key = key.trim_start_matches("| ").trim_matches('`');
            let Some(value) = value.strip_prefix('`').and_then(|v| v.strip_suffix('`')) else {
                continue; // "required", "none", another key's name
            };
            if key.contains('.') || key == "metrics_cluster" {
                continue; // stats, and a default that names another key
            }
            let json = match serde_json::from_str::<serde_json::Value>(value) {
                Ok(_) => value.to_string(),
                Err(_) => format!("{value:?}"),
            };
            let got = parse(&format!(r#", "{key}": {json}"#));
            let got = got.map(|c| format!("{c:?}"));
            assert_eq!(
                got.ok().as_ref(),
                Some(&default),
                "README's default of `{key}`"
            );
            checked.push(key);
        }
        assert!(
            checked.len() >= 25,
            "the table's rows were found: {checked:?}"
        );
        let guide = include_str!("../docs/operators-guide.md");
        let samples: Vec<&str> = [readme, guide]
            .iter()
            .flat_map(|doc| doc.split("```json\n").skip(1))
            .filter_map(|b| b.split("```").next())
            .collect();
        assert!(samples.len() >= 6);
        for sample in samples {
            if let Err(e) = Config::parse(sample.as_bytes()) {
                panic!("README sample {sample} does not parse: {e}");
            }
        }
    }

    #[test]
    fn staleness_must_outlast_two_scrape_intervals() {
        let cfg = |interval: u64, staleness: u64| {
            format!(
                r#"{{"endpoints":["10.0.0.1:80"],"cluster":"pool","scrape_interval_ms":{interval},"staleness_ms":{staleness}}}"#
            )
        };
        let e = err(&cfg(5000, 2000));
        assert!(
            e.contains("`staleness_ms`") && e.contains("scrape_interval_ms"),
            "{e}"
        );
        assert!(Config::parse(cfg(1000, 2000).as_bytes()).is_ok());
        assert!(Config::parse(cfg(1000, 1999).as_bytes()).is_err());
        // Without scraping there is nothing to go stale.
        let quiet = r#"{"endpoints":["10.0.0.1:80"],"scrape_interval_ms":5000}"#;
        assert!(Config::parse(quiet.as_bytes()).is_ok());
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::parse(br#"{"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}"#).unwrap();
        assert_eq!(c.static_endpoints.len(), 2);
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!(
            c.inference_paths,
            vec!["/v1/completions", "/v1/chat/completions", "/v1/messages"]
        );
        assert_eq!(c.max_fallbacks, 0);
        assert_eq!(c.block_bytes, 64);
        assert_eq!(c.max_blocks, 256);
        assert!(!c.debug_header);
    }

    #[test]
    fn accepts_ipv6() {
        let c = Config::parse(br#"{"endpoints": ["[::1]:8000", "[fd00::2]:8001"]}"#).unwrap();
        assert_eq!(c.static_endpoints[1].as_str(), "[fd00::2]:8001");
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
        assert!(c.static_endpoints.is_empty());
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
        assert!(c.static_endpoints.is_empty());
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

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn gateways_default_to_one_and_are_bounded() {
        let c = Config::parse(br#"{"endpoints":["10.0.0.1:1"]}"#).unwrap();
        assert_eq!(c.gateways, 1);
        assert!(c.hit_rate_feedback);
        let off = br#"{"endpoints":["10.0.0.1:1"],"hit_rate_feedback":false}"#;
        assert!(!Config::parse(off).unwrap().hit_rate_feedback);
        assert!(!c.traffic_balance);
        let on = br#"{"endpoints":["10.0.0.1:1"],"traffic_balance":true}"#;
        assert!(Config::parse(on).unwrap().traffic_balance);
        let c = Config::parse(br#"{"endpoints":["10.0.0.1:1"],"gateways":64}"#).unwrap();
        assert_eq!(c.gateways, 64);
        for bad in ["0", "65"] {
            let json = format!(r#"{{"endpoints":["10.0.0.1:1"],"gateways":{bad}}}"#);
            assert!(err(&json).contains("`gateways`"), "{bad}");
        }
        assert!(err(r#"{"endpoints":["10.0.0.1:1"],"gateways":-1}"#).contains("invalid value"));
    }

    #[test]
    fn affinity_is_off_by_default_and_gets_its_defaults() {
        let c = Config::parse(br#"{"endpoints":["10.0.0.1:1"]}"#).unwrap();
        assert!(c.affinity.is_none());
        let json = format!(r#"{{"endpoints":["10.0.0.1:1"],"affinity":{{"key":"{KEY}"}}}}"#);
        let a = Config::parse(json.as_bytes()).unwrap().affinity.unwrap();
        assert_eq!(a.header, "x-prefix-router-affinity");
        assert_eq!(a.key, KEY);
        assert_eq!((a.max_age_s, a.clients_echo), (3600, false));
        assert!(!a.response_ids);
        let json = format!(
            r#"{{"endpoints":["10.0.0.1:1"],"affinity":{{"header":"x-session","key":"{KEY}","max_age_s":604800,"clients_echo":true}}}}"#
        );
        let a = Config::parse(json.as_bytes()).unwrap().affinity.unwrap();
        assert_eq!((a.header.as_str(), a.max_age_s), ("x-session", 604_800));
        assert!(a.clients_echo);
        assert_eq!(a.cookie, None);
        let json = format!(
            r#"{{"endpoints":["10.0.0.1:1"],"affinity":{{"key":"{KEY}","cookie":"PR_affinity"}}}}"#
        );
        let a = Config::parse(json.as_bytes()).unwrap().affinity.unwrap();
        assert_eq!(a.cookie.as_deref(), Some("PR_affinity"));
        assert_eq!(a.cookie_sessions, 16);
    }

    #[test]
    fn affinity_errors_name_the_key_and_never_show_the_secret() {
        let with = |inner: &str| format!(r#"{{"endpoints":["10.0.0.1:1"],"affinity":{inner}}}"#);
        let short = "s3cret-but-only-31-bytes-long!!";
        assert_eq!(short.len(), 31);
        let e = err(&with(&format!(r#"{{"key":"{short}"}}"#)));
        assert!(e.contains("`affinity.key`") && !e.contains(short), "{e}");
        assert!(err(&with("{}")).contains("`affinity.key`"));
        let bad_header = with(&format!(r#"{{"header":"X-Bad","key":"{KEY}"}}"#));
        assert!(err(&bad_header).contains("`affinity.header`"));
        let clash = with(&format!(
            r#"{{"header":"x-gateway-destination-endpoint","key":"{KEY}"}}"#
        ));
        assert!(err(&clash).contains("`affinity.header`"));
        // Review finding: the token's header is removed from every request
        // and replaced on every 2xx response. Named after a header that
        // carries something else, that wiped the client's cookies or
        // credentials before the upstream, or the upstream's own
        // `set-cookie` (every copy) and the response's framing.
        for name in [
            "cookie",
            "set-cookie",
            "authorization",
            "content-length",
            "content-type",
            "transfer-encoding",
            "host",
            "x-prefix-router-debug",
            "x-prefix-router-priority",
            "x-envoy-retry-on",
        ] {
            let json = with(&format!(r#"{{"header":"{name}","key":"{KEY}"}}"#));
            let e = Config::parse(json.as_bytes())
                .map(|_| ())
                .map_err(|e| e.to_string());
            assert!(
                e.as_ref().is_err_and(|e| e.contains("`affinity.header`")),
                "{name}: {e:?}"
            );
        }
        for name in ["", "a=b", "a b", "semi;colon", &"c".repeat(65)] {
            let json = with(&format!(r#"{{"key":"{KEY}","cookie":"{name}"}}"#));
            assert!(err(&json).contains("`affinity.cookie`"), "{name}");
        }
        for n in ["0", "65"] {
            let json = with(&format!(
                r#"{{"key":"{KEY}","cookie":"pr","cookie_sessions":{n}}}"#
            ));
            assert!(err(&json).contains("`affinity.cookie_sessions`"), "{n}");
        }
        for age in ["0", "604801", "4294967306"] {
            let json = with(&format!(r#"{{"key":"{KEY}","max_age_s":{age}}}"#));
            assert!(err(&json).contains("`affinity.max_age_s`"), "{age}");
        }
        assert!(
            err(&with(&format!(r#"{{"key":"{KEY}","ttl":5}}"#))).contains("unknown field `ttl`")
        );
        let c = Config::parse(with(&format!(r#"{{"key":"{KEY}"}}"#)).as_bytes()).unwrap();
        assert!(!format!("{c:?}").contains(KEY));
    }

    #[test]
    fn scraping_is_derived_from_its_keys() {
        let c = Config::parse(br#"{"endpoints":["10.0.0.1:1"]}"#).unwrap();
        assert!(c.scrape.is_none());
        let c = Config::parse(
            br#"{"endpoints":["10.0.0.1:1"],"cluster":"pool","metrics_path":"/m","engine":"sglang"}"#,
        )
        .unwrap();
        let s = c.scrape.unwrap();
        assert_eq!((s.cluster.as_str(), s.path.as_str()), ("pool", "/m"));
        assert_eq!(
            (s.interval_ms, s.timeout_ms, s.max_bytes),
            (100, 1000, 1 << 20)
        );
        assert_eq!(s.engine, Engine::Sglang);
        // Each engine's own page by default: trtllm-serve's `/metrics` is
        // JSON, its Prometheus text is under `/prometheus`.
        for (engine, path) in [
            ("vllm", "/metrics"),
            ("sglang", "/metrics"),
            ("trtllm", "/prometheus/metrics"),
        ] {
            let json =
                format!(r#"{{"endpoints":["10.0.0.1:1"],"cluster":"p","engine":"{engine}"}}"#);
            let c = Config::parse(json.as_bytes()).unwrap();
            assert_eq!(c.scrape.unwrap().path, path, "{engine}");
        }
        let c = Config::parse(
            br#"{"endpoints":["10.0.0.1:1"],"cluster":"pool","metrics_cluster":"direct"}"#,
        )
        .unwrap();
        assert_eq!(c.scrape.unwrap().cluster, "direct");
        assert!(err(r#"{"endpoints":["10.0.0.1:1"],"metrics_cluster":""}"#)
            .contains("`metrics_cluster`"));
        assert!(
            err(r#"{"endpoints":["10.0.0.1:1"],"cluster":"p","metrics_path":"m"}"#)
                .contains("`metrics_path`")
        );
        // Without a cluster the scraping keys are not used, so not checked.
        assert!(Config::parse(br#"{"endpoints":["10.0.0.1:1"],"scrape_interval_ms":1}"#).is_ok());
    }

    #[test]
    fn numbers_out_of_range_name_their_key() {
        for (key, v) in [
            ("max_body_bytes", "0"),
            ("block_bytes", "4"),
            ("max_blocks", "4097"),
            ("index_capacity", "63"),
            ("index_stride", "257"),
            ("checkpoints_per_doubling", "0"),
            ("trunk_min_new_blocks", "0"),
            ("staleness_ms", "5"),
            ("unhealthy_after", "0"),
            ("queue_threshold", "-1"),
            ("kv_threshold", "1.5"),
            ("priority_header", "\"Bad\""),
        ] {
            let json = format!(r#"{{"endpoints":["10.0.0.1:1"],"{key}":{v}}}"#);
            assert!(
                err(&json).contains(&format!("`{key}`")),
                "{key}: {}",
                err(&json)
            );
        }
    }
}
