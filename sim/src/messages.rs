//! The Anthropic Messages API (`POST /v1/messages`), as vLLM serves it
//! (`vllm/entrypoints/anthropic/serving.py`, since v0.11.1): the body is
//! converted into an OpenAI chat request and rendered by the chat
//! template, so the same conversation costs the same prompt over either
//! API, and the cache hits across them.
//!
//! The conversion, as vLLM's:
//! - `system` (a string, or text blocks joined with nothing between them)
//!   and any `system`-role message's text become one system message,
//!   first. Blocks starting `x-anthropic-billing-header` (Claude Code's
//!   per-request attribution, which would defeat caching) are dropped.
//! - `tools` become function tools `{"type": "function", "function":
//!   {"name", "description", "parameters": input_schema}}` (`type:
//!   "object"` added to a schema without a type).
//! - An assistant's `tool_use` blocks become its `tool_calls`, the
//!   arguments `json.dumps(input)` (Python's separators `, ` and `: `,
//!   non-ASCII escaped; keys in sorted order here, as parsed).
//! - A user's `tool_result` blocks become `tool` messages, placed before
//!   what remains of the user message (its text and images); a user
//!   message of tool results only leaves nothing else. A result's images
//!   follow it as a user message of images. (In an assistant message a
//!   result is text, `Tool result: ...`; vLLM prints a list of items as
//!   Python's repr, here their text.)
//! - Text blocks become text parts (one text part: plain content); images
//!   become `image_url` parts (`url` sources as is, base64 as a data URL),
//!   rendered as the sim renders chat images.
//! - `thinking` becomes the message's reasoning, which this sim's template
//!   (like most that strip earlier turns' reasoning) does not render;
//!   `redacted_thinking` and `tool_reference` blocks are dropped.
//! - `cache_control`, `metadata`, `stop_sequences`, `temperature`, ... are
//!   accepted and change nothing: moving a cache breakpoint keeps the
//!   prompt, so the cache still hits.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::engine::Usage;
use crate::template::{self, Content, Message, Part};

/// A parsed `POST /v1/messages` body: the chat request it converts to.
#[derive(Debug)]
pub struct Request {
    pub model: String,
    pub max_tokens: u32,
    pub stream: bool,
    pub messages: Vec<Message>,
    /// OpenAI function tools, as the chat template renders them.
    pub tools: Option<Value>,
}

/// The body's fields, checked as vLLM's request model checks them; a
/// message for a 400 otherwise.
pub fn parse(body: &[u8]) -> Result<Request, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    let model = match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) => return Err("model: Model is required".into()),
        Some(_) => return Err("model: must be a string".into()),
        None => return Err("model: Field required".into()),
    };
    let max_tokens = match obj.get("max_tokens") {
        None | Some(Value::Null) => return Err("max_tokens: Field required".into()),
        Some(n) => match n.as_i64() {
            Some(n) if n <= 0 => return Err("max_tokens: max_tokens must be positive".into()),
            Some(n) => u32::try_from(n).map_err(|_| "max_tokens: too large")?,
            None => return Err("max_tokens: must be an integer".into()),
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream: must be a boolean".into()),
    };
    let msgs = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err("messages must contain at least one item".into()),
        _ => return Err("messages: must be an array of messages".into()),
    };
    let mut parsed = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        parsed.push(message(m).map_err(|e| format!("messages.{i}: {e}"))?);
    }
    let system = match obj.get("system") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(Blocks::Text(s.clone())),
        Some(Value::Array(b)) => Some(Blocks::List(
            b.iter()
                .enumerate()
                .map(|(i, b)| block(b).map_err(|e| format!("system.{i}: {e}")))
                .collect::<Result<_, _>>()?,
        )),
        Some(_) => return Err("system: must be a string or an array of text blocks".into()),
    };
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(Value::Array(
            t.iter()
                .enumerate()
                .map(|(i, t)| tool(t).map_err(|e| format!("tools.{i}: {e}")))
                .collect::<Result<_, _>>()?,
        )),
        Some(_) => return Err("tools: must be an array of tools".into()),
    };
    Ok(Request {
        model,
        max_tokens,
        stream,
        messages: convert(system.as_ref(), &parsed),
        tools,
    })
}

