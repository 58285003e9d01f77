//! One simulated replica: its engine, metrics, fault state and identity.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::http::HeaderValue;
use tokio::sync::watch;

use crate::engine::{self, EngineHandle};
use crate::fault::{FailRate, Fault, Mode};
use crate::hash::hash_str;
use crate::metrics::{Info, Metrics};
use crate::metrics_fault::MetricsFault;
use crate::preset::EngineConfig;
use crate::responses::Store;

/// Stored responses a replica keeps, and their text; the oldest go first.
const STORED_RESPONSES: usize = 65_536;
const STORED_BYTES: usize = 64 << 20;

/// Settings shared by all replicas of the process.
#[derive(Clone)]
pub struct Settings {
    pub cfg: EngineConfig,
    pub model: String,
    pub loras: Vec<String>,
    pub default_max_tokens: usize,
    pub fail_rate: f64,
    pub slow_ms: u64,
}

pub struct Replica {
    /// `HOST:PORT` this replica listens on, for `x-served-by`.
    pub served_by: HeaderValue,
    pub port: u16,
    pub settings: Settings,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub fault: watch::Sender<Fault>,
    /// The `/metrics` fault; a watch so a stalled scrape wakes on a change.
    pub metrics_fault: watch::Sender<MetricsFault>,
    pub fail: FailRate,
    pub next_id: AtomicU64,
    /// Stored Responses API conversations, by response id (in memory, as
    /// vLLM keeps them).
    pub responses: Store,
}

impl Replica {
    /// Builds the replica and starts its engine (needs a tokio runtime).
    /// `metrics_fault` is per replica (unlike `settings`), so one replica
    /// of a process can start with a broken `/metrics`.
    pub fn start(
        addr: std::net::SocketAddr,
        settings: Settings,
        metrics_fault: MetricsFault,
    ) -> Arc<Self> {
        let cfg = &settings.cfg;
        let metrics = Arc::new(Metrics::new(Info {
            model: settings.model.clone(),
            block_size: cfg.block_size,
            num_gpu_blocks: cfg.kv_blocks,
            max_lora: cfg.max_loras,
            has_lora: !settings.loras.is_empty(),
        }));
        let engine = engine::spawn(cfg.clone(), metrics.clone(), settings.loras.clone());
        let initial = match settings.slow_ms {
            0 => Fault {
                mode: Mode::Ok,
                delay_ms: 0,
            },
            ms => Fault {
                mode: Mode::Slow,
                delay_ms: ms,
            },
        };
        let served_by = HeaderValue::from_str(&addr.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Arc::new(Self {
            served_by,
            port: addr.port(),
            fail: FailRate::new(settings.fail_rate),
            settings,
            engine,
            metrics,
            fault: watch::Sender::new(initial),
            metrics_fault: watch::Sender::new(metrics_fault),
            next_id: AtomicU64::new(0),
            responses: Store::new(STORED_RESPONSES, STORED_BYTES),
        })
    }

    /// Adapter index selected by a request's `model`; other names (including
    /// unknown ones, for leniency toward test clients) mean the base model.
    pub fn lora_index(&self, model: Option<&str>) -> Option<usize> {
        let m = model?;
        self.settings.loras.iter().position(|l| l == m)
    }

    /// Hash-chain seed: adapters never share KV with the base model or each
    /// other, as in vLLM (the adapter is part of the block key).
    /// The block-hash chain's seed: the LoRA adapter and the cache salt,
    /// which vLLM hashes into a request's blocks, so neither shares KV
    /// with a request that differs in them.
    pub fn hash_seed(&self, lora: Option<usize>, cache_salt: Option<&str>) -> u64 {
        let adapter = lora
            .and_then(|i| self.settings.loras.get(i))
            .map_or(0, |name| hash_str(name));
        cache_salt.map_or(adapter, |s| adapter ^ hash_str(s).rotate_left(17))
    }
}
