//! Model-server metrics (Prometheus text) → replica load.
//!
//! The filter scrapes each replica's `/metrics` page and needs only a handful
//! of numbers from it: queue depth, running requests, KV-cache usage, the
//! LoRA adapters in use and the KV geometry. Everything else on the page
//! (often hundreds of histogram buckets) is skipped after reading the metric
//! name, so the cost is one linear pass over a page whose size the caller
//! has already capped, and memory use is a few small values plus the LoRA
//! names.
//!
//! Two layers:
//! - [`samples`] / [`parse_line`]: a tolerant reader of the text exposition
//!   format as servers really emit it. A line it cannot read is skipped, never
//!   fatal, because one odd line from some unrelated exporter sharing the
//!   page must not blind the router to the replica's load.
//! - [`parse`]: picks the engine's families out of a page and folds them into
//!   a [`ReplicaMetrics`].
//!
//! Nothing here panics on any input: slicing goes through `str::get`, loops
//! advance by at least one byte per step, and every allocation is bounded by
//! the page size or by the LoRA limits below.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use thiserror::Error;

/// Most LoRA adapter names kept per list. vLLM's `max_loras` is normally a
/// few dozen at most; anything beyond this is a broken or hostile page.
pub const MAX_LORA_ADAPTERS: usize = 64;
/// Longest adapter name kept, in bytes. A longer one is dropped rather than
/// cut short, since a truncated name would never match a real adapter.
pub const MAX_LORA_NAME_BYTES: usize = 256;

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
    pub max_lora: Option<u32>,
    /// Tokens per KV block, if advertised (smallest if series disagree).
    pub block_size: Option<u32>,
    /// KV capacity in blocks, if advertised: summed over series, since each
    /// series is a separate engine with its own cache.
    pub num_gpu_blocks: Option<u64>,
    /// Prefix-cache counters (vLLM), summed over series, if present.
    pub prefix_cache_queries: Option<f64>,
    pub prefix_cache_hits: Option<f64>,
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

// ---------------------------------------------------------------------------
// Text exposition format
// ---------------------------------------------------------------------------

/// One sample line. Borrowed from the page; label values are unescaped only
/// when asked for, so skipping a sample costs nothing beyond finding it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name as written, including any `_total`/`_bucket`/... suffix.
    pub name: &'a str,
    pub value: f64,
    /// The optional trailing timestamp, as written: integer milliseconds in
    /// the Prometheus text format, seconds in OpenMetrics. Not interpreted.
    pub timestamp: Option<f64>,
    /// Text between the braces, already checked to be well formed.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// Label pairs in page order, values unescaped.
    pub fn labels(&self) -> Labels<'a> {
        Labels { rest: self.labels }
    }

    /// The value of label `key` (the first one, if it is repeated).
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The label text between the braces, still escaped.
    pub fn raw_labels(&self) -> &'a str {
        self.labels
    }
}

/// Iterator over a sample's `(name, value)` label pairs.
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        match next_label(self.rest) {
            LabelStep::Pair { name, raw, rest } => {
                self.rest = rest;
                Some((name, unescape(raw)))
            }
            LabelStep::Close(_) | LabelStep::End | LabelStep::Bad => {
                self.rest = "";
                None
            }
        }
    }
}

/// Every readable sample of a page, in order; comments, blank lines and
/// malformed lines are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.split('\n').filter_map(parse_line)
}

/// Reads one line of the text format. `None` for comments, blank lines and
/// anything malformed.
///
/// Accepted, beyond the strict grammar, because real exporters do it:
/// leading/trailing blanks, `\r` (CRLF pages), blanks inside the braces and
/// around `=`, a trailing comma in the label set, tabs as separators, any
/// float spelling Rust reads (`NaN`, `+Inf`, `1.5e-05`, `.5`), fractional
/// (OpenMetrics) timestamps, and a trailing OpenMetrics exemplar (`# {...}`).
/// An unknown escape in a label value is kept as written.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let (name, rest) = split_name(line)?;
    parse_after_name(name, rest)
}

fn is_blank(b: u8) -> bool {
    // '\r' counts as a blank so CRLF pages need no separate pass.
    b == b' ' || b == b'\t' || b == b'\r'
}

