//! OpenAI-style request bodies (and the Anthropic Messages API's, which
//! vLLM and SGLang serve too) → model name and the prompt as one byte
//! string, rendered the way it reaches the model server's prompt (tools
//! first, then the system prompt and messages in order).
//!
//! At most `cap` bytes of the rendered prompt are kept (the filter passes
//! `max_body_bytes`: a prompt's identity reaches its end, see `prefix`).

mod body;
mod json;

use body::{Block, Content, InputField, Part, PromptField};
pub use json::JsonError;
use thiserror::Error;

/// Longest model name kept; longer names are cut (they only seed hashes).
const MAX_MODEL_BYTES: usize = 256;

#[derive(Debug, Error)]
pub enum ParseError {
    #[error("body is not a JSON object of the expected shape: {0}")]
    Json(#[from] JsonError),
    #[error("body has none of `prompt`, `messages` or `input`")]
    NoPrompt,
}

/// What routing needs from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub model: String,
    /// Part of the hash seed, like vLLM's `cache_salt`: requests with
    /// different salts must not be considered to share a cache.
    pub cache_salt: Option<String>,
    /// Rendered prompt, at most `cap` bytes.
    pub text: Vec<u8>,
    /// Where the conversation's own part starts (see [`Header::lead_bytes`]).
    pub lead_bytes: usize,
    /// Messages in it (see [`Header::own_messages`]).
    pub own_messages: u32,
}

/// Where rendered prompt bytes go: a buffer (`extract`), or straight into
/// the checkpoint hasher (the filter: a long prompt is never copied).
pub trait Sink {
    fn push(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn push(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for crate::prefix::Hasher {
    fn push(&mut self, bytes: &[u8]) {
        crate::prefix::Hasher::push(self, bytes);
    }
}

/// What a body says besides its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub model: String,
    pub cache_salt: Option<String>,
    /// Rendered bytes before the content of the first message that isn't
    /// a preamble (tools, system, developer, instructions): the start of
    /// what a conversation, agent session or document brings of its own,
    /// after what many requests may share. 0 without such a preamble.
    pub lead_bytes: usize,
    /// Messages from there on: more than one for a conversation's or an
    /// agent session's later turns.
    pub own_messages: u32,
    /// A Responses API body's stored-response facts (`None` for others).
    pub responses: Option<Responses>,
}

/// What a Responses API body says of stored responses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Responses {
    /// The stored response it continues (`previous_response_id`).
    pub previous: Option<String>,
    /// Its own response is stored (`store` absent, or a value the
    /// servers read as true: see `body::stores`).
    pub store: bool,
    /// The client named the request itself (`request_id`).
    pub named: bool,
}

/// Roles that open a prompt with what many requests share.
fn is_preamble(role: &str) -> bool {
    matches!(role, "system" | "developer" | "tools" | "instructions")
}

/// Parse a body and render its prompt, keeping at most `cap` bytes.
pub fn extract(body: &[u8], cap: usize) -> Result<Prompt, ParseError> {
    // The rendering is about as long as the body: one allocation, no
    // regrowth copies of a long prompt.
    let (h, text) = extract_into(body, cap, |_| Vec::with_capacity(cap.min(body.len() + 256)))?;
    Ok(Prompt {
        model: h.model,
        cache_salt: h.cache_salt,
        text,
        lead_bytes: h.lead_bytes,
        own_messages: h.own_messages,
    })
}

/// Parse a body and render at most `cap` bytes of its prompt into the
/// sink `make` builds from the body's model and salt.
pub fn extract_into<S: Sink>(
    body: &[u8],
    cap: usize,
    make: impl FnOnce(&Header) -> S,
) -> Result<(Header, S), ParseError> {
    let b = body::read(body)?;
    let mut header = Header {
        model: truncate_str(b.model.as_deref().unwrap_or(""), MAX_MODEL_BYTES).to_string(),
        cache_salt: b.cache_salt.as_deref().map(salt),
        lead_bytes: 0,
        own_messages: 0,
        responses: None,
    };
    let mut out = Render {
        sink: make(&header),
        len: 0,
        cap,
        preamble: false,
        lead: None,
        own: 0,
    };
    if let Some(messages) = &b.messages {
        render_tools(&mut out, b.tools, b.functions);
        if let Some(system) = &b.system {
            out.message("system", Some(system), None);
        }
        for m in messages {
            out.message(
                m.role.as_deref().unwrap_or(""),
                m.content.as_ref(),
                m.tool_calls,
            );
        }
    } else if let Some(p) = &b.prompt {
        render_prompt(&mut out, p);
    } else if b.input.is_some() || b.instructions.is_some() {
        render_responses(&mut out, &b);
    } else {
        return Err(ParseError::NoPrompt);
    }
    // Also beside `messages`, which a Responses API server ignores: the
    // response it stores must still be named.
    if b.input.is_some() || b.instructions.is_some() {
        header.responses = Some(Responses {
            previous: b.previous_response_id.as_deref().map(str::to_string),
            store: b.store,
            named: b.request_id,
        });
    }
    header.lead_bytes = out.lead.unwrap_or(0);
    header.own_messages = out.own;
    Ok((header, out.sink))
}

/// A Responses API body: tools, `instructions`, then `input` (a string,
/// or items whose arguments and outputs render as their own messages).
fn render_responses<S: Sink>(out: &mut Render<S>, b: &body::Body) {
    render_tools(out, b.tools, None);
    if let Some(i) = b.instructions {
        out.message("instructions", Some(&Content::Text(i)), None);
    }
    match &b.input {
        Some(InputField::Text(t)) => out.message("user", Some(&Content::Text(t)), None),
        Some(InputField::Items(items)) => {
            for it in items {
                let role = it.role.as_deref().or(it.kind.as_deref()).unwrap_or("");
                out.message(role, it.content.as_ref(), None);
                // A call is its function's name and its arguments.
                for extra in [it.name, it.arguments].into_iter().flatten() {
                    out.message(role, Some(&Content::Text(extra)), None);
                }
                if it.output.is_some() {
                    out.message(role, it.output.as_ref(), None);
                }
            }
        }
        None => {}
    }
}

fn render_prompt<S: Sink>(out: &mut Render<S>, p: &PromptField) {
    match p {
        PromptField::Text(t) => out.push(t),
        PromptField::Texts(ts) => {
            for (i, t) in ts.iter().enumerate() {
                if i > 0 {
                    out.push(b"\n");
                }
                out.push(t);
            }
        }
        PromptField::Tokens(ids) => out.tokens(ids),
        PromptField::TokenBatch(batch) => {
            for (i, ids) in batch.iter().enumerate() {
                if i > 0 {
                    out.push(b"\n");
                }
                out.tokens(ids);
            }
        }
    }
}

/// Tool definitions render first, verbatim: one agent framework sends
/// the same tools the same way every time, and the model server's chat
/// template renders them in the order sent too. Re-serialising them in a
/// canonical key order (a `Value` tree per request) was 140 of the 158 µs
/// a 22 KB agent turn took to parse and hash natively
/// (`examples/decision_cost.rs`, shape `agent`).
fn render_tools<S: Sink>(out: &mut Render<S>, tools: Option<&[u8]>, funcs: Option<&[u8]>) {
    for v in [tools, funcs].into_iter().flatten() {
        out.message("tools", Some(&Content::Text(v)), None);
    }
}

/// The renderer: writes the prompt to a sink, stopping at `cap` bytes.
struct Render<S> {
    sink: S,
    len: usize,
    cap: usize,
    /// A preamble message was rendered before any other.
    preamble: bool,
    /// Set at the first other message: where its content starts, if a
    /// preamble came before it (else 0).
    lead: Option<usize>,
    /// Messages rendered since then, that one included.
    own: u32,
}

impl<S: Sink> Render<S> {
    fn full(&self) -> bool {
        self.len >= self.cap
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = self.cap.saturating_sub(self.len);
        let take = bytes.len().min(room);
        self.sink.push(&bytes[..take]);
        self.len += take;
    }

