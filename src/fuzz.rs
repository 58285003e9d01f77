//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the fuzz
//! smoke test (`tests/fuzz_smoke.rs`): each takes arbitrary bytes, must
//! never panic, and asserts the invariants the filter relies on.

use crate::config::Config;
use crate::metrics::{self, Engine};
use crate::request;
use crate::route::Hashed;

const CAP: usize = 16 * 1024;

/// Request body → prompt → block hashes.
pub fn request_body(data: &[u8]) {
    #[allow(clippy::expect_used)]
    // ok: a literal, valid config (see the config tests), in a fuzz-only entry point the filter never calls.
    let cfg = Config::parse(br#"{"endpoints":["10.0.0.1:80"]}"#).expect("static config");
    if let Ok(p) = request::extract(data, CAP) {
        assert!(p.text.len() <= CAP);
        assert!(p.lead_bytes <= p.text.len());
        let h = Hashed::of(&p, &cfg);
        // The filter's one-pass parse-and-hash agrees with render-then-hash.
        if p.text.len() < CAP {
            // Probes (the affinity cookie's) anywhere: on blocks, in one,
            // in the partial block at the end, at it, past it.
            let len = u32::try_from(p.text.len()).unwrap_or(u32::MAX);
            let bb = cfg.block_bytes as u32;
            let probes = [
                1,
                3,
                bb,
                len / 3,
                h.blocks() * bb,
                len.saturating_sub(1),
                len,
                len + 1,
            ];
            if let Ok((_, streamed)) = Hashed::parse_probing(data, &cfg, Some(&probes)) {
                assert_eq!(streamed.checkpoints, h.checkpoints);
                assert_eq!(streamed.lead_blocks, h.lead_blocks);
                assert_eq!(streamed.later_turn, h.later_turn);
                assert_eq!(streamed.end, h.end);
                for pr in &streamed.probes {
                    // The end of the prompt cut there.
                    let shorter = p.text.get(..pr.bytes as usize);
                    let mut q = p.clone();
                    q.text = shorter.unwrap_or_default().to_vec();
                    assert_eq!(Hashed::of(&q, &cfg).end, Some(*pr));
                }
                let reached = probes.iter().filter(|&&b| b > 0 && b <= len);
                let mut reached: Vec<u32> = reached.copied().collect();
                reached.sort_unstable();
                reached.dedup();
                assert_eq!(streamed.probes.len(), reached.len());
            }
        }
        assert_eq!(h.blocks() as usize, p.text.len() / cfg.block_bytes);
        assert!(h.checkpoints.windows(2).all(|w| w[0].blocks < w[1].blocks));
        // Bounded by the schedule: dense window, then log2 of the length.
        assert!(
            h.checkpoints.len()
                <= cfg.max_blocks / cfg.index_stride
                    + cfg.checkpoints_per_doubling as usize * 16
                    + 1
        );
    }
}

/// Prometheus text for every engine.
pub fn metrics_page(data: &[u8]) {
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
        if let Ok(m) = metrics::parse(engine, data, 1 << 20) {
            assert!(m.waiting.is_finite() && m.waiting >= 0.0);
            assert!(m.running.is_finite() && m.running >= 0.0);
            assert!((0.0..=1.0).contains(&m.kv_usage));
            assert!(m.running_lora.len() <= metrics::MAX_LORA_ADAPTERS);
        }
    }
}

/// Plugin configuration: accepted configs are internally consistent.
pub fn plugin_config(data: &[u8]) {
    if let Ok(c) = Config::parse(data) {
        // An empty static list is only valid when discovery provides the
        // pool (found by the fuzzer: the first version of this check
        // predated discovery).
        assert!(!c.static_endpoints.is_empty() || c.discovery.is_some());
        assert!(c.max_fallbacks <= crate::config::MAX_FALLBACKS);
        assert!(c.block_bytes >= 8 && c.max_blocks >= 1);
    }
}

/// Shared-data records read back from any bytes: absent or well-formed.
pub fn shared_records(data: &[u8]) {
    crate::index::check_codec(data);
    crate::load::check_codec(data);
    crate::replicas::check_codec(data);
}

/// Envoy admin `/clusters?format=json` answers (discovery).
pub fn admin_clusters(data: &[u8]) {
    crate::discovery::check_admin_json(data);
}

/// Affinity tokens, cookies and response ids as a client may send them: a
/// header token, a cookie header, a cookie value, a response id, a path
/// and a body to name, none of which may panic; a value that opens is
/// within the jar's bounds, and a named body starts with its name.
pub fn affinity_values(data: &[u8]) {
    use crate::affinity::{self, cookie, response};
    const KEY: &[u8] = b"fuzzing-key-fuzzing-key-fuzzing-key";
    let _ = affinity::verify(KEY, data, 1_000_000, 3600);
    let _ = response::replica_of(KEY, data);
    if let Some(h) = response::request_id_head(data, "resp_x") {
        let named = h.apply(data);
        assert!(named.starts_with(br#"{"request_id":"resp_x""#));
        assert_eq!(named.len(), h.len_with(data.len()));
    }
    if let Ok(path) = std::str::from_utf8(data) {
        let _ = response::id_in_path(path, &["/v1/responses".to_string()]);
    }
    if let Ok(jar) = cookie::Jar::open(KEY, data, 1_000_000, 3600) {
        assert!((1..=cookie::MAX_SESSIONS).contains(&jar.probes().len()));
    }
    let headers = vec![(b"cookie".to_vec(), data.to_vec())];
    if let Some(v) = cookie::find(&headers, "pr") {
        let _ = cookie::Jar::open(KEY, v, 1_000_000, 3600);
        // Stripped, none of ours is left for the upstream.
        if let Some(rest) = cookie::without(&headers, "pr") {
            let after = vec![(b"cookie".to_vec(), rest)];
            assert!(cookie::find(&after, "pr").is_none());
        }
    }
}
