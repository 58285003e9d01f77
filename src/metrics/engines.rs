//! Which metric families each engine exports for the quantities the router
//! reads: waiting and running requests, KV-cache usage, LoRA adapters, and
//! the prefix cache's queried and hit tokens.

use std::fmt;

use serde::Deserialize;

/// Which model server a replica runs; it decides the metric names to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
    Trtllm,
}

impl Engine {
    /// Where the engine serves its Prometheus page: trtllm-serve's
    /// `/metrics` is JSON iteration statistics (and reading it drains
    /// them); its Prometheus text is at `/prometheus/metrics`.
    pub fn metrics_path(self) -> &'static str {
        match self {
            Engine::Vllm | Engine::Sglang => "/metrics",
            Engine::Trtllm => "/prometheus/metrics",
        }
    }

    /// The spelling used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a family contributes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    Waiting,
    Running,
    KvUsage,
    /// Prefix-cache lookups, in tokens (a counter).
    CacheQueries,
    /// Prefix-cache hits, in tokens (a counter).
    CacheHits,
    /// vLLM's LoRA info gauge: state in labels, timestamp as the value.
    LoraInfo,
}

/// Number of numeric quantities (the targets with a [`Target::slot`]).
pub(super) const QUANTITIES: usize = 5;

impl Target {
    pub(super) fn slot(self) -> Option<usize> {
        Some(match self {
            Target::Waiting => 0,
            Target::Running => 1,
            Target::KvUsage => 2,
            Target::CacheQueries => 3,
            Target::CacheHits => 4,
            Target::LoraInfo => return None,
        })
    }
}

/// Number of alternative spellings a quantity can have.
pub(super) const RANKS: usize = 3;

/// One metric name an engine may use for a quantity. When a page has several
/// spellings of the same quantity (say, a server mid-rename exporting both),
/// the lowest rank present wins rather than adding them up twice.
pub(super) struct Family {
    pub(super) name: &'static str,
    /// Only samples with this label value count (Triton multiplexes several
    /// quantities into one family by a label).
    pub(super) only: Option<(&'static str, &'static str)>,
    pub(super) target: Target,
    pub(super) rank: usize,
}

const fn fam(name: &'static str, target: Target, rank: usize) -> Family {
    Family {
        name,
        only: None,
        target,
        rank,
    }
}

const fn fam_where(
    name: &'static str,
    label: &'static str,
    value: &'static str,
    target: Target,
    rank: usize,
) -> Family {
    Family {
        name,
        only: Some((label, value)),
        target,
        rank,
    }
}

// vLLM: `kv_cache_usage_perc` replaced `gpu_cache_usage_perc`.
const VLLM: &[Family] = &[
    fam("vllm:num_requests_waiting", Target::Waiting, 0),
    fam("vllm:num_requests_running", Target::Running, 0),
    fam("vllm:kv_cache_usage_perc", Target::KvUsage, 0),
    fam("vllm:gpu_cache_usage_perc", Target::KvUsage, 1),
    // Counters: `_total` in the text format; OpenMetrics pages may name the
    // samples without it; `gpu_` is the name before vLLM 0.10.
    fam("vllm:prefix_cache_queries_total", Target::CacheQueries, 0),
    fam("vllm:prefix_cache_queries", Target::CacheQueries, 1),
    fam(
        "vllm:gpu_prefix_cache_queries_total",
        Target::CacheQueries,
        2,
    ),
    fam("vllm:prefix_cache_hits_total", Target::CacheHits, 0),
    fam("vllm:prefix_cache_hits", Target::CacheHits, 1),
    fam("vllm:gpu_prefix_cache_hits_total", Target::CacheHits, 2),
    fam("vllm:lora_requests_info", Target::LoraInfo, 0),
];

const SGLANG: &[Family] = &[
    fam("sglang:num_queue_reqs", Target::Waiting, 0),
    fam("sglang:num_running_reqs", Target::Running, 0),
    fam("sglang:token_usage", Target::KvUsage, 0),
];

// TensorRT-LLM: `trtllm_*` is what `trtllm-serve` exports itself; Dynamo
// used to re-export the same gauges as `trtllm:*`; Triton's TensorRT-LLM
// backend has its own label-multiplexed families (the names the Gateway API
// inference extension maps for Triton).
const TRTLLM: &[Family] = &[
    fam("trtllm_num_requests_waiting", Target::Waiting, 0),
    fam("trtllm:num_requests_waiting", Target::Waiting, 1),
    fam_where(
        "nv_trt_llm_request_metrics",
        "request_type",
        "waiting",
        Target::Waiting,
        2,
    ),
    fam("trtllm_num_requests_running", Target::Running, 0),
    fam("trtllm:num_requests_running", Target::Running, 1),
    fam_where(
        "nv_trt_llm_request_metrics",
        "request_type",
        "scheduled",
        Target::Running,
        2,
    ),
    fam("trtllm_kv_cache_utilization", Target::KvUsage, 0),
    fam("trtllm:kv_cache_utilization", Target::KvUsage, 1),
    fam_where(
        "nv_trt_llm_kv_cache_block_metrics",
        "kv_cache_block_type",
        "fraction",
        Target::KvUsage,
        2,
    ),
];

pub(super) fn families(engine: Engine) -> &'static [Family] {
    match engine {
        Engine::Vllm => VLLM,
        Engine::Sglang => SGLANG,
        Engine::Trtllm => TRTLLM,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_from_config_spelling() {
        let engines: Vec<Engine> = serde_json::from_str(r#"["vllm", "sglang", "trtllm"]"#).unwrap();
        assert_eq!(engines, vec![Engine::Vllm, Engine::Sglang, Engine::Trtllm]);
        assert!(serde_json::from_str::<Engine>(r#""VLLM""#).is_err());
        assert_eq!(Engine::default(), Engine::Vllm);
        assert_eq!(Engine::Trtllm.to_string(), "trtllm");
    }

    #[test]
    fn family_tables_are_consistent() {
        for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
            let table = families(engine);
            // A rank past the array would be silently dropped by `fold`.
            assert!(table.iter().all(|f| f.rank < RANKS));
            for target in [Target::Waiting, Target::Running, Target::KvUsage] {
                assert!(target.slot().is_some_and(|q| q < QUANTITIES));
                assert!(table.iter().any(|f| f.target == target && f.rank == 0));
            }
            // Same name and same filter twice would count samples twice.
            for (i, a) in table.iter().enumerate() {
                for b in table.iter().skip(i + 1) {
                    assert!(!(a.name == b.name && a.only == b.only), "{}", a.name);
                }
            }
        }
    }
}
