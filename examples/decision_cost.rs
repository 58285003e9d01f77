//! What parsing, hashing and one decision cost, compiled to the target
//! the filter runs on: `cargo run --release --example decision_cost
//! --target wasm32-wasip1` (under wasmtime, see .cargo/config.toml), or
//! natively without `--target`. Median of many runs per size, in µs.
//! Criterion can't run inside wasm; this is its small stand-in there.
//!
//! `decision_cost SHAPE BYTES N` instead parses and hashes one body (shape
//! `plain`, `escaped`, `agent` or `anthropic`) N times and prints nothing: for counting
//! instructions, which a noisy machine doesn't change (`valgrind
//! --tool=callgrind`, run with N and with 0, and take the difference).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Instant;

use prefix_router::config::Config;
use prefix_router::request;
use prefix_router::route::{Hashed, Meta, Router};
use prefix_router::store::MemStore;

/// A chat body with a `bytes`-long document: plain text, or with a line
/// break (a JSON escape, unescaped into a copy) every 46 bytes, as prose
/// and code have.
fn body(bytes: usize, escaped: bool) -> String {
    let line = if escaped {
        "The quick brown fox jumps over the lazy dog.\\n"
    } else {
        "The quick brown fox jumps over the lazy dog. "
    };
    let doc: String = line.chars().cycle().take(bytes).collect();
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"You answer from the document."}},{{"role":"user","content":"{doc}"}}],"stream":true}}"#
    )
}

/// One of the agent's 40 tools: its name, description and JSON Schema
/// (the same in both APIs' spellings of the turn).
fn tool(i: usize) -> (String, String, &'static str) {
    let schema = r#"{"type":"object","properties":{"id":{"type":"string","description":"The record id, as printed on the label"},"fields":{"type":"array","items":{"type":"string"},"description":"Which fields to return; all when empty"},"since":{"type":"string","format":"date-time","description":"Only history after this instant"},"limit":{"type":"integer","minimum":1,"maximum":500}},"required":["id"]}"#;
    let description = format!(
        "Looks up record {i} in the inventory and returns its fields, history and owners as JSON."
    );
    (format!("tool_{i}"), description, schema)
}

/// Tool call `t`'s result rows: JSON inside a JSON string, escaped.
fn rows(t: usize) -> String {
    (0..40)
        .map(|r| format!(r#"{{\"id\":\"r-{t}-{r}\",\"state\":\"ok\",\"owner\":\"team {r}\"}},\n"#))
        .collect()
}

/// An agent's turn of about `bytes`: ~20 KB of `tools` (JSON Schema
/// function definitions), a system prompt, the task, then tool calls and
/// their results (JSON text with escaped quotes and line breaks) up to the
/// size, as the `agentic` benchmark workload sends.
fn agent_body(bytes: usize) -> String {
    let tools: Vec<String> = (0..40)
        .map(|i| {
            let (name, description, schema) = tool(i);
            format!(
                r#"{{"type":"function","function":{{"name":"{name}","description":"{description}","parameters":{schema}}}}}"#
            )
        })
        .collect();
    let mut messages = vec![
        r#"{"role":"system","content":"You are an operations agent.\nCall one tool at a time and use its result.\nNever guess a record id."}"#.to_string(),
        r#"{"role":"user","content":"Task: reconcile the inventory of site 7 with last week's audit.\nReport every mismatch."}"#.to_string(),
    ];
    let mut t = 0;
    while messages.iter().map(String::len).sum::<usize>() + 30_000 < bytes {
        let rows = rows(t);
        messages.push(format!(
            r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":"call_{t}","type":"function","function":{{"name":"tool_{t}","arguments":"{{\"id\":\"r-{t}\",\"limit\":40}}"}}}}]}}"#
        ));
        messages.push(format!(
            r#"{{"role":"tool","tool_call_id":"call_{t}","content":"{{\"records\":[\n{rows}]}}"}}"#
        ));
        t += 1;
    }
    format!(
        r#"{{"model":"llama","tools":[{}],"messages":[{}],"stream":true}}"#,
        tools.join(","),
        messages.join(",")
    )
}

