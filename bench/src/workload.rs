//! Workloads: what to send, built deterministically from a seed.

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::content;
use crate::text::{self, Rng, Zipf};

/// One request of a pre-planned workload (everything but multi-turn).
#[derive(Clone, Debug)]
pub struct Planned {
    /// Arrival offset in workload seconds (open loop / replay); unused in
    /// closed loop.
    pub at: f64,
    pub path: &'static str,
    pub body: Value,
    /// Group / session key: sent as the session header, kept in records.
    pub key: String,
}

/// A conversation of the multi-turn workload: the history grows with the
/// server's answers, so only the user turns are planned.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub key: String,
    pub system: String,
    pub user_turns: Vec<String>,
    /// Think time before each turn after the first (workload seconds).
    pub think: Vec<f64>,
    /// Delay before the first turn (spreads conversation starts).
    pub start: f64,
}

/// An agent session of the agentic workload: planned in full (the tool
/// calls and results are part of the plan, not the server's answers), sent
/// turn after turn in a closed loop.
#[derive(Clone, Debug)]
pub struct Session {
    pub key: String,
    /// The `tools` field of every request (shared by all sessions).
    pub tools: Arc<Value>,
    /// System prompt and the task: the first request's messages.
    pub head: Vec<Value>,
    /// `steps[t]`: the messages appended before turn t (an assistant tool
    /// call and its tool result); `steps[0]` is empty.
    pub steps: Vec<Vec<Value>>,
    /// Think time (tool execution) before each turn after the first
    /// (workload seconds).
    pub think: Vec<f64>,
    /// Delay before the first turn.
    pub start: f64,
    /// The API the session speaks.
    pub api: Api,
}

/// How an agent session talks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    /// `/v1/chat/completions`: every turn resends the whole history.
    Chat,
    /// `/v1/responses` with stored responses: every turn after the first
    /// names the one before (`previous_response_id`) and sends only what
    /// is new, so it can be served only where that response is stored.
    Responses,
    /// `/v1/messages` (the Anthropic Messages API), as Claude Code sends
    /// it: every turn resends the whole history, its cache breakpoint on
    /// the newest block.
    Messages,
}

impl Session {
    pub fn turns(&self) -> usize {
        self.steps.len()
    }

    /// The request body of turn `t`: the whole history so far.
    pub fn body(&self, t: usize, model: &str, max_tokens: usize) -> Value {
        let messages = self.history(t).cloned().collect();
        let mut b = chat(model, messages, max_tokens);
        b["tools"] = (*self.tools).clone();
        b
    }

    /// Turn `t` over the Responses API, continuing the stored response
    /// `previous`: the instructions and tools again (a follow-up inherits
    /// neither), then only what is new: the task at turn 0, the tool's
    /// output after (the model's own call is in the stored response).
    pub fn responses_body(
        &self,
        t: usize,
        previous: Option<&str>,
        model: &str,
        max_tokens: usize,
    ) -> Value {
        let input: Vec<Value> = if t == 0 {
            self.task().cloned().collect()
        } else {
            self.tool_outputs(t)
                .map(|(id, out)| json!({"type": "function_call_output", "call_id": id, "output": out}))
                .collect()
        };
        let mut b = json!({
            "model": model,
            "instructions": self.instructions(),
            "input": input,
            "tools": responses_tools(&self.tools),
            "max_output_tokens": max_tokens,
            "stream": true,
            "store": true,
        });
        if let Some(id) = previous {
            b["previous_response_id"] = json!(id);
        }
        b
    }

    /// What the server renders for turn `t` of a Responses session, as a
    /// chat body (for the cache-hit bound): the instructions, the task,
    /// then each earlier answer (`answers[k]`, turn k's) and the tool
    /// output that followed it.
    pub fn responses_prompt(&self, t: usize, answers: &[String], model: &str) -> Value {
        let mut messages = vec![json!({"role": "system", "content": self.instructions()})];
        messages.extend(self.task().cloned());
        for k in 1..=t {
            let answer = answers.get(k - 1).map_or("", String::as_str);
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.extend(
                self.tool_outputs(k)
                    .map(|(_, out)| json!({"role": "tool", "content": out})),
            );
        }
        let mut b = chat(model, messages, 0);
        b["tools"] = responses_tools(&self.tools);
        b
    }

