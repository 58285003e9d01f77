//! Model-server metrics (Prometheus text) → replica load.
//!
//! The filter scrapes each replica's `/metrics` page and needs only a handful
//! of numbers from it: queue depth, running requests, KV-cache usage, the
//! LoRA adapters in use, and the prefix cache's lookup and hit counters.
//! Everything else on the page (often hundreds of histogram buckets) is
//! skipped after reading the metric name, so the cost is one linear pass
//! over a page whose size the caller has already capped, and memory use is
//! a few small values plus the LoRA names.
//!
//! Three parts:
//! - `text`: a tolerant reader of the text exposition format as servers
//!   really emit it; a line it cannot read is skipped, never fatal;
//! - `engines`: the metric families each [`Engine`] exports for each
//!   quantity;
//! - here, [`parse`]: picks the engine's families out of a page and folds
//!   them into a [`ReplicaMetrics`].
//!
//! Nothing here panics on any input: slicing goes through `str::get`, loops
//! advance by at least one byte per step, and every allocation is bounded by
//! the page size or by the LoRA limits below.

mod engines;
mod text;

use thiserror::Error;

pub use engines::Engine;
use engines::{families, Family, Target, QUANTITIES, RANKS};
use text::Sample;

/// Most LoRA adapter names kept per list, here and in the shared replica
/// table. vLLM's `max_loras` is normally a handful; a replica reporting more
/// is seen with its first ones only.
pub const MAX_LORA_ADAPTERS: usize = 16;
/// Longest adapter name kept, in bytes. A longer one is dropped rather than
/// cut short, since a truncated name would never match a real adapter.
pub const MAX_LORA_NAME_BYTES: usize = 128;

// The replica table stores a list's length and each name's length in a byte.
const _: () = assert!(MAX_LORA_ADAPTERS <= u8::MAX as usize);
const _: () = assert!(MAX_LORA_NAME_BYTES <= u8::MAX as usize);

/// The load picture of one replica, from one scrape.
///
/// Counts are summed over all series of a family (several models, several
/// data-parallel engines); KV usage is the maximum, because the fullest
/// engine is the one that will start preempting. A family missing from the
/// page reads as 0 / empty / `None`; [`parse`] fails only when all of
/// waiting, running and KV usage are missing.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplicaMetrics {
    /// Queued requests. NaN, infinite or negative series count as 0.
    pub waiting: f64,
    /// Running requests. NaN, infinite or negative series count as 0.
    pub running: f64,
    /// KV-cache usage in 0..=1 (clamped; NaN → 0).
    pub kv_usage: f64,
    /// Adapters currently running (vLLM), at most [`MAX_LORA_ADAPTERS`]
    /// distinct names of at most [`MAX_LORA_NAME_BYTES`] bytes each.
    pub running_lora: Vec<String>,
    /// Adapters with queued requests (vLLM), same bounds.
    pub waiting_lora: Vec<String>,
    /// Adapter slots (vLLM's `max_lora` label), if advertised.
    pub max_lora: Option<u32>,
    /// The prefix cache's lifetime totals, in tokens: looked up, and found
    /// (vLLM's counters; `None` when the page has none). Their increments
    /// between scrapes are the replica's measured hit rate.
    pub cache: Option<CacheCounters>,
}

/// Prefix-cache counters as a page reports them (sanitised: finite,
/// non-negative).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CacheCounters {
    pub queries: f64,
    pub hits: f64,
}

#[derive(Debug, Error, PartialEq)]
pub enum MetricsError {
    #[error("metrics page is {len} bytes, over the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    /// The page has none of the engine's waiting/running/KV families, so it
    /// was not served by that engine (wrong port, wrong engine configured,
    /// an error page). Treating it as "idle" would pile traffic onto it.
    #[error("no {engine} load metrics on the page (not a {engine} /metrics page?)")]
    NoKnownFamily { engine: Engine },
}

/// Parses a Prometheus text page for `engine`; pages longer than `max_bytes`
/// are rejected (the caller also caps what it reads).
///
/// Work is one pass over at most `max_bytes` bytes: every line is visited
/// once, so there are at most `max_bytes + 1` lines, and a line whose name
/// is not one of the engine's families is dropped after reading the name.
/// Invalid UTF-8 is replaced line by line, so a stray byte only affects the
/// line it is on.
pub fn parse(
    engine: Engine,
    page: &[u8],
    max_bytes: usize,
) -> Result<ReplicaMetrics, MetricsError> {
    if page.len() > max_bytes {
        return Err(MetricsError::TooLarge {
            len: page.len(),
            limit: max_bytes,
        });
    }
    let table = families(engine);
    let mut acc = Accumulator::default();
    for raw in page.split(|&b| b == b'\n') {
        let line = String::from_utf8_lossy(raw);
        let wanted = |name: &str| table.iter().any(|f| f.name == name);
        let Some(sample) = text::read_sample(&line, wanted) else {
            continue;
        };
        for family in table.iter().filter(|f| f.name == sample.name) {
            acc.add(family, &sample);
        }
    }
    acc.finish(engine)
}

