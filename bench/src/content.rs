//! Prompt content for the long-preamble and agentic workloads: a system
//! prompt, JSON tool definitions, documents, tool calls and tool results.
//! Shaped like what agent and RAG frameworks send (structured instructions,
//! JSON Schema tools, JSON / log / file tool output), deterministic for a
//! seed, built from the word list in `text`.

use serde_json::{json, Map, Value};

use crate::text::{self, Rng};

const VERBS: &[&str] = &[
    "get",
    "list",
    "search",
    "create",
    "update",
    "delete",
    "send",
    "run",
    "schedule",
    "read",
    "write",
    "summarize",
    "lookup",
    "cancel",
    "approve",
    "export",
];

const NOUNS: &[&str] = &[
    "customer",
    "invoice",
    "ticket",
    "order",
    "document",
    "report",
    "account",
    "payment",
    "file",
    "deployment",
    "user",
    "calendar_event",
    "email",
    "shipment",
    "contract",
    "metric",
    "alert",
    "repository",
    "branch",
    "query",
];

const PARAMS: &[&str] = &[
    "id",
    "query",
    "limit",
    "offset",
    "status",
    "owner",
    "since",
    "until",
    "format",
    "path",
    "region",
    "priority",
    "tags",
    "include_archived",
    "sort_by",
    "dry_run",
    "reason",
    "amount",
    "currency",
    "email",
    "name",
    "timeout_s",
    "page_token",
    "fields",
];

const STATUSES: &[&str] = &["open", "closed", "pending", "done"];

const LEVELS: &[&str] = &["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"];

/// Text of `base` + up to `spread - 1` tokens.
fn sentence(rng: &mut Rng, base: usize, spread: usize) -> String {
    let n = base + rng.below(spread);
    text::text(rng, n)
}