    /// Turn `t` over the Anthropic Messages API, as Claude Code sends it:
    /// the system prompt as text blocks, the tools in Anthropic's form,
    /// the whole history (the model's tool calls as `tool_use` blocks,
    /// their results as `tool_result` blocks of user messages), and a
    /// `cache_control` breakpoint on the system's last block, the last
    /// tool and the last block of the last message, which moves to the
    /// newest block every turn.
    pub fn messages_body(&self, t: usize, model: &str, max_tokens: usize) -> Value {
        let ephemeral = json!({"type": "ephemeral"});
        // Two blocks, as Claude Code splits its system prompt (the
        // server joins them with nothing between).
        let system_text = self.instructions().as_str().unwrap_or_default();
        let cut = system_text.find('\n').map_or(system_text.len(), |i| i + 1);
        let mut system: Vec<Value> = [&system_text[..cut], &system_text[cut..]]
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| json!({"type": "text", "text": s}))
            .collect();
        if let Some(last) = system.last_mut() {
            last["cache_control"] = ephemeral.clone();
        }
        // Claude Code (>= 2.1.29) opens `system` with an attribution block
        // whose `cch` differs every request; vLLM drops it before the
        // template, a router that hashes it sees a new prompt every turn.
        system.insert(
            0,
            json!({"type": "text", "text": attribution(&self.key, t)}),
        );
        let mut tools: Vec<Value> = (self.tools.as_array().into_iter().flatten())
            .map(|t| {
                let f = &t["function"];
                json!({"name": f["name"], "description": f["description"],
                       "input_schema": f["parameters"]})
            })
            .collect();
        if let Some(last) = tools.last_mut() {
            last["cache_control"] = ephemeral.clone();
        }
        let mut messages: Vec<Value> = Vec::new();
        for m in self.history(t).skip(1) {
            let text = |v: &Value| json!({"type": "text", "text": v});
            let (role, blocks) = match m["role"].as_str() {
                Some("assistant") => {
                    let mut blocks: Vec<Value> = m["content"]
                        .as_str()
                        .filter(|c| !c.is_empty())
                        .map(|_| text(&m["content"]))
                        .into_iter()
                        .collect();
                    blocks.extend((m["tool_calls"].as_array().into_iter().flatten()).map(|c| {
                        json!({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": arguments(c)})
                    }));
                    ("assistant", blocks)
                }
                Some("tool") => (
                    "user",
                    vec![
                        json!({"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                "content": m["content"]}),
                    ],
                ),
                _ => ("user", vec![text(&m["content"])]),
            };
            // Consecutive results of one turn's calls share a user message.
            match messages.last_mut() {
                Some(prev) if role == "user" && prev["role"] == "user" => {
                    if let Some(b) = prev["content"].as_array_mut() {
                        b.extend(blocks);
                    }
                }
                _ => messages.push(json!({"role": role, "content": blocks})),
            }
        }
        let last_block = messages
            .last_mut()
            .and_then(|m| m["content"].as_array_mut())
            .and_then(|b| b.last_mut());
        if let Some(b) = last_block {
            b["cache_control"] = ephemeral;
        }
        json!({
            "model": model,
            "max_tokens": max_tokens,
            "system": system,
            "tools": tools,
            "messages": messages,
            "metadata": {"user_id": self.key},
            "stream": true,
        })
    }

    /// What the server renders for turn `t` of a Messages session, as a
    /// chat body (for the cache-hit bound): the chat body vLLM converts
    /// the Messages body into. It is the chat workload's but for the tool
    /// calls' arguments, re-serialized by Python's `json.dumps` from the
    /// `tool_use` input.
    pub fn messages_prompt(&self, t: usize, model: &str) -> Value {
        let messages = self
            .history(t)
            .map(|m| {
                let mut m = m.clone();
                if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    for c in calls {
                        let args = py_json(&arguments(c));
                        c["function"]["arguments"] = json!(args);
                    }
                }
                m
            })
            .collect();
        let mut b = chat(model, messages, 0);
        b["tools"] = (*self.tools).clone();
        b
    }

    /// The chat messages of turn `t`: the head, then each step so far.
    fn history(&self, t: usize) -> impl Iterator<Item = &Value> {
        self.head
            .iter()
            .chain(self.steps.iter().take(t + 1).flatten())
    }

    fn instructions(&self) -> &Value {
        self.head.first().map_or(&Value::Null, |m| &m["content"])
    }

    fn task(&self) -> impl Iterator<Item = &Value> {
        self.head.iter().skip(1)
    }

    /// Turn `t`'s tool results: call id and output.
    fn tool_outputs(&self, t: usize) -> impl Iterator<Item = (&Value, &Value)> {
        (self.steps.get(t).into_iter().flatten())
            .filter(|m| m["role"] == "tool")
            .map(|m| (&m["tool_call_id"], &m["content"]))
    }
}

/// A chat tool call's arguments as the object they encode.
fn arguments(call: &Value) -> Value {
    call["function"]["arguments"]
        .as_str()
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_else(|| json!({}))
}

/// `json.dumps(v)` with Python's defaults, as vLLM serializes a
/// `tool_use` block's input into the chat request's arguments: `, ` and
/// `: ` separators, every character outside printable ASCII escaped.
pub fn py_json(v: &Value) -> String {
    fn string(s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                ' '..='~' => out.push(c),
                _ => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
            }
        }
        out.push('"');
    }
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::String(s) => string(s, out),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write(x, out);
                }
                out.push(']');
            }
            Value::Object(o) => {
                out.push('{');
                for (i, (k, x)) in o.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    string(k, out);
                    out.push_str(": ");
                    write(x, out);
                }
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

/// Claude Code's attribution block for turn `t` of session `key`: its
/// version and entry point, then `cch`, a 5-hex-digit value that is
/// another one every request (FNV-1a of both, so a run is reproducible).
fn attribution(key: &str, t: usize) -> String {
    let cch = (key.bytes().chain(t.to_le_bytes())).fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; cch={:05x};",
        cch & 0xf_ffff
    )
}