/// The same agent's turn as a coding agent sends it over the Anthropic
/// Messages API (`/v1/messages`): tools with `input_schema`, `system` as
/// blocks, each call a `tool_use` block and each result a `tool_result`
/// block, with Claude Code's cache breakpoints.
fn anthropic_body(bytes: usize) -> String {
    const CC: &str = r#""cache_control":{"type":"ephemeral"}"#;
    let tools: Vec<String> = (0..40)
        .map(|i| {
            let (name, description, schema) = tool(i);
            format!(r#"{{"name":"{name}","description":"{description}","input_schema":{schema}}}"#)
        })
        .collect();
    let mut messages = vec![
        r#"{"role":"user","content":[{"type":"text","text":"Task: reconcile the inventory of site 7 with last week's audit.\nReport every mismatch."}]}"#.to_string(),
    ];
    let mut t = 0;
    while messages.iter().map(String::len).sum::<usize>() + 30_000 < bytes {
        let rows = rows(t);
        messages.push(format!(
            r#"{{"role":"assistant","content":[{{"type":"tool_use","id":"toolu_{t}","name":"tool_{t}","input":{{"id":"r-{t}","limit":40}}}}]}}"#
        ));
        messages.push(format!(
            r#"{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"toolu_{t}","content":"{{\"records\":[\n{rows}]}}",{CC}}}]}}"#
        ));
        t += 1;
    }
    format!(
        r#"{{"model":"llama","max_tokens":4096,"tools":[{}],"system":[{{"type":"text","text":"You are an operations agent.\nCall one tool at a time and use its result.\nNever guess a record id.",{CC}}}],"messages":[{}],"stream":true}}"#,
        tools.join(","),
        messages.join(",")
    )
}

fn median_us(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn body_of(shape: &str, size: usize) -> String {
    match shape {
        "agent" => agent_body(size),
        "anthropic" => anthropic_body(size),
        s => body(size, s == "escaped"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [shape, size, n] = &args[..] {
        let cfg = Config::parse(br#"{"endpoints":["10.0.0.1:8000"]}"#).expect("config");
        let b = body_of(shape, size.parse().expect("BYTES"));
        for _ in 0..n.parse::<usize>().expect("N") {
            std::hint::black_box(Hashed::parse(std::hint::black_box(b.as_bytes()), &cfg).unwrap());
        }
        return;
    }
    let eps: Vec<String> = (1..=8).map(|i| format!("\"10.0.0.{i}:8000\"")).collect();
    let cfg = format!(r#"{{"endpoints":[{}]}}"#, eps.join(","));
    let r = Router::new(Config::parse(cfg.as_bytes()).expect("config"));
    let store = MemStore::new();
    println!(
        "{:>9} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "body", "shape", "json", "render", "hash", "decision"
    );
    let sizes = [16 << 10, 256 << 10, 1 << 20];
    for (shape, size) in ["plain", "escaped", "agent", "anthropic"]
        .into_iter()
        .flat_map(|e| sizes.map(|s| (e, s)))
    {
        let b = body_of(shape, size);
        let runs = if size > 300_000 { 60 } else { 200 };
        let json = median_us(runs, || {
            std::hint::black_box(
                serde_json::from_slice::<serde::de::IgnoredAny>(b.as_bytes()).unwrap(),
            );
        });
        let render = median_us(runs, || {
            std::hint::black_box(request::extract(b.as_bytes(), 16 << 20).unwrap());
        });
        let hash = median_us(runs, || {
            std::hint::black_box(Hashed::parse(b.as_bytes(), &r.config).unwrap());
        });
        let (_, h) = Hashed::parse(b.as_bytes(), &r.config).unwrap();
        let first = r.decide(&store, &h, Meta::default(), 1000).unwrap();
        let mut board = prefix_router::load::LoadBoard::new(1, 60_000);
        r.commit(&store, &mut board, &first, &h, 1000);
        let decision = median_us(runs, || {
            let (_, h) = Hashed::parse(b.as_bytes(), &r.config).unwrap();
            let c = r.decide(&store, &h, Meta::default(), 1000).unwrap();
            std::hint::black_box(r.header_value(&c));
        });
        let size = b.len();
        println!("{size:>9} {shape:>8} {json:>9.1} {render:>9.1} {hash:>9.1} {decision:>9.1}");
    }
}