fn trim_blank_start(s: &str) -> &str {
    s.trim_start_matches([' ', '\t', '\r'])
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Splits a line into its metric name and the rest. Comments fail here
/// because `#` can't start a name.
fn split_name(line: &str) -> Option<(&str, &str)> {
    let line = trim_blank_start(line);
    let bytes = line.as_bytes();
    let first = *bytes.first()?;
    if !(first.is_ascii_alphabetic() || first == b'_' || first == b':') {
        return None;
    }
    let len = bytes
        .iter()
        .position(|&b| !is_name_byte(b))
        .unwrap_or(bytes.len());
    Some((line.get(..len)?, line.get(len..)?))
}

fn parse_after_name<'a>(name: &'a str, rest: &'a str) -> Option<Sample<'a>> {
    let rest = trim_blank_start(rest);
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => split_label_block(inside)?,
        None => ("", rest),
    };
    let (value_token, rest) = split_token(trim_blank_start(rest));
    let value = parse_float(value_token)?;
    let rest = trim_blank_start(rest);
    let (timestamp, rest) = if ends_sample(rest) {
        (None, rest)
    } else {
        let (token, rest) = split_token(rest);
        let ts = parse_float(token).filter(|t| t.is_finite())?;
        (Some(ts), trim_blank_start(rest))
    };
    if !ends_sample(rest) {
        return None;
    }
    Some(Sample {
        name,
        value,
        timestamp,
        labels,
    })
}

/// Nothing left, or only an OpenMetrics exemplar, which we don't need.
fn ends_sample(rest: &str) -> bool {
    rest.is_empty() || rest.starts_with('#')
}

fn split_token(s: &str) -> (&str, &str) {
    match s.bytes().position(is_blank) {
        Some(i) => (s.get(..i).unwrap_or(s), s.get(i..).unwrap_or("")),
        None => (s, ""),
    }
}

fn parse_float(token: &str) -> Option<f64> {
    // Rust's parser takes exactly the Prometheus spellings that matter
    // (NaN, +Inf, -Inf, exponents) and rejects blanks, so no pre-check.
    token.parse::<f64>().ok()
}

/// Walks a label block starting just after `{`; returns the text inside the
/// braces and what follows the `}`. Fails on anything malformed, including a
/// block that never closes, so a sample is only ever built from a label set
/// that [`Labels`] can read back completely.
fn split_label_block(inside: &str) -> Option<(&str, &str)> {
    let mut rest = inside;
    loop {
        match next_label(rest) {
            LabelStep::Pair { rest: next, .. } => rest = next,
            LabelStep::Close(after) => {
                // `after` is a suffix of `inside`; the '}' sits just before it.
                let close_at = inside.len().checked_sub(after.len() + 1)?;
                return Some((inside.get(..close_at)?, after));
            }
            LabelStep::End | LabelStep::Bad => return None,
        }
    }
}

enum LabelStep<'a> {
    /// One `name="value"`; `rest` starts after its comma, or at the `}`/end.
    Pair {
        name: &'a str,
        raw: &'a str,
        rest: &'a str,
    },
    /// Reached the closing brace; holds what follows it.
    Close(&'a str),
    /// Ran out of text (fine inside a validated block, fatal while scanning).
    End,
    Bad,
}

fn next_label(s: &str) -> LabelStep<'_> {
    let s = trim_blank_start(s);
    let bytes = s.as_bytes();
    match bytes.first() {
        None => return LabelStep::End,
        Some(b'}') => return LabelStep::Close(s.get(1..).unwrap_or("")),
        Some(b) if b.is_ascii_alphabetic() || *b == b'_' => {}
        Some(_) => return LabelStep::Bad,
    }
    let name_len = bytes
        .iter()
        .position(|&b| !(b.is_ascii_alphanumeric() || b == b'_'))
        .unwrap_or(bytes.len());
    let (Some(name), Some(after_name)) = (s.get(..name_len), s.get(name_len..)) else {
        return LabelStep::Bad;
    };
    let Some(quoted) = trim_blank_start(after_name)
        .strip_prefix('=')
        .map(trim_blank_start)
        .and_then(|t| t.strip_prefix('"'))
    else {
        return LabelStep::Bad;
    };
    let Some(close_quote) = closing_quote(quoted) else {
        return LabelStep::Bad;
    };
    let (Some(raw), Some(after_value)) = (quoted.get(..close_quote), quoted.get(close_quote + 1..))
    else {
        return LabelStep::Bad;
    };
    let after_value = trim_blank_start(after_value);
    let rest = match after_value.as_bytes().first() {
        Some(b',') => after_value.get(1..).unwrap_or(""),
        Some(b'}') | None => after_value,
        Some(_) => return LabelStep::Bad,
    };
    LabelStep::Pair { name, raw, rest }
}

