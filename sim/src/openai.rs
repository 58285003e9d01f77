//! OpenAI-shaped request parsing and response bodies. Parsing turns any body
//! into either a prepared prompt or a message for a 400; unknown fields are
//! ignored (serde's default) because peers add their own.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::engine::Usage;
use crate::template::{self, Message};
use crate::tokenizer::{self, VOCAB_SIZE};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
#[serde(
    expecting = "prompt must be a string, an array of strings, an array of token ids, or an array of token-id arrays"
)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdBatches(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    /// Keeps this request's KV apart from other salts' (vLLM hashes it
    /// into the first block).
    #[serde(default)]
    cache_salt: Option<String>,
    prompt: Prompt,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    // Accepted for compatibility; generation always runs to max_tokens.
    #[serde(default)]
    #[allow(dead_code)]
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    /// Keeps this request's KV apart from other salts' (vLLM hashes it
    /// into the first block).
    #[serde(default)]
    cache_salt: Option<String>,
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    #[allow(dead_code)]
    ignore_eos: Option<bool>,
}

/// `/tokenize` takes either a prompt or messages.
#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

/// A parsed inference request, ready for the engine.
pub struct Prepared {
    pub kind: Kind,
    pub model: Option<String>,
    pub cache_salt: Option<String>,
    pub tokens: Vec<u32>,
    pub max_tokens: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
}

pub fn parse(kind: Kind, body: &[u8]) -> Result<Prepared, String> {
    match kind {
        Kind::Completion => parse_completion(body),
        Kind::Chat => parse_chat(body),
    }
}

fn parse_completion(body: &[u8]) -> Result<Prepared, String> {
    let r: CompletionRequest = from_json(body)?;
    Ok(Prepared {
        kind: Kind::Completion,
        model: r.model,
        cache_salt: r.cache_salt,
        tokens: prompt_tokens(r.prompt)?,
        max_tokens: r.max_tokens,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

fn parse_chat(body: &[u8]) -> Result<Prepared, String> {
    let r: ChatRequest = from_json(body)?;
    if r.messages.is_empty() {
        return Err("messages must not be empty".into());
    }
    let text = template::render(&r.messages, r.tools.as_ref(), true);
    Ok(Prepared {
        kind: Kind::Chat,
        model: r.model,
        cache_salt: r.cache_salt,
        tokens: tokenizer::encode(&text),
        // The newer name wins, as in OpenAI's API.
        max_tokens: r.max_completion_tokens.or(r.max_tokens),
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// Token ids for `/tokenize`.
pub fn parse_tokenize(body: &[u8]) -> Result<Vec<u32>, String> {
    let r: TokenizeRequest = from_json(body)?;
    match (r.prompt, r.messages) {
        (Some(p), None) => prompt_tokens(p),
        (None, Some(m)) => {
            let gen = r.add_generation_prompt.unwrap_or(true);
            Ok(tokenizer::encode(&template::render(
                &m,
                r.tools.as_ref(),
                gen,
            )))
        }
        _ => Err("exactly one of 'prompt' or 'messages' is required".into()),
    }
}

fn from_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))
}

/// A batch of prompts is served as one sequence (texts or id lists
/// concatenated in order): the simulator has one choice per response.
fn prompt_tokens(p: Prompt) -> Result<Vec<u32>, String> {
    let tokens = match p {
        Prompt::Text(t) => tokenizer::encode(&t),
        Prompt::Texts(ts) => tokenizer::encode(&ts.concat()),
        Prompt::Ids(ids) => ids,
        Prompt::IdBatches(b) => b.concat(),
    };
    if let Some(bad) = tokens.iter().find(|t| **t >= VOCAB_SIZE) {
        return Err(format!(
            "token id {bad} is out of vocabulary (size {VOCAB_SIZE})"
        ));
    }
    if tokens.is_empty() {
        return Err("prompt must not be empty".into());
    }
    Ok(tokens)
}

/// Fields shared by every response body of one request.
pub struct Meta {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// One streamed token. `first` carries the assistant role for chat.
    pub fn chunk(&self, text: &str, first: bool, last: bool) -> Value {
        let finish = last.then_some("length");
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null})
            }
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish, "stop_reason": null})
            }
        };
        self.envelope(true, json!([choice]), None)
    }

    /// The `include_usage` chunk: no choices, just usage.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        self.envelope(true, json!([]), Some(usage))
    }

    /// The complete non-streaming response.
    pub fn full(&self, text: &str, usage: &Usage) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null,
                "finish_reason": "length",
                "stop_reason": null
            }),
        };
        self.envelope(false, json!([choice]), Some(usage))
    }

    fn envelope(&self, chunk: bool, choices: Value, usage: Option<&Usage>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        } else if !chunk {
            v["usage"] = Value::Null;
        }
        v
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompt_shapes() {
        let p = parse(
            Kind::Completion,
            br#"{"prompt":"hello world","extra":{"x":1}}"#,
        )
        .unwrap();
        assert_eq!(p.tokens, tokenizer::encode("hello world"));
        assert_eq!(p.max_tokens, None);
        let p = parse(Kind::Completion, br#"{"prompt":[1,2,3],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(
            (p.tokens, p.max_tokens, p.stream, p.include_usage),
            (vec![1, 2, 3], Some(5), true, true)
        );
        let p = parse(Kind::Completion, br#"{"prompt":[[1,2],[3]]}"#).unwrap();
        assert_eq!(p.tokens, vec![1, 2, 3]);
        let p = parse(Kind::Completion, br#"{"prompt":["ab","cd"]}"#).unwrap();
        assert_eq!(p.tokens, tokenizer::encode("abcd"));
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        let bad: [&[u8]; 9] = [
            b"",
            b"{",
            b"[]",
            br#"{"prompt":""}"#,
            br#"{"prompt":[60000]}"#,
            br#"{"prompt":"x","max_tokens":-1}"#,
            br#"{"prompt":{"a":1}}"#,
            br#"{"messages":[]}"#,
            b"\xff\xfe",
        ];
        for b in bad {
            assert!(
                parse(Kind::Completion, b).is_err(),
                "{}",
                String::from_utf8_lossy(b)
            );
        }
        // Each kind judged by its own parser: a chat body is no completion,
        // so "either fails" held whatever the completion parser did.
        let chat_bad: [&[u8]; 4] = [
            br#"{"messages":[]}"#,
            br#"{"messages":"hi"}"#,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            b"\xff\xfe",
        ];
        for b in chat_bad {
            assert!(
                parse(Kind::Chat, b).is_err(),
                "{}",
                String::from_utf8_lossy(b)
            );
        }
        assert!(parse(Kind::Chat, br#"{"messages":[{"content":"no role"}]}"#).is_err());
        assert!(parse(Kind::Chat, br#"{"messages":[]}"#).is_err());
    }

    #[test]
    fn chat_prefers_max_completion_tokens() {
        let p = parse(
            Kind::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"max_completion_tokens":7,"tools":[{"type":"function"}]}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(7));
        assert!(p.tokens.starts_with(&[3]), "starts with <|im_start|>");
    }
}
