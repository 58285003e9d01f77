//! The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), as
//! vLLM serves it: a response with `store` (the default) is kept in this
//! replica's memory, and a later request continues it by
//! `previous_response_id`, its prompt the stored conversation plus the new
//! input. Another replica doesn't have it and answers 404, as vLLM does.
//! `request_id` names the response (vLLM's and SGLang's extra parameter).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::engine::Usage;
use crate::template::{self, Content, Message};

/// One message of a stored conversation: role and text.
pub type Turn = (String, String);

/// A parsed `POST /v1/responses` body.
pub struct Request {
    pub model: Option<String>,
    pub cache_salt: Option<String>,
    pub instructions: Option<String>,
    pub input: Vec<Turn>,
    pub tools: Option<Value>,
    pub max_output_tokens: Option<u32>,
    pub stream: bool,
    pub store: bool,
    pub previous: Option<String>,
    pub request_id: Option<String>,
}

pub fn parse(body: &[u8]) -> Result<Request, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    let s = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_string);
    let input = match obj.get("input") {
        Some(Value::String(t)) => vec![("user".to_string(), t.clone())],
        Some(Value::Array(items)) => items.iter().map(item).collect::<Result<_, _>>()?,
        _ => return Err("input must be a string or an array of items".into()),
    };
    let max_output_tokens = match obj.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or("max_output_tokens must be a non-negative integer")?,
        ),
    };
    Ok(Request {
        model: s("model"),
        cache_salt: s("cache_salt"),
        instructions: s("instructions"),
        input,
        tools: obj.get("tools").filter(|t| !t.is_null()).cloned(),
        max_output_tokens,
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        store: stores(obj.get("store")),
        previous: s("previous_response_id"),
        request_id: s("request_id"),
    })
}

/// Whether `store` stores the response: absent (the API's default), or
/// true as vLLM's request model reads it (pydantic's lax booleans: `true`,
/// a number equal to 1, "true", "yes", "on", "1", "t", "y" in any case).
fn stores(v: Option<&Value>) -> bool {
    match v {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() == Some(1.0),
        Some(Value::String(s)) => ["true", "yes", "on", "1", "t", "y"]
            .iter()
            .any(|t| t.eq_ignore_ascii_case(s)),
        _ => false,
    }
}

/// An input item as a turn: a message, a function call or its output.
fn item(v: &Value) -> Result<Turn, String> {
    let text = |v: Option<&Value>| match v {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    if let Some(role) = v.get("role").and_then(Value::as_str) {
        return Ok((role.to_string(), text(v.get("content"))));
    }
    match v.get("type").and_then(Value::as_str) {
        Some("function_call") => Ok((
            "assistant".into(),
            format!(
                "<tool_call>{} {}</tool_call>",
                text(v.get("name")),
                text(v.get("arguments"))
            ),
        )),
        Some("function_call_output") => Ok(("tool".into(), text(v.get("output")))),
        _ => Err("input items must be messages, function calls or their outputs".into()),
    }
}

/// A response id no other replica or process hands out, as vLLM's random
/// uuid: replicas of different hosts share ports, so a follow-up sent to
/// the wrong one must not find a response of the same name there.
pub fn fresh_id(request: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let pid = u64::from(std::process::id());
    let a = crate::hash::mix(crate::hash::hash_str(request) ^ nanos);
    let b = crate::hash::mix(a ^ pid.rotate_left(32) ^ nanos.rotate_left(17));
    format!("resp_{a:016x}{b:016x}")
}

/// The prompt: this request's instructions, the stored conversation it
/// continues, then its input.
pub fn render(req: &Request, history: &[Turn]) -> String {
    let system = req
        .instructions
        .iter()
        .map(|i| ("system".to_string(), i.clone()));
    let turns = system
        .chain(history.iter().cloned())
        .chain(req.input.iter().cloned());
    let messages: Vec<Message> = turns
        .map(|(role, text)| Message {
            role,
            content: Some(Content::Text(text)),
            tool_calls: None,
        })
        .collect();
    template::render(&messages, req.tools.as_ref(), true)
}

/// Stored conversations by response id, the oldest dropped past `cap`
/// conversations or `cap_bytes` of text (each holds its whole history, so
/// a long chain stores its turns over and over).
pub struct Store {
    inner: Mutex<Stored>,
    cap: usize,
    cap_bytes: usize,
}

#[derive(Default)]
struct Stored {
    by_id: HashMap<String, Vec<Turn>>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

fn size(turns: &[Turn]) -> usize {
    turns.iter().map(|(r, t)| r.len() + t.len()).sum()
}

impl Store {
    pub fn new(cap: usize, cap_bytes: usize) -> Store {
        Store {
            inner: Mutex::new(Stored::default()),
            cap,
            cap_bytes,
        }
    }

    pub fn get(&self, id: &str) -> Option<Vec<Turn>> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.by_id.get(id).cloned()
    }

    pub fn put(&self, id: String, turns: Vec<Turn>) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.bytes += size(&turns);
        match g.by_id.insert(id.clone(), turns) {
            Some(old) => g.bytes -= size(&old),
            None => g.order.push_back(id),
        }
        while g.order.len() > self.cap || (g.bytes > self.cap_bytes && g.order.len() > 1) {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some(t) = g.by_id.remove(&old) {
                g.bytes -= size(&t);
            }
        }
    }
}