/// Index of the `"` ending a label value, honouring backslash escapes.
fn closing_quote(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    loop {
        match bytes.get(i)? {
            b'"' => return Some(i),
            // Skip the escaped byte whatever it is; a multi-byte character
            // after the backslash just leaves continuation bytes, which are
            // never '"' or '\\'.
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

// ---------------------------------------------------------------------------
// Engine families
// ---------------------------------------------------------------------------

/// What a family contributes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Waiting,
    Running,
    KvUsage,
    PrefixQueries,
    PrefixHits,
    BlockSize,
    NumBlocks,
    /// vLLM's LoRA info gauge: state in labels, timestamp as the value.
    LoraInfo,
    /// vLLM's cache-config info gauge: geometry in labels.
    CacheConfig,
}

const QUANTITIES: usize = 7;

impl Target {
    fn slot(self) -> Option<usize> {
        Some(match self {
            Target::Waiting => 0,
            Target::Running => 1,
            Target::KvUsage => 2,
            Target::PrefixQueries => 3,
            Target::PrefixHits => 4,
            Target::BlockSize => 5,
            Target::NumBlocks => 6,
            Target::LoraInfo | Target::CacheConfig => return None,
        })
    }
}

/// Number of alternative spellings a quantity can have.
const RANKS: usize = 4;

/// One metric name an engine may use for a quantity. When a page has several
/// spellings of the same quantity (say, a server mid-rename exporting both),
/// the lowest rank present wins rather than adding them up twice.
struct Family {
    name: &'static str,
    /// Only samples with this label value count (Triton multiplexes several
    /// quantities into one family by a label).
    only: Option<(&'static str, &'static str)>,
    target: Target,
    rank: usize,
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

// vLLM: `kv_cache_usage_perc` replaced `gpu_cache_usage_perc`, and
// `prefix_cache_*` replaced V1's first `gpu_prefix_cache_*` counters. A
// counter's samples end in `_total` in both exposition formats, but some
// wrappers drop it, so the bare name is accepted one rank lower.
const VLLM: &[Family] = &[
    fam("vllm:num_requests_waiting", Target::Waiting, 0),
    fam("vllm:num_requests_running", Target::Running, 0),
    fam("vllm:kv_cache_usage_perc", Target::KvUsage, 0),
    fam("vllm:gpu_cache_usage_perc", Target::KvUsage, 1),
    fam("vllm:prefix_cache_queries_total", Target::PrefixQueries, 0),
    fam("vllm:prefix_cache_queries", Target::PrefixQueries, 1),
    fam(
        "vllm:gpu_prefix_cache_queries_total",
        Target::PrefixQueries,
        2,
    ),
    fam("vllm:gpu_prefix_cache_queries", Target::PrefixQueries, 3),
    fam("vllm:prefix_cache_hits_total", Target::PrefixHits, 0),
    fam("vllm:prefix_cache_hits", Target::PrefixHits, 1),
    fam("vllm:gpu_prefix_cache_hits_total", Target::PrefixHits, 2),
    fam("vllm:gpu_prefix_cache_hits", Target::PrefixHits, 3),
    fam("vllm:lora_requests_info", Target::LoraInfo, 0),
    fam("vllm:cache_config_info", Target::CacheConfig, 0),
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
    fam("trtllm_kv_cache_tokens_per_block", Target::BlockSize, 0),
    fam("trtllm:kv_cache_tokens_per_block", Target::BlockSize, 1),
    fam_where(
        "nv_trt_llm_kv_cache_block_metrics",
        "kv_cache_block_type",
        "tokens_per",
        Target::BlockSize,
        2,
    ),
    fam("trtllm_kv_cache_max_blocks", Target::NumBlocks, 0),
    fam("trtllm:kv_cache_max_blocks", Target::NumBlocks, 1),
    fam_where(
        "nv_trt_llm_kv_cache_block_metrics",
        "kv_cache_block_type",
        "max",
        Target::NumBlocks,
        2,
    ),
];

fn families(engine: Engine) -> &'static [Family] {
    match engine {
        Engine::Vllm => VLLM,
        Engine::Sglang => SGLANG,
        Engine::Trtllm => TRTLLM,
    }
}

// ---------------------------------------------------------------------------
// Folding samples into ReplicaMetrics
// ---------------------------------------------------------------------------

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
    text: &[u8],
    max_bytes: usize,
) -> Result<ReplicaMetrics, MetricsError> {
    if text.len() > max_bytes {
        return Err(MetricsError::TooLarge {
            len: text.len(),
            limit: max_bytes,
        });
    }
    let table = families(engine);
    let mut acc = Accumulator::default();
    for raw in text.split(|&b| b == b'\n') {
        let line = String::from_utf8_lossy(raw);
        let Some((name, rest)) = split_name(&line) else {
            continue;
        };
        if !table.iter().any(|f| f.name == name) {
            continue;
        }
        let Some(sample) = parse_after_name(name, rest) else {
            continue;
        };
        for family in table.iter().filter(|f| f.name == name) {
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

/// A gauge value that must be a positive whole number (block counts/sizes
/// are exported as floats like `16.0`). Zero is refused: a block size or
/// capacity of zero is meaningless and would be a divisor downstream.
fn whole_positive(v: f64) -> Option<f64> {
    // 2^53: past this, f64 can't represent every integer anyway.
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0;
    (v.is_finite() && v >= 1.0 && v.fract() == 0.0 && v <= MAX_EXACT).then_some(v)
}

fn label_whole_positive(value: Option<Cow<'_, str>>) -> Option<f64> {
    let n: u64 = value?.trim().parse().ok()?;
    // Exact for anything a KV cache could have; larger values are noise.
    whole_positive(n as f64)
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
        match family.target {
            Target::LoraInfo => self.add_lora(sample),
            Target::CacheConfig => {
                if let Some(size) = label_whole_positive(sample.label("block_size")) {
                    self.fold(Target::BlockSize, 0, size);
                }
                if let Some(blocks) = label_whole_positive(sample.label("num_gpu_blocks")) {
                    self.fold(Target::NumBlocks, 0, blocks);
                }
            }
            Target::BlockSize | Target::NumBlocks => {
                if let Some(v) = whole_positive(sample.value) {
                    self.fold(family.target, family.rank, v);
                }
            }
            Target::KvUsage => {
                self.fold(family.target, family.rank, sanitize_fraction(sample.value))
            }
            Target::Waiting | Target::Running | Target::PrefixQueries | Target::PrefixHits => {
                self.fold(family.target, family.rank, sanitize_count(sample.value))
            }
        }
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
            (Some(old), Target::BlockSize) => old.min(v),
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
        // Float-to-int `as` saturates, and the values are already whole and
        // positive, so these conversions are exact within range.
        let block_size = self
            .pick(Target::BlockSize)
            .filter(|&v| v <= f64::from(u32::MAX))
            .map(|v| v as u32);
        let num_gpu_blocks = self.pick(Target::NumBlocks).map(|v| v as u64);
        let prefix_cache_queries = self.pick(Target::PrefixQueries);
        let prefix_cache_hits = self.pick(Target::PrefixHits);
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
            block_size,
            num_gpu_blocks,
            prefix_cache_queries,
            prefix_cache_hits,
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

    // --- the sample reader -------------------------------------------------

    #[test]
    fn reads_plain_and_labelled_samples() {
        let s = parse_line("process_virtual_memory_bytes 2.5936637952e+010").unwrap();
        assert_eq!(s.name, "process_virtual_memory_bytes");
        assert_eq!(s.value, 2.5936637952e10);
        assert_eq!(s.timestamp, None);
        assert_eq!(s.labels().count(), 0);

        let s = parse_line(r#"vllm:num_requests_running{engine="0",model_name="m"} 12.0"#).unwrap();
        assert_eq!(s.name, "vllm:num_requests_running");
        assert_eq!(s.value, 12.0);
        let labels: Vec<_> = s.labels().collect();
        assert_eq!(
            labels,
            vec![
                ("engine", Cow::Borrowed("0")),
                ("model_name", Cow::Borrowed("m"))
            ]
        );
        assert_eq!(s.label("model_name").as_deref(), Some("m"));
        assert_eq!(s.label("absent"), None);
        assert_eq!(parse_line("x{} 1").unwrap().labels().count(), 0);
    }

    #[test]
    fn escaped_label_values_with_delimiters_inside() {
        let line = r#"m{a="say \"hi\", ok}",b="back\\slash",c="two\nlines",d="x=y}{,",e="\q"} 7"#;
        let s = parse_line(line).unwrap();
        assert_eq!(s.value, 7.0);
        assert_eq!(s.label("a").as_deref(), Some("say \"hi\", ok}"));
        assert_eq!(s.label("b").as_deref(), Some("back\\slash"));
        assert_eq!(s.label("c").as_deref(), Some("two\nlines"));
        assert_eq!(s.label("d").as_deref(), Some("x=y}{,"));
        // Unknown escapes are kept as written, as Prometheus itself does.
        assert_eq!(s.label("e").as_deref(), Some("\\q"));
        assert_eq!(s.labels().count(), 5);
        // Unescaping allocates only when there is something to unescape.
        assert!(matches!(s.label("d"), Some(Cow::Borrowed(_))));
    }

    #[test]
    fn special_floats_and_timestamps() {
        assert!(parse_line("a NaN").unwrap().value.is_nan());
        assert_eq!(parse_line("a +Inf").unwrap().value, f64::INFINITY);
        assert_eq!(parse_line("a -Inf").unwrap().value, f64::NEG_INFINITY);
        assert_eq!(parse_line("a 1.5e-05").unwrap().value, 1.5e-5);
        assert_eq!(parse_line("a -0.25").unwrap().value, -0.25);

        let s = parse_line(r#"a{x="1"} 3 1712345678000"#).unwrap();
        assert_eq!((s.value, s.timestamp), (3.0, Some(1_712_345_678_000.0)));
        let s = parse_line("a 3 -1").unwrap();
        assert_eq!(s.timestamp, Some(-1.0));
        // OpenMetrics: seconds with a fraction, and an exemplar after it.
        let s = parse_line(r#"a_total 17 1712345678.5 # {trace_id="t"} 1.0"#).unwrap();
        assert_eq!((s.value, s.timestamp), (17.0, Some(1_712_345_678.5)));
        let s = parse_line(r#"a_total 17 # {trace_id="t"} 1.0 1712345678.001"#).unwrap();
        assert_eq!((s.value, s.timestamp), (17.0, None));
    }

    #[test]
    fn tolerant_spacing_and_line_endings() {
        let s = parse_line("  a { x = \"1\" , y=\"2\", }\t4.5\t\r").unwrap();
        assert_eq!(s.value, 4.5);
        assert_eq!(s.label("x").as_deref(), Some("1"));
        assert_eq!(s.label("y").as_deref(), Some("2"));
        assert_eq!(parse_line("a 2\r").unwrap().value, 2.0);
    }

    #[test]
    fn malformed_lines_are_rejected() {
        for line in [
            "",
            "   ",
            "\r",
            "# HELP a something",
            "# TYPE a gauge",
            "#a 1",
            "a",
            "a ",
            "a{",
            "a{} ",
            "1a 1",
            "a-b 1",
            "a one",
            "a 1 2 3",
            "a 1 ts",
            "a 1 NaN",
            "a 1 +Inf",
            r#"a{x="1" 2"#,
            r#"a{x="1"y="2"} 2"#,
            r#"a{x="unterminated} 2"#,
            r#"a{x="1",,} 2"#,
            r#"a{,} 2"#,
            r#"a{x=1} 2"#,
            r#"a{="1"} 2"#,
            r#"a{1x="1"} 2"#,
            r#"a{x="1\"} 2"#,
            r#"a{x "1"} 2"#,
            r#"a{x="\"#,
            "{\"a.b\"} 1",
        ] {
            assert!(parse_line(line).is_none(), "accepted {line:?}");
        }
    }

    #[test]
    fn samples_skips_everything_but_samples() {
        let page =
            "# HELP a help\n# TYPE a gauge\n\na{x=\"1\"} 1\ngarbage here\na{x=\"2\"} 2\r\n# EOF";
        let got: Vec<_> = samples(page)
            .map(|s| (s.name, s.label("x").map(Cow::into_owned), s.value))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", Some("1".to_string()), 1.0),
                ("a", Some("2".to_string()), 2.0)
            ]
        );
        assert_eq!(
            samples(VLLM_V1_DP2)
                .filter(|s| s.name.ends_with("_created"))
                .count(),
            7
        );
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
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(12_000));
        assert_close(m.prefix_cache_queries.unwrap(), 1_523_488.0 + 1_398_112.0);
        assert_close(m.prefix_cache_hits.unwrap(), 1_196_032.0 + 1_012_736.0);
    }

    #[test]
    fn vllm_v0_old_names() {
        let m = parse(Engine::Vllm, VLLM_V0.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 1.0);
        assert_close(m.running, 7.0);
        assert_close(m.kv_usage, 0.0871);
        assert!(m.running_lora.is_empty() && m.waiting_lora.is_empty());
        assert_eq!(m.max_lora, Some(0));
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.num_gpu_blocks, Some(27_512));
        assert_eq!(m.prefix_cache_queries, None);
        assert_eq!(m.prefix_cache_hits, None);
    }

    #[test]
    fn vllm_prefers_new_names_over_old() {
        let page = "\
vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.2
vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 1000
vllm:prefix_cache_queries_total{model_name=\"m\"} 10
vllm:prefix_cache_hits{model_name=\"m\"} 7
vllm:gpu_prefix_cache_hits{model_name=\"m\"} 500
";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_close(m.kv_usage, 0.2);
        assert_eq!(m.prefix_cache_queries, Some(10.0));
        assert_eq!(m.prefix_cache_hits, Some(7.0));
        // Only the KV family is present: no error, counts read as 0.
        assert_eq!((m.waiting, m.running), (0.0, 0.0));

        let old_only = "vllm:gpu_prefix_cache_hits_total 5\nvllm:num_requests_waiting 1\n";
        let m = parse(Engine::Vllm, old_only.as_bytes(), LIMIT).unwrap();
        assert_eq!(m.prefix_cache_hits, Some(5.0));
        assert_eq!(m.prefix_cache_queries, None);
    }

    #[test]
    fn vllm_cache_config_with_none_values() {
        let page = "vllm:num_requests_running 0\n\
                    vllm:cache_config_info{block_size=\"None\",num_gpu_blocks=\"None\"} 1.0\n";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));

        let page = "vllm:num_requests_running 0\n\
                    vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"-5\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"64\",num_gpu_blocks=\"100\",engine=\"1\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\",engine=\"2\"} 1.0\n";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(200)));
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
        assert_eq!(m.waiting_lora.last().map(String::as_str), Some("a63"));
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
        assert_eq!(m.prefix_cache_queries, Some(100.0));
        assert_eq!(m.prefix_cache_hits, Some(40.0));
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
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.num_gpu_blocks, Some(4096));
        assert!(m.running_lora.is_empty());
        assert_eq!(m.prefix_cache_queries, None);
    }

    #[test]
    fn trtllm_under_triton() {
        let m = parse(Engine::Trtllm, TRITON_PAGE.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 3.0);
        assert_close(m.running, 11.0);
        assert_close(m.kv_usage, 0.4875);
        assert_eq!(m.block_size, Some(64));
        assert_eq!(m.num_gpu_blocks, Some(6240));
    }

    #[test]
    fn trtllm_native_names_win_over_triton() {
        let page = format!("{TRITON_PAGE}{TRTLLM_PAGE}");
        let m = parse(Engine::Trtllm, page.as_bytes(), LIMIT).unwrap();
        assert_close(m.waiting, 6.0);
        assert_close(m.running, 16.0);
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.num_gpu_blocks, Some(4096));
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
                    vllm:num_requests_waiting{a=\"2\"} 1.7e308\n\
                    vllm:cache_config_info{block_size=\"99999999999\",num_gpu_blocks=\"18446744073709551615\"} 1\n";
        let m = parse(Engine::Vllm, page.as_bytes(), LIMIT).unwrap();
        assert_eq!(m.waiting, f64::MAX);
        // Beyond u32 / beyond exact f64: treated as not advertised.
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
    }

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
                assert!(m.running_lora.len() <= MAX_LORA_ADAPTERS);
                assert!(m.waiting_lora.len() <= MAX_LORA_ADAPTERS);
                assert!(m
                    .running_lora
                    .iter()
                    .all(|n| n.len() <= MAX_LORA_NAME_BYTES));
                assert!(m.block_size != Some(0) && m.num_gpu_blocks != Some(0));
            }
        }
        for line in page.split(|&b| b == b'\n') {
            if let Some(s) = parse_line(&String::from_utf8_lossy(line)) {
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
