//! Fault modes of the `/metrics` page: the ways a dying or broken model
//! server's scrape goes wrong, so a router's scraper can be tested against
//! each. Per replica, switched at run time by `POST /admin/metrics-fault`
//! (or set at start by `--metrics-fault`). Independent of the inference
//! fault of `/admin/fault`, which still gates `/metrics` first (`down`
//! answers 503, `hang` parks the scrape).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::sync::watch;
use tokio_stream::StreamExt;

use crate::hash::mix;
use crate::metrics::{num, Metrics, SCALARS};

/// Content type of the Prometheus text format, as vLLM serves it.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Default size of a `huge` page: ~1000× a real vLLM page, above any sane
/// scraper's body limit.
pub const DEFAULT_HUGE_BYTES: u64 = 40 << 20;
/// Streamed, so size costs no memory; the cap only keeps a typo from
/// keeping a scraper busy for hours.
pub const MAX_HUGE_BYTES: u64 = 1 << 30;
/// Default bound of a `stall`: longer than any scrape timeout worth having.
pub const DEFAULT_STALL_MS: u64 = 60_000;
/// A stall is always bounded, so a forgotten fault cannot pin connections.
pub const MAX_STALL_MS: u64 = 3_600_000;
/// Size of the `garbage` body.
pub const GARBAGE_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ScrapeMode {
    /// The normal page.
    #[default]
    Ok,
    /// 200 with the page's full content-length, the first half of the
    /// page, then the connection is dropped: a replica dying mid-scrape.
    Reset,
    /// Like `reset`, but the connection is held open after the first half
    /// until the fault is set again or `stall_ms` passes; then dropped.
    Stall,
    /// A valid page of exactly `bytes` bytes: filler series, then the page.
    Huge,
    /// The normal page with `values` replacing some series' values.
    Absurd,
    /// 500 with a short text body.
    Error,
    /// 200, Prometheus content type, and bytes that are not text at all.
    Garbage,
}

/// A replica's `/metrics` fault state, as `/admin/metrics-fault` reads and
/// writes it. Fields a mode does not use are kept and ignored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MetricsFault {
    pub mode: ScrapeMode,
    /// Total page size of `huge`.
    #[serde(default = "default_huge_bytes")]
    pub bytes: u64,
    /// Upper bound of a `stall` (real time).
    #[serde(default = "default_stall_ms")]
    pub stall_ms: u64,
    /// Series name → value shown by `absurd`; names from [`SCALARS`].
    #[serde(default = "absurd_values")]
    pub values: BTreeMap<String, PromValue>,
}

fn default_huge_bytes() -> u64 {
    DEFAULT_HUGE_BYTES
}

fn default_stall_ms() -> u64 {
    DEFAULT_STALL_MS
}

/// The default `absurd` set: each value breaks a different assumption a
/// scraper might make (fits f32, fits a sum, is a number, is finite, a
/// counter is non-negative).
pub fn absurd_values() -> BTreeMap<String, PromValue> {
    [
        ("vllm:num_requests_waiting", 1e308),
        ("vllm:num_requests_running", 1e39),
        ("vllm:kv_cache_usage_perc", f64::NAN),
        ("vllm:prefix_cache_hits_total", f64::INFINITY),
        ("vllm:prefix_cache_queries_total", -1.0),
        ("vllm:prompt_tokens_total", f64::NEG_INFINITY),
    ]
    .into_iter()
    .map(|(name, v)| (name.to_string(), PromValue(v)))
    .collect()
}

impl Default for MetricsFault {
    fn default() -> Self {
        Self::new(ScrapeMode::Ok)
    }
}

impl MetricsFault {
    pub fn new(mode: ScrapeMode) -> Self {
        Self {
            mode,
            bytes: DEFAULT_HUGE_BYTES,
            stall_ms: DEFAULT_STALL_MS,
            values: absurd_values(),
        }
    }

    /// Limits checked on every way in (admin API and command line).
    pub fn validate(&self) -> Result<(), String> {
        if self.bytes > MAX_HUGE_BYTES {
            return Err(format!("bytes must be at most {MAX_HUGE_BYTES}"));
        }
        if self.stall_ms > MAX_STALL_MS {
            return Err(format!("stall_ms must be at most {MAX_STALL_MS}"));
        }
        match self.values.keys().find(|k| !SCALARS.contains(&k.as_str())) {
            Some(k) => Err(format!("values: {k} is not one of {}", SCALARS.join(", "))),
            None => Ok(()),
        }
    }
}