/// Counts can't be negative or unbounded; a NaN/Inf gauge is a broken
/// exporter, and guessing "0" keeps it from dominating a sum.
fn sanitize_count(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

fn sanitize_fraction(v: f64) -> f64 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1.0)
    }
}

#[derive(Debug)]
struct LoraPick {
    stamp: f64,
    running: Vec<String>,
    waiting: Vec<String>,
    max_lora: Option<u32>,
}

#[derive(Debug, Default)]
struct Accumulator {
    /// Per quantity, per rank: the value folded so far, `None` if unseen.
    values: [[Option<f64>; RANKS]; QUANTITIES],
    lora: Option<LoraPick>,
}

impl Accumulator {
    fn add(&mut self, family: &Family, sample: &Sample<'_>) {
        if let Some((key, want)) = family.only {
            if sample.label(key).as_deref() != Some(want) {
                return;
            }
        }
        let v = match family.target {
            Target::LoraInfo => return self.add_lora(sample),
            Target::KvUsage => sanitize_fraction(sample.value),
            Target::Waiting | Target::Running | Target::CacheQueries | Target::CacheHits => {
                sanitize_count(sample.value)
            }
        };
        self.fold(family.target, family.rank, v);
    }

    fn fold(&mut self, target: Target, rank: usize, v: f64) {
        let Some(cell) = target
            .slot()
            .and_then(|q| self.values.get_mut(q))
            .and_then(|ranks| ranks.get_mut(rank))
        else {
            return;
        };
        *cell = Some(match (*cell, target) {
            (None, _) => v,
            (Some(old), Target::KvUsage) => old.max(v),
            // Saturate rather than reach +Inf on absurd pages.
            (Some(old), _) => (old + v).min(f64::MAX),
        });
    }

    /// vLLM keeps one series per distinct adapter state ever seen, valued
    /// with the time it was last current, so the newest series is the
    /// present. On equal stamps the later line wins: series are printed in
    /// creation order, so it is the more recent label set.
    fn add_lora(&mut self, sample: &Sample<'_>) {
        let stamp = sample.value;
        if stamp.is_nan() {
            return;
        }
        if matches!(&self.lora, Some(best) if stamp < best.stamp) {
            return;
        }
        self.lora = Some(LoraPick {
            stamp,
            running: adapter_list(sample.label("running_lora_adapters").as_deref()),
            waiting: adapter_list(sample.label("waiting_lora_adapters").as_deref()),
            max_lora: sample
                .label("max_lora")
                .and_then(|v| v.trim().parse::<u32>().ok()),
        });
    }

    fn pick(&self, target: Target) -> Option<f64> {
        let ranks = self.values.get(target.slot()?)?;
        ranks.iter().find_map(|v| *v)
    }

    fn finish(self, engine: Engine) -> Result<ReplicaMetrics, MetricsError> {
        let waiting = self.pick(Target::Waiting);
        let running = self.pick(Target::Running);
        let kv_usage = self.pick(Target::KvUsage);
        if waiting.is_none() && running.is_none() && kv_usage.is_none() {
            return Err(MetricsError::NoKnownFamily { engine });
        }
        let cache = match (
            self.pick(Target::CacheQueries),
            self.pick(Target::CacheHits),
        ) {
            (Some(queries), Some(hits)) => Some(CacheCounters { queries, hits }),
            _ => None,
        };
        let (running_lora, waiting_lora, max_lora) = match self.lora {
            Some(pick) => (pick.running, pick.waiting, pick.max_lora),
            None => (Vec::new(), Vec::new(), None),
        };
        Ok(ReplicaMetrics {
            waiting: waiting.unwrap_or(0.0),
            running: running.unwrap_or(0.0),
            kv_usage: kv_usage.unwrap_or(0.0),
            running_lora,
            waiting_lora,
            max_lora,
            cache,
        })
    }
}

