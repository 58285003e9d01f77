//! End-to-end behaviour of the real binary over loopback HTTP.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn chat_body(content: &str, max_tokens: u64) -> Value {
    json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": content}, {"role": "user", "content": "Summarise."}],
        "max_tokens": max_tokens,
        "some_peer_field": {"ignored": true}
    })
}

fn ttft_sum(addr: &str) -> f64 {
    metric(addr, "vllm:time_to_first_token_seconds_sum")
}

#[test]
fn repeated_long_prefix_is_served_from_cache() {
    // 0.05 ms/token so the cold prefill is visible in real time too.
    let sim = Sim::start(1, &["--prefill-ms-per-token", "0.05"]);
    let a = sim.addr();
    let body = chat_body(&text(1, 1200), 4);

    let before = ttft_sum(a);
    let cold = post(a, "/v1/chat/completions", &body).json();
    let cold_sim = ttft_sum(a) - before;
    let p = cold["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    assert!(p > 1500.0, "prompt should be long, got {p}");
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(cold["usage"]["completion_tokens"], 4);
    // Chunked prefill of <=512 tokens per step: one 0.5 ms overhead each.
    let expected_cold = ((p / 512.0).ceil() * 0.5 + p * 0.05) / 1000.0;
    assert!(
        (cold_sim - expected_cold).abs() < 1e-6,
        "cold {cold_sim} vs {expected_cold}"
    );

    let before = ttft_sum(a);
    let warm = post(a, "/v1/chat/completions", &body).json();
    let warm_sim = ttft_sum(a) - before;
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as f64;
    assert_eq!(
        cached,
        ((p - 1.0) / 16.0).floor() * 16.0,
        "prefix rounded down to blocks"
    );
    let expected_warm = (0.5 + (p - cached) * 0.05) / 1000.0;
    assert!(
        (warm_sim - expected_warm).abs() < 1e-6,
        "warm {warm_sim} vs {expected_warm}"
    );
    assert!(cold_sim / warm_sim > 50.0, "ratio {}", cold_sim / warm_sim);

    // A client sees it as well: time to the first SSE frame.
    let mut other = chat_body(&text(2, 1200), 4);
    other["stream"] = json!(true);
    let (client_cold, _) = stream(a, "/v1/chat/completions", &other);
    let (client_warm, _) = stream(a, "/v1/chat/completions", &other);
    assert!(client_cold > 0.05, "cold TTFT {client_cold}");
    assert!(
        client_warm < client_cold / 3.0,
        "warm {client_warm} vs cold {client_cold}"
    );
}

#[test]
fn served_by_health_and_models() {
    let sim = Sim::start(1, &["--lora", "alpha"]);
    let a = sim.addr();
    for r in [
        get(a, "/health"),
        get(a, "/metrics"),
        get(a, "/v1/models"),
        get(a, "/nope"),
    ] {
        assert_eq!(r.served_by.as_deref(), Some(a));
    }
    assert_eq!(get(a, "/health").status, 200);
    assert_eq!(get(a, "/nope").status, 404);
    let models = get(a, "/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-model", "alpha"]);
    assert_eq!(models["data"][1]["parent"], "sim-model");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
}