/// Chat tool definitions in the Responses API's flat form
/// (`{"type": "function", "name", "description", "parameters"}`).
fn responses_tools(tools: &Value) -> Value {
    let flat = (tools.as_array().into_iter().flatten()).map(|t| {
        let f = &t["function"];
        json!({"type": "function", "name": f["name"], "description": f["description"],
               "parameters": f["parameters"]})
    });
    Value::Array(flat.collect())
}

pub enum Plan {
    Requests(Vec<Planned>),
    Conversations(Vec<Conversation>),
    Sessions(Vec<Session>),
}

pub fn completion(model: &str, prompt: String, max_tokens: usize) -> Value {
    json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
}

pub fn chat(model: &str, messages: Vec<Value>, max_tokens: usize) -> Value {
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
}

/// Arrival times: Poisson at `rate` per second (0 = all at once).
fn arrivals(rng: &mut Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate > 0.0 {
                t += rng.exp(1.0 / rate);
            }
            t
        })
        .collect()
}

pub struct SharedPrefix {
    pub groups: usize,
    pub prompts: usize,
    pub prefix_tokens: usize,
    pub question_tokens: usize,
    pub max_tokens: usize,
}

/// G long shared prefixes (a RAG document or system prompt each), every
/// request = its group's prefix + a short unique question; groups
/// interleaved at random.
pub fn shared_prefix(p: &SharedPrefix, model: &str, seed: u64, rate: f64) -> Plan {
    let groups = p.groups.max(1);
    let prefixes: Vec<String> = (0..groups)
        .map(|g| {
            let mut rng = Rng::derive(seed, "prefix", g as u64);
            format!(
                "You are answering questions about document {g}. Use only the document.\n\n{}\n\n",
                text::text(&mut rng, p.prefix_tokens)
            )
        })
        .collect();
    // Exactly prompts/groups per group (+1 for the first remainder groups),
    // then shuffled: groups interleave at random.
    let mut order: Vec<(usize, usize)> = (0..p.prompts).map(|i| (i % groups, i)).collect();
    let mut rng = Rng::derive(seed, "order", 0);
    rng.shuffle(&mut order);
    let times = arrivals(&mut Rng::derive(seed, "arrivals", 0), order.len(), rate);
    let reqs = order
        .into_iter()
        .zip(times)
        .map(|((g, i), at)| {
            let mut qrng = Rng::derive(seed, "question", i as u64);
            let q = text::text(&mut qrng, p.question_tokens);
            let prompt = format!("{}Question {i}: {q}\nAnswer:", prefixes[g]);
            Planned {
                at,
                path: "/v1/completions",
                body: completion(model, prompt, p.max_tokens),
                key: format!("group-{g}"),
            }
        })
        .collect();
    Plan::Requests(reqs)
}

pub struct Unique {
    pub prompts: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// Short independent prompts with nothing in common: the control.
pub fn unique(p: &Unique, model: &str, seed: u64, rate: f64) -> Plan {
    let times = arrivals(&mut Rng::derive(seed, "arrivals", 1), p.prompts, rate);
    let reqs = times
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let mut rng = Rng::derive(seed, "unique", i as u64);
            // A unique lead so no two prompts share even their first block.
            let prompt = format!(
                "Request {i} {seed}: {}",
                text::text(&mut rng, p.prompt_tokens)
            );
            Planned {
                at,
                path: "/v1/completions",
                body: completion(model, prompt, p.max_tokens),
                key: format!("req-{i}"),
            }
        })
        .collect();
    Plan::Requests(reqs)
}

pub struct MultiTurn {
    pub conversations: usize,
    pub turns: usize,
    pub system_tokens: usize,
    pub first_turn_tokens: usize,
    pub user_tokens: usize,
    pub think_s: f64,
}

/// C conversations x T turns; each turn resends the whole history (system
/// prompt shared by all conversations, previous user and assistant turns)
/// plus a new user message.
pub fn multi_turn(p: &MultiTurn, seed: u64) -> Plan {
    let system = format!(
        "You are a helpful assistant for a support team. {}",
        text::text(&mut Rng::derive(seed, "system", 0), p.system_tokens)
    );
    let convs = (0..p.conversations)
        .map(|c| {
            let mut rng = Rng::derive(seed, "conversation", c as u64);
            let user_turns = (0..p.turns)
                .map(|t| {
                    let n = if t == 0 {
                        p.first_turn_tokens
                    } else {
                        p.user_tokens
                    };
                    format!("[conversation {c}, turn {t}] {}", text::text(&mut rng, n))
                })
                .collect();
            let think = (0..p.turns).map(|_| rng.exp(p.think_s)).collect();
            let start = rng.f64() * p.think_s;
            Conversation {
                key: format!("conv-{c}"),
                system: system.clone(),
                user_turns,
                think,
                start,
            }
        })
        .collect();
    Plan::Conversations(convs)
}

pub struct LongPreamble {
    pub prompts: usize,
    pub documents: usize,
    /// Bytes of the shared system message (instructions + tool JSON).
    pub preamble_bytes: usize,
    /// Document length range, tokens (uniform per document).
    pub doc_tokens: (usize, usize),
    pub question_tokens: usize,
    /// Zipf exponent of document popularity (0 = uniform).
    pub zipf: f64,
    pub max_tokens: usize,
}