/// The prompt text: the converted chat request through the chat template.
pub fn render(req: &Request) -> String {
    template::render(&req.messages, req.tools.as_ref(), true)
}

/// A message's or the system's content: a string or blocks.
enum Blocks {
    Text(String),
    List(Vec<Block>),
}

struct Msg {
    role: String,
    content: Blocks,
}

/// The content blocks vLLM's request model knows.
enum Block {
    Text(Option<String>),
    Image(Option<Map<String, Value>>),
    ToolUse {
        id: Option<String>,
        name: Option<String>,
        input: Option<Map<String, Value>>,
    },
    ToolResult(ToolResult),
    Thinking,
    Skipped,
}

struct ToolResult {
    content: Option<Value>,
}

fn message(v: &Value) -> Result<Msg, String> {
    let obj = v.as_object().ok_or("must be an object")?;
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r.to_string(),
        // Claude Code >= 2.1.154's own roles, as vLLM maps them.
        Some("ctx" | "msg") => "user".to_string(),
        Some(r) => return Err(format!("role: '{r}' is not one of user, assistant, system")),
        None => return Err("role: Field required".into()),
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => Blocks::Text(s.clone()),
        Some(Value::Array(b)) if b.is_empty() => {
            return Err("content: message content must not be empty".into())
        }
        Some(Value::Array(b)) => Blocks::List(
            b.iter()
                .enumerate()
                .map(|(i, b)| block(b).map_err(|e| format!("content.{i}: {e}")))
                .collect::<Result<_, _>>()?,
        ),
        Some(_) => return Err("content: must be a string or an array of blocks".into()),
        None => return Err("content: Field required".into()),
    };
    Ok(Msg { role, content })
}

fn block(v: &Value) -> Result<Block, String> {
    let obj = v.as_object().ok_or("a block must be an object")?;
    let string = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("{k}: must be a string")),
    };
    let object = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o.clone())),
        Some(_) => Err(format!("{k}: must be an object")),
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Block::Text(string("text")?)),
        Some("image") => Ok(Block::Image(object("source")?)),
        Some("tool_use") => Ok(Block::ToolUse {
            id: string("id")?,
            name: string("name")?,
            input: object("input")?,
        }),
        Some("tool_result") => {
            string("tool_use_id")?;
            let content = match obj.get("content") {
                None | Some(Value::Null) => None,
                Some(c @ Value::String(_)) => Some(c.clone()),
                Some(Value::Array(items)) if items.iter().all(Value::is_object) => {
                    Some(Value::Array(items.clone()))
                }
                Some(_) => {
                    return Err("content: must be a string or an array of blocks".into());
                }
            };
            Ok(Block::ToolResult(ToolResult { content }))
        }
        Some("thinking") => Ok(Block::Thinking),
        Some("redacted_thinking" | "tool_reference") => Ok(Block::Skipped),
        Some(t) => Err(format!("type: unknown block type '{t}'")),
        None => Err("type: Field required".into()),
    }
}

