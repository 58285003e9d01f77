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
            if let Ok((_, streamed)) = Hashed::parse(data, &cfg) {
                assert_eq!(streamed.checkpoints, h.checkpoints);
                assert_eq!(streamed.lead_blocks, h.lead_blocks);
                assert_eq!(streamed.later_turn, h.later_turn);
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
