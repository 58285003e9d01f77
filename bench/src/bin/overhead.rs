//! Proxy overhead micro-benchmark tools (driven by `bench/overhead.py`):
//!
//! - `overhead echo --port P`: an instant OpenAI-ish backend (answers every
//!   request with a tiny completion, on `/v1/messages` a tiny Anthropic
//!   message, and `/v1/models` with model `m`; no model, no delay), so
//!   what is measured is the proxy in between;
//! - `overhead load --target URL --concurrency C --body-bytes N --seconds S
//!   [--shape chat|agent|responses|anthropic]`: closed loop, keep-alive,
//!   fixed-size bodies over 64 distinct documents (`chat`: one plain-text
//!   document; `agent`: an agent's turn, tools + tool calls + JSON tool
//!   results full of escapes; `responses`: the chat body as a Responses API
//!   request, for `/v1/responses`; `anthropic`: the agent's turn as an
//!   Anthropic Messages request, for `/v1/messages`); prints one JSON line:
//!   requests, errors (and the first: status and the start of the answer,
//!   or what failed), req/s, latency percentiles in microseconds.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1 as server_http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
#[command(about = "proxy overhead benchmark tools")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Instant backend on 127.0.0.1:PORT.
    Echo {
        #[arg(long)]
        port: u16,
    },
    /// Closed-loop load against TARGET (http://host:port/path).
    Load {
        #[arg(long)]
        target: String,
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        #[arg(long, default_value_t = 16384)]
        body_bytes: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Requests per connection before it is replaced (spreads load over
        /// Envoy's workers; 0 = keep forever).
        #[arg(long, default_value_t = 0)]
        reconnect_every: usize,
        #[arg(long, value_enum, default_value_t = Shape::Chat)]
        shape: Shape,
        /// Keep this cookie as a client's jar does (each response's value
        /// replaces the last) and send it back: prefix-router's
        /// `affinity.cookie`. Empty = no cookies.
        #[arg(long, default_value = "")]
        cookie: String,
    },
}

/// What the request bodies look like.
#[derive(Clone, Copy, ValueEnum)]
enum Shape {
    /// A system line and one plain-text document (no JSON escapes).
    Chat,
    /// An agent's turn: about 20 KB of tool definitions, then tool calls
    /// and their results (JSON text: an escaped quote every few bytes).
    Agent,
    /// The chat body's document as a Responses API request
    /// (`instructions`, `input`), stored by default.
    Responses,
    /// The agent's turn as a coding agent sends it over the Anthropic
    /// Messages API (`/v1/messages`): `tool_use` and `tool_result` blocks,
    /// `cache_control` breakpoints.
    Anthropic,
}

const ANSWER: &str = r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
/// The answer on `/v1/messages`, an Anthropic message (as vLLM's), so a
/// router that reads the answer finds what it expects.
const MESSAGES_ANSWER: &str = r#"{"id":"msg_x","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"ok"}],"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":1}}"#;

/// The model list: model `m`, the one every body names (smg 1.13 routes
/// a request only to a worker that lists its model).
const MODELS: &str =
    r#"{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"overhead"}]}"#;

/// What the echo backend answers on `path`.
fn answer(path: &str) -> &'static str {
    match path {
        "/v1/messages" => MESSAGES_ANSWER,
        "/v1/models" => MODELS,
        _ => ANSWER,
    }
}

async fn echo(port: u16) -> Result<(), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    println!("overhead echo listening on {addr}");
    loop {
        let (stream, _) = listener.accept().await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = service_fn(|req: Request<hyper::body::Incoming>| async move {
                let answer = answer(req.uri().path());
                // Read the whole body, as a model server would.
                let _ = req.into_body().collect().await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(answer.as_bytes())))
                        .unwrap_or_default(),
                )
            });
            let _ = server_http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// 64 distinct bodies of about `bytes` bytes each.