/// A sample value. In JSON a number, or a string for what JSON cannot
/// hold: `"NaN"`, `"+Inf"`, `"-Inf"` (any number text Rust parses).
#[derive(Clone, Copy, Debug)]
pub struct PromValue(pub f64);

impl Serialize for PromValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_finite() {
            s.serialize_f64(self.0)
        } else {
            s.serialize_str(&num(self.0))
        }
    }
}

impl<'de> Deserialize<'de> for PromValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(v) => Ok(Self(v)),
            Raw::Text(t) => t.trim().parse().map(Self).map_err(|_| {
                serde::de::Error::custom(format!("{t:?} is not a number, NaN, +Inf or -Inf"))
            }),
        }
    }
}

/// The `/metrics` answer under `fault`. `changes` (subscribed before
/// `fault` was read) ends a stall when the fault is set again.
pub fn respond(
    fault: &MetricsFault,
    m: &Metrics,
    changes: watch::Receiver<MetricsFault>,
) -> Response {
    match fault.mode {
        ScrapeMode::Ok => page(m.render()),
        ScrapeMode::Absurd => page(m.render_with(&|name| fault.values.get(name).map(|v| v.0))),
        ScrapeMode::Reset => truncated(m.render(), Box::pin(tokio::task::yield_now())),
        ScrapeMode::Stall => {
            let bound = Duration::from_millis(fault.stall_ms);
            truncated(m.render(), Box::pin(stall(changes, bound)))
        }
        ScrapeMode::Huge => huge(m.render(), fault.bytes),
        ScrapeMode::Error => {
            let ct = [(header::CONTENT_TYPE, "text/plain; charset=utf-8")];
            // uvicorn's body for an unhandled exception.
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                ct,
                "Internal Server Error",
            )
                .into_response()
        }
        ScrapeMode::Garbage => ([(header::CONTENT_TYPE, CONTENT_TYPE)], garbage()).into_response(),
    }
}

fn page(text: String) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

/// A streamed body with an explicit content-length: hyper then frames it
/// by length (not chunked), as uvicorn serves vLLM's page, so a short body
/// is visibly short to the client.
fn sized(body: Body, len: u64) -> Response {
    let mut resp = ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

type Wait = Pin<Box<dyn Future<Output = ()> + Send>>;

enum Step {
    Send(Bytes),
    Abort(Wait),
}

/// Promises the whole page, sends its first half, waits for `wait`, then
/// fails the body: hyper drops the connection mid-body, so the client sees
/// EOF (or a reset) before content-length bytes.
fn truncated(text: String, wait: Wait) -> Response {
    let len = text.len() as u64;
    let mut head = Bytes::from(text);
    head.truncate(head.len() / 2);
    let steps = tokio_stream::iter([Step::Send(head), Step::Abort(wait)]).then(|step| async move {
        match step {
            Step::Send(b) => Ok(b),
            Step::Abort(wait) => {
                wait.await;
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "metrics fault: connection dropped mid-body",
                ))
            }
        }
    });
    sized(Body::from_stream(steps), len)
}

/// Holds a stalled body until the fault is set again or `bound` passes.
/// (`reset` instead waits one `yield_now`: the Pending lets hyper flush the
/// first half before the failure closes the connection.)
async fn stall(mut changes: watch::Receiver<MetricsFault>, bound: Duration) {
    tokio::select! {
        _ = changes.changed() => {}
        () = tokio::time::sleep(bound) => {}
    }
}

/// A page of exactly `bytes` bytes (or the normal page, if that is already
/// larger): filler first, as real pages put other families (python_gc_*,
/// process_*) before vLLM's, so a scraper must get through all of it.
/// Generated chunk by chunk as hyper asks for more: never in memory whole.
fn huge(text: String, bytes: u64) -> Response {
    let pad = Padding::fit(bytes.saturating_sub(text.len() as u64));
    let len = pad.len() + text.len() as u64;
    let chunks = pad
        .chunks()
        .chain(std::iter::once(Bytes::from(text)))
        .map(Ok::<_, Infallible>);
    sized(Body::from_stream(tokio_stream::iter(chunks)), len)
}