/// An Anthropic tool as an OpenAI function tool.
fn tool(v: &Value) -> Result<Value, String> {
    let obj = v.as_object().ok_or("a tool must be an object")?;
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .ok_or("name: Field required")?;
    let mut schema = match obj.get("input_schema") {
        Some(Value::Object(s)) => s.clone(),
        _ => return Err("input_schema: must be a dictionary".into()),
    };
    schema.entry("type").or_insert_with(|| json!("object"));
    let mut function = json!({"name": name, "parameters": schema});
    match obj.get("description") {
        None | Some(Value::Null) => {}
        Some(d @ Value::String(_)) => function["description"] = d.clone(),
        Some(_) => return Err("description: must be a string".into()),
    }
    Ok(json!({"type": "function", "function": function}))
}

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The system text and messages as vLLM converts them.
fn convert(system: Option<&Blocks>, msgs: &[Msg]) -> Vec<Message> {
    // The system's parts: the field's, then any system message's.
    let mut parts: Vec<&str> = Vec::new();
    // An empty system string is no system (Python's falsy "").
    if let Some(s) = system.filter(|s| !matches!(s, Blocks::Text(t) if t.is_empty())) {
        system_parts(s, &mut parts);
    }
    for m in msgs.iter().filter(|m| m.role == "system") {
        system_parts(&m.content, &mut parts);
    }
    let mut out = Vec::new();
    if !parts.is_empty() {
        out.push(Message {
            role: "system".into(),
            content: Some(Content::Text(parts.concat())),
            tool_calls: None,
        });
    }
    for m in msgs.iter().filter(|m| m.role != "system") {
        match &m.content {
            Blocks::Text(s) => out.push(Message {
                role: m.role.clone(),
                content: Some(Content::Text(s.clone())),
                tool_calls: None,
            }),
            Blocks::List(blocks) => convert_blocks(&m.role, blocks, &mut out),
        }
    }
    out
}

/// A system field's or message's text: its non-empty text blocks, but
/// for Claude Code's billing header.
fn system_parts<'a>(blocks: &'a Blocks, parts: &mut Vec<&'a str>) {
    match blocks {
        Blocks::Text(s) => parts.push(s),
        Blocks::List(list) => parts.extend(list.iter().filter_map(|b| match b {
            Block::Text(Some(t)) if !t.is_empty() && !t.starts_with(BILLING_HEADER) => {
                Some(t.as_str())
            }
            _ => None,
        })),
    }
}

/// One message of blocks: its tool results first (as `tool` messages, in
/// a user message), then the message itself, unless a user message has
/// nothing left (an assistant's is sent with its calls, or empty).
fn convert_blocks(role: &str, blocks: &[Block], out: &mut Vec<Message>) {
    let mut parts: Vec<Part> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    for b in blocks {
        match b {
            Block::Text(Some(t)) if !t.is_empty() => parts.push(text_part(t.clone())),
            Block::Text(_) | Block::Image(None) | Block::Thinking | Block::Skipped => {}
            Block::Image(Some(source)) => parts.push(image_part(source)),
            Block::ToolUse { id, name, input } => calls.push(json!({
                "id": id.clone().unwrap_or_else(fallback_call_id),
                "type": "function",
                "function": {
                    "name": name.clone().unwrap_or_default(),
                    "arguments": py_json(&Value::Object(input.clone().unwrap_or_default())),
                },
            })),
            Block::ToolResult(r) if role == "user" => tool_message(r, out),
            Block::ToolResult(r) => {
                let shown = match &r.content {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(items)) => item_texts(items),
                    _ => String::new(),
                };
                parts.push(text_part(format!("Tool result: {shown}")));
            }
        }
    }
    let content = if parts.len() == 1 && parts[0].kind == "text" {
        parts.pop().and_then(|p| p.text).map(Content::Text)
    } else if !parts.is_empty() {
        Some(Content::Parts(parts))
    } else {
        None
    };
    if content.is_none() && role == "user" {
        return;
    }
    out.push(Message {
        role: role.to_string(),
        content,
        tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
    });
}

/// A user's tool result: a `tool` message with its text (text items
/// joined by line breaks), then its images as a user message.
fn tool_message(r: &ToolResult, out: &mut Vec<Message>) {
    let (text, images) = match &r.content {
        Some(Value::String(s)) => (s.clone(), Vec::new()),
        Some(Value::Array(items)) => {
            let images = items
                .iter()
                .filter(|i| i["type"] == "image")
                .map(|i| image_part(i["source"].as_object().unwrap_or(&Map::new())))
                .collect();
            (item_texts(items), images)
        }
        _ => (String::new(), Vec::new()),
    };
    out.push(Message {
        role: "tool".into(),
        content: Some(Content::Text(text)),
        tool_calls: None,
    });
    if !images.is_empty() {
        out.push(Message {
            role: "user".into(),
            content: Some(Content::Parts(images)),
            tool_calls: None,
        });
    }
}