fn bodies(bytes: usize, shape: Shape) -> Vec<Bytes> {
    (0..64)
        .map(|d| match shape {
            Shape::Chat => chat_body(d, bytes),
            Shape::Agent => agent_body(d, bytes),
            Shape::Responses => responses_body(d, bytes),
            Shape::Anthropic => anthropic_body(d, bytes),
        })
        .collect()
}

/// Document `d`'s text, for a body of about `bytes` bytes.
fn document(d: usize, bytes: usize) -> String {
    format!("Document {d}: the quick brown fox jumps over the lazy dog. ")
        .chars()
        .cycle()
        .take(bytes.saturating_sub(200))
        .collect()
}

fn chat_body(d: usize, bytes: usize) -> Bytes {
    let doc = document(d, bytes);
    Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"Answer from the document."}},{{"role":"user","content":"{doc} Question?"}}],"max_tokens":1}}"#
    ))
}

fn responses_body(d: usize, bytes: usize) -> Bytes {
    let doc = document(d, bytes);
    Bytes::from(format!(
        r#"{{"model":"m","instructions":"Answer from the document.","input":"{doc} Question?","max_output_tokens":1}}"#
    ))
}

/// The agent's system prompt, in the two parts a coding agent sends as
/// two text blocks over `/v1/messages`.
const AGENT_SYSTEM: [&str; 2] = ["You are an operations agent.", "\nCall one tool at a time."];

/// The agent's 48 tools (about 20 KB): name, description, JSON Schema.
fn agent_tools() -> Vec<(String, &'static str, serde_json::Value)> {
    use serde_json::json;
    (0..48)
        .map(|i| {
            let schema = json!({"type": "object", "required": ["id"], "properties": {
                "id": {"type": "string", "description": "Record id as printed on its label"},
                "fields": {"type": "array", "items": {"type": "string"}},
                "since": {"type": "string", "format": "date-time"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500}}});
            (
                format!("inventory_{i}"),
                "Returns one inventory record with its fields, history and owners.",
                schema,
            )
        })
        .collect()
}

/// Document `d`'s task, the agent's first user message.
fn agent_task(d: usize) -> String {
    format!("Task {d}: reconcile site {d} with the audit.")
}

/// The agent's call number `turn` in document `d`: its id suffix, the tool
/// it calls, its arguments and the tool's result (pretty-printed JSON: an
/// escaped quote every few bytes, a line break every record field).
fn agent_call(d: usize, turn: usize) -> (&'static str, serde_json::Value, String) {
    use serde_json::json;
    let records: Vec<_> = (0..30)
        .map(|r| json!({"id": format!("r-{d}-{turn}-{r}"), "state": "ok", "owner": r}))
        .collect();
    let result = serde_json::to_string_pretty(&json!({"records": records})).unwrap_or_default();
    ("inventory_1", json!({"id": format!("r-{turn}")}), result)
}

/// An agent's turn over chat completions: tools, system, task, then tool
/// calls and tool results until the body is about `bytes` long.
fn agent_body(d: usize, bytes: usize) -> Bytes {
    use serde_json::json;
    let tools: Vec<_> = agent_tools()
        .into_iter()
        .map(|(name, description, parameters)| {
            json!({"type": "function", "function": {
                "name": name, "description": description, "parameters": parameters}})
        })
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": AGENT_SYSTEM.concat()}),
        json!({"role": "user", "content": agent_task(d)}),
    ];
    let mut len = json!({"tools": tools, "messages": messages})
        .to_string()
        .len();
    let mut turn = 0;
    while len < bytes.saturating_sub(3_000) {
        let (name, args, result) = agent_call(d, turn);
        let call = format!("call_{turn}");
        for m in [
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": call, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]}),
            json!({"role": "tool", "tool_call_id": call, "content": result}),
        ] {
            len += m.to_string().len() + 1;
            messages.push(m);
        }
        turn += 1;
    }
    let body = json!({"model": "m", "tools": tools, "messages": messages, "max_tokens": 1});
    Bytes::from(body.to_string())
}

