//! `/metrics` fault modes, observed on the wire against the real binary.

mod common;

use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use prom_text_format_parser::Scrape;
use serde_json::{json, Value};

const SHORT: Duration = Duration::from_secs(5);

fn set(addr: &str, fault: Value) -> Value {
    let r = post(addr, "/admin/metrics-fault", &fault);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// The normal page of an idle replica (identical scrape after scrape).
fn normal_page(addr: &str) -> Vec<u8> {
    let r = raw_get(addr, "/metrics", SHORT);
    assert!(r.status == 200 && r.complete(), "{r:?}");
    r.body
}

/// First sample of a family, as the Prometheus parser reads it.
fn value(scrape: &Scrape, name: &str) -> f64 {
    scrape
        .metrics
        .iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .samples[0]
        .value
        .value
        .as_f64()
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("proc status")
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn reset_sends_half_the_page_then_drops_the_connection() {
    let sim = Sim::start(2, &[]);
    let (a, b) = (sim.addr(), sim.addrs[1].as_str());
    let normal = normal_page(a);
    assert_eq!(set(a, json!({"mode": "reset"}))["mode"], "reset");

    let cut = raw_get(a, "/metrics", SHORT);
    assert_eq!(cut.status, 200);
    assert_eq!(cut.header("x-served-by"), Some(a));
    assert_eq!(
        cut.content_length(),
        normal.len(),
        "promises the whole page"
    );
    assert_eq!(
        cut.body,
        normal[..normal.len() / 2],
        "then sends half of it"
    );
    assert_ne!(cut.end, End::TimedOut, "and closes, rather than stalls");
    assert!(cut.elapsed < Duration::from_secs(2), "{:?}", cut.elapsed);
    // A client library reports an error, not a short page.
    assert!(
        try_get(a, "/metrics", SHORT).is_err(),
        "truncated body must fail"
    );

    assert_eq!(normal_page(b), normal, "faults are per replica");
    assert_eq!(get(a, "/health").status, 200, "only the page breaks");
    set(a, json!({"mode": "ok"}));
    assert_eq!(normal_page(a), normal);
}

#[test]
fn stall_holds_half_a_page_until_the_fault_changes_or_the_bound() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr().to_string();
    let full = normal_page(&a).len();
    set(&a, json!({"mode": "stall"}));

    let held = raw_get(&a, "/metrics", Duration::from_millis(400));
    assert_eq!((held.status, &held.end), (200, &End::TimedOut));
    assert_eq!(held.content_length(), full);
    assert_eq!(held.body.len(), full / 2, "first half arrives at once");

    // A parked scrape ends (truncated) when the fault is set again.
    let a2 = a.clone();
    let parked = thread::spawn(move || raw_get(&a2, "/metrics", Duration::from_secs(10)));
    thread::sleep(Duration::from_millis(500));
    set(&a, json!({"mode": "ok"}));
    let p = parked.join().unwrap();
    assert_ne!(p.end, End::TimedOut);
    assert!(
        p.elapsed >= Duration::from_millis(400) && p.elapsed < Duration::from_secs(5),
        "{:?}",
        p.elapsed
    );
    assert_eq!(p.body.len(), full / 2, "the page is never completed");
    assert_eq!(normal_page(&a).len(), full);

    // Left alone, a stall ends at its bound.
    set(&a, json!({"mode": "stall", "stall_ms": 300}));
    let t0 = Instant::now();
    let bounded = raw_get(&a, "/metrics", Duration::from_secs(10));
    assert_ne!(bounded.end, End::TimedOut);
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert!(
        bounded.elapsed < Duration::from_secs(5),
        "{:?}",
        bounded.elapsed
    );
    assert_eq!(bounded.body.len(), full / 2);
}

#[test]
fn huge_page_is_exactly_the_size_asked_valid_and_streamed() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let normal = normal_page(a);
    let echo = set(a, json!({"mode": "huge"}));
    assert_eq!(echo["bytes"], 40 << 20, "default size");

    let big = raw_get(a, "/metrics", Duration::from_secs(60));
    assert_eq!(big.status, 200);
    assert!(big.complete(), "{:?} {}", big.end, big.body.len());
    assert_eq!(big.body.len(), 40 << 20);
    assert!(big.body.starts_with(b"# ."));
    assert!(big.body.ends_with(&normal), "the real page comes last");
    // Streamed: the server's peak memory stays well below one page.
    let hwm = vm_hwm_kib(sim.pid());
    assert!(hwm < 24 * 1024, "peak RSS {hwm} KiB");

    // A smaller one parses as a whole, filler series included.
    set(a, json!({"mode": "huge", "bytes": 300_000}));
    let page = get(a, "/metrics").body;
    assert_eq!(page.len(), 300_000);
    let scrape = Scrape::parse(&page).expect("valid exposition format");
    let padding = scrape
        .metrics
        .iter()
        .find(|m| m.name == "sim:padding")
        .unwrap();
    assert!(padding.samples.len() > 9000, "{}", padding.samples.len());
    assert_eq!(value(&scrape, "vllm:num_requests_waiting"), 0.0);

    // Asked for less than the page: the page alone.
    set(a, json!({"mode": "huge", "bytes": 10}));
    assert_eq!(normal_page(a), normal);
}