fn item_texts(items: &[Value]) -> String {
    items
        .iter()
        .filter(|i| i["type"] == "text")
        .map(|i| i["text"].as_str().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn text_part(text: String) -> Part {
    Part {
        kind: "text".into(),
        text: Some(text),
        rest: Map::new(),
    }
}

/// An image source as the chat API's `image_url` part: a `url` source's
/// URL, anything else a base64 data URL.
fn image_part(source: &Map<String, Value>) -> Part {
    let s = |k: &str| source.get(k).and_then(Value::as_str);
    let url = if s("type") == Some("url") {
        s("url").unwrap_or("").to_string()
    } else {
        format!(
            "data:{};base64,{}",
            s("media_type").unwrap_or("image/jpeg"),
            s("data").unwrap_or("")
        )
    };
    let mut rest = Map::new();
    rest.insert("image_url".into(), json!({"url": url}));
    Part {
        kind: "image_url".into(),
        text: None,
        rest,
    }
}

/// vLLM names a `tool_use` block without an id by the clock.
fn fallback_call_id() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("call_{secs}")
}

/// `json.dumps(v)` with Python's defaults: `, ` and `: ` separators,
/// every character outside printable ASCII escaped (`\uXXXX`, UTF-16).
pub fn py_json(v: &Value) -> String {
    let mut out = String::new();
    write_py(v, &mut out);
    out
}

fn write_py(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => py_str(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(x, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_str(k, out);
                out.push_str(": ");
                write_py(x, out);
            }
            out.push('}');
        }
    }
}

fn py_str(s: &str, out: &mut String) {
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

/// What every body of one message shares.
pub struct Meta {
    pub id: String,
    pub model: String,
    pub input_tokens: usize,
    pub max_tokens: usize,
}

impl Meta {
    /// Generation always runs to `max_tokens` here (no EOS), so a message
    /// that stopped short of it ended its turn.
    fn stop_reason(&self, u: &Usage) -> &'static str {
        if u.completion_tokens >= self.max_tokens {
            "max_tokens"
        } else {
            "end_turn"
        }
    }

    /// The usage of a finished message. `input_tokens` counts the whole
    /// prompt, as vLLM's does (Anthropic's own API counts only the part
    /// not read from its cache); `cache_read_input_tokens` the part the
    /// prefix cache served.
    fn usage(u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens,
        })
    }

    /// The non-streaming response.
    pub fn message(&self, text: &str, u: &Usage) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": self.stop_reason(u),
            "stop_sequence": null,
            "usage": Meta::usage(u),
        })
    }

    /// The events before the first token: the empty message, its text
    /// block opened, a ping (Anthropic's order).
    pub fn opening(&self) -> String {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        });
        let mut s = event("message_start", json!({"message": message}));
        s.push_str(&event(
            "content_block_start",
            json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
        ));
        s.push_str(&event("ping", json!({})));
        s
    }

    /// One generated piece of text.
    pub fn delta(text: &str) -> String {
        event(
            "content_block_delta",
            json!({"index": 0, "delta": {"type": "text_delta", "text": text}}),
        )
    }

    /// The events after the last token: the block closed, the stop reason
    /// and usage, the end.
    pub fn closing(&self, u: &Usage) -> String {
        let mut s = event("content_block_stop", json!({"index": 0}));
        s.push_str(&event(
            "message_delta",
            json!({"delta": {"stop_reason": self.stop_reason(u), "stop_sequence": null},
                   "usage": Meta::usage(u)}),
        ));
        s.push_str(&event("message_stop", json!({})));
        s
    }
}

/// One server-sent event, named by its type.
pub fn event(kind: &str, mut data: Value) -> String {
    data["type"] = json!(kind);
    format!("event: {kind}\ndata: {data}\n\n")
}