#[test]
fn excess_requests_show_up_as_waiting() {
    let sim = Sim::start(1, &["--max-num-seqs", "2", "--decode-ms-per-step", "5"]);
    let a = sim.addr().to_string();
    let workers: Vec<_> = (0..6)
        .map(|i| {
            let a = a.clone();
            // 100 tokens at ~5 ms each: about half a second in flight.
            thread::spawn(move || {
                post(
                    &a,
                    "/v1/completions",
                    &json!({"prompt": text(i, 20), "max_tokens": 100}),
                )
                .status
            })
        })
        .collect();
    let seen = wait_until(Duration::from_secs(5), || {
        metric(&a, "vllm:num_requests_waiting") == 4.0
            && metric(&a, "vllm:num_requests_running") == 2.0
    });
    assert!(seen, "expected 2 running and 4 waiting");
    assert!(metric(&a, "vllm:kv_cache_usage_perc") > 0.0);
    for w in workers {
        assert_eq!(w.join().unwrap(), 200);
    }
    assert_eq!(metric(&a, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(metric(&a, "vllm:request_success_total"), 6.0);
}

#[test]
fn metrics_page_parses_with_a_prometheus_parser() {
    let sim = Sim::start(1, &["--lora", "alpha,beta", "--max-loras", "2"]);
    let a = sim.addr();
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": text(3, 50), "max_tokens": 3}),
    )
    .json();
    let prompt = r["usage"]["prompt_tokens"].as_f64().unwrap();
    let page = get(a, "/metrics").body;
    let scrape = prom_text_format_parser::Scrape::parse(&page).expect("valid exposition format");
    // The parser is strict enough to catch what a hand renderer gets wrong.
    for broken in [
        "vllm:x{model_name=unquoted} 1\n",
        "vllm:x{a=\"1\"} one\n",
        "# TYPE vllm:x gauge\nvllm:x{a=\"1\"\n",
    ] {
        assert!(
            prom_text_format_parser::Scrape::parse(broken).is_err(),
            "{broken:?} should not parse"
        );
    }
    use prom_text_format_parser::{Metric, Type, ValueType};
    let family = |name: &str| -> &Metric {
        scrape
            .metrics
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    let label = |m: &Metric, key: &str| -> Option<String> {
        m.samples[0]
            .labels
            .iter()
            .find(|l| l.key == key)
            .map(|l| l.value.clone())
    };
    let value = |name: &str, kind: Type| -> f64 {
        let m = family(name);
        assert_eq!(m.kind, kind, "{name}");
        assert!(
            m.help_desc.as_deref().is_some_and(|h| !h.is_empty()),
            "{name} has HELP"
        );
        assert_eq!(
            label(m, "model_name").as_deref(),
            Some("sim-model"),
            "{name}"
        );
        m.samples[0].value.value.as_f64()
    };
    assert_eq!(value("vllm:prompt_tokens_total", Type::Counter), prompt);
    assert_eq!(value("vllm:generation_tokens_total", Type::Counter), 3.0);
    assert_eq!(
        value("vllm:prefix_cache_queries_total", Type::Counter),
        prompt
    );
    assert_eq!(value("vllm:prefix_cache_hits_total", Type::Counter), 0.0);
    assert_eq!(value("vllm:request_success_total", Type::Counter), 1.0);
    assert_eq!(value("vllm:num_requests_waiting", Type::Gauge), 0.0);
    assert_eq!(value("vllm:num_requests_running", Type::Gauge), 0.0);
    assert_eq!(value("vllm:kv_cache_usage_perc", Type::Gauge), 0.0);
    for name in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ] {
        let h = family(name);
        assert_eq!(h.kind, Type::Histogram);
        let count = h
            .samples
            .iter()
            .find(|s| s.value.value_type == ValueType::Count)
            .unwrap();
        assert_eq!(count.value.value.as_f64(), 1.0, "{name}");
        let inf = h
            .samples
            .iter()
            .find(|s| s.labels.iter().any(|l| l.key == "le" && l.value == "+Inf"))
            .unwrap();
        assert_eq!(inf.value.value.as_f64(), 1.0);
    }
    let info = family("vllm:cache_config_info");
    assert_eq!(label(info, "block_size").as_deref(), Some("16"));
    assert_eq!(label(info, "num_gpu_blocks").as_deref(), Some("512"));
    let lora = family("vllm:lora_requests_info");
    assert_eq!(label(lora, "max_lora").as_deref(), Some("2"));
    assert_eq!(label(lora, "running_lora_adapters").as_deref(), Some(""));
}

#[test]
fn lora_adapter_in_flight_is_reported() {
    let sim = Sim::start(1, &["--lora", "alpha,beta", "--decode-ms-per-step", "5"]);
    let a = sim.addr().to_string();
    let b = a.clone();
    let worker = thread::spawn(move || {
        post(
            &b,
            "/v1/completions",
            &json!({"model": "beta", "prompt": "hi", "max_tokens": 80}),
        )
        .json()
    });
    let seen = wait_until(Duration::from_secs(5), || {
        get(&a, "/metrics")
            .body
            .contains("running_lora_adapters=\"beta\"")
    });
    assert!(seen);
    assert_eq!(worker.join().unwrap()["model"], "beta");
}

#[test]
fn malformed_requests_get_openai_style_400() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let long = "word ".repeat(5000);
    let cases: Vec<(&str, String)> = vec![
        ("/v1/completions", "not json".into()),
        ("/v1/completions", "".into()),
        ("/v1/completions", json!({"max_tokens": 3}).to_string()),
        ("/v1/completions", json!({"prompt": {"x": 1}}).to_string()),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -2}).to_string(),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}).to_string(),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999999]}).to_string(),
        ),
        ("/v1/completions", json!({"prompt": long}).to_string()),
        ("/v1/chat/completions", json!({"messages": []}).to_string()),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "no role"}]}).to_string(),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
        ),
        ("/v1/chat/completions/render", "[1,2".into()),
        ("/tokenize", json!({}).to_string()),
        ("/admin/fault", json!({"mode": "sideways"}).to_string()),
    ];
    for (path, body) in cases {
        let r = try_post(a, path, &body, &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 400, "{path} {body:.60}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{}", r.body);
        assert_eq!(e["error"]["code"], 400);
        assert!(e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let bad_delay = try_post(
        a,
        "/v1/completions",
        r#"{"prompt":"x"}"#,
        &[("x-sim-delay-ms", "soon")],
        Duration::from_secs(5),
    );
    assert_eq!(bad_delay.unwrap().status, 400);
    // Still serving after all that.
    assert_eq!(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": "ok", "max_tokens": 1})
        )
        .status,
        200
    );
}