    /// `pieces` one after another, as one push when they are short (the
    /// framing around a message): the hasher's cost is per push.
    fn push_all(&mut self, pieces: &[&[u8]]) {
        let mut buf = [0u8; 64];
        let mut n = 0;
        for p in pieces {
            match buf.get_mut(n..n + p.len()) {
                Some(dst) => dst.copy_from_slice(p),
                None => {
                    pieces.iter().for_each(|p| self.push(p));
                    return;
                }
            }
            n += p.len();
        }
        self.push(buf.get(..n).unwrap_or_default());
    }

    /// Token ids as decimal text, after a byte no JSON string holds raw:
    /// `[1, 2, 3]` is not the text prompt `"1 2 3"`.
    fn tokens(&mut self, ids: &[i64]) {
        self.push(b"\x1c");
        for (i, id) in ids.iter().enumerate() {
            if self.full() {
                return;
            }
            if i > 0 {
                self.push(b" ");
            }
            self.push(itoa::Buffer::new().format(*id).as_bytes());
        }
    }

    /// One chat message:
    /// `\x1e role \x1f role-length \x1f content [\x1f tool-calls] \x1f length`.
    /// The lengths come after what they measure, so the rendering reads
    /// back unambiguously from the end (no content can fake a message
    /// boundary), and two messages that start alike render alike up to
    /// where they differ: the same document followed by different
    /// questions shares the document's prefix, as in the model server's
    /// prompt. (A length before the content broke that: it differs with
    /// the question.) A conversation's rendering is a prefix of the same
    /// conversation with more turns.
    fn message(&mut self, role: &str, content: Option<&Content>, tool_calls: Option<&[u8]>) {
        if self.full() {
            return;
        }
        // Tool calls follow the text after a byte no JSON text holds raw
        // (else the text `ok[]` and the text `ok` with calls `[]` were one
        // prompt); the length after them covers both.
        let len = content_len(content) + tool_calls.map_or(0, |c| CALLS_MARK.len() + c.len());
        self.push_all(&[
            b"\x1e",
            role.as_bytes(),
            b"\x1f",
            itoa::Buffer::new().format(role.len()).as_bytes(),
            b"\x1f",
        ]);
        if self.lead.is_none() {
            if is_preamble(role) {
                self.preamble = true;
            } else {
                self.lead = Some(if self.preamble { self.len } else { 0 });
            }
        }
        if self.lead.is_some() {
            self.own = self.own.saturating_add(1);
        }
        match content {
            Some(Content::Text(t)) => self.push(t),
            Some(Content::Parts(parts)) => {
                for (i, p) in parts.iter().enumerate() {
                    if follows_text(parts, i) {
                        self.push(PART_BREAK);
                    }
                    match p {
                        Part::Text(t) => self.push(t),
                        Part::Other(digest) => {
                            self.push_all(&[b"\x1d", &digest.to_le_bytes()]);
                            self.push(&MEDIA_FILL);
                        }
                        Part::Mark(b) => self.push(mark(*b)),
                    }
                }
            }
            None => {}
        }
        if let Some(calls) = tool_calls {
            self.push(CALLS_MARK);
            self.push(calls);
        }
        self.push_all(&[b"\x1f", itoa::Buffer::new().format(len).as_bytes()]);
    }
}

/// Before an assistant's tool calls (see `Render::message`).
const CALLS_MARK: &[u8] = b"\x1f";

/// The salt as kept: a long one by a digest of all of it (cut short, two
/// tenants' salts that share their first 256 bytes shared their prefixes).
fn salt(s: &str) -> String {
    if s.len() <= MAX_MODEL_BYTES {
        return s.to_string();
    }
    format!(
        "xxh3-128:{:032x}",
        xxhash_rust::xxh3::xxh3_128(s.as_bytes())
    )
}

/// What an image, audio or file part weighs in the rendered prompt: its
/// digest, then filler up to about 512 tokens' worth of bytes (LLaVA's
/// 576 image tokens, Gemma 3's 256, Qwen2-VL's hundreds to thousands),
/// whatever its encoded size. The model server prefills those tokens and
/// caches them; nine bytes alone left a picture and its question under
/// one block, with no checkpoint, routed as if it had no prompt.
pub const MEDIA_BYTES: usize = 2048;
/// After the part's mark and its 8-byte digest.
const MEDIA_FILL: [u8; MEDIA_BYTES - 1 - 8] = [0; MEDIA_BYTES - 1 - 8];

/// Before an Anthropic tool block's name and input, or its result: bytes
/// no JSON text holds raw, so a tool's output is not the same text sent
/// as the user's.
fn mark(b: Block) -> &'static [u8] {
    match b {
        Block::ToolUse => b"\x1bu",
        Block::ToolResult => b"\x1br",
    }
}

