//! Command line: a preset plus per-parameter overrides.

use clap::Parser;

use crate::metrics_fault::{MetricsFault, ScrapeMode, DEFAULT_HUGE_BYTES, DEFAULT_STALL_MS};
use crate::preset::{EngineConfig, Preset};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "replica-sim",
    version,
    about = "Simulated vLLM-style model-server replicas with a paged, prefix-reusing KV cache"
)]
pub struct Cli {
    /// Address to bind. Keep it on loopback for tests and benchmarks.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// First port; replica i listens on port+i. 0 = any free port per replica.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Number of independent replicas served by this process.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub replicas: u16,
    /// Served model name (the `model_name` metrics label).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Cost model and capacity (see README for sources).
    #[arg(long, value_enum, default_value_t = Preset::A10g7b)]
    pub preset: Preset,
    /// Real time per simulated time: 0.1 runs 10x faster. Metrics stay in
    /// simulated time.
    #[arg(long)]
    pub time_scale: Option<f64>,
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// KV cache size in blocks of --block-size tokens.
    #[arg(long, conflicts_with = "kv_tokens")]
    pub kv_blocks: Option<usize>,
    /// KV cache size in tokens (rounded down to whole blocks).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Per-replica share of the KV cache (comma-separated, replica 0
    /// first; replicas past the list keep all of it): `1,1,1,0.25` gives
    /// the fourth replica a quarter, as a pool of mixed GPUs has.
    #[arg(long, value_delimiter = ',')]
    pub kv_fractions: Vec<f64>,
    #[arg(long)]
    pub block_size: Option<usize>,
    #[arg(long)]
    pub step_overhead_ms: Option<f64>,
    #[arg(long)]
    pub prefill_ms_per_token: Option<f64>,
    /// Decode cost of a step at batch 1 (excluding the step overhead).
    #[arg(long)]
    pub decode_ms_per_step: Option<f64>,
    /// Extra decode cost per additional running sequence.
    #[arg(long)]
    pub decode_ms_per_seq: Option<f64>,
    /// LoRA adapter names servable by the `model` request field.
    #[arg(long, value_delimiter = ',')]
    pub lora: Vec<String>,
    /// Adapters resident at once.
    #[arg(long)]
    pub max_loras: Option<usize>,
    #[arg(long)]
    pub lora_load_ms: Option<f64>,
    /// `max_tokens` when a request gives none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Fraction of inference requests answered 500 (spread evenly).
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Start in fault mode "slow" with this real-time delay before the first
    /// token.
    #[arg(long, default_value_t = 0)]
    pub slow_ms: u64,
    /// Start with this `/metrics` fault (switchable later through
    /// `/admin/metrics-fault`).
    #[arg(long, value_enum, default_value_t = ScrapeMode::Ok)]
    pub metrics_fault: ScrapeMode,
    /// Replica indices (0-based, comma-separated) that start with
    /// --metrics-fault; the others start `ok`. Default: all replicas.
    #[arg(long, value_delimiter = ',')]
    pub metrics_fault_replicas: Vec<u16>,
    /// Size in bytes of the page in --metrics-fault huge.
    #[arg(long, default_value_t = DEFAULT_HUGE_BYTES)]
    pub metrics_huge_bytes: u64,
    /// Upper bound (ms) of a stalled page in --metrics-fault stall.
    #[arg(long, default_value_t = DEFAULT_STALL_MS)]
    pub metrics_stall_ms: u64,
}

impl Cli {
    /// The preset with every given override applied, validated.
    pub fn engine_config(&self) -> Result<EngineConfig, String> {
        let mut c = self.preset.config();
        set(&mut c.time_scale, self.time_scale);
        set(&mut c.max_num_seqs, self.max_num_seqs);
        set(&mut c.max_num_batched_tokens, self.max_num_batched_tokens);
        set(&mut c.max_model_len, self.max_model_len);
        set(&mut c.block_size, self.block_size);
        set(&mut c.kv_blocks, self.kv_blocks);
        if let Some(tokens) = self.kv_tokens {
            c.kv_blocks = tokens / c.block_size.max(1);
        }
        set(&mut c.step_overhead_ms, self.step_overhead_ms);
        set(&mut c.prefill_ms_per_token, self.prefill_ms_per_token);
        set(&mut c.decode_ms_per_step, self.decode_ms_per_step);
        set(&mut c.decode_ms_per_seq, self.decode_ms_per_seq);
        set(&mut c.max_loras, self.max_loras);
        set(&mut c.lora_load_ms, self.lora_load_ms);
        // A sequence must fit in the cache on its own or it could never run.
        c.max_model_len = c.max_model_len.min(c.kv_tokens());
        c.validate()?;
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err("fail-rate must be within 0..=1".into());
        }
        Ok(c)
    }
}