#[test]
fn sse_framing_usage_and_done() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let body = json!({"prompt": text(4, 30), "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true});
    let (_, frames) = stream(a, "/v1/completions", &body);
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(frames.len(), 5 + 2, "5 tokens, usage, [DONE]");
    let chunks: Vec<Value> = frames[..6]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    for (i, c) in chunks[..5].iter().enumerate() {
        assert_eq!(c["object"], "text_completion");
        assert!(c["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()));
        let finish = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], finish);
    }
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);

    // Chat: role in the first delta; no usage frame unless asked.
    let chat = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}], "max_completion_tokens": 3, "stream": true, "tools": [{"type": "function", "function": {"name": "f"}}]});
    let (_, frames) = stream(a, "/v1/chat/completions", &chat);
    assert_eq!(frames.len(), 4);
    let first: Value = serde_json::from_str(&frames[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(frames[3], "[DONE]");
}

#[test]
fn reset_zeroes_counters_and_cache() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let body = json!({"prompt": text(5, 300), "max_tokens": 2});
    post(a, "/v1/completions", &body);
    let again = post(a, "/v1/completions", &body).json();
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(metric(a, "vllm:prompt_tokens_total") > 0.0);
    let r = post(a, "/reset", &json!({})).json();
    assert_eq!(r["cache_cleared"], true);
    for m in [
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ] {
        assert_eq!(metric(a, m), 0.0, "{m}");
    }
    let after = post(a, "/v1/completions", &body).json();
    assert_eq!(after["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn replicas_have_independent_caches_and_metrics() {
    let sim = Sim::start(3, &[]);
    assert_eq!(sim.addrs.len(), 3);
    let body = json!({"prompt": text(6, 400), "max_tokens": 1});
    post(&sim.addrs[0], "/v1/completions", &body);
    let warm = post(&sim.addrs[0], "/v1/completions", &body);
    assert_eq!(warm.served_by.as_deref(), Some(sim.addrs[0].as_str()));
    assert!(
        warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let other = post(&sim.addrs[1], "/v1/completions", &body);
    assert_eq!(other.served_by.as_deref(), Some(sim.addrs[1].as_str()));
    assert_eq!(
        other.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert!(metric(&sim.addrs[0], "vllm:prefix_cache_hits_total") > 0.0);
    assert_eq!(metric(&sim.addrs[1], "vllm:prefix_cache_hits_total"), 0.0);
    assert_eq!(metric(&sim.addrs[2], "vllm:request_success_total"), 0.0);
}

#[test]
fn fault_modes_down_hang_slow() {
    let sim = Sim::start(2, &[]);
    let (a, b) = (sim.addr(), sim.addrs[1].as_str());
    let set = |mode: Value| assert_eq!(post(a, "/admin/fault", &mode).status, 200);
    let short = Duration::from_millis(300);

    set(json!({"mode": "down"}));
    for path in ["/health", "/metrics"] {
        let r = try_get(a, path, short).unwrap();
        assert_eq!((r.status, r.served_by.as_deref()), (503, Some(a)));
    }
    assert_eq!(
        try_post(a, "/v1/completions", r#"{"prompt":"x"}"#, &[], short)
            .unwrap()
            .status,
        503
    );
    assert_eq!(get(b, "/health").status, 200, "faults are per replica");

    set(json!({"mode": "hang"}));
    assert!(
        try_get(a, "/health", short).is_err(),
        "hang must not answer"
    );
    assert!(try_post(a, "/v1/completions", r#"{"prompt":"x"}"#, &[], short).is_err());
    // A request parked by hang completes once the mode changes.
    let a2 = a.to_string();
    let parked =
        thread::spawn(move || try_get(&a2, "/health", Duration::from_secs(10)).map(|r| r.status));
    thread::sleep(Duration::from_millis(100));
    set(json!({"mode": "ok"}));
    assert_eq!(parked.join().unwrap(), Ok(200));

    set(json!({"mode": "slow", "delay_ms": 300}));
    let t0 = Instant::now();
    post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
    );
    assert!(t0.elapsed() >= Duration::from_millis(300));
    set(json!({"mode": "ok"}));
    assert_eq!(get(a, "/admin/fault").json()["mode"], "ok");
}

#[test]
fn delay_header_holds_a_request_in_flight() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr().to_string();
    let b = a.clone();
    let t0 = Instant::now();
    let held = thread::spawn(move || {
        try_post(
            &b,
            "/v1/completions",
            r#"{"prompt":"x","max_tokens":1}"#,
            &[("x-sim-delay-ms", "400")],
            Duration::from_secs(5),
        )
        .map(|r| r.status)
    });
    assert!(wait_until(Duration::from_secs(2), || metric(
        &a,
        "vllm:num_requests_waiting"
    ) == 1.0));
    assert_eq!(held.join().unwrap(), Ok(200));
    assert!(t0.elapsed() >= Duration::from_millis(400));
    assert_eq!(metric(&a, "vllm:num_requests_waiting"), 0.0);
}

#[test]
fn fail_rate_fails_that_fraction() {
    let sim = Sim::start(1, &["--fail-rate", "0.5"]);
    let a = sim.addr();
    let statuses: Vec<u16> = (0..10)
        .map(|_| {
            try_post(
                a,
                "/v1/completions",
                r#"{"prompt":"x","max_tokens":1}"#,
                &[],
                Duration::from_secs(5),
            )
            .unwrap()
            .status
        })
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 500).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5);
}

#[test]
fn tokenize_and_render_agree_with_usage() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let messages = json!([{"role": "user", "content": "How many tokens is this?"}]);
    let render = post(
        a,
        "/v1/chat/completions/render",
        &json!({"messages": messages}),
    )
    .json();
    let tok = post(a, "/tokenize", &json!({"messages": messages})).json();
    let usage = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .json();
    let ids = render["token_ids"].as_array().unwrap();
    assert_eq!(&render["prompt_token_ids"], &render["token_ids"]);
    assert_eq!(tok["tokens"].as_array().unwrap(), ids);
    assert_eq!(tok["count"], ids.len());
    assert_eq!(usage["usage"]["prompt_tokens"], ids.len());
    let comp = post(
        a,
        "/v1/completions/render",
        &json!({"prompt": "hello world"}),
    )
    .json();
    let by_tokenize = post(a, "/tokenize", &json!({"prompt": "hello world"})).json();
    assert_eq!(comp[0]["token_ids"], by_tokenize["tokens"]);
    // Token-id prompts pass through unchanged.
    let ids = post(a, "/v1/completions/render", &json!({"prompt": [5, 6, 7]})).json();
    assert_eq!(ids[0]["token_ids"], json!([5, 6, 7]));
}

/// vLLM hashes `cache_salt` into a request's blocks: a prompt sent with
/// another salt shares no KV, and with the same salt it hits.
#[test]
fn cache_salt_separates_kv() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let prompt = text(7, 300);
    let body = |salt: &str| json!({"prompt": prompt, "max_tokens": 1, "cache_salt": salt});
    post(a, "/v1/completions", &body("tenant-a"));
    let other = post(a, "/v1/completions", &body("tenant-b")).json();
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let same = post(a, "/v1/completions", &body("tenant-a")).json();
    assert!(
        same["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 200
    );
}

#[test]
fn a_stored_response_continues_on_its_replica_only() {
    let sim = Sim::start(2, &[]);
    let (a, b) = (sim.addr(), sim.addrs[1].as_str());
    let first = json!({"model": "sim-model", "instructions": text(2, 300), "input": "Hello.",
                       "max_output_tokens": 3, "request_id": "resp_named"});
    let r = post(a, "/v1/responses", &first).json();
    assert_eq!(
        (r["id"].as_str(), r["status"].as_str()),
        (Some("resp_named"), Some("completed"))
    );
    let next = json!({"model": "sim-model", "instructions": text(2, 300), "input": "And?",
                      "previous_response_id": "resp_named", "max_output_tokens": 3});
    // The stored conversation is the new prompt's prefix, in the cache.
    let r = post(a, "/v1/responses", &next).json();
    let cached = r["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 300, "{cached}");
    assert_eq!(get(a, "/v1/responses/resp_named").status, 200);
    // Another replica has no such response.
    let elsewhere = post(b, "/v1/responses", &next);
    assert_eq!(elsewhere.status, 404, "{}", elsewhere.body);
    assert_eq!(get(b, "/v1/responses/resp_named").status, 404);
    // Not stored: nothing to continue.
    let unstored =
        json!({"input": "x", "store": false, "request_id": "resp_gone", "max_output_tokens": 1});
    assert_eq!(post(a, "/v1/responses", &unstored).status, 200);
    assert_eq!(get(a, "/v1/responses/resp_gone").status, 404);
}

/// An agent session's turn `k` over the Messages API, as Claude Code
/// sends it: system blocks, a tool, the whole history (tool calls and
/// their results), the cache breakpoint on the last block only.
fn messages_turn(k: usize, preamble: &str) -> Value {
    let mut msgs =
        vec![json!({"role": "user", "content": [{"type": "text", "text": "Fix the tests."}]})];
    for t in 0..k {
        msgs.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Step {t}.")},
            {"type": "tool_use", "id": format!("toolu_{t}"), "name": "run", "input": {"cmd": "cargo test"}}
        ]}));
        msgs.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{t}"), "content": text(10 + t, 120)}
        ]}));
    }
    let last = msgs.last_mut().unwrap()["content"]
        .as_array_mut()
        .unwrap()
        .last_mut()
        .unwrap();
    last["cache_control"] = json!({"type": "ephemeral"});
    json!({
        "model": "sim-model", "max_tokens": 3,
        "system": [{"type": "text", "text": preamble, "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "run", "description": "Run a command",
                   "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}],
        "messages": msgs
    })
}

/// What vLLM makes of `messages_turn(k)`: the chat body.
fn messages_turn_as_chat(k: usize, preamble: &str) -> Value {
    let mut msgs = vec![
        json!({"role": "system", "content": preamble}),
        json!({"role": "user", "content": "Fix the tests."}),
    ];
    for t in 0..k {
        msgs.push(
            json!({"role": "assistant", "content": format!("Step {t}."), "tool_calls": [
            {"id": format!("toolu_{t}"), "type": "function",
             "function": {"name": "run", "arguments": "{\"cmd\": \"cargo test\"}"}}]}),
        );
        msgs.push(
            json!({"role": "tool", "tool_call_id": format!("toolu_{t}"), "content": text(10 + t, 120)}),
        );
    }
    json!({
        "model": "sim-model", "max_tokens": 3, "messages": msgs,
        "tools": [{"type": "function", "function": {"name": "run", "description": "Run a command",
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
    })
}

/// Server-sent events as (event name, data), checking the framing
/// (`event: NAME\ndata: JSON\n\n`, the name the data's type).
fn events(addr: &str, path: &str, body: &Value) -> Vec<(String, Value)> {
    let resp = agent(Duration::from_secs(20))
        .post(&format!("http://{addr}{path}"))
        .send_string(&body.to_string())
        .expect("stream request");
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    assert_eq!(resp.header("x-served-by"), Some(addr));
    let mut raw = String::new();
    std::io::Read::read_to_string(&mut resp.into_reader(), &mut raw).unwrap();
    assert!(raw.ends_with("\n\n"), "{raw:?}");
    raw.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("bad event {e:?}"));
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name, "{e}");
            (name.to_string(), data)
        })
        .collect()
}

