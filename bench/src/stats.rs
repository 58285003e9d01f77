//! Per-request records, the run summary, and the cache-hit upper bound.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

#[derive(Serialize, Clone, Debug)]
pub struct Record {
    pub id: usize,
    /// Group / conversation / session key.
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    /// Index of the target (router instance) it was sent to.
    pub target: usize,
    /// Real seconds since the run started, when the request was sent.
    pub start_s: f64,
    pub status: u16,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub itl_mean_ms: Option<f64>,
    pub chunks: u32,
    pub served_by: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The filter's explanation of the pick (`--plugin '{"debug_header":true}'`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
}

#[derive(Serialize, Default, Debug)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Nearest-rank percentiles; values are divided by `scale` (real ms ->
/// simulated ms).
pub fn dist(values: &[f64], scale: f64) -> Dist {
    if values.is_empty() {
        return Dist::default();
    }
    let mut v: Vec<f64> = values.iter().map(|x| x / scale).collect();
    v.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    };
    Dist {
        n: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: pct(50.0),
        p90: pct(90.0),
        p95: pct(95.0),
        p99: pct(99.0),
        max: v[v.len() - 1],
    }
}

#[derive(Serialize, Debug)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    /// Error messages by kind (first 60 chars), with counts.
    pub error_kinds: BTreeMap<String, usize>,
    /// Real seconds from the first send to the last completion.
    pub wall_s: f64,
    /// Completed requests per simulated second.
    pub req_per_s: f64,
    /// Latencies in simulated ms (real ms / time_scale).
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    /// Requests per replica (`x-served-by`).
    pub served_by: BTreeMap<String, usize>,
    /// max / mean of the per-replica request counts over `replicas`
    /// replicas (1.0 = perfectly even).
    pub share_max_over_mean: f64,
    /// From the servers' `usage`: cached / prompt tokens.
    pub client_hit_rate: Option<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

pub fn summarize(records: &[Record], itl: &[f64], time_scale: f64, replicas: usize) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok).collect();
    let mut error_kinds = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok) {
        let e = r.error.clone().unwrap_or_else(|| "unknown".into());
        *error_kinds
            .entry(e.chars().take(60).collect::<String>())
            .or_insert(0) += 1;
    }
    let start = records
        .iter()
        .map(|r| r.start_s)
        .fold(f64::INFINITY, f64::min);
    let end = records
        .iter()
        .map(|r| r.start_s + r.e2e_ms.unwrap_or(0.0) / 1000.0)
        .fold(0.0, f64::max);
    let wall_s = if start.is_finite() {
        (end - start).max(1e-9)
    } else {
        0.0
    };
    let mut served_by = BTreeMap::new();
    for r in &ok {
        let k = r.served_by.clone().unwrap_or_else(|| "unknown".into());
        *served_by.entry(k).or_insert(0usize) += 1;
    }
    let n = replicas.max(served_by.len()).max(1);
    let max = served_by.values().copied().max().unwrap_or(0) as f64;
    let mean = ok.len() as f64 / n as f64;
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let col = |f: fn(&Record) -> Option<f64>| ok.iter().filter_map(|r| f(r)).collect::<Vec<_>>();
    Summary {
        requests: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        error_kinds,
        wall_s,
        req_per_s: if wall_s > 0.0 {
            ok.len() as f64 / (wall_s / time_scale)
        } else {
            0.0
        },
        ttft_ms: dist(&col(|r| r.ttft_ms), time_scale),
        itl_ms: dist(itl, time_scale),
        e2e_ms: dist(&col(|r| r.e2e_ms), time_scale),
        served_by,
        share_max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
        client_hit_rate: (prompt_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        prompt_tokens,
        cached_tokens,
    }
}

#[derive(Serialize, Debug, Default)]
pub struct UpperBound {
    /// Best possible prefix-cache hit rate: one infinite cache that has
    /// seen every earlier request (each distinct prefix block computed
    /// once), counted like vLLM (full blocks, never the last token).
    pub hit_rate: f64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    pub distinct_blocks: usize,
    /// Distinct blocks that more than one request sent (the shared,
    /// cacheable content; the rest is unique to one request).
    pub shared_blocks: usize,
    pub block_size: usize,
    pub requests: usize,
}

/// Upper bound from the token ids of every request, in send order.
pub fn upper_bound(prompts: &[Vec<u32>], block_size: usize) -> UpperBound {
    let bs = block_size.max(1);
    // Block hash -> sent again by a later request.
    let mut seen: HashMap<u64, bool> = HashMap::new();
    let mut total = 0u64;
    let mut hits = 0u64;
    for tokens in prompts {
        total += tokens.len() as u64;
        let max_hit = tokens.len().saturating_sub(1) / bs;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut matched = 0;
        let mut still_matching = true;
        for (i, block) in tokens.chunks_exact(bs).enumerate() {
            for t in block {
                for b in t.to_le_bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
            }
            // Mix the chain so equal blocks at different depths differ.
            h = h.rotate_left(17) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let new = match seen.get_mut(&h) {
                Some(again) => {
                    *again = true;
                    false
                }
                None => {
                    seen.insert(h, false);
                    true
                }
            };
            if still_matching && !new && i < max_hit {
                matched += 1;
            } else {
                still_matching = false;
            }
        }
        hits += (matched * bs) as u64;
    }
    UpperBound {
        hit_rate: if total > 0 {
            hits as f64 / total as f64
        } else {
            0.0
        },
        prompt_tokens: total,
        hit_tokens: hits,
        distinct_blocks: seen.len(),
        shared_blocks: seen.values().filter(|&&again| again).count(),
        block_size: bs,
        requests: prompts.len(),
    }
}

/// CPU seconds (user + system) this process used so far.
pub fn self_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the ")" of the command name: state is field 3, utime and
    // stime are fields 14 and 15, i.e. indices 11 and 12 here.
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on every Linux ABI in use.
    (ticks(11) + ticks(12)) / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let d = dist(&v, 1.0);
        assert_eq!(d.p50, 50.0);
        assert_eq!(d.p99, 99.0);
        assert_eq!(d.max, 100.0);
        assert_eq!(dist(&v, 0.5).p50, 100.0);
    }

    #[test]
    fn bound_counts_shared_blocks_once() {
        // Two requests sharing 32 tokens (2 blocks of 16) then diverging.
        let a: Vec<u32> = (0..40).collect();
        let mut b: Vec<u32> = (0..32).collect();
        b.extend(100..108);
        let ub = upper_bound(&[a.clone(), b, a], 16);
        // Second: 2 blocks hit; third (identical to first, 40 tokens): 2
        // full blocks, capped at (40-1)/16 = 2.
        assert_eq!(ub.hit_tokens, 64);
        assert_eq!(ub.prompt_tokens, 120);
        assert_eq!(ub.distinct_blocks, 2);
        assert_eq!(ub.shared_blocks, 2);
        // A request alone shares nothing.
        assert_eq!(upper_bound(&[(0..64).collect()], 16).shared_blocks, 0);
    }

    #[test]
    fn cpu_seconds_reads() {
        // It grows with work done (a parse failure reads 0, always).
        // Work until it has used 20 ms of CPU, not for 60 ms of wall time
        // (on a busy machine that may be less CPU); bounded all the same.
        let before = self_cpu_seconds();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut x = 0u64;
        let mut after = before;
        while after - before < 0.02 && std::time::Instant::now() < deadline {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_add(i * i));
            }
            after = self_cpu_seconds();
        }
        assert!(
            after > before && after - before >= 0.02,
            "{before} -> {after} ({x})"
        );
    }
}