impl Cli {
    /// Replica `index`'s engine config: `base` with its share of the KV
    /// cache (`--kv-fractions`), still able to hold one sequence.
    pub fn replica_config(&self, base: &EngineConfig, index: u16) -> Result<EngineConfig, String> {
        let mut c = base.clone();
        if let Some(&f) = self.kv_fractions.get(usize::from(index)) {
            if !(f > 0.0 && f <= 1.0) {
                return Err(format!("kv-fractions: {f} is not within (0, 1]"));
            }
            c.kv_blocks = ((c.kv_blocks as f64 * f) as usize).max(1);
            c.max_model_len = c.max_model_len.min(c.kv_tokens());
            c.validate()?;
        }
        Ok(c)
    }

    /// The `/metrics` fault replica `index` starts with.
    pub fn metrics_fault_for(&self, index: u16) -> MetricsFault {
        let chosen =
            self.metrics_fault_replicas.is_empty() || self.metrics_fault_replicas.contains(&index);
        let mode = if chosen {
            self.metrics_fault
        } else {
            ScrapeMode::Ok
        };
        MetricsFault {
            bytes: self.metrics_huge_bytes,
            stall_ms: self.metrics_stall_ms,
            ..MetricsFault::new(mode)
        }
    }

    pub fn validate_metrics_fault(&self) -> Result<(), String> {
        if let Some(i) = self
            .metrics_fault_replicas
            .iter()
            .find(|i| **i >= self.replicas)
        {
            return Err(format!(
                "metrics-fault-replicas: no replica {i} (--replicas {})",
                self.replicas
            ));
        }
        self.metrics_fault_for(0).validate()
    }
}

fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_apply_over_preset() {
        let cli = Cli::parse_from([
            "replica-sim",
            "--preset",
            "fast",
            "--kv-tokens",
            "1000",
            "--max-num-seqs",
            "4",
            "--time-scale",
            "0.1",
        ]);
        let c = cli.engine_config().unwrap();
        assert_eq!(c.kv_blocks, 62);
        assert_eq!(c.max_num_seqs, 4);
        assert_eq!(c.time_scale, 0.1);
        assert_eq!(c.max_model_len, 992, "clamped to cache capacity");
        assert_eq!(
            c.prefill_ms_per_token,
            Preset::Fast.config().prefill_ms_per_token
        );
    }

    #[test]
    fn rejects_bad_values() {
        let cli = Cli::parse_from(["replica-sim", "--fail-rate", "2"]);
        assert!(cli.engine_config().is_err());
        assert!(
            Cli::try_parse_from(["replica-sim", "--kv-blocks", "1", "--kv-tokens", "16"]).is_err()
        );
    }

    #[test]
    fn metrics_fault_applies_to_the_chosen_replicas() {
        let cli = Cli::parse_from([
            "replica-sim",
            "--replicas",
            "3",
            "--metrics-fault",
            "stall",
            "--metrics-fault-replicas",
            "0,2",
            "--metrics-stall-ms",
            "500",
        ]);
        cli.validate_metrics_fault().unwrap();
        let modes: Vec<_> = (0..3).map(|i| cli.metrics_fault_for(i).mode).collect();
        assert_eq!(
            modes,
            [ScrapeMode::Stall, ScrapeMode::Ok, ScrapeMode::Stall]
        );
        assert_eq!(cli.metrics_fault_for(2).stall_ms, 500);
        let all = Cli::parse_from(["replica-sim", "--replicas", "2", "--metrics-fault", "huge"]);
        assert!((0..2).all(|i| all.metrics_fault_for(i).mode == ScrapeMode::Huge));
        assert_eq!(all.metrics_fault_for(1).bytes, 40 << 20);
        for bad in [
            &["--replicas", "2", "--metrics-fault-replicas", "2"][..],
            &["--metrics-huge-bytes", "2000000000"],
            &["--metrics-stall-ms", "4000000"],
        ] {
            let cli = Cli::parse_from(std::iter::once("replica-sim").chain(bad.iter().copied()));
            assert!(cli.validate_metrics_fault().is_err(), "{bad:?}");
        }
        assert!(Cli::try_parse_from(["replica-sim", "--metrics-fault", "sideways"]).is_err());
    }

    #[test]
    fn kv_fractions_shrink_single_replicas() {
        let cli = Cli::try_parse_from([
            "replica-sim",
            "--kv-blocks",
            "1000",
            "--kv-fractions",
            "1,0.25",
        ])
        .unwrap();
        let base = cli.engine_config().unwrap();
        assert_eq!(cli.replica_config(&base, 0).unwrap().kv_blocks, 1000);
        let small = cli.replica_config(&base, 1).unwrap();
        assert_eq!(small.kv_blocks, 250);
        assert!(small.max_model_len <= small.kv_tokens());
        assert_eq!(cli.replica_config(&base, 2).unwrap().kv_blocks, 1000);
        for bad in ["0", "1.5", "-1", "NaN"] {
            let arg = format!("--kv-fractions={bad}");
            let cli = Cli::try_parse_from(["replica-sim", arg.as_str()]).unwrap();
            assert!(cli.replica_config(&base, 0).is_err(), "{bad}");
        }
    }
}