/// The same agent's turn as a coding agent (Claude Code) sends it over the
/// Anthropic Messages API (`/v1/messages`), to the same size: the tools as
/// `{"name","description","input_schema"}`, `system` as text blocks, each
/// call a `tool_use` block of an assistant message and each result a
/// `tool_result` block of a user message; `cache_control` breakpoints on
/// the system's last block, the last tool and the last block of the last
/// message.
fn anthropic_body(d: usize, bytes: usize) -> Bytes {
    use serde_json::json;
    let cc = || json!({"type": "ephemeral"});
    let mut tools: Vec<_> = agent_tools()
        .into_iter()
        .map(|(name, description, schema)| {
            json!({"name": name, "description": description, "input_schema": schema})
        })
        .collect();
    if let Some(last) = tools.last_mut() {
        last["cache_control"] = cc();
    }
    let system = json!([
        {"type": "text", "text": AGENT_SYSTEM[0]},
        {"type": "text", "text": AGENT_SYSTEM[1], "cache_control": cc()},
    ]);
    let mut messages =
        vec![json!({"role": "user", "content": [{"type": "text", "text": agent_task(d)}]})];
    let mut len = json!({"tools": tools, "system": system, "messages": messages})
        .to_string()
        .len();
    let mut turn = 0;
    while len < bytes.saturating_sub(3_000) {
        let (name, input, result) = agent_call(d, turn);
        let id = format!("toolu_{turn}");
        for m in [
            json!({"role": "assistant", "content": [
                {"type": "tool_use", "id": id, "name": name, "input": input}]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": result}]}),
        ] {
            len += m.to_string().len() + 1;
            messages.push(m);
        }
        turn += 1;
    }
    if let Some(block) = messages
        .last_mut()
        .and_then(|m| m["content"].as_array_mut())
        .and_then(|c| c.last_mut())
    {
        block["cache_control"] = cc();
    }
    let body = json!({"model": "m", "max_tokens": 1, "tools": tools, "system": system, "messages": messages});
    Bytes::from(body.to_string())
}

struct Target {
    addr: String,
    path: String,
}

fn parse_target(url: &str) -> Result<Target, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("target must start with http://")?;
    let (addr, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    Ok(Target {
        addr: addr.to_string(),
        path: path.to_string(),
    })
}

/// The value a response sets for cookie `name`, if any.
fn set_cookie(resp: &Response<hyper::body::Incoming>, name: &str) -> Option<String> {
    resp.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next()?.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.to_string())
}

async fn client(
    t: Arc<Target>,
    bodies: Arc<Vec<Bytes>>,
    seed: usize,
    stop: Arc<AtomicBool>,
    reconnect_every: usize,
    cookie: Arc<String>,
) -> (Vec<u32>, u64, Option<String>) {
    let mut jar: Option<String> = None;
    let mut lat = Vec::new();
    let mut errors = 0u64;
    // What went wrong first, to tell a router that doesn't serve a path
    // from a slow one.
    let mut first: Option<String> = None;
    let mut i = seed;
    while !stop.load(Ordering::Relaxed) {
        let stream = match TcpStream::connect(&t.addr).await {
            Ok(s) => s,
            Err(e) => {
                errors += 1;
                first.get_or_insert_with(|| format!("connect: {e}"));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (mut send, conn) =
            match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                Ok(x) => x,
                Err(e) => {
                    errors += 1;
                    first.get_or_insert_with(|| format!("handshake: {e}"));
                    continue;
                }
            };
        tokio::spawn(conn);
        let mut on_conn = 0;
        while !stop.load(Ordering::Relaxed) && (reconnect_every == 0 || on_conn < reconnect_every) {
            let body = bodies[i % bodies.len()].clone();
            i += 7;
            on_conn += 1;
            let mut req = Request::post(t.path.as_str())
                .header("host", t.addr.as_str())
                .header("content-type", "application/json");
            if let Some(v) = jar.as_ref().filter(|_| !cookie.is_empty()) {
                req = req.header("cookie", format!("{cookie}={v}"));
            }
            let req = req.body(Full::new(body));
            let Ok(req) = req else {
                errors += 1;
                break;
            };
            let t0 = Instant::now();
            match send.send_request(req).await {
                Ok(resp) => {
                    let status = resp.status();
                    if !cookie.is_empty() {
                        jar = set_cookie(&resp, &cookie).or(jar);
                    }
                    let answer = resp.into_body().collect().await;
                    if status.is_success() {
                        lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    } else {
                        errors += 1;
                        first.get_or_insert_with(|| {
                            let text = answer.map(|a| a.to_bytes()).unwrap_or_default();
                            let text: String =
                                String::from_utf8_lossy(&text).chars().take(200).collect();
                            format!("HTTP {}: {}", status.as_u16(), text.trim())
                        });
                    }
                }
                Err(e) => {
                    errors += 1;
                    first.get_or_insert_with(|| format!("request: {e}"));
                    break;
                }
            }
        }
    }
    (lat, errors, first)
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn load(
    target: &str,
    concurrency: usize,
    body_bytes: usize,
    seconds: f64,
    reconnect_every: usize,
    shape: Shape,
    cookie: String,
) -> Result<(), String> {
    let cookie = Arc::new(cookie);
    let t = Arc::new(parse_target(target)?);
    let b = Arc::new(bodies(body_bytes, shape));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..concurrency.max(1))
        .map(|k| {
            tokio::spawn(client(
                t.clone(),
                b.clone(),
                k,
                stop.clone(),
                reconnect_every,
                cookie.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(seconds.clamp(0.1, 3600.0))).await;
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for task in tasks {
        if let Ok((l, e, first)) = task.await {
            lat.extend(l);
            errors += e;
            first_error = first_error.or(first);
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    let out = serde_json::json!({
        "requests": lat.len(),
        "errors": errors,
        "seconds": wall,
        "rps": lat.len() as f64 / wall,
        "p50_us": pct(&lat, 0.50),
        "p90_us": pct(&lat, 0.90),
        "p99_us": pct(&lat, 0.99),
        "body_bytes": b.first().map(|x| x.len()).unwrap_or(0),
        "first_error": first_error,
    });
    println!("{out}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("overhead: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Echo { port } => echo(port).await,
            Cmd::Load {
                target,
                concurrency,
                body_bytes,
                seconds,
                reconnect_every,
                shape,
                cookie,
            } => {
                load(
                    &target,
                    concurrency,
                    body_bytes,
                    seconds,
                    reconnect_every,
                    shape,
                    cookie,
                )
                .await
            }
        }
    });
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("overhead: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn parse(b: &Bytes) -> Value {
        serde_json::from_slice(b).expect("a JSON body")
    }

    #[test]
    fn the_anthropic_shape_is_the_agent_turn_as_a_messages_request_of_the_same_size() {
        for size in [16384, 262144] {
            let chat = agent_body(5, size);
            let msgs = anthropic_body(5, size);
            // The size --sizes asks for (within the 3 KB the agent's turn
            // leaves, plus one turn), but never less than the tools.
            for b in [&chat, &msgs] {
                assert!(
                    b.len() + 3_000 >= size && b.len() <= size.max(21_000) + 3_000,
                    "{} for {size}",
                    b.len()
                );
            }
            let (chat, msgs) = (parse(&chat), parse(&msgs));
            // Tools: the same, in `input_schema` form; the last one a
            // cache breakpoint.
            let tools = msgs["tools"].as_array().unwrap();
            assert_eq!(tools.len(), chat["tools"].as_array().unwrap().len());
            for (t, c) in tools.iter().zip(chat["tools"].as_array().unwrap()) {
                assert_eq!(t["name"], c["function"]["name"]);
                assert_eq!(t["input_schema"], c["function"]["parameters"]);
                assert!(t.get("function").is_none() && t.get("type").is_none());
            }
            assert!(tools
                .iter()
                .rev()
                .skip(1)
                .all(|t| t.get("cache_control").is_none()));
            assert_eq!(tools.last().unwrap()["cache_control"]["type"], "ephemeral");
            // System: text blocks, the breakpoint on the last, the same
            // text as the chat body's system message.
            let system = msgs["system"].as_array().unwrap();
            assert!(system.len() > 1 && system.iter().all(|b| b["type"] == "text"));
            let text: String = system.iter().map(|b| b["text"].as_str().unwrap()).collect();
            assert_eq!(text, chat["messages"][0]["content"].as_str().unwrap());
            assert_eq!(system.last().unwrap()["cache_control"]["type"], "ephemeral");
            assert!(system[0].get("cache_control").is_none());
            // Messages: the task, then each call a tool_use block of an
            // assistant message and its result a tool_result block of the
            // next user message, with the chat body's arguments and results.
            let m = msgs["messages"].as_array().unwrap();
            let c = &chat["messages"].as_array().unwrap()[1..];
            assert_eq!(m[0]["role"], "user");
            assert_eq!(m[0]["content"][0]["text"], c[0]["content"]);
            let turns = (m.len() - 1) / 2;
            // (At 16 KiB the tools alone fill the body: no call yet.)
            assert!(
                m.len() % 2 == 1 && (size < 21_000 || turns >= 50),
                "{} messages",
                m.len()
            );
            assert!(turns.abs_diff((c.len() - 1) / 2) <= 1);
            for (k, pair) in m[1..].chunks(2).enumerate() {
                let (call, res) = (&pair[0]["content"][0], &pair[1]["content"][0]);
                assert_eq!(pair[0]["role"], "assistant");
                assert_eq!(pair[1]["role"], "user");
                assert_eq!(call["type"], "tool_use");
                assert_eq!(res["type"], "tool_result");
                assert_eq!(res["tool_use_id"], call["id"]);
                if let Some(chat_turn) = c.get(1 + 2 * k..3 + 2 * k) {
                    let f = &chat_turn[0]["tool_calls"][0]["function"];
                    assert_eq!(call["name"], f["name"]);
                    let args: Value =
                        serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
                    assert_eq!(call["input"], args);
                    assert_eq!(res["content"], chat_turn[1]["content"]);
                }
            }
            // One breakpoint in the messages: the last block of the last.
            let marked: Vec<_> = m
                .iter()
                .enumerate()
                .flat_map(|(i, x)| {
                    let blocks = x["content"].as_array().unwrap();
                    blocks
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| b.get("cache_control").is_some())
                        .map(move |(j, _)| (i, j, blocks.len()))
                })
                .collect();
            let last = m.len() - 1;
            assert_eq!(marked, [(last, 0, 1)]);
        }
        // 64 distinct bodies, as every shape has.
        let all = bodies(16384, Shape::Anthropic);
        assert_eq!(all.len(), 64);
        assert_eq!(
            all.iter().collect::<std::collections::HashSet<_>>().len(),
            64
        );
    }

    #[test]
    fn the_echo_backend_answers_messages_as_an_anthropic_message_and_lists_model_m() {
        let m: Value = serde_json::from_str(answer("/v1/messages")).unwrap();
        assert_eq!(
            (m["type"].as_str(), m["content"][0]["type"].as_str()),
            (Some("message"), Some("text"))
        );
        // smg routes only to a worker listing the body's model: without
        // it, every request to sglang-router was a 404.
        let models: Value = serde_json::from_str(answer("/v1/models")).unwrap();
        assert_eq!(models["data"][0]["id"], "m");
        for shape in [
            Shape::Chat,
            Shape::Agent,
            Shape::Responses,
            Shape::Anthropic,
        ] {
            let b = parse(&bodies(16384, shape)[0]);
            assert_eq!(b["model"], "m");
        }
        for path in ["/v1/chat/completions", "/v1/responses", "/v1/completions"] {
            assert_eq!(answer(path), ANSWER);
        }
    }
}