/// Text parts that follow one another are joined by a line break, as the
/// model server joins them (vLLM's chat utils): `["Summarize.", "Be
/// brief."]` is not the prompt `"Summarize.Be brief."`. Spelled as a JSON
/// string spells it (`\n`), since text is hashed as the body spells it.
const PART_BREAK: &[u8] = br"\n";

fn follows_text(parts: &[Part], i: usize) -> bool {
    let text = |j: usize| matches!(parts.get(j), Some(Part::Text(_)));
    i > 0 && text(i) && text(i - 1)
}

fn content_len(c: Option<&Content>) -> usize {
    match c {
        Some(Content::Text(t)) => t.len(),
        Some(Content::Parts(parts)) => (parts.iter().enumerate())
            .map(|(i, p)| {
                usize::from(follows_text(parts, i)) * PART_BREAK.len()
                    + match p {
                        Part::Text(t) => t.len(),
                        Part::Other(_) => MEDIA_BYTES,
                        Part::Mark(b) => mark(*b).len(),
                    }
            })
            .sum(),
        None => 0,
    }
}

fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(body: &str) -> Vec<u8> {
        extract(body.as_bytes(), 1 << 20).unwrap().text
    }

    #[test]
    fn completions_prompt_forms() {
        assert_eq!(text(r#"{"model":"m","prompt":"hello"}"#), b"hello");
        assert_eq!(text(r#"{"prompt":["a","b"]}"#), b"a\nb");
        assert_eq!(text(r#"{"prompt":[1,22,333]}"#), b"\x1c1 22 333");
        assert_eq!(text(r#"{"prompt":[[1,2],[3]]}"#), b"\x1c1 2\n\x1c3");
        assert_eq!(text(r#"{"prompt":[]}"#), b"");
        // Text renders as the body spells it, escapes and all: the same
        // text sent the same way renders alike, and a quote inside can't
        // end the string early.
        assert_eq!(text(r#"{"prompt":"a\nb\u00e9"}"#), br"a\nb\u00e9");
        assert_eq!(text(r#"{"prompt":["a\"b\\"]}"#), br#"a\"b\\"#);
        assert_eq!(
            text(r#"{"messages":[{"role":"user","content":"x\u0041y"}]}"#),
            text(r#"{"messages":[{"role":"user","content":"x\u0041y"}]}"#)
        );
        // Two spellings of one text are two prompts (one client spells a
        // prompt one way every time; see `json` for why).
        assert_ne!(
            text(r#"{"messages":[{"role":"user","content":"x\u0041y"}]}"#),
            text(r#"{"messages":[{"role":"user","content":"xAy"}]}"#)
        );
        // Names are decoded: an escaped key or role is the same name.
        assert_eq!(
            text(r#"{"m\u0065ssages":[{"r\u006fle":"\u0075ser","content":"hi"}]}"#),
            text(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
        );
        assert_eq!(
            extract(br#"{"model":"ll\u0061ma","prompt":"x"}"#, 9)
                .unwrap()
                .model,
            "llama"
        );
        let p = extract(br#"{"model":"llama","prompt":"x","cache_salt":"s1"}"#, 10).unwrap();
        assert_eq!(p.model, "llama");
        assert_eq!(p.cache_salt.as_deref(), Some("s1"));
    }

    #[test]
    fn prompt_text_is_read_as_bytes_not_checked_for_utf8() {
        // Invalid UTF-8 and a lone surrogate are the model server's to
        // reject; the filter routes them by their bytes, not as no prompt.
        let mut body = br#"{"prompt":"a"#.to_vec();
        body.extend_from_slice(b"\xff\x01b\"}");
        assert_eq!(extract(&body, 100).unwrap().text, b"a\xff\x01b");
        assert_eq!(text(r#"{"prompt":"x\ud800"}"#), br"x\ud800");
        // Every text field renders its bytes as spelled.
        let chat = |s: &str| {
            text(&format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"{s}"}}]}}]}}"#
            ))
        };
        assert_eq!(chat(r"a\nb\u00e9"), b"\x1euser\x1f4\x1fa\\nb\\u00e9\x1f10");
        assert_eq!(
            text(r#"{"instructions":"s\ty","input":[{"type":"function_call","arguments":"{\"k\":1}"}]}"#),
            "\x1einstructions\x1f12\x1fs\\ty\x1f4\x1efunction_call\x1f13\x1f\x1f0\x1efunction_call\x1f13\x1f{\\\"k\\\":1}\x1f9"
                .as_bytes()
        );
        // Names stay strings: a model name that is no string is an error.
        assert!(extract(br#"{"model":5,"prompt":"x"}"#, 100).is_err());
    }

    #[test]
    fn generated_chat_bodies_render_their_text_as_spelled() {
        // Messages whose text strings escapes of every kind together
        // (backslash runs, escaped quotes before and after them, \u
        // escapes, raw UTF-8, brackets), fields in any order around
        // unknown fields of nested values, with whitespace between
        // tokens: the rendering is the framing around each text exactly
        // as the body spells it.
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = move |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let pieces = [
            "a", r#"\""#, r"\\", r#"\\\""#, r"\n", r"\u00e9", "é", " ", "{", "]", r"\/", ":",
        ];
        let junk = [
            r#""name":"x\"y""#,
            r#""extra" : {"a":[1, 2.5e3, {"b":"\"]\\"}], "c":null}"#,
            r#""n":-0.5"#,
        ];
        for _ in 0..500 {
            let (mut msgs, mut want) = (Vec::new(), Vec::new());
            for _ in 0..1 + next(4) {
                let text: String = (0..next(200)).map(|_| pieces[next(pieces.len())]).collect();
                let role = ["user", "assistant", "system"][next(3)];
                let mut fields = [
                    format!(r#""role":"{role}""#),
                    format!("\"content\" :\n \"{text}\""),
                    junk[next(junk.len())].to_string(),
                ];
                fields.rotate_left(next(3));
                msgs.push(format!("{{ {} }}", fields.join(" ,\t")));
                want.extend_from_slice(
                    format!("\x1e{role}\x1f{}\x1f{text}\x1f{}", role.len(), text.len()).as_bytes(),
                );
            }
            let body = format!(
                r#"{{"model":"m", "messages": [{}], "stream":true}}"#,
                msgs.join(",")
            );
            assert_eq!(text(&body), want, "{body}");
        }
    }

    #[test]
    fn the_lead_ends_where_the_first_message_after_the_preamble_begins() {
        let lead = |body: &str| {
            let p = extract(body.as_bytes(), 1 << 20).unwrap();
            (p.lead_bytes, p.text)
        };
        // Tools and a system message, then the user's own part.
        let (at, text) = lead(
            r#"{"tools":[{"type":"function"}],"messages":[{"role":"system","content":"rules"},{"role":"user","content":"my task"},{"role":"assistant","content":"ok"}]}"#,
        );
        assert!(text[at..].starts_with(b"my task\x1f7"), "{at}");
        let own = |body: &str| extract(body.as_bytes(), 1 << 20).unwrap().own_messages;
        assert_eq!(
            own(
                r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"assistant","content":"a"},{"role":"user","content":"v"}]}"#
            ),
            3
        );
        assert_eq!(
            own(r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}"#),
            1
        );
        assert_eq!(&text[at - 8..at], b"\x1euser\x1f4\x1f");
        // The same preamble gives the same lead whatever follows.
        let (other, _) = lead(
            r#"{"tools":[{"type":"function"}],"messages":[{"role":"system","content":"rules"},{"role":"user","content":"another task, longer"}]}"#,
        );
        assert_eq!(other, at);
        // Responses API: instructions are a preamble too.
        let (at, text) = lead(r#"{"instructions":"be brief","input":"hi there"}"#);
        assert!(text[at..].starts_with(b"hi there"));
        // No preamble, only a preamble, or no messages at all: no lead.
        for body in [
            r#"{"messages":[{"role":"user","content":"a"},{"role":"system","content":"b"}]}"#,
            r#"{"messages":[{"role":"system","content":"only rules"}]}"#,
            r#"{"prompt":"plain completion"}"#,
        ] {
            assert_eq!(lead(body).0, 0, "{body}");
        }
    }

    #[test]
    fn chat_renders_roles_lengths_and_text_parts() {
        let chat = |image: &str| {
            text(&format!(
                r#"{{"messages":[{{"role":"system","content":"be brief"}},
            {{"role":"user","content":[{{"type":"text","text":"hi"}},{image},{{"type":"text","text":"!"}}]}}]}}"#
            ))
        };
        let t = chat(r#"{"type":"image_url","image_url":{"url":"x"}}"#);
        let head = b"\x1esystem\x1f6\x1fbe brief\x1f8\x1euser\x1f4\x1fhi\x1d";
        let tail = [&MEDIA_FILL[..], b"!\x1f2051"].concat();
        assert!(t.starts_with(head) && t.ends_with(&tail), "{t:?}");
        assert_eq!(t.len(), head.len() + 8 + tail.len());
        // The 8 bytes between are the image's digest: another image is
        // another prompt; the same one spelled with other spacing or a
        // cache breakpoint is the same.
        let other = chat(r#"{"type":"image_url","image_url":{"url":"y"}}"#);
        assert_ne!(t, other);
        assert_eq!(t.len(), other.len());
        let same = chat(
            r#"{"type": "image_url", "cache_control": {"type": "ephemeral"}, "image_url": {"url":"x"}}"#,
        );
        assert_eq!(t, same);
    }

    #[test]
    fn an_image_is_part_of_the_prefix_by_its_digest() {
        let ask = |url: &str| {
            text(&format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}"}}}},{{"type":"text","text":"What is in this picture?"}}]}}]}}"#
            ))
        };
        let big = format!("data:image/png;base64,{}", "iVBORw0KGgo".repeat(50_000));
        let (a, b) = (ask(&big), ask(&format!("{big}A")));
        assert_ne!(a, b, "two images, one question: two prompts");
        assert_eq!(a, ask(&big), "the same image: the same prompt");
        // A digest and a fixed weight, not the bytes: a 550 KB image
        // renders as `MEDIA_BYTES`, so a picture and its question have
        // checkpoints, and weigh about what the server prefills.
        assert!(
            a.len() > MEDIA_BYTES && a.len() < MEDIA_BYTES + 100,
            "{}",
            a.len()
        );
        let cfg = crate::config::Config::parse(br#"{"endpoints":["10.0.0.1:80"]}"#).unwrap();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{big}"}}}},{{"type":"text","text":"What is in this picture?"}}]}}]}}"#
        );
        let (_, hashed) = crate::route::Hashed::parse(body.as_bytes(), &cfg).unwrap();
        assert_eq!(hashed.blocks() as usize, a.len() / cfg.block_bytes);
        // Responses API input items the same.
        let input = |url: &str| {
            text(&format!(
                r#"{{"input":[{{"role":"user","content":[{{"type":"input_image","image_url":"{url}"}},{{"type":"input_text","text":"Describe it."}}]}}]}}"#
            ))
        };
        assert_ne!(input("data:one"), input("data:two"));
    }

    /// An Anthropic Messages API body (`/v1/messages`).
    fn messages(system: &str, messages: &str) -> Vec<u8> {
        text(&format!(
            r#"{{"model":"m","max_tokens":64,"system":{system},"messages":{messages}}}"#
        ))
    }

    #[test]
    fn an_anthropic_system_prompt_renders_first_like_a_system_message() {
        let user = r#"[{"role":"user","content":"hi"}]"#;
        let chat = text(
            r#"{"messages":[{"role":"system","content":"rules"},{"role":"user","content":"hi"}]}"#,
        );
        assert_eq!(messages(r#""rules""#, user), chat);
        let blocks = r#"[{"type":"text","text":"rules","cache_control":{"type":"ephemeral"}}]"#;
        assert_eq!(messages(blocks, user), chat);
        // Review finding: `system` was skipped, so two agents with
        // different system prompts and the same first message were one
        // prompt, and the system prompt weighed nothing.
        assert_ne!(messages(r#""other rules""#, user), chat);
        // It opens the preamble: the lead is where the user's own part
        // starts.
        let body = r#"{"system":"rules","messages":[{"role":"user","content":"my task"}]}"#;
        let p = extract(body.as_bytes(), 1 << 20).unwrap();
        assert!(p.text[p.lead_bytes..].starts_with(b"my task"), "{p:?}");
        // A `system` of another type is not the Messages API's: skipped,
        // and the body still routes.
        assert_eq!(
            messages("{}", user),
            text(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
        );
    }

    /// Claude Code's turns: tools and system with their breakpoints, and
    /// one breakpoint on the newest message's last block, which moves on.
    #[test]
    fn an_agents_turn_is_a_prefix_of_its_next_one_though_its_breakpoint_moved() {
        const CC: &str = r#""cache_control":{"type":"ephemeral"}"#;
        let system = format!(r#"[{{"type":"text","text":"You are a coding agent.",{CC}}}]"#);
        let task = |cc: &str| {
            format!(
                r#"{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"iVBOR"}}{cc}}},{{"type":"text","text":"fix the bug"{cc}}}]}}"#
            )
        };
        let call = r#"{"role":"assistant","content":[{"type":"text","text":"Reading it."},{"type":"tool_use","id":"toolu_1","name":"read_file","input":{"path":"src/main.rs"}}]}"#;
        let result = |cc: &str| {
            format!(
                r#"{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"toolu_1","content":"fn main() {{}}"{cc}}}]}}"#
            )
        };
        let cc = format!(",{CC}");
        let turn1 = messages(&system, &format!("[{}]", task(&cc)));
        let turn2 = messages(&system, &format!("[{},{call},{}]", task(""), result(&cc)));
        let turn3 = messages(
            &system,
            &format!("[{},{call},{},{call}]", task(""), result("")),
        );
        assert!(
            turn2.starts_with(&turn1),
            "turn 1 is not a prefix of turn 2"
        );
        assert!(
            turn3.starts_with(&turn2),
            "turn 2 is not a prefix of turn 3"
        );
    }

    /// Claude Code (>= 2.1.29) opens `system` with an attribution block
    /// whose `cch` changes every request; vLLM drops it before the chat
    /// template, so the server's prompt is the same every turn.
    #[test]
    fn claude_codes_per_request_attribution_block_is_left_out() {
        let system = |cch: &str| {
            format!(
                r#"[{{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; cch={cch};"}},
                {{"type":"text","text":"You are Claude Code.","cache_control":{{"type":"ephemeral"}}}},
                {{"type":"text","text":"Working directory: /src/a"}}]"#
            )
        };
        let task = r#"[{"role":"user","content":"fix the bug"}]"#;
        let turn = messages(&system("65abc"), task);
        // Review finding: the block was rendered, so every turn of every
        // session diverged from the one before right after the tools.
        assert_eq!(turn, messages(&system("0aaa9"), task));
        assert_eq!(
            turn,
            messages(
                r#"[{"type":"text","text":"You are Claude Code."},{"type":"text","text":"Working directory: /src/a"}]"#,
                task
            )
        );
        // Only a system block: a user who pastes such a line sent it.
        let pasted = |cch: &str| {
            messages(
                r#""s""#,
                &format!(
                    r#"[{{"role":"user","content":[{{"type":"text","text":"x-anthropic-billing-header: cch={cch};"}}]}}]"#
                ),
            )
        };
        assert_ne!(pasted("1"), pasted("2"));
    }

    #[test]
    fn anthropic_tool_blocks_render_their_name_input_and_result() {
        let user = |blocks: &str| {
            messages(
                r#""s""#,
                &format!(r#"[{{"role":"user","content":{blocks}}}]"#),
            )
        };
        let output = "x".repeat(3000);
        let result = |content: &str| {
            user(&format!(
                r#"[{{"type":"tool_result","tool_use_id":"t","content":{content}}}]"#
            ))
        };
        // A tool's output weighs its length (a digest weighed 2 KiB).
        let long = result(&format!(r#""{output}""#));
        assert!(long.windows(3000).any(|w| w == output.as_bytes()));
        assert_ne!(long, result(&format!(r#""{output}y""#)));
        // Its content as a string or as text blocks is one prompt.
        assert_eq!(
            long,
            result(&format!(r#"[{{"type":"text","text":"{output}"}}]"#))
        );
        // A tool's output is not the user's text.
        assert_ne!(result(r#""ok""#), user(r#"[{"type":"text","text":"ok"}]"#));
        // A tool call: its name and its input as spelled.
        let call = |name: &str, path: &str| {
            user(&format!(
                r#"[{{"type":"tool_use","id":"toolu_9","name":"{name}","input":{{"path":"{path}"}}}}]"#
            ))
        };
        let a = call("read_file", "a.rs");
        assert!(a.windows(15).any(|w| w == br#"{"path":"a.rs"}"#));
        assert_ne!(a, call("read_file", "b.rs"));
        assert_ne!(a, call("write_file", "a.rs"));
        // Inside a result, parts are read one level deep: a result nested
        // in a result is a digest, not its text.
        let nested = result(r#"[{"type":"tool_result","content":"deep"}]"#);
        assert!(!nested.windows(4).any(|w| w == b"deep"));
        assert_ne!(
            nested,
            result(r#"[{"type":"tool_result","content":"other"}]"#)
        );
    }

    #[test]
    fn anthropic_tool_calls_count_against_the_bodys_budget() {
        let calls = |n: usize| {
            let call = r#"{"type":"tool_use","name":"f","input":{}}"#;
            let blocks = vec![call; n].join(",");
            format!(r#"{{"messages":[{{"role":"assistant","content":[{blocks}]}}]}}"#)
        };
        // Three parts each (mark, name, input): 21,845 fit the budget.
        let per_call = 3 * body::STRUCTURED;
        let fits = (body::KEPT_UNITS / per_call) as usize - 1;
        assert!(extract(calls(fits).as_bytes(), 1 << 24).is_ok());
        assert!(matches!(
            extract(calls(fits + 2).as_bytes(), 1 << 24),
            Err(ParseError::Json(_))
        ));
    }

    #[test]
    fn message_splits_hash_differently() {
        let one = text(r#"{"messages":[{"role":"user","content":"ab"}]}"#);
        let two =
            text(r#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#);
        assert_ne!(one, two);
        // Content can't forge a boundary: the lengths cover it.
        let forged =
            text(r#"{"messages":[{"role":"user","content":"a\u001f1\u001euser\u001f4\u001fb"}]}"#);
        assert_ne!(forged, two);
    }

    #[test]
    fn a_document_asked_two_questions_shares_its_prefix() {
        let ask = |q: &str| {
            text(&format!(
                r#"{{"messages":[{{"role":"system","content":"tools"}},{{"role":"user","content":"<doc>long document</doc> {q}"}}]}}"#
            ))
        };
        let (a, b) = (ask("Why?"), ask("And how exactly?"));
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let doc_end = a.windows(6).position(|w| w == b"</doc>").unwrap() + 6;
        assert!(
            shared > doc_end,
            "diverged at {shared}, document ends at {doc_end}"
        );
    }

    #[test]
    fn history_is_a_prefix_of_the_next_turn() {
        let t1 = text(r#"{"messages":[{"role":"user","content":"q1"}]}"#);
        let t2 = text(
            r#"{"messages":[{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#,
        );
        assert!(t2.starts_with(&t1));
    }

    #[test]
    fn tools_and_tool_calls_render_first_and_verbatim() {
        let tools = r#"[{"type":"function","function":{"name":"f","parameters":{"q":"\n"}}}]"#;
        let call = r#"[{"id":"c1","function":{"name":"f","arguments":"{\"q\":1}"}}]"#;
        let a = text(&format!(
            r#"{{"tools":{tools},"messages":[{{"role":"assistant","content":null,"tool_calls":{call}}}]}}"#
        ));
        // Wherever the field sits in the body, the tools render first.
        let b = text(&format!(
            r#"{{"messages":[{{"role":"assistant","tool_calls":{call},"content":null}}],"tools":{tools}}}"#
        ));
        assert_eq!(a, b);
        let want = format!(
            "\x1etools\x1f5\x1f{tools}\x1f{}\x1eassistant\x1f9\x1f\x1f{call}\x1f{}",
            tools.len(),
            call.len() + 1
        );
        assert_eq!(a, want.as_bytes());
        // `functions` (the older field) renders like `tools`; null is none.
        let f = text(&format!(r#"{{"functions":{tools},"messages":[]}}"#));
        assert!(f.starts_with(format!("\x1etools\x1f5\x1f{tools}").as_bytes()));
        assert!(text(r#"{"tools":null,"messages":[]}"#).is_empty());
        // Tools whose brackets don't balance, or whose strings don't
        // close, are a malformed body; the tokens between brackets are the
        // server's to check (the filter only needs where the tools end).
        assert!(extract(br#"{"tools":[{"a":1],"messages":[]}"#, 100).is_err());
        assert!(extract(br#"{"tools":[{"a":"}]"}"#, 100).is_err());
        assert_eq!(
            text(r#"{"tools":[1,,2],"messages":[]}"#),
            b"\x1etools\x1f5\x1f[1,,2]\x1f6"
        );
    }

    #[test]
    fn responses_api_instructions_then_input() {
        let t = text(r#"{"model":"m","instructions":"sys","input":"hello"}"#);
        assert_eq!(
            t,
            b"\x1einstructions\x1f12\x1fsys\x1f3\x1euser\x1f4\x1fhello\x1f5"
        );
        let t =
            text(r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"hey"}]}]}"#);
        assert_eq!(t, b"\x1euser\x1f4\x1fhey\x1f3");
    }

    #[test]
    fn store_is_read_as_the_servers_read_it() {
        let responses = |body: &[u8]| extract_into(body, 100, |_| Vec::new()).unwrap().0.responses;
        let store = |v: &str| {
            let body = format!(r#"{{"model":"m","input":"hi","store":{v}}}"#);
            responses(body.as_bytes()).unwrap().store
        };
        for yes in [
            "true",
            "1",
            "1.00",
            "1e0",
            "10e-1",
            r#""\u0074rue""#,
            r#""true""#,
            r#""Yes""#,
            r#""on""#,
            r#""1""#,
            r#""T""#,
        ] {
            assert!(store(yes), "{yes}");
        }
        for no in [
            "false",
            "null",
            "0",
            r#""false""#,
            r#""off""#,
            r#""no""#,
            r#""0""#,
            r#""""#,
            "2",
            "0.5",
            "{}",
            r#""maybe""#,
        ] {
            assert!(!store(no), "{no}");
        }
        let absent = responses(br#"{"model":"m","input":"hi"}"#).unwrap();
        assert!(absent.store, "the API's default");
        // `messages` beside `input`: rendered as chat, still a response.
        let both = br#"{"messages":[{"role":"user","content":"a"}],"input":"b","previous_response_id":"resp_1"}"#;
        let r = responses(both).unwrap();
        assert_eq!((r.previous.as_deref(), r.store), (Some("resp_1"), true));
        assert_eq!(
            responses(br#"{"messages":[{"role":"user","content":"a"}]}"#),
            None
        );
        // A prompt template reference beside the input: still a response.
        let template =
            br#"{"input":"hi","previous_response_id":"resp_1","prompt":{"id":"pmpt_1"}}"#;
        let r = responses(template).unwrap();
        assert_eq!(r.previous.as_deref(), Some("resp_1"));
    }

    #[test]
    fn cap_bounds_the_rendering() {
        let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(100_000));
        let p = extract(big.as_bytes(), 1000).unwrap();
        assert_eq!(p.text.len(), 1000);
        let toks = format!("{{\"prompt\":[{}]}}", vec!["12345"; 10_000].join(","));
        assert_eq!(extract(toks.as_bytes(), 100).unwrap().text.len(), 100);
    }

    #[test]
    fn bad_bodies_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"not json",
            b"[]",
            b"{}",
            b"{\"prompt\": 5}",
            b"{\"messages\": \"x\"}",
            b"{\"messages\": [5]}",
            // A prompt array is of one kind.
            b"{\"prompt\": [1, \"a\"]}",
            b"{\"prompt\": [\"a\", [1]]}",
            b"{\"prompt\": [[1], 2]}",
            b"{\"prompt\": [1.5]}",
            b"{\"prompt\": [18446744073709551615]}",
            b"{\"messages\": [{\"content\": 5}]}",
            b"{\"input\": 5}",
            b"{\"model\": 7, \"prompt\": \"x\"}",
            b"\xff\xfe",
        ] {
            assert!(
                extract(bad, 100).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Deep nesting where we parse is the wrong shape.
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let body = format!(r#"{{"prompt":{deep}}}"#);
        assert!(extract(body.as_bytes(), 100).is_err());
        // Deep nesting in a field we skip is walked without recursion, to
        // 1,024 levels (no model server parses deeper).
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let body = format!(r#"{{"prompt":"x","extra":{{"a":{}}}}}"#, deep(1023));
        assert_eq!(extract(body.as_bytes(), 100).unwrap().text, b"x");
        let body = format!(r#"{{"prompt":"x","extra":{}}}"#, deep(10_000));
        assert!(extract(body.as_bytes(), 100).is_err());
    }

    #[test]
    fn what_a_body_keeps_is_bounded_whatever_its_items() {
        use body::{KEPT_UNITS, STRUCTURED};
        let items = |n: u32, item: &str| vec![item; n as usize].join(",");
        let most = KEPT_UNITS / STRUCTURED;
        // Empty objects: three bytes each, a whole item each kept.
        for field in ["input", "messages"] {
            let ok = format!(r#"{{"{field}":[{}]}}"#, items(most, "{}"));
            assert!(extract(ok.as_bytes(), 100).is_ok(), "{field}");
            let over = format!(r#"{{"{field}":[{}]}}"#, items(most + 1, "{}"));
            let e = extract(over.as_bytes(), 100).unwrap_err();
            assert!(e.to_string().contains("fewer array items"), "{e}");
        }
        // Content parts count with their messages.
        let parts = format!(r#"{{"content":[{}]}}"#, items(most / 2, "{}"));
        let body = format!(r#"{{"messages":[{parts},{parts}]}}"#);
        assert!(extract(body.as_bytes(), 100).is_err());
        // A prompt of a million token ids (more than any context) is read.
        let toks = format!(r#"{{"prompt":[{}]}}"#, items(KEPT_UNITS, "7"));
        assert_eq!(extract(toks.as_bytes(), 4).unwrap().text, b"\x1c7 7");
        let toks = format!(r#"{{"prompt":[{}]}}"#, items(KEPT_UNITS + 1, "7"));
        assert!(extract(toks.as_bytes(), 4).is_err());
    }

    #[test]
    fn long_salts_are_kept_whole_by_their_digest() {
        let salted = |salt: &str| {
            let body = format!(r#"{{"model":"m","cache_salt":"{salt}","prompt":"x"}}"#);
            extract(body.as_bytes(), 10).unwrap().cache_salt.unwrap()
        };
        let long = "tenant-".repeat(100);
        let (a, b) = (salted(&format!("{long}a")), salted(&format!("{long}b")));
        assert_ne!(a, b);
        assert!(a.len() <= MAX_MODEL_BYTES);
        assert_eq!(salted("short"), "short");
    }

    #[test]
    fn long_model_names_are_cut_on_char_boundaries() {
        let body = format!(r#"{{"model":"{}","prompt":"x"}}"#, "é".repeat(200));
        let p = extract(body.as_bytes(), 10).unwrap();
        assert!(p.model.len() <= MAX_MODEL_BYTES);
        assert!(p.model.chars().all(|c| c == 'é'));
    }

    /// The model server joins a message's text parts with a line break:
    /// parts `"Summarize."`, `"Be brief."` are the prompt `"Summarize.\nBe
    /// brief."`, and one part is the plain string.
    #[test]
    fn text_parts_join_with_a_line_break() {
        let msg = |content: &str| {
            text(&format!(
                r#"{{"messages":[{{"role":"user","content":{content}}}]}}"#
            ))
        };
        let part = |t: &str| format!(r#"{{"type":"text","text":"{t}"}}"#);
        let two = msg(&format!("[{},{}]", part("Summarize."), part("Be brief.")));
        assert_eq!(two, msg(r#""Summarize.\nBe brief.""#));
        assert_ne!(two, msg(r#""Summarize.Be brief.""#));
        assert_eq!(msg(&format!("[{}]", part("Hi."))), msg(r#""Hi.""#));
    }

    /// A Responses function call renders with its function's name, and
    /// its output may be parts (text, images, files) as well as a string.
    #[test]
    fn responses_function_calls_keep_their_name_and_output_parts() {
        let call = |name: &str| {
            text(&format!(
                r#"{{"input":[{{"role":"user","content":"go"}},{{"type":"function_call","call_id":"c1","name":"{name}","arguments":"{{}}"}}]}}"#
            ))
        };
        assert_ne!(call("delete_all_files"), call("list_files"));
        let output = |o: &str| {
            text(&format!(
                r#"{{"input":[{{"role":"user","content":"weather?"}},{{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{{}}"}},{{"type":"function_call_output","call_id":"c1","output":{o}}}]}}"#
            ))
        };
        let parts = output(r#"[{"type":"input_text","text":"sunny"}]"#);
        assert_eq!(parts, output(r#""sunny""#));
        assert_ne!(parts, output(r#"[{"type":"input_text","text":"rain"}]"#));
    }

    /// Token ids are not their decimal text, and whole numbers written as
    /// floats (`1.0`, as Python's `json` writes a float list) are ids.
    #[test]
    fn token_ids_are_not_text_and_may_be_whole_floats() {
        assert_ne!(text(r#"{"prompt":[1,2,3]}"#), text(r#"{"prompt":"1 2 3"}"#));
        assert_ne!(
            text(r#"{"prompt":[[1,2],[3]]}"#),
            text(r#"{"prompt":["1 2","3"]}"#)
        );
        assert_eq!(
            text(r#"{"prompt":[1.0,2.00,3]}"#),
            text(r#"{"prompt":[1,2,3]}"#)
        );
        assert!(extract(br#"{"prompt":[1.5]}"#, 100).is_err());
        assert!(extract(br#"{"prompt":[1.5e0]}"#, 100).is_err());
    }

    /// A body that starts with a UTF-8 byte order mark is the same request
    /// (the servers' parser skips it); only at the start.
    #[test]
    fn a_byte_order_mark_is_skipped() {
        let plain = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let marked = [&b"\xEF\xBB\xBF"[..], plain.as_bytes()].concat();
        assert_eq!(
            extract(&marked, 1 << 20).map(|p| p.text).ok(),
            Some(extract(plain.as_bytes(), 1 << 20).unwrap().text)
        );
        assert!(extract(&marked[..2], 1 << 20).is_err());
        let inside = [&b" "[..], &marked].concat();
        assert!(extract(&inside, 1 << 20).is_err());
    }

    /// A whole number in exponent form is a token id too: the server reads
    /// it as a float (Python's `json`) and pydantic's lax int takes a float
    /// without a fraction, as `stores` already reads `1e0` as 1.
    #[test]
    fn token_ids_in_exponent_form_are_ids() {
        assert_eq!(
            text(r#"{"prompt":[1e0,2E+0,30e-1,1.0e3]}"#),
            text(r#"{"prompt":[1,2,3,1000]}"#)
        );
        assert_eq!(
            text(r#"{"prompt":[[5e1],[1]]}"#),
            text(r#"{"prompt":[[50],[1]]}"#)
        );
        for bad in ["[1e-1]", "[2.5e0]", "[1e400]", "[1e19]"] {
            let body = format!(r#"{{"prompt":{bad}}}"#);
            assert!(extract(body.as_bytes(), 100).is_err(), "{bad}");
        }
    }

    /// An assistant's tool calls can't pass for the end of its text: the
    /// text `ok[]` and the text `ok` with no calls (`[]`) are two prompts
    /// (the server renders no calls for `[]`).
    #[test]
    fn tool_calls_are_told_apart_from_text() {
        let a = text(r#"{"messages":[{"role":"assistant","content":"ok[]"}]}"#);
        let b = text(r#"{"messages":[{"role":"assistant","content":"ok","tool_calls":[]}]}"#);
        assert_ne!(a, b);
        let parts = text(
            r#"{"messages":[{"role":"assistant","content":[{"type":"text","text":"ok"}],"tool_calls":[]}]}"#,
        );
        assert_ne!(a, parts);
        // Still a prefix of the next turn.
        let t1 = text(r#"{"messages":[{"role":"assistant","content":"ok","tool_calls":[]}]}"#);
        let t2 = text(
            r#"{"messages":[{"role":"assistant","content":"ok","tool_calls":[]},{"role":"tool","content":"r"}]}"#,
        );
        assert!(t2.starts_with(&t1));
    }

    /// A key given twice counts the last time, `prompt` too: a template
    /// reference after a string prompt leaves no completions prompt, and
    /// the Responses input is what the request asks.
    #[test]
    fn a_later_prompt_template_replaces_an_earlier_prompt() {
        let body = |input: &str| {
            text(&format!(
                r#"{{"prompt":"x","input":"{input}","prompt":{{"id":"pmpt_1"}}}}"#
            ))
        };
        assert_ne!(body("first question"), body("second question"));
        assert_eq!(
            body("hi"),
            text(r#"{"input":"hi","prompt":{"id":"pmpt_1"}}"#)
        );
    }
}