#[test]
fn messages_stream_their_events_in_order_with_text_and_usage() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let preamble = text(20, 200);
    let mut body = messages_turn(2, &preamble);
    body["stream"] = json!(true);
    let evs = events(a, "/v1/messages", &body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &evs[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (&start["role"], &start["model"], &start["content"]),
        (&json!("assistant"), &json!("sim-model"), &json!([]))
    );
    assert_eq!(
        evs[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let said: String = evs[3..6]
        .iter()
        .map(|(_, d)| {
            assert_eq!(
                (&d["index"], &d["delta"]["type"]),
                (&json!(0), &json!("text_delta"))
            );
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert!(!said.is_empty());
    // The prompt is the chat body's: the same number of tokens.
    let chat = post(
        a,
        "/v1/chat/completions",
        &messages_turn_as_chat(2, &preamble),
    )
    .json();
    let prompt = &chat["usage"]["prompt_tokens"];
    assert_eq!(&start["usage"]["input_tokens"], prompt);
    let end = &evs[7].1;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end["usage"]["output_tokens"], 3);
    assert_eq!(&end["usage"]["input_tokens"], prompt);
    assert_eq!(end["usage"]["cache_read_input_tokens"], 0, "cold");

    // Not streamed: one message.
    body["stream"] = json!(false);
    let m = post(a, "/v1/messages", &body).json();
    assert_eq!(
        (&m["type"], &m["stop_reason"]),
        (&json!("message"), &json!("max_tokens"))
    );
    assert_eq!(m["content"][0]["type"], "text");
    assert!(!m["content"][0]["text"].as_str().unwrap().is_empty());
    assert_eq!(&m["usage"]["input_tokens"], prompt);
    assert!(m["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 300);
}

/// The cache hits across the two APIs' equivalent bodies, and a session's
/// next turn (its breakpoint moved to the new last block) hits the last.
#[test]
fn messages_share_the_chat_cache_and_a_sessions_next_turn_hits() {
    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let preamble = text(21, 400);
    let chat = post(
        a,
        "/v1/chat/completions",
        &messages_turn_as_chat(1, &preamble),
    )
    .json();
    let m = post(a, "/v1/messages", &messages_turn(1, &preamble)).json();
    let p = chat["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(m["usage"]["input_tokens"], p);
    assert_eq!(
        m["usage"]["cache_read_input_tokens"],
        (p - 1) / 16 * 16,
        "the whole prompt but its last token, in whole blocks"
    );

    let sim = Sim::start(1, &[]);
    let a = sim.addr();
    let first = post(a, "/v1/messages", &messages_turn(1, &preamble)).json();
    let before = metric(a, "vllm:prefix_cache_hits_total");
    assert_eq!(before, 0.0);
    let next = post(a, "/v1/messages", &messages_turn(2, &preamble)).json();
    let hits = metric(a, "vllm:prefix_cache_hits_total") - before;
    let p1 = first["usage"]["input_tokens"].as_u64().unwrap() as f64;
    // Turn 1's prompt in whole blocks (its last block may end mid-way).
    assert!(hits >= (p1 / 16.0).floor() * 16.0 - 16.0, "{hits} of {p1}");
    assert_eq!(
        next["usage"]["cache_read_input_tokens"].as_f64(),
        Some(hits)
    );
}

#[test]
fn bad_messages_bodies_get_anthropic_style_errors() {
    let sim = Sim::start(1, &["--max-model-len", "512"]);
    let a = sim.addr();
    let ok = json!({"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let mut cases: Vec<(String, u16)> = vec![
        ("not json".into(), 400),
        (json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}).to_string(), 400),
        (json!({"model": "sim-model", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}).to_string(), 400),
        (json!({"model": "sim-model", "max_tokens": 2, "messages": []}).to_string(), 400),
        (json!({"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}).to_string(), 400),
    ];
    // Over the context length, as vLLM words it.
    let mut long = ok.clone();
    long["messages"][0]["content"] = json!(text(22, 600));
    cases.push((long.to_string(), 400));
    for (body, status) in cases {
        let r = try_post(a, "/v1/messages", &body, &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, status, "{body:.80}: {}", r.body);
        assert_eq!(r.served_by.as_deref(), Some(a));
        let e = r.json();
        assert_eq!(e["type"], "error", "{}", r.body);
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // The fault modes apply; a down replica answers in the same shape.
    assert_eq!(
        post(a, "/admin/fault", &json!({"mode": "down"})).status,
        200
    );
    let r = try_post(
        a,
        "/v1/messages",
        &ok.to_string(),
        &[],
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    let chat = try_post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
        &[],
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(
        chat.json()["error"]["code"],
        503,
        "other routes keep OpenAI's shape"
    );
    assert_eq!(post(a, "/admin/fault", &json!({"mode": "ok"})).status, 200);
    assert_eq!(post(a, "/v1/messages", &ok).status, 200);
}