/// Document `g`'s length in tokens.
fn doc_tokens(seed: u64, g: usize, (lo, hi): (usize, usize)) -> usize {
    let hi = hi.max(lo);
    lo + Rng::derive(seed, "doc-tokens", g as u64).below(hi - lo + 1)
}

/// Every request: one long shared system message (instructions and tool
/// definitions, longer than any fixed hashing window), then a user message
/// with one of G documents and a question. Documents are picked with Zipf
/// skew (a seeded permutation decides which ids are hot).
pub fn long_preamble(p: &LongPreamble, model: &str, seed: u64, rate: f64) -> Plan {
    let g_n = p.documents.max(1);
    let preamble = content::preamble(seed, p.preamble_bytes);
    let docs: Vec<String> = (0..g_n)
        .map(|g| content::document(seed, g, doc_tokens(seed, g, p.doc_tokens)))
        .collect();
    let mut by_rank: Vec<usize> = (0..g_n).collect();
    Rng::derive(seed, "doc-rank", 0).shuffle(&mut by_rank);
    let zipf = Zipf::new(g_n, p.zipf);
    let mut pick = Rng::derive(seed, "doc-pick", 0);
    let times = arrivals(&mut Rng::derive(seed, "arrivals", 2), p.prompts, rate);
    let reqs = times
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let g = by_rank[zipf.sample(&mut pick)];
            let q = text::text(
                &mut Rng::derive(seed, "lp-question", i as u64),
                p.question_tokens,
            );
            let user = format!(
                "Answer the question using only the document below.\n\n<document id=\"{g}\">\n{}</document>\n\nQuestion {i}: {q}",
                docs[g]
            );
            let messages = vec![
                json!({"role": "system", "content": preamble}),
                json!({"role": "user", "content": user}),
            ];
            Planned {
                at,
                path: "/v1/chat/completions",
                body: chat(model, messages, p.max_tokens),
                key: format!("doc-{g}"),
            }
        })
        .collect();
    Plan::Requests(reqs)
}

pub struct Agentic {
    pub sessions: usize,
    /// Requests per session, uniform in this range.
    pub turns: (usize, usize),
    /// Bytes of the shared part: `tools` JSON (about 70%) + system prompt.
    pub shared_bytes: usize,
    /// The task (first user message), tokens.
    pub task_tokens: usize,
    /// Tool result size range, bytes (uniform per turn).
    pub result_bytes: (usize, usize),
    /// Mean think time between turns (tool execution), simulated seconds.
    pub think_s: f64,
    /// Sessions start uniformly over this many simulated seconds.
    pub ramp_s: f64,
    pub api: Api,
}

/// S agent sessions sharing one tool set and system prompt; each turn
/// resends the history plus the last tool call and its result.
pub fn agentic(p: &Agentic, seed: u64) -> Plan {
    let mut shared = Rng::derive(seed, "agent-shared", 0);
    let tools = content::tools(&mut shared, p.shared_bytes * 7 / 10);
    let tools_len = Value::Array(tools.clone()).to_string().len();
    let system = content::instructions(&mut shared, p.shared_bytes.saturating_sub(tools_len));
    let tools = Arc::new(Value::Array(tools));
    let (lo, hi) = (p.turns.0.max(1), p.turns.1.max(p.turns.0.max(1)));
    let (rlo, rhi) = (p.result_bytes.0, p.result_bytes.1.max(p.result_bytes.0));
    let sessions = (0..p.sessions)
        .map(|s| {
            let mut rng = Rng::derive(seed, "session", s as u64);
            let turns = lo + rng.below(hi - lo + 1);
            let task = format!(
                "Task {s}: {}\nWork step by step. Call one tool at a time and use its result.",
                text::text(&mut rng, p.task_tokens)
            );
            let head = vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": task}),
            ];
            let list = tools.as_array().map_or(&[][..], Vec::as_slice);
            let steps = (0..turns)
                .map(|t| {
                    if t == 0 {
                        return Vec::new();
                    }
                    let id = format!("call_{s}_{t}");
                    let call = content::tool_call(&mut rng, list, &id);
                    let bytes = rlo + rng.below(rhi - rlo + 1);
                    vec![call, content::tool_result(&mut rng, bytes, &id)]
                })
                .collect();
            let think = (0..turns).map(|_| rng.exp(p.think_s)).collect();
            let start = rng.f64() * p.ramp_s;
            Session {
                key: format!("agent-{s}"),
                tools: tools.clone(),
                head,
                steps,
                think,
                start,
                api: p.api,
            }
        })
        .collect();
    Plan::Sessions(sessions)
}