#[test]
fn absurd_values_parse_but_are_absurd() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    set(a, json!({"mode": "absurd"}));
    let page = get(a, "/metrics").body;
    let scrape = Scrape::parse(&page).expect("still valid exposition format");
    let v = |name: &str| value(&scrape, name);
    assert_eq!(v("vllm:num_requests_waiting"), 1e308);
    assert_eq!(v("vllm:num_requests_running"), 1e39);
    assert!(
        (v("vllm:num_requests_running") as f32).is_infinite(),
        "> f32"
    );
    assert!(v("vllm:kv_cache_usage_perc").is_nan());
    assert_eq!(v("vllm:prefix_cache_hits_total"), f64::INFINITY);
    assert_eq!(v("vllm:prefix_cache_queries_total"), -1.0);
    assert_eq!(v("vllm:prompt_tokens_total"), f64::NEG_INFINITY);
    assert_eq!(v("vllm:generation_tokens_total"), 2.0, "others stay live");
    assert!(page.contains("vllm:kv_cache_usage_perc{model_name=\"sim-model\",engine=\"0\"} NaN\n"));
    assert!(
        page.contains("vllm:num_requests_waiting{model_name=\"sim-model\",engine=\"0\"} 1e308\n")
    );

    // A chosen set replaces the default one.
    let values = json!({"vllm:num_requests_waiting": -3, "vllm:kv_cache_usage_perc": "+Inf"});
    let echo = set(a, json!({"mode": "absurd", "values": values}));
    assert_eq!(
        echo["values"],
        json!({"vllm:num_requests_waiting": -3.0, "vllm:kv_cache_usage_perc": "+Inf"})
    );
    let scrape = Scrape::parse(&get(a, "/metrics").body).unwrap();
    assert_eq!(value(&scrape, "vllm:num_requests_waiting"), -3.0);
    assert_eq!(value(&scrape, "vllm:kv_cache_usage_perc"), f64::INFINITY);
    assert_eq!(value(&scrape, "vllm:num_requests_running"), 0.0);
    assert_eq!(value(&scrape, "vllm:prompt_tokens_total"), 1.0);
}

#[test]
fn error_and_garbage() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    set(a, json!({"mode": "error"}));
    let r = raw_get(a, "/metrics", SHORT);
    assert_eq!(r.status, 500);
    assert!(r.complete());
    assert_eq!(r.body, b"Internal Server Error");
    assert_eq!(r.header("x-served-by"), Some(a));

    set(a, json!({"mode": "garbage"}));
    let r = raw_get(a, "/metrics", SHORT);
    assert_eq!(r.status, 200);
    assert!(r.complete());
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8"),
        "claims to be a metrics page"
    );
    assert_eq!(r.body.len(), 4096);
    assert!(r.body.starts_with(&[0xff, 0xfe, 0x00]));
    assert!(std::str::from_utf8(&r.body).is_err());
    assert!(Scrape::parse(&String::from_utf8_lossy(&r.body)).is_err());
    assert_eq!(raw_get(a, "/metrics", SHORT).body, r.body, "deterministic");
}

#[test]
fn admin_api_validates_and_composes_with_the_inference_fault() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    // The inference fault's JSON is unchanged.
    assert_eq!(
        get(a, "/admin/fault").json(),
        json!({"mode": "ok", "delay_ms": 0})
    );
    let initial = get(a, "/admin/metrics-fault").json();
    assert_eq!(initial["mode"], "ok");
    assert_eq!(initial["stall_ms"], 60_000);
    for bad in [
        json!({"mode": "sideways"}),
        json!({"bytes": 5}),
        json!({"mode": "huge", "bytes": 2_000_000_000u64}),
        json!({"mode": "stall", "stall_ms": 4_000_000}),
        json!({"mode": "absurd", "values": {"vllm:made_up": 1}}),
        json!({"mode": "absurd", "values": {"vllm:num_requests_waiting": "lots"}}),
    ] {
        let r = try_post(a, "/admin/metrics-fault", &bad.to_string(), &[], SHORT).unwrap();
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    assert_eq!(get(a, "/admin/metrics-fault").json(), initial, "unchanged");

    // down/hang gate /metrics first; the admin endpoints always answer.
    set(a, json!({"mode": "huge"}));
    assert_eq!(
        post(a, "/admin/fault", &json!({"mode": "down"})).status,
        200
    );
    assert_eq!(try_get(a, "/metrics", SHORT).unwrap().status, 503);
    assert_eq!(
        post(a, "/admin/fault", &json!({"mode": "hang"})).status,
        200
    );
    assert!(try_get(a, "/metrics", Duration::from_millis(300)).is_err());
    assert_eq!(set(a, json!({"mode": "error"}))["mode"], "error");
    assert_eq!(get(a, "/admin/metrics-fault").json()["mode"], "error");
    assert_eq!(post(a, "/admin/fault", &json!({"mode": "ok"})).status, 200);
    assert_eq!(try_get(a, "/metrics", SHORT).unwrap().status, 500);
}

#[test]
fn command_line_starts_chosen_replicas_in_a_mode() {
    let sim = Sim::start(
        3,
        &["--metrics-fault", "error", "--metrics-fault-replicas", "1"],
    );
    let statuses: Vec<u16> = sim
        .addrs
        .iter()
        .map(|a| try_get(a, "/metrics", SHORT).unwrap().status)
        .collect();
    assert_eq!(statuses, [200, 500, 200]);
    assert_eq!(
        get(&sim.addrs[1], "/admin/metrics-fault").json()["mode"],
        "error"
    );

    let sim = Sim::start(
        1,
        &["--metrics-fault", "huge", "--metrics-huge-bytes", "65536"],
    );
    let r = raw_get(sim.addr(), "/metrics", SHORT);
    assert!(r.complete());
    assert_eq!(r.body.len(), 65536);

    let mut child = Command::new(env!("CARGO_BIN_EXE_replica-sim"))
        .args(["--port", "0", "--replicas", "2"])
        .args(["--metrics-fault", "reset", "--metrics-fault-replicas", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + SHORT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "no replica 2 of 2: usage error"
    );
}
