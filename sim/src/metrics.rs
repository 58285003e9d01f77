//! Per-replica Prometheus metrics under vLLM's names, rendered by hand in the
//! text exposition format (0.0.4). Counters and histograms are reset by the
//! admin `/reset`; gauges always show live engine state.
//!
//! Latency histograms record *simulated* seconds, so numbers read the same
//! at any `--time-scale`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Every single-sample gauge and counter of the page: the series whose
/// values the `absurd` metrics fault may replace.
pub const SCALARS: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
];
/// vLLM's end-to-end latency buckets (seconds).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

/// Static facts about the replica shown in info metrics.
pub struct Info {
    pub model: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_lora: usize,
    pub has_lora: bool,
}

#[derive(Default)]
pub struct Gauges {
    /// Requests queued in the engine.
    pub waiting: AtomicU64,
    /// Requests held by a fault/test delay before reaching the engine; they
    /// count as waiting, as they would in a real server's queue.
    pub delayed: AtomicU64,
    pub running: AtomicU64,
    /// f64 bits.
    pub kv_usage: AtomicU64,
}

#[derive(Default)]
pub struct Counters {
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub request_success: AtomicU64,
}

pub struct Metrics {
    info: Info,
    pub gauges: Gauges,
    pub counters: Counters,
    ttft: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
    /// (running adapters, waiting adapters), comma-separated.
    lora: Mutex<(String, String)>,
}

impl Metrics {
    pub fn new(info: Info) -> Self {
        Self {
            info,
            gauges: Gauges::default(),
            counters: Counters::default(),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            e2e: Mutex::new(Histogram::new(E2E_BUCKETS)),
            lora: Mutex::new((String::new(), String::new())),
        }
    }

    pub fn observe_ttft(&self, seconds: f64) {
        lock(&self.ttft).observe(seconds);
    }

    /// (sum of seconds, count) of the TTFT histogram.
    #[cfg(test)]
    pub fn ttft_totals(&self) -> (f64, u64) {
        let h = lock(&self.ttft);
        (h.sum, h.count)
    }

    pub fn observe_e2e(&self, seconds: f64) {
        lock(&self.e2e).observe(seconds);
    }

    pub fn set_kv_usage(&self, v: f64) {
        self.gauges.kv_usage.store(v.to_bits(), Relaxed);
    }

    pub fn set_lora(&self, running: String, waiting: String) {
        *lock(&self.lora) = (running, waiting);
    }

    pub fn num_waiting(&self) -> u64 {
        self.gauges.waiting.load(Relaxed) + self.gauges.delayed.load(Relaxed)
    }

    /// Zeroes counters and histograms (the admin reset).
    pub fn reset(&self) {
        let c = &self.counters;
        for a in [
            &c.prefix_queries,
            &c.prefix_hits,
            &c.prompt_tokens,
            &c.generation_tokens,
            &c.request_success,
        ] {
            a.store(0, Relaxed);
        }
        *lock(&self.ttft) = Histogram::new(TTFT_BUCKETS);
        *lock(&self.e2e) = Histogram::new(E2E_BUCKETS);
    }

    /// The whole `/metrics` page.
    pub fn render(&self) -> String {
        self.render_with(&|_| None)
    }

    /// The page with some of the [`SCALARS`] replaced: `over(name)` gives
    /// the value to show instead of the live one (the `absurd` fault).
    pub fn render_with(&self, over: &dyn Fn(&str) -> Option<f64>) -> String {
        let pick = |name: &str, live: f64| over(name).unwrap_or(live);
        let mut out = String::with_capacity(8192);
        let l = format!("model_name=\"{}\",engine=\"0\"", escape(&self.info.model));
        let g = &self.gauges;
        let c = &self.counters;
        let gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                g.running.load(Relaxed) as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                self.num_waiting() as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                f64::from_bits(g.kv_usage.load(Relaxed)),
            ),
        ];
        for (name, help, v) in gauges {
            sample(&mut out, name, help, "gauge", &l, pick(name, v));
        }
        let counters = [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                &c.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                &c.prefix_hits,
            ),
            (
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                &c.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                &c.generation_tokens,
            ),
        ];
        for (name, help, v) in counters {
            let v = pick(name, v.load(Relaxed) as f64);
            sample(&mut out, name, help, "counter", &l, v);
        }
        let success = format!("{l},finished_reason=\"length\"");
        let name = "vllm:request_success_total";
        sample(
            &mut out,
            name,
            "Count of successfully processed requests.",
            "counter",
            &success,
            pick(name, c.request_success.load(Relaxed) as f64),
        );
        histogram(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &l,
            &lock(&self.ttft),
        );
        histogram(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &l,
            &lock(&self.e2e),
        );
        let cache = format!(
            "block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"True\"",
            self.info.block_size, self.info.num_gpu_blocks
        );
        sample(
            &mut out,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            "gauge",
            &cache,
            1.0,
        );
        if self.info.has_lora {
            self.render_lora(&mut out);
        }
        out
    }

    /// vLLM publishes the adapter sets as labels with the update time
    /// (unix seconds) as value; consumers take the newest series.
    fn render_lora(&self, out: &mut String) {
        let (running, waiting) = lock(&self.lora).clone();
        let labels = format!(
            "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
            self.info.max_lora,
            escape(&running),
            escape(&waiting)
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        sample(
            out,
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            "gauge",
            &labels,
            now,
        );
    }
}