const PAD_HEAD: &str =
    "# HELP sim:padding Filler series of the huge /metrics fault.\n# TYPE sim:padding gauge\n";
/// `sim:padding{i="000000000042"} 0\n`: fixed width, so sizes are exact.
const PAD_LINE: u64 = 32;
/// The shortest comment line strict parsers accept, `# .\n` (some reject
/// an empty comment, `# \n`).
const MIN_COMMENT: u64 = 4;
/// 64 KiB chunks: big enough to be cheap, small enough to stream.
const LINES_PER_CHUNK: u64 = 2048;

/// Filler of a `huge` page: one comment line sized so the total is exact,
/// then a gauge family of distinct fixed-width samples — real series, so a
/// scraper has to parse (and maybe store) them, not just skip comments.
/// Too little room for one sample: the comment alone (strict parsers
/// reject a family without samples).
#[derive(Debug, PartialEq)]
struct Padding {
    /// Length of the comment line including its newline; 0 = no filler.
    comment: u64,
    lines: u64,
}

impl Padding {
    /// The filler of exactly `bytes`, or none if `bytes` is too small to
    /// hold a comment.
    fn fit(bytes: u64) -> Self {
        let family = PAD_HEAD.len() as u64 + PAD_LINE;
        let (comment, lines) = if bytes < MIN_COMMENT {
            (0, 0)
        } else if bytes < MIN_COMMENT + family {
            (bytes, 0)
        } else {
            let lines = (bytes - MIN_COMMENT - PAD_HEAD.len() as u64) / PAD_LINE;
            (bytes - PAD_HEAD.len() as u64 - lines * PAD_LINE, lines)
        };
        Self { comment, lines }
    }

    fn len(&self) -> u64 {
        let family = if self.lines > 0 {
            PAD_HEAD.len() as u64 + self.lines * PAD_LINE
        } else {
            0
        };
        self.comment + family
    }

    fn chunks(self) -> impl Iterator<Item = Bytes> + Send {
        let head = (self.comment > 0).then(|| {
            let dots = ".".repeat((self.comment - 3) as usize);
            let family = if self.lines > 0 { PAD_HEAD } else { "" };
            Bytes::from(format!("# {dots}\n{family}"))
        });
        let lines = self.lines;
        let body = (0..lines.div_ceil(LINES_PER_CHUNK)).map(move |c| {
            let start = c * LINES_PER_CHUNK;
            pad_lines(start, (start + LINES_PER_CHUNK).min(lines))
        });
        head.into_iter().chain(body)
    }
}

fn pad_lines(start: u64, end: u64) -> Bytes {
    let mut s = String::with_capacity(((end - start) * PAD_LINE) as usize);
    for i in start..end {
        let _ = writeln!(s, "sim:padding{{i=\"{i:012}\"}} 0");
    }
    Bytes::from(s)
}