/// What every body of one response shares.
pub struct Meta {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub previous: Option<String>,
    pub store: bool,
}

impl Meta {
    /// The response object: in progress (no output yet) or completed.
    pub fn object(&self, done: Option<(&str, &Usage)>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": if done.is_some() { "completed" } else { "in_progress" },
            "output": [],
            "previous_response_id": self.previous,
            "store": self.store,
            "usage": null,
        });
        if let Some((text, u)) = done {
            v["output"] = json!([{
                "type": "message",
                "id": format!("msg_{}", self.id.trim_start_matches("resp_")),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }]);
            v["usage"] = json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            });
        }
        v
    }

    /// One server-sent event, named by its type.
    pub fn event(kind: &str, seq: u64, mut data: Value) -> String {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        format!("event: {kind}\ndata: {data}\n\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_shapes_become_turns() {
        let r = parse(
            br#"{"model":"m","instructions":"Be brief.","input":[
                {"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},
                {"type":"function_call","name":"f","arguments":"{}","call_id":"c"},
                {"type":"function_call_output","call_id":"c","output":"42"}
            ],"store":false,"previous_response_id":"resp_1","request_id":"resp_2"}"#,
        )
        .unwrap();
        assert_eq!(
            r.input,
            [
                ("user".into(), "a\nb".into()),
                ("assistant".into(), "<tool_call>f {}</tool_call>".into()),
                ("tool".into(), "42".into())
            ]
        );
        assert!(!r.store);
        assert_eq!(r.previous.as_deref(), Some("resp_1"));
        assert_eq!(r.request_id.as_deref(), Some("resp_2"));
        assert!(parse(br#"{"input":"x"}"#).unwrap().store);
        assert!(!parse(br#"{"input":"x","store":null}"#).unwrap().store);
        assert!(parse(br#"{"input":"x","store":"Yes"}"#).unwrap().store);
        assert!(parse(br#"{"input":"x","store":1.0}"#).unwrap().store);
        assert!(!parse(br#"{"input":"x","store":"off"}"#).unwrap().store);
        for bad in [
            &b"[]"[..],
            br#"{"model":"m"}"#,
            br#"{"input":[{"type":"x"}]}"#,
            b"{",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_continued_prompt_starts_with_the_stored_one() {
        let first = parse(br#"{"instructions":"S","input":"a"}"#).unwrap();
        let next = parse(br#"{"instructions":"S","input":"c"}"#).unwrap();
        let stored = [
            ("user".to_string(), "a".to_string()),
            ("assistant".into(), "b".into()),
        ];
        let p1 = render(&first, &[]);
        let p2 = render(&next, &stored);
        assert!(p2.starts_with(&p1), "{p1:?} {p2:?}");
    }

    #[test]
    fn the_store_keeps_the_newest_within_its_count_and_bytes() {
        let s = Store::new(2, 1 << 20);
        for id in ["a", "b", "c"] {
            s.put(id.into(), vec![("user".into(), id.into())]);
        }
        assert_eq!(s.get("a"), None);
        assert_eq!(s.get("c"), Some(vec![("user".into(), "c".into())]));
        // A chain of long turns: the oldest go once the text passes the cap.
        let s = Store::new(100, 1000);
        let mut turns = Vec::new();
        for n in 0..10 {
            turns.push(("user".to_string(), "x".repeat(100)));
            s.put(format!("r{n}"), turns.clone());
        }
        assert_eq!(s.get("r9").map(|t| t.len()), Some(10));
        assert_eq!(s.get("r8"), None, "r9 alone is 1,040 bytes");
        let g = s.inner.lock().unwrap();
        assert_eq!(g.bytes, size(&turns));
    }

    #[test]
    fn ids_the_server_makes_differ() {
        // Each request of a replica is named apart (its own counter), and
        // two processes or hosts apart by the clock and process id.
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|n| fresh_id(&format!("chatcmpl-8000-{n}")))
            .collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|i| i.starts_with("resp_") && i.len() == 37));
    }
}