/// vLLM joins adapter names with ","; "" means none.
fn adapter_list(label: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let Some(label) = label else {
        return out;
    };
    for name in label.split(',').map(str::trim) {
        if out.len() >= MAX_LORA_ADAPTERS {
            break;
        }
        if name.is_empty() || name.len() > MAX_LORA_NAME_BYTES || out.iter().any(|n| n == name) {
            continue;
        }
        out.push(name.to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_V1_DP2: &str = include_str!("../tests/fixtures/metrics/vllm_v1_dp2.txt");
    const VLLM_V0: &str = include_str!("../tests/fixtures/metrics/vllm_v0.txt");
    const SGLANG_PAGE: &str = include_str!("../tests/fixtures/metrics/sglang.txt");
    const TRTLLM_PAGE: &str = include_str!("../tests/fixtures/metrics/trtllm.txt");
    const TRITON_PAGE: &str = include_str!("../tests/fixtures/metrics/triton_trtllm.txt");
    const AWKWARD: &str = include_str!("../tests/fixtures/metrics/awkward_vllm.txt");

    const LIMIT: usize = 1 << 20;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[track_caller]
    fn assert_close(actual: f64, expected: f64) {
        assert!(close(actual, expected), "{actual} != {expected}");
    }

    fn strings(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    // --- vLLM ----------------------------------------------------------------

    #[test]
    fn vllm_v1_two_engines() {
        let m = parse(Engine::Vllm, VLLM_V1_DP2.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 5.0);
        assert_close(m.running, 21.0);
        assert_close(m.kv_usage, 0.5731707317073171);
        // Newest of three series (the middle line), not the last one.
        assert_eq!(m.running_lora, strings(&["sql-lora", "chat-lora"]));
        assert_eq!(m.waiting_lora, strings(&["sql-lora"]));
        assert_eq!(m.max_lora, Some(4));
    }

    #[test]
    fn vllm_prefix_cache_counters() {
        // Summed over the two engines; absent on the V0 page (a hit-rate
        // gauge of -1 there, which is not read).
        let m = parse(Engine::Vllm, VLLM_V1_DP2.as_bytes(), LIMIT).unwrap();
        let c = m.cache.unwrap();
        assert_close(c.queries, 1.523488e6 + 1.398112e6);
        assert!(c.hits > 0.0 && c.hits <= c.queries, "{c:?}");
        assert_eq!(
            parse(Engine::Vllm, VLLM_V0.as_bytes(), LIMIT)
                .unwrap()
                .cache,
            None
        );
        // The sample names without `_total` (OpenMetrics style).
        let m = parse(Engine::Vllm, AWKWARD.as_bytes(), LIMIT).unwrap();
        assert_eq!(
            m.cache,
            Some(CacheCounters {
                queries: 100.0,
                hits: 40.0
            })
        );
        // Both counters or neither; the names before vLLM 0.10 too.
        let page = "vllm:num_requests_running 1\nvllm:prefix_cache_hits_total 5\n";
        assert_eq!(
            parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap().cache,
            None
        );
        let page = "vllm:num_requests_running 1\n\
                    vllm:gpu_prefix_cache_queries_total 50\n\
                    vllm:gpu_prefix_cache_hits_total NaN\n";
        let c = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap().cache;
        assert_eq!(
            c,
            Some(CacheCounters {
                queries: 50.0,
                hits: 0.0
            })
        );
    }

    #[test]
    fn vllm_v0_old_names() {
        let m = parse(Engine::Vllm, VLLM_V0.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 1.0);
        assert_close(m.running, 7.0);
        assert_close(m.kv_usage, 0.0871);
        assert!(m.running_lora.is_empty() && m.waiting_lora.is_empty());
        assert_eq!(m.max_lora, Some(0));
    }

    #[test]
    fn vllm_prefers_new_names_over_old() {
        let page = "\
vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.2
";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_close(m.kv_usage, 0.2);
        // Only the KV family is present: no error, counts read as 0.
        assert_eq!((m.waiting, m.running), (0.0, 0.0));
    }

    #[test]
    fn lora_ties_and_bounds() {
        // Equal stamps: the later series is the newer label set.
        let page = "vllm:num_requests_running 1\n\
                    vllm:lora_requests_info{running_lora_adapters=\"a\",waiting_lora_adapters=\"\",max_lora=\"x\"} 1.0\n\
                    vllm:lora_requests_info{running_lora_adapters=\"b\",waiting_lora_adapters=\"\"} 1.0\n";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!(m.running_lora, strings(&["b"]));
        assert_eq!(m.max_lora, None);

        let long = "x".repeat(MAX_LORA_NAME_BYTES + 1);
        let fits = "y".repeat(MAX_LORA_NAME_BYTES);
        let many: Vec<String> = (0..200).map(|i| format!("a{i}")).collect();
        let page = format!(
            "vllm:num_requests_running 1\n\
             vllm:lora_requests_info{{running_lora_adapters=\"{long},{fits},ok\",waiting_lora_adapters=\"{}\"}} 2\n",
            many.join(",")
        );
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!(m.running_lora, vec![fits, "ok".to_string()]);
        assert_eq!(m.waiting_lora.len(), MAX_LORA_ADAPTERS);
        assert_eq!(m.waiting_lora.first().map(String::as_str), Some("a0"));
        let last = format!("a{}", MAX_LORA_ADAPTERS - 1);
        assert_eq!(m.waiting_lora.last(), Some(&last));
    }

    #[test]
    fn awkward_page() {
        let m = parse(Engine::Vllm, AWKWARD.as_bytes(), LIMIT).unwrap();
        // 2 + 1.5; the NaN, negative and +Inf series count as 0.
        assert_close(m.waiting, 3.5);
        // 3 + 4 + 1e-05; the five malformed running lines are skipped and
        // `_extra` is another family.
        assert_close(m.running, 7.00001);
        // max(clamp(1.7), clamp(-Inf), NaN→0)
        assert_eq!(m.kv_usage, 1.0);
        assert_eq!(m.running_lora, strings(&["a", "b"]));
        assert_eq!(m.waiting_lora, strings(&["c\\d"]));
        assert_eq!(m.max_lora, Some(2));
    }

    #[test]
    fn crlf_page_reads_the_same() {
        for page in [VLLM_V1_DP2, AWKWARD, SGLANG_PAGE] {
            let crlf = page.replace('\n', "\r\n");
            for engine in [Engine::Vllm, Engine::Sglang] {
                assert_eq!(
                    parse(engine, crlf.as_bytes(), LIMIT),
                    parse(engine, page.as_bytes(), LIMIT)
                );
            }
        }
    }

    #[test]
    fn no_trailing_newline() {
        let m = parse(Engine::Vllm, b"vllm:num_requests_waiting 4", LIMIT).unwrap();
        assert_eq!(m.waiting, 4.0);
    }

    // --- SGLang and TensorRT-LLM ---------------------------------------------

    #[test]
    fn sglang_two_dp_ranks() {
        let m = parse(Engine::Sglang, SGLANG_PAGE.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 4.0);
        assert_close(m.running, 78.0);
        assert_close(m.kv_usage, 0.44);
        assert_eq!(
            m,
            ReplicaMetrics {
                waiting: m.waiting,
                running: m.running,
                kv_usage: m.kv_usage,
                ..ReplicaMetrics::default()
            }
        );
    }

    #[test]
    fn trtllm_serve() {
        let m = parse(Engine::Trtllm, TRTLLM_PAGE.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 6.0);
        assert_close(m.running, 16.0);
        assert_close(m.kv_usage, 0.2265625);
        assert!(m.running_lora.is_empty());
    }

    #[test]
    fn trtllm_under_triton() {
        let m = parse(Engine::Trtllm, TRITON_PAGE.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 3.0);
        assert_close(m.running, 11.0);
        assert_close(m.kv_usage, 0.4875);
    }

    #[test]
    fn trtllm_native_names_win_over_triton() {
        let page = format!("{TRITON_PAGE}{TRTLLM_PAGE}");
        let m = parse(Engine::Trtllm, page.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 6.0);
        assert_close(m.running, 16.0);
    }

    #[test]
    fn trtllm_dynamo_prefix() {
        let page = "trtllm:num_requests_waiting{model_name=\"m\"} 2\n\
                    trtllm:kv_cache_utilization{model_name=\"m\"} 0.5\n";
        let m = parse(Engine::Trtllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (2.0, 0.0, 0.5));
    }

    // --- failures --------------------------------------------------------------

    #[test]
    fn wrong_engine_is_an_error() {
        let cases = [
            (Engine::Vllm, SGLANG_PAGE),
            (Engine::Vllm, TRTLLM_PAGE),
            (Engine::Sglang, VLLM_V1_DP2),
            (Engine::Sglang, TRITON_PAGE),
            (Engine::Trtllm, VLLM_V0),
            (Engine::Trtllm, SGLANG_PAGE),
        ];
        for (engine, page) in cases {
            assert_eq!(
                parse(engine, page.as_bytes(), LIMIT),
                Err(MetricsError::NoKnownFamily { engine })
            );
        }
    }

    #[test]
    fn info_gauges_alone_are_not_load() {
        let page = "vllm:cache_config_info{block_size=\"16\"} 1\n\
                    vllm:lora_requests_info{running_lora_adapters=\"a\"} 5\n\
                    vllm:num_requests_waiting_by_reason{reason=\"x\"} 3\n";
        assert_eq!(
            parse(Engine::Vllm, page.as_bytes(), LIMIT),
            Err(MetricsError::NoKnownFamily {
                engine: Engine::Vllm
            })
        );
    }

    #[test]
    fn empty_and_comment_only_pages() {
        for page in ["", "\n\n", "# HELP x y\n# TYPE x gauge\n# EOF\n"] {
            assert_eq!(
                parse(Engine::Sglang, page.as_bytes(), LIMIT),
                Err(MetricsError::NoKnownFamily {
                    engine: Engine::Sglang
                })
            );
        }
    }

    #[test]
    fn binary_garbage() {
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let bytes: Vec<u8> = (0..8192).map(|_| xorshift(&mut state) as u8).collect();
        assert!(matches!(
            parse(Engine::Vllm, &bytes, LIMIT),
            Err(MetricsError::NoKnownFamily { .. })
        ));
        // Bad bytes cost only their own line: here inside a label value of a
        // needed series (replaced, line kept) and on a line of its own.
        let mut page = b"\xff\xfe\x00garbage\n".to_vec();
        page.extend_from_slice(b"vllm:num_requests_waiting{model_name=\"caf\xe9\"} 2\n");
        page.extend_from_slice(b"vllm:num_requests_running 3\n\xc3\n");
        let m = parse(Engine::Vllm, &page, LIMIT).unwrap();
        assert_eq!((m.waiting, m.running), (2.0, 3.0));
    }

    #[test]
    fn page_over_the_limit() {
        let page = SGLANG_PAGE.as_bytes();
        assert_eq!(
            parse(Engine::Sglang, page, page.len() - 1),
            Err(MetricsError::TooLarge {
                len: page.len(),
                limit: page.len() - 1
            })
        );
        assert!(parse(Engine::Sglang, page, page.len()).is_ok());
        assert!(matches!(
            parse(Engine::Sglang, b"x", 0),
            Err(MetricsError::TooLarge { len: 1, limit: 0 })
        ));
    }

    #[test]
    fn huge_values_saturate() {
        let page = "vllm:num_requests_waiting{a=\"1\"} 1.7e308\n\
                    vllm:num_requests_waiting{a=\"2\"} 1.7e308\n";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!(m.waiting, f64::MAX);
    }

    // --- robustness --------------------------------------------------------------

    fn xorshift(state: &mut u64) -> u64 {
        let mut x = *state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *state = x;
        x
    }

    #[track_caller]
    fn check_sane(page: &[u8]) {
        for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
            if let Ok(m) = parse(engine, page, LIMIT) {
                assert!(m.waiting.is_finite() && m.waiting >= 0.0);
                assert!(m.running.is_finite() && m.running >= 0.0);
                assert!((0.0..=1.0).contains(&m.kv_usage));
                for list in [&m.running_lora, &m.waiting_lora] {
                    assert!(list.len() <= MAX_LORA_ADAPTERS);
                    assert!(list
                        .iter()
                        .all(|n| !n.is_empty() && n.len() <= MAX_LORA_NAME_BYTES));
                }
            }
        }
        for line in page.split(|&b| b == b'\n') {
            if let Some(s) = text::read_sample(&String::from_utf8_lossy(line), |_| true) {
                // Whatever was accepted must read back fully.
                let _ = s.labels().count();
            }
        }
    }

    #[test]
    fn every_truncation_is_safe() {
        for page in [AWKWARD, VLLM_V1_DP2, TRITON_PAGE] {
            let bytes = page.as_bytes();
            for end in 0..=bytes.len() {
                check_sane(&bytes[..end]);
            }
        }
    }

    #[test]
    fn random_mutations_are_safe() {
        const SPICY: &[u8] = b"{}\",=\\\n\r #:_.0e+-\xff\xc3";
        let base = AWKWARD.as_bytes();
        let mut state = 0x2545_F491_4F6C_DD1D_u64;
        for _ in 0..4000 {
            let mut page = base.to_vec();
            let edits = 1 + xorshift(&mut state) % 8;
            for _ in 0..edits {
                let len = page.len().max(1) as u64;
                let at = (xorshift(&mut state) % len) as usize;
                let pick = xorshift(&mut state);
                let byte = if pick & 1 == 0 {
                    SPICY[(pick / 2 % SPICY.len() as u64) as usize]
                } else {
                    (pick >> 8) as u8
                };
                match xorshift(&mut state) % 4 {
                    0 if at < page.len() => page[at] = byte,
                    1 => page.insert(at.min(page.len()), byte),
                    2 if at < page.len() => {
                        page.remove(at);
                    }
                    _ => page.truncate(at),
                }
            }
            check_sane(&page);
        }
    }
}