/// Fixed pseudo-random bytes, starting with bytes no UTF-8 text can start
/// with (0xFF, 0xFE) and a NUL, so even a lenient reader sees binary.
fn garbage() -> Vec<u8> {
    let mut out = vec![0xff, 0xfe, 0x00, 0x80];
    let mut i = 0u64;
    while out.len() < GARBAGE_BYTES {
        i += 1;
        out.extend_from_slice(&mix(i).to_le_bytes());
    }
    out.truncate(GARBAGE_BYTES);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filler(p: Padding) -> Vec<u8> {
        p.chunks().flat_map(|b| b.to_vec()).collect()
    }

    #[test]
    fn padding_is_exact_and_valid_for_every_size() {
        let first_sample = MIN_COMMENT + PAD_HEAD.len() as u64 + PAD_LINE;
        for bytes in (0..first_sample + 3 * PAD_LINE).chain([100_000, 1 << 20]) {
            let p = Padding::fit(bytes);
            let expected = if bytes < MIN_COMMENT { 0 } else { bytes };
            assert_eq!(p.len(), expected, "{bytes}");
            assert_eq!(p.lines > 0, bytes >= first_sample, "{bytes}");
            let out = filler(Padding::fit(bytes));
            assert_eq!(out.len() as u64, expected, "{bytes}");
            // Valid on its own and in front of a page.
            let text = String::from_utf8(out).unwrap() + "x 1\n";
            let parsed = prom_text_format_parser::Scrape::parse(&text)
                .unwrap_or_else(|e| panic!("{bytes}: {e:?}"));
            let pads = parsed.metrics.iter().find(|m| m.name == "sim:padding");
            let samples = pads.map_or(0, |m| m.samples.len() as u64);
            assert_eq!(samples, p.lines, "{bytes}");
        }
    }

    #[test]
    fn padding_series_are_distinct_fixed_width_lines() {
        let p = Padding::fit(40 << 20);
        assert_eq!(p.len(), 40 << 20);
        let lines = p.lines;
        assert!(lines > 1_300_000, "{lines}");
        let mut seen = 0u64;
        for chunk in p.chunks().skip(1) {
            for line in chunk.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                assert_eq!(line.len() as u64 + 1, PAD_LINE);
                let want = format!("sim:padding{{i=\"{seen:012}\"}} 0");
                assert_eq!(line, want.as_bytes());
                seen += 1;
            }
        }
        assert_eq!(seen, lines);
    }

    #[test]
    fn garbage_is_not_utf8_and_fixed() {
        let g = garbage();
        assert_eq!(g.len(), GARBAGE_BYTES);
        assert!(std::str::from_utf8(&g).is_err());
        assert_eq!(g, garbage(), "deterministic");
        assert!(g.iter().filter(|b| **b == b'\n').count() < 64, "not text");
    }

    #[test]
    fn fault_json_defaults_and_special_values() {
        let f: MetricsFault = serde_json::from_str(r#"{"mode":"stall"}"#).unwrap();
        assert_eq!(f.mode, ScrapeMode::Stall);
        assert_eq!((f.bytes, f.stall_ms), (40 << 20, 60_000));
        assert!(f.values["vllm:kv_cache_usage_perc"].0.is_nan());
        let f: MetricsFault = serde_json::from_str(
            r#"{"mode":"absurd","values":{"vllm:num_requests_waiting":-3,
                "vllm:kv_cache_usage_perc":"+Inf","vllm:num_requests_running":"nan",
                "vllm:prompt_tokens_total":"-Inf","vllm:prefix_cache_hits_total":"1e39"}}"#,
        )
        .unwrap();
        let v = |k: &str| f.values[k].0;
        assert_eq!(v("vllm:num_requests_waiting"), -3.0);
        assert_eq!(v("vllm:kv_cache_usage_perc"), f64::INFINITY);
        assert!(v("vllm:num_requests_running").is_nan());
        assert_eq!(v("vllm:prompt_tokens_total"), f64::NEG_INFINITY);
        assert_eq!(v("vllm:prefix_cache_hits_total"), 1e39);
        assert_eq!(f.values.len(), 5, "given values replace the default set");
        let echo = serde_json::to_value(&f).unwrap();
        assert_eq!(echo["values"]["vllm:kv_cache_usage_perc"], "+Inf");
        assert_eq!(echo["values"]["vllm:num_requests_running"], "NaN");
        assert_eq!(echo["values"]["vllm:num_requests_waiting"], -3.0);
        for bad in [
            r#"{"mode":"sideways"}"#,
            r#"{"mode":"absurd","values":{"vllm:num_requests_waiting":"lots"}}"#,
            r#"{"bytes":1}"#,
        ] {
            assert!(serde_json::from_str::<MetricsFault>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validation_bounds_size_stall_and_names() {
        assert!(MetricsFault::default().validate().is_ok());
        let mut f = MetricsFault::new(ScrapeMode::Huge);
        f.bytes = MAX_HUGE_BYTES + 1;
        assert!(f.validate().is_err());
        let mut f = MetricsFault::new(ScrapeMode::Stall);
        f.stall_ms = MAX_STALL_MS + 1;
        assert!(f.validate().is_err());
        let mut f = MetricsFault::new(ScrapeMode::Absurd);
        f.values.insert("vllm:made_up".into(), PromValue(1.0));
        assert!(f.validate().unwrap_err().contains("vllm:made_up"));
    }
}