/// An error body in Anthropic's shape, its type by status.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(v: Value) -> Request {
        parse(v.to_string().as_bytes()).unwrap()
    }

    /// The chat template's rendering of a chat body.
    fn chat(v: Value) -> String {
        let msgs: Vec<Message> = serde_json::from_value(v["messages"].clone()).unwrap();
        template::render(&msgs, v.get("tools"), true)
    }

    const EPHEMERAL: &str = r#"{"type": "ephemeral"}"#;

    fn ephemeral() -> Value {
        serde_json::from_str(EPHEMERAL).unwrap()
    }

    /// An agent's turn over the Messages API: system blocks, a tool, a
    /// tool call and its result, an image, the breakpoint on the last block.
    fn agent_turn() -> Value {
        json!({
            "model": "m", "max_tokens": 8, "stream": true, "metadata": {"user_id": "u"},
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=5f1e"},
                {"type": "text", "text": "You are an agent. "},
                {"type": "text", "text": "Be brief.", "cache_control": ephemeral()}
            ],
            "tools": [{"name": "read", "description": "Read a file",
                       "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
                       "cache_control": ephemeral()},
                      {"name": "now", "input_schema": {}}],
            "messages": [
                {"role": "user", "content": "Fix the bug in main.rs."},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look first.", "signature": "s"},
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read",
                     "input": {"path": "src/main.rs", "limit": 20}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "fn main() {}"}, {"type": "text", "text": "// end"}]},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                    {"type": "text", "text": "What now?", "cache_control": ephemeral()}
                ]}
            ]
        })
    }

    /// What vLLM converts `agent_turn()` into, as a chat body.
    fn agent_turn_as_chat() -> Value {
        json!({
            "messages": [
                {"role": "system", "content": "You are an agent. Be brief."},
                {"role": "user", "content": "Fix the bug in main.rs."},
                {"role": "assistant", "content": "Reading it.", "tool_calls": [{
                    "id": "toolu_1", "type": "function",
                    "function": {"name": "read", "arguments": "{\"limit\": 20, \"path\": \"src/main.rs\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "fn main() {}\n// end"},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                    {"type": "text", "text": "What now?"}
                ]}
            ],
            "tools": [
                {"type": "function", "function": {"name": "read", "description": "Read a file",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
            ]
        })
    }

    #[test]
    fn a_messages_body_renders_as_the_chat_body_vllm_converts_it_to() {
        let r = messages(agent_turn());
        assert_eq!(render(&r), chat(agent_turn_as_chat()));
        assert_eq!((r.model.as_str(), r.max_tokens, r.stream), ("m", 8, true));
        // System as a plain string, string contents, no tools.
        let plain = json!({"model": "m", "max_tokens": 1, "system": "S",
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}]});
        let as_chat = json!({"messages": [{"role": "system", "content": "S"},
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}]});
        assert_eq!(render(&messages(plain)), chat(as_chat));
    }

    #[test]
    fn cache_control_changes_nothing_and_a_turn_extends_the_one_before() {
        let with = messages(agent_turn());
        let mut without = agent_turn();
        let strip = |v: &mut Value| {
            if let Some(o) = v.as_object_mut() {
                o.remove("cache_control");
            }
        };
        for b in without["system"].as_array_mut().unwrap() {
            strip(b);
        }
        strip(&mut without["tools"][0]);
        strip(&mut without["messages"][2]["content"][2]);
        assert!(!without.to_string().contains("cache_control"));
        assert_eq!(render(&with), render(&messages(without)));

        // The next turn: the answer, a tool result, the breakpoint moved
        // from the last turn's block to the new last block.
        let mut next = agent_turn();
        strip(&mut next["messages"][2]["content"][2]);
        let m = next["messages"].as_array_mut().unwrap();
        m.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]}));
        m.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00",
             "cache_control": ephemeral()}]}));
        let (p1, p2) = (render(&with), render(&messages(next)));
        assert!(p2.starts_with(&p1), "{p1}\n---\n{p2}");
        // The assistant's calls without text, the user's tool result alone.
        assert!(p2.ends_with(
            "<|im_start|>assistant\n<tool_call>[{\"function\":{\"arguments\":\"{}\",\"name\":\"now\"},\"id\":\"toolu_2\",\"type\":\"function\"}]</tool_call><|im_end|>\n\
             <|im_start|>tool\n12:00<|im_end|>\n<|im_start|>assistant\n"
        ), "{p2}");
    }

    #[test]
    fn system_messages_fold_into_the_system_and_result_images_follow_it() {
        let r = messages(json!({"model": "m", "max_tokens": 1,
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": ""}],
        "messages": [
            {"role": "system", "content": "B"},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "is_error": true, "content": [
                    {"type": "text", "text": "shot"},
                    {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]},
                {"type": "redacted_thinking", "data": "zz"}
            ]}
        ]}));
        let as_chat = json!({"messages": [
            {"role": "system", "content": "AB"},
            {"role": "tool", "content": "shot"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}
        ]});
        assert_eq!(render(&r), chat(as_chat));
    }

    #[test]
    fn arguments_are_python_json_dumps() {
        let v = json!({"a": [1, 2.5, true, null], "b": "x\"y\\\n\t\u{e9}\u{1F600}\u{7f}\u{1}", "c": {}});
        // python3 -c 'import json; print(json.dumps(...))'
        assert_eq!(
            py_json(&v),
            r#"{"a": [1, 2.5, true, null], "b": "x\"y\\\n\t\u00e9\ud83d\ude00\u007f\u0001", "c": {}}"#
        );
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        let ok =
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
        assert!(parse(ok.to_string().as_bytes()).is_ok());
        let with = |k: &str, v: Value| {
            let mut b = ok.clone();
            b[k] = v;
            b
        };
        let without = |k: &str| {
            let mut b = ok.clone();
            b.as_object_mut().unwrap().remove(k);
            b
        };
        for (bad, why) in [
            (without("max_tokens"), "max_tokens"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (with("max_tokens", json!("8")), "max_tokens"),
            (without("model"), "model"),
            (with("model", json!("")), "model"),
            (with("messages", json!([])), "at least one"),
            (with("messages", json!("hi")), "messages"),
            (
                with("messages", json!([{"role": "tool", "content": "x"}])),
                "role",
            ),
            (
                with("messages", json!([{"role": "user", "content": []}])),
                "empty",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "video"}]}]),
                ),
                "video",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"text": "x"}]}]),
                ),
                "type",
            ),
            (with("system", json!(7)), "system"),
            (with("tools", json!([{"name": "f"}])), "input_schema"),
            (with("stream", json!("yes")), "stream"),
            (json!([1]), "object"),
        ] {
            let e = parse(bad.to_string().as_bytes()).err();
            assert!(
                e.as_deref().is_some_and(|e| e.contains(why)),
                "{bad}: {e:?}"
            );
        }
        assert!(parse(b"{").unwrap_err().contains("invalid request body"));
    }

    #[test]
    fn stream_events_name_their_type_and_end_with_usage() {
        let meta = Meta {
            id: "msg_1".into(),
            model: "m".into(),
            input_tokens: 40,
            max_tokens: 2,
        };
        let opening = meta.opening();
        assert!(opening.starts_with("event: message_start\ndata: {"));
        let u = Usage {
            prompt_tokens: 40,
            completion_tokens: 2,
            cached_tokens: 32,
        };
        let closing = meta.closing(&u);
        let datas: Vec<Value> = closing
            .split("\n\n")
            .filter_map(|e| e.split_once("\ndata: "))
            .map(|(name, d)| {
                let v: Value = serde_json::from_str(d).unwrap();
                assert_eq!(name.strip_prefix("event: "), v["type"].as_str());
                v
            })
            .collect();
        assert_eq!(datas.len(), 3);
        assert_eq!(datas[1]["delta"]["stop_reason"], "max_tokens");
        assert_eq!(datas[1]["usage"]["cache_read_input_tokens"], 32);
        assert_eq!(meta.message("hi", &u)["usage"]["output_tokens"], 2);
        let short = Usage {
            completion_tokens: 1,
            ..u
        };
        assert_eq!(meta.message("h", &short)["stop_reason"], "end_turn");
        assert_eq!(
            error_body(400, "no")["error"]["type"],
            "invalid_request_error"
        );
    }
}