/// A JSONL trace, one request a line:
/// `{"timestamp": 12.5, "prompt": "..."}` or `{"timestamp": ..., "messages": [...]}`
/// or `{"timestamp": ..., "body": {<full OpenAI body>}}`, with optional
/// `max_tokens`, `session_id`, `path`. Timestamps are seconds (any origin;
/// the first line's is subtracted; lines are sorted by time). Streaming is
/// always switched on.
pub fn replay(
    file: &Path,
    model: &str,
    default_max_tokens: usize,
    speedup: f64,
) -> Result<Plan, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read trace {}: {e}", file.display()))?;
    let mut reqs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: not JSON: {e}", file.display(), n + 1))?;
        let at = v
            .get("timestamp")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("{}:{}: missing numeric timestamp", file.display(), n + 1))?;
        let max_tokens = v
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map_or(default_max_tokens, |m| m as usize);
        let mut body = if let Some(b) = v.get("body") {
            b.clone()
        } else if let Some(m) = v.get("messages") {
            chat(model, m.as_array().cloned().unwrap_or_default(), max_tokens)
        } else if let Some(p) = v.get("prompt").and_then(Value::as_str) {
            completion(model, p.to_string(), max_tokens)
        } else {
            return Err(format!(
                "{}:{}: needs one of body, messages, prompt",
                file.display(),
                n + 1
            ));
        };
        if let Some(obj) = body.as_object_mut() {
            obj.insert("stream".into(), json!(true));
            obj.insert("stream_options".into(), json!({"include_usage": true}));
            obj.entry("model").or_insert(json!(model));
        }
        let path = match v.get("path").and_then(Value::as_str) {
            Some("/v1/chat/completions") => "/v1/chat/completions",
            Some("/v1/completions") => "/v1/completions",
            Some(other) => {
                return Err(format!(
                    "{}:{}: unsupported path {other} (replay sends /v1/completions and /v1/chat/completions)",
                    file.display(),
                    n + 1
                ))
            }
            None if body.get("messages").is_some() => "/v1/chat/completions",
            None => "/v1/completions",
        };
        let key = v
            .get("session_id")
            .map(|s| s.as_str().map_or_else(|| s.to_string(), str::to_string))
            .unwrap_or_else(|| format!("line-{}", n + 1));
        reqs.push(Planned {
            at,
            path,
            body,
            key,
        });
    }
    reqs.sort_by(|a, b| a.at.total_cmp(&b.at));
    let t0 = reqs.first().map_or(0.0, |r| r.at);
    for r in &mut reqs {
        r.at = (r.at - t0) / speedup.max(1e-9);
    }
    Ok(Plan::Requests(reqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_is_deterministic_and_grouped() {
        let p = SharedPrefix {
            groups: 3,
            prompts: 12,
            prefix_tokens: 200,
            question_tokens: 10,
            max_tokens: 4,
        };
        let (Plan::Requests(a), Plan::Requests(b)) = (
            shared_prefix(&p, "m", 1, 5.0),
            shared_prefix(&p, "m", 1, 5.0),
        ) else {
            panic!("requests expected");
        };
        assert_eq!((a.len(), b.len()), (12, 12));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.body, y.body);
            assert_eq!(x.at, y.at);
        }
        let same: Vec<_> = a.iter().filter(|r| r.key == "group-0").collect();
        assert_eq!(same.len(), 4);
        let p0 = same[0].body["prompt"].as_str().unwrap();
        let p1 = same[1].body["prompt"].as_str().unwrap();
        let common = p0
            .bytes()
            .zip(p1.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(common > 600, "shared prefix of {common} bytes");
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
    }

    fn lp(prompts: usize, documents: usize) -> LongPreamble {
        LongPreamble {
            prompts,
            documents,
            preamble_bytes: 40_000,
            doc_tokens: (1000, 2000),
            question_tokens: 32,
            zipf: 0.8,
            max_tokens: 8,
        }
    }

    fn requests(p: Plan) -> Vec<Planned> {
        match p {
            Plan::Requests(r) => r,
            _ => panic!("requests expected"),
        }
    }

    fn content(v: &Value) -> &str {
        v["content"].as_str().unwrap()
    }

    #[test]
    fn long_preamble_shares_one_long_system_message() {
        let reqs = requests(long_preamble(&lp(600, 64), "m", 1, 8.0));
        assert_eq!(reqs.len(), 600);
        let pre = content(&reqs[0].body["messages"][0]);
        // Longer than any fixed window (16 KiB), within the 24-64 KB brief.
        assert!((40_000..48_000).contains(&pre.len()), "{}", pre.len());
        assert!(pre.contains("# Tools") && pre.contains("\"parameters\""));
        // Its tool definitions are valid JSON.
        let json_start = pre.find("\n[").unwrap() + 1;
        let tools: Value = serde_json::from_str(pre[json_start..].trim()).unwrap();
        assert!(tools.as_array().unwrap().len() >= 10);
        for r in &reqs {
            assert_eq!(r.path, "/v1/chat/completions");
            assert_eq!(r.body["messages"][0]["role"], "system");
            assert_eq!(content(&r.body["messages"][0]), pre);
            assert_eq!(r.body["messages"][1]["role"], "user");
            assert_eq!(r.body["stream"], true);
        }
        assert!(reqs.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn long_preamble_documents_are_distinct_sized_and_skewed() {
        let reqs = requests(long_preamble(&lp(2000, 64), "m", 1, 8.0));
        let mut docs: std::collections::HashMap<String, String> = Default::default();
        let mut counts: std::collections::HashMap<String, usize> = Default::default();
        for (i, r) in reqs.iter().enumerate() {
            let user = content(&r.body["messages"][1]);
            let doc = &user[..user.find("</document>").unwrap()];
            // The same key always carries the same document.
            let prev = docs.entry(r.key.clone()).or_insert_with(|| doc.to_string());
            assert_eq!(prev, doc);
            *counts.entry(r.key.clone()).or_default() += 1;
            // A unique question after the document.
            assert!(user.contains(&format!("</document>\n\nQuestion {i}: ")));
        }
        // Nearly every document is used, and all are different.
        assert!(docs.len() >= 60, "{} documents", docs.len());
        let distinct: std::collections::HashSet<&String> = docs.values().collect();
        assert_eq!(distinct.len(), docs.len());
        // 1-2k tokens each at ~4 chars a token (plus the wrapper).
        for d in docs.values() {
            assert!((3_500..11_000).contains(&d.len()), "{}", d.len());
        }
        // Zipf 0.8 over 64: the hottest document ~12% of requests, the
        // coldest under 1%.
        let mut c: Vec<usize> = counts.values().copied().collect();
        c.sort_unstable();
        let top = *c.last().unwrap() as f64 / reqs.len() as f64;
        assert!((0.08..0.2).contains(&top), "{top}");
        assert!((c[0] as f64) < 0.01 * reqs.len() as f64);
        // Documents alone are several times one 48k-token KV cache (at
        // ~3.5 bytes a token), and fit four.
        let doc_bytes: usize = docs.values().map(String::len).sum();
        assert!(doc_bytes > 2 * 48_000 * 35 / 10, "{doc_bytes}");
        assert!(doc_bytes < 4 * 48_000 * 35 / 10, "{doc_bytes}");
    }

    #[test]
    fn long_preamble_is_deterministic_by_seed() {
        let a = requests(long_preamble(&lp(50, 16), "m", 7, 8.0));
        let b = requests(long_preamble(&lp(50, 16), "m", 7, 8.0));
        let c = requests(long_preamble(&lp(50, 16), "m", 8, 8.0));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.body, y.body);
            assert_eq!((x.at, &x.key), (y.at, &y.key));
        }
        assert_ne!(a[0].body["messages"][0], c[0].body["messages"][0]);
        // More documents don't change the first ones.
        let key = a[0].key.clone();
        let more = requests(long_preamble(&lp(400, 32), "m", 7, 8.0));
        assert_eq!(document_text(&a, &key), document_text(&more, &key));
        assert!(document_text(&a, &key).is_some());
    }

    fn document_text(reqs: &[Planned], key: &str) -> Option<String> {
        let r = reqs.iter().find(|r| r.key == key)?;
        let user = content(&r.body["messages"][1]);
        Some(user[..user.find("</document>")?].to_string())
    }

    fn ag(sessions: usize) -> Agentic {
        Agentic {
            sessions,
            turns: (10, 30),
            shared_bytes: 40_000,
            task_tokens: 400,
            result_bytes: (2048, 8192),
            think_s: 5.0,
            ramp_s: 30.0,
            api: Api::Chat,
        }
    }

    fn sessions(p: Plan) -> Vec<Session> {
        match p {
            Plan::Sessions(s) => s,
            _ => panic!("sessions expected"),
        }
    }

    #[test]
    fn agentic_sessions_share_tools_and_grow() {
        let ss = sessions(agentic(&ag(8), 1));
        assert_eq!(ss.len(), 8);
        let first = ss[0].body(0, "m", 8);
        let tools = first["tools"].to_string();
        let system = content(&first["messages"][0]).to_string();
        // 30-60 KB shared: tools (as the server renders them) + system.
        let shared = tools.len() + system.len();
        assert!((38_000..50_000).contains(&shared), "{shared}");
        assert!(first["tools"].as_array().unwrap().len() >= 10);
        let mut keys = std::collections::HashSet::new();
        let mut turn_counts = Vec::new();
        for s in &ss {
            assert!(keys.insert(s.key.clone()));
            assert!((10..=30).contains(&s.turns()), "{}", s.turns());
            turn_counts.push(s.turns());
            assert!(s.steps[0].is_empty());
            assert!((0.0..30.0).contains(&s.start));
            let mut prev: Option<Value> = None;
            for t in 0..s.turns() {
                let b = s.body(t, "m", 8);
                assert_eq!(b["tools"].to_string(), tools);
                assert_eq!(content(&b["messages"][0]), system);
                let msgs = b["messages"].as_array().unwrap();
                // system + task + 2 per earlier turn.
                assert_eq!(msgs.len(), 2 + 2 * t);
                if t > 0 {
                    let call = &msgs[msgs.len() - 2];
                    let result = &msgs[msgs.len() - 1];
                    assert_eq!(call["role"], "assistant");
                    let id = call["tool_calls"][0]["id"].as_str().unwrap();
                    assert_eq!(result["role"], "tool");
                    assert_eq!(result["tool_call_id"], id);
                    let args = call["tool_calls"][0]["function"]["arguments"]
                        .as_str()
                        .unwrap();
                    assert!(serde_json::from_str::<Value>(args).unwrap().is_object());
                    let n = content(result).len();
                    assert!((2048..8192 + 600).contains(&n), "{n}");
                    // The history grows by appending: the previous request is a prefix.
                    let p = prev.as_ref().unwrap()["messages"].as_array().unwrap();
                    assert_eq!(&msgs[..p.len()], &p[..]);
                }
                prev = Some(b);
            }
            // Grows past 100 KB unless a session is short.
            let last = s.body(s.turns() - 1, "m", 8).to_string().len();
            if s.turns() >= 15 {
                assert!(last > 100_000, "{} turns, {last} bytes", s.turns());
            }
        }
        assert!(turn_counts.iter().any(|&t| t >= 15));
        // Different sessions have different tasks.
        assert_ne!(ss[0].head[1], ss[1].head[1]);
    }

    #[test]
    fn responses_sessions_send_only_what_is_new_after_the_first_turn() {
        let s = &sessions(agentic(&ag(2), 3))[0];
        let chat = s.body(0, "m", 8);
        let first = s.responses_body(0, None, "m", 8);
        assert_eq!(first["instructions"], chat["messages"][0]["content"]);
        assert_eq!(first["input"], json!([chat["messages"][1]]));
        assert_eq!(first.get("previous_response_id"), None);
        assert_eq!(first["store"], true);
        // Tools flattened: the chat form's function fields, one level up.
        let (flat, nested) = (&first["tools"][0], &chat["tools"][0]["function"]);
        assert_eq!(
            (&flat["type"], &flat["name"]),
            (&json!("function"), &nested["name"])
        );
        assert_eq!(flat["parameters"], nested["parameters"]);
        assert_eq!(
            first["tools"].as_array().unwrap().len(),
            chat["tools"].as_array().unwrap().len()
        );
        for t in 1..s.turns() {
            let b = s.responses_body(t, Some("resp_x"), "m", 8);
            assert_eq!(b["previous_response_id"], "resp_x");
            assert_eq!(
                (&b["instructions"], &b["tools"]),
                (&first["instructions"], &first["tools"])
            );
            // Only the tool's output: the call is the model's, stored.
            let result = &s.body(t, "m", 8)["messages"][2 * t + 1];
            assert_eq!(
                b["input"],
                json!([{"type": "function_call_output", "call_id": result["tool_call_id"],
                        "output": result["content"]}])
            );
        }
        // The server's prompt, as chat: each turn's extends the one before
        // by the answer and the next tool output.
        let answers: Vec<String> = (0..s.turns()).map(|k| format!("answer {k}")).collect();
        let p0 = s.responses_prompt(0, &answers, "m");
        assert_eq!(p0["messages"], chat["messages"]);
        let p2 = s.responses_prompt(2, &answers, "m");
        let m2 = p2["messages"].as_array().unwrap();
        assert_eq!(m2.len(), 6);
        assert_eq!(
            &m2[..4],
            &s.responses_prompt(1, &answers, "m")["messages"]
                .as_array()
                .unwrap()[..]
        );
        assert_eq!(m2[4], json!({"role": "assistant", "content": "answer 1"}));
        assert_eq!(
            m2[5]["content"],
            s.body(2, "m", 8)["messages"][5]["content"]
        );
        assert_eq!(p2["tools"], first["tools"]);
    }

    /// Every `cache_control` in a Messages body: where it is.
    fn breakpoints(v: &Value, at: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                if o.contains_key("cache_control") {
                    assert_eq!(o["cache_control"], json!({"type": "ephemeral"}));
                    out.push(at.to_string());
                }
                for (k, x) in o {
                    breakpoints(x, &format!("{at}.{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    breakpoints(x, &format!("{at}.{i}"), out);
                }
            }
            _ => {}
        }
    }

    fn without_breakpoints(mut v: Value) -> Value {
        fn strip(v: &mut Value) {
            match v {
                Value::Object(o) => {
                    o.remove("cache_control");
                    o.values_mut().for_each(strip);
                }
                Value::Array(a) => a.iter_mut().for_each(strip),
                _ => {}
            }
        }
        strip(&mut v);
        v
    }

    #[test]
    fn messages_sessions_resend_the_history_as_claude_code_does() {
        let s = &sessions(agentic(&ag(2), 4))[0];
        for t in 0..s.turns() {
            let chat = s.body(t, "m", 8);
            let b = s.messages_body(t, "m", 8);
            assert_eq!(
                (&b["model"], &b["max_tokens"], &b["stream"]),
                (&json!("m"), &json!(8), &json!(true))
            );
            assert_eq!(b["metadata"]["user_id"], json!(s.key));
            // Claude Code's attribution block, another `cch` every turn,
            // then the system prompt in two text blocks that join to the
            // chat one.
            let system = b["system"].as_array().unwrap();
            assert_eq!(system.len(), 3);
            let cch = system[0]["text"].as_str().unwrap();
            assert!(
                cch.starts_with("x-anthropic-billing-header: cc_version="),
                "{cch}"
            );
            if t + 1 < s.turns() {
                assert_ne!(s.messages_body(t + 1, "m", 8)["system"][0], system[0]);
            }
            let joined: String = system[1..]
                .iter()
                .map(|x| x["text"].as_str().unwrap())
                .collect();
            assert_eq!(joined, content(&chat["messages"][0]));
            // Tools in Anthropic's form.
            let (tools, chat_tools) = (
                b["tools"].as_array().unwrap(),
                chat["tools"].as_array().unwrap(),
            );
            assert_eq!(tools.len(), chat_tools.len());
            for (a, c) in tools.iter().zip(chat_tools) {
                let f = &c["function"];
                assert_eq!(
                    (&a["name"], &a["description"], &a["input_schema"]),
                    (&f["name"], &f["description"], &f["parameters"])
                );
            }
            // The task, then per earlier turn the call and its result.
            let msgs = b["messages"].as_array().unwrap();
            assert_eq!(msgs.len(), 1 + 2 * t);
            assert_eq!(
                without_breakpoints(msgs[0].clone()),
                json!({"role": "user", "content": [{"type": "text", "text": chat["messages"][1]["content"]}]})
            );
            for k in 1..=t {
                let (call, result) = (&msgs[2 * k - 1], &msgs[2 * k]);
                let (chat_call, chat_result) =
                    (&chat["messages"][2 * k], &chat["messages"][2 * k + 1]);
                let c = &chat_call["tool_calls"][0];
                let args: Value =
                    serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
                assert_eq!(
                    without_breakpoints(call.clone()),
                    json!({"role": "assistant", "content": [
                    {"type": "text", "text": chat_call["content"]},
                    {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args}]})
                );
                assert_eq!(
                    without_breakpoints(result.clone()),
                    json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": chat_result["tool_call_id"], "content": chat_result["content"]}]})
                );
            }
            // Breakpoints: the system's last block, the last tool, the
            // last block of the last message; nowhere else.
            let mut at = Vec::new();
            breakpoints(&b, "", &mut at);
            let last = msgs.len() - 1;
            let blocks = msgs[last]["content"].as_array().unwrap().len() - 1;
            assert_eq!(
                at,
                [
                    format!(".messages.{last}.content.{blocks}"),
                    ".system.2".to_string(),
                    format!(".tools.{}", tools.len() - 1),
                ]
            );
            // The next turn extends this one, the breakpoint moved on.
            if t + 1 < s.turns() {
                let next = without_breakpoints(s.messages_body(t + 1, "m", 8));
                let this = without_breakpoints(b.clone());
                assert_eq!(
                    next["messages"].as_array().unwrap()[..msgs.len()],
                    this["messages"].as_array().unwrap()[..]
                );
                assert_eq!(
                    (&next["system"].as_array().unwrap()[1..], &next["tools"]),
                    (&this["system"].as_array().unwrap()[1..], &this["tools"])
                );
            }
            // What the server renders: the chat body, the arguments as
            // Python's json.dumps writes the input.
            let prompt = s.messages_prompt(t, "m");
            assert_eq!(prompt["tools"], chat["tools"]);
            let (pm, cm) = (
                prompt["messages"].as_array().unwrap(),
                chat["messages"].as_array().unwrap(),
            );
            assert_eq!(pm.len(), cm.len());
            for (p, c) in pm.iter().zip(cm) {
                let mut c = c.clone();
                if let Some(call) = c.get_mut("tool_calls").map(|x| &mut x[0]) {
                    let args: Value =
                        serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
                            .unwrap();
                    let dumped = py_json(&args);
                    assert!(dumped.contains("\": "), "{dumped}");
                    call["function"]["arguments"] = json!(dumped);
                }
                assert_eq!(p, &c);
            }
        }
    }

    #[test]
    fn python_json_dumps() {
        let v = json!({"a": [1, 2.5, true, null], "b": "x\"y\\\n\t\u{e9}\u{1F600}\u{7f}\u{1}", "c": {}});
        // python3 -c 'import json; print(json.dumps(...))'
        assert_eq!(
            py_json(&v),
            r#"{"a": [1, 2.5, true, null], "b": "x\"y\\\n\t\u00e9\ud83d\ude00\u007f\u0001", "c": {}}"#
        );
    }

    #[test]
    fn agentic_is_deterministic_by_seed() {
        let a = sessions(agentic(&ag(3), 5));
        let b = sessions(agentic(&ag(3), 5));
        let c = sessions(agentic(&ag(3), 6));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.turns(), y.turns());
            assert_eq!(x.think, y.think);
            assert_eq!(x.start, y.start);
            for t in 0..x.turns() {
                assert_eq!(x.body(t, "m", 8), y.body(t, "m", 8));
            }
        }
        assert_ne!(a[0].body(1, "m", 8), c[0].body(1, "m", 8));
        // Session 0 doesn't depend on how many sessions there are.
        let more = sessions(agentic(&ag(5), 5));
        assert_eq!(a[0].body(3, "m", 8), more[0].body(3, "m", 8));
    }

    #[test]
    fn replay_parses_and_rebases() {
        let dir = std::env::temp_dir().join(format!("prefix-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jsonl");
        std::fs::write(
            &f,
            "{\"timestamp\": 12, \"prompt\": \"hi\"}\n\n{\"timestamp\": 10, \"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"session_id\": 3}\n",
        )
        .unwrap();
        let Plan::Requests(r) = replay(&f, "m", 8, 2.0).unwrap() else {
            panic!()
        };
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].path, "/v1/chat/completions");
        assert_eq!(r[0].key, "3");
        assert_eq!(r[1].at, 1.0);
        assert_eq!(r[1].body["stream"], true);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