/// `base` + up to `spread - 1` capitalised words.
pub fn title(rng: &mut Rng, base: usize, spread: usize) -> String {
    let words = base + rng.below(spread);
    let t = text::text(rng, words);
    t.trim_end_matches('.')
        .split(' ')
        .take(words)
        .map(|w| {
            let w = w.trim_matches(',');
            let mut c = w.chars();
            c.next().map_or_else(String::new, |f| {
                f.to_ascii_uppercase().to_string() + c.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One tool definition in the OpenAI `tools` format (JSON Schema
/// parameters).
pub fn tool(rng: &mut Rng, name: &str) -> Value {
    let mut props = Map::new();
    let mut required = Vec::new();
    let n = 2 + rng.below(5);
    while props.len() < n {
        let p = PARAMS[rng.below(PARAMS.len())];
        if props.contains_key(p) {
            continue;
        }
        let desc = sentence(rng, 8, 16);
        let schema = match rng.below(5) {
            0 => json!({"type": "integer", "description": desc, "minimum": 0}),
            1 => json!({"type": "boolean", "description": desc, "default": false}),
            2 => {
                let choices: Vec<String> = (0..3 + rng.below(3))
                    .map(|_| title(rng, 1, 1).to_ascii_lowercase())
                    .collect();
                json!({"type": "string", "description": desc, "enum": choices})
            }
            3 => json!({"type": "array", "items": {"type": "string"}, "description": desc}),
            _ => json!({"type": "string", "description": desc}),
        };
        props.insert(p.to_string(), schema);
        if rng.below(2) == 0 {
            required.push(p);
        }
    }
    json!({
        "type": "function",
        "function": {
            "name": name,
            "description": sentence(rng, 30, 50),
            "parameters": {"type": "object", "properties": props, "required": required},
        }
    })
}

/// Tool names (verb_noun), shuffled; past the list they get a number.
fn tool_names(rng: &mut Rng) -> Vec<String> {
    let mut names: Vec<String> = VERBS
        .iter()
        .flat_map(|v| NOUNS.iter().map(move |n| format!("{v}_{n}")))
        .collect();
    rng.shuffle(&mut names);
    names
}

fn tool_name(names: &[String], i: usize) -> String {
    if i < names.len() {
        names[i].clone()
    } else {
        format!("{}_{}", names[i % names.len()], i / names.len())
    }
}

/// Tool definitions until their compact JSON reaches `bytes`.
pub fn tools(rng: &mut Rng, bytes: usize) -> Vec<Value> {
    let names = tool_names(rng);
    let mut out = Vec::new();
    let mut len = 2;
    while len < bytes {
        let t = tool(rng, &tool_name(&names, out.len()));
        len += t.to_string().len() + 1;
        out.push(t);
    }
    out
}

/// Structured instructions (an assistant persona, numbered rules under
/// headings) of at least `bytes` bytes.
pub fn instructions(rng: &mut Rng, bytes: usize) -> String {
    let mut s = format!(
        "You are Atlas, the assistant of the {} team. Follow these instructions exactly.\n",
        title(rng, 2, 1)
    );
    while s.len() < bytes {
        s.push_str(&format!("\n## {}\n", title(rng, 2, 3)));
        for k in 1..=3 + rng.below(6) {
            s.push_str(&format!("{k}. {}\n", sentence(rng, 15, 30)));
        }
    }
    s
}

/// The long-preamble workload's system message: instructions, then the tool
/// definitions as pretty-printed JSON, at least `bytes` bytes in all.
pub fn preamble(seed: u64, bytes: usize) -> String {
    let mut rng = Rng::derive(seed, "preamble", 0);
    let mut s = instructions(&mut rng, bytes * 35 / 100);
    s.push_str(
        "\n# Tools\n\nYou can call the tools below. Call one by answering with its name and \
         JSON arguments; never invent a tool. Definitions (JSON Schema):\n\n",
    );
    let names = tool_names(&mut rng);
    let mut defs: Vec<Value> = Vec::new();
    let mut json = String::new();
    while s.len() + json.len() < bytes {
        defs.push(tool(&mut rng, &tool_name(&names, defs.len())));
        json = serde_json::to_string_pretty(&defs).unwrap_or_default();
    }
    s.push_str(&json);
    s.push('\n');
    s
}

/// Document `g` of about `tokens` tokens: a title, paragraphs, section
/// headings.
pub fn document(seed: u64, g: usize, tokens: usize) -> String {
    let mut rng = Rng::derive(seed, "document", g as u64);
    let mut s = format!("Document {g}: {}\n\n", title(&mut rng, 3, 4));
    let mut n = 0;
    let mut para = 0;
    while n < tokens {
        if para > 0 && para % 4 == 0 {
            s.push_str(&format!("### {}\n\n", title(&mut rng, 2, 3)));
        }
        let want = (60 + rng.below(80)).min(tokens - n).max(1);
        n += text::append_text(&mut s, &mut rng, want);
        s.push_str("\n\n");
        para += 1;
    }
    s
}

/// An assistant message calling one of `tools` (OpenAI `tool_calls`).
pub fn tool_call(rng: &mut Rng, tools: &[Value], id: &str) -> Value {
    let f = tools
        .get(rng.below(tools.len()))
        .map_or(&Value::Null, |t| &t["function"]);
    let mut args = Map::new();
    if let Some(props) = f["parameters"]["properties"].as_object() {
        for (k, schema) in props.iter().take(1 + rng.below(3)) {
            let v = match schema["type"].as_str() {
                Some("integer") => json!(rng.below(500)),
                Some("boolean") => json!(rng.below(2) == 0),
                Some("array") => json!([title(rng, 1, 1).to_ascii_lowercase()]),
                _ => match schema["enum"].as_array() {
                    Some(e) if !e.is_empty() => e[rng.below(e.len())].clone(),
                    _ => json!(sentence(rng, 3, 8)),
                },
            };
            args.insert(k.clone(), v);
        }
    }
    json!({
        "role": "assistant",
        "content": sentence(rng, 10, 25),
        "tool_calls": [{
            "id": id,
            "type": "function",
            "function": {
                "name": f["name"].as_str().unwrap_or("tool"),
                "arguments": Value::Object(args).to_string(),
            }
        }],
    })
}

/// A tool result of about `bytes` bytes: JSON records, log lines or file
/// text.
pub fn tool_result(rng: &mut Rng, bytes: usize, id: &str) -> Value {
    let content = match rng.below(3) {
        0 => {
            let mut items = Vec::new();
            let mut len = 30;
            while len < bytes {
                let status = STATUSES[rng.below(STATUSES.len())];
                let item = json!({
                    "id": format!("{:x}", rng.next_u64() >> 20),
                    "title": title(rng, 3, 4),
                    "status": status,
                    "updated": format!("2025-0{}-{:02}T{:02}:{:02}:00Z", 1 + rng.below(9), 1 + rng.below(28), rng.below(24), rng.below(60)),
                    "summary": sentence(rng, 20, 40),
                });
                len += item.to_string().len() + 1;
                items.push(item);
            }
            json!({"total": items.len() + rng.below(50), "items": items}).to_string()
        }
        1 => {
            let mut s = String::new();
            let (mut m, mut sec) = (rng.below(60), rng.below(60));
            while s.len() < bytes {
                sec += 1 + rng.below(20);
                m += sec / 60;
                sec %= 60;
                s.push_str(&format!(
                    "2025-03-14T10:{:02}:{:02}.{:03}Z {} {}-service[{}]: {}\n",
                    m % 60,
                    sec,
                    rng.below(1000),
                    LEVELS[rng.below(LEVELS.len())],
                    NOUNS[rng.below(NOUNS.len())],
                    1000 + rng.below(9000),
                    sentence(rng, 8, 20),
                ));
            }
            s
        }
        _ => {
            let mut s = format!(
                "```\n# {}.md\n\n",
                title(rng, 2, 1).to_ascii_lowercase().replace(' ', "_")
            );
            while s.len() < bytes {
                let n = 40 + rng.below(80);
                text::append_text(&mut s, rng, n);
                s.push_str("\n\n");
            }
            s.push_str("```\n");
            s
        }
    };
    json!({"role": "tool", "tool_call_id": id, "content": content})
}