fn sample(out: &mut String, name: &str, help: &str, kind: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {}",
        num(v)
    );
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cumulative = 0;
    for (b, n) in h.bounds.iter().zip(&h.counts) {
        cumulative += n;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"{}\"}} {cumulative}",
            num(*b)
        );
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", num(h.sum));
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

/// Prometheus floats: always with a decimal point, like the Python client;
/// `NaN`/`+Inf`/`-Inf` as the format spells them (Rust would print `inf`);
/// huge magnitudes in exponent form (Rust would print all 309 digits).
pub fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        (if v > 0.0 { "+Inf" } else { "-Inf" }).into()
    } else if v.abs() >= 1e15 {
        format!("{v:e}")
    } else if v.fract() == 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Label values escape backslash, quote and newline.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A poisoned lock only means another thread panicked mid-update of plain
/// numbers; the data is still usable, so never propagate the panic.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> Metrics {
        Metrics::new(Info {
            model: "m\"x".into(),
            block_size: 16,
            num_gpu_blocks: 10,
            max_lora: 2,
            has_lora: true,
        })
    }

    #[test]
    fn histogram_is_cumulative_and_reset_zeroes_it() {
        let m = metrics();
        m.observe_ttft(0.003);
        m.observe_ttft(0.5);
        m.observe_ttft(10_000.0);
        m.counters.prompt_tokens.store(42, Relaxed);
        let page = m.render();
        assert!(page.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"0.005\"} 1\n"));
        assert!(page.contains("le=\"0.5\"} 2\n"));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_count{model_name=\"m\\\"x\",engine=\"0\"} 3\n"
        ));
        assert!(page.contains("le=\"+Inf\"} 3\n"));
        assert!(
            page.contains("vllm:prompt_tokens_total{model_name=\"m\\\"x\",engine=\"0\"} 42.0\n")
        );
        assert!(page.contains("vllm:lora_requests_info{max_lora=\"2\""));
        m.reset();
        let page = m.render();
        assert!(page.contains("vllm:prompt_tokens_total{model_name=\"m\\\"x\",engine=\"0\"} 0.0\n"));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_count{model_name=\"m\\\"x\",engine=\"0\"} 0\n"
        ));
    }

    #[test]
    fn special_values_use_prometheus_spelling() {
        assert_eq!(num(f64::NAN), "NaN");
        assert_eq!(num(f64::INFINITY), "+Inf");
        assert_eq!(num(f64::NEG_INFINITY), "-Inf");
        assert_eq!(num(1e308), "1e308");
        assert_eq!(num(-1e39), "-1e39");
        assert_eq!(num(42.0), "42.0");
        assert_eq!(num(-1.0), "-1.0");
        assert_eq!(num(0.25), "0.25");
    }

    #[test]
    fn every_scalar_can_be_overridden() {
        let m = metrics();
        m.counters.prompt_tokens.store(7, Relaxed);
        let page = m.render_with(&|name| SCALARS.contains(&name).then_some(-2.5));
        for name in SCALARS {
            let line = page
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .unwrap_or_else(|| panic!("{name} missing"));
            assert!(line.ends_with("} -2.5"), "{line}");
        }
        assert!(m
            .render()
            .contains("vllm:prompt_tokens_total{model_name=\"m\\\"x\",engine=\"0\"} 7.0\n"));
    }
}
