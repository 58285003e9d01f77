//! The fields of an OpenAI-style body that routing reads, walked with the
//! [`Reader`]; every other field is skipped. Prompt text stays as the body
//! spells it (see `json`); names (`model`, `role`) are decoded.
//!
//! The shapes follow the OpenAI API (and the Anthropic Messages API's
//! `system` and tool blocks): a field may be a string or an array
//! (`prompt`, `content`, `input`), `null` is the same as absent, a key
//! given twice counts the last time (as the model server's JSON parser
//! does), and a value of the wrong type makes the body an error (it is
//! routed by load alone).

use std::borrow::Cow;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::json::{JsonError, Reader};

/// Prompt text as the body spells it (escapes kept).
pub(super) type Text<'a> = &'a [u8];

#[derive(Default)]
pub(super) struct Body<'a> {
    pub model: Option<Cow<'a, str>>,
    pub cache_salt: Option<Cow<'a, str>>,
    pub prompt: Option<PromptField<'a>>,
    pub messages: Option<Vec<Message<'a>>>,
    /// Tool definitions (and the older `functions`), as spelled.
    pub tools: Option<&'a [u8]>,
    pub functions: Option<&'a [u8]>,
    pub instructions: Option<Text<'a>>,
    /// The Anthropic Messages API's system prompt, beside `messages`.
    pub system: Option<Content<'a>>,
    pub input: Option<InputField<'a>>,
    /// The Responses API's stored response this one continues.
    pub previous_response_id: Option<Cow<'a, str>>,
    /// `store` is not `false` (the Responses API's default is to store).
    pub store: bool,
    /// The body has a `request_id` (any value, `null` too): the client
    /// named the request itself, or a name put first would lose to it.
    pub request_id: bool,
}

/// A completions `prompt`: a string, strings, token ids, or batches of
/// token ids (an array of one kind only).
pub(super) enum PromptField<'a> {
    Text(Text<'a>),
    Texts(Vec<Text<'a>>),
    Tokens(Vec<i64>),
    TokenBatch(Vec<Vec<i64>>),
}

pub(super) struct Message<'a> {
    pub role: Option<Cow<'a, str>>,
    pub content: Option<Content<'a>>,
    /// An assistant's tool calls, as spelled.
    pub tool_calls: Option<&'a [u8]>,
}

pub(super) enum Content<'a> {
    Text(Text<'a>),
    Parts(Vec<Part<'a>>),
}

/// A content part: its text, or for one without (an image, audio, a
/// file) a digest of the part as spelled. The model server's cache for a
/// prompt holds the image's tokens too: left out, two requests that
/// differ only in their image read as one prefix, and the second was
/// credited to the first one's replica in full. A digest, not the bytes:
/// a base64 image would count as tens of thousands of blocks of prefill,
/// where the server spends a few thousand tokens on it.
///
/// The Anthropic Messages API's tool blocks render as what the server
/// renders of them after a [`Block`] mark: a `tool_use` its name and its
/// `input` as spelled, a `tool_result` its content (a digest stood for
/// kilobytes of tool output as one image's worth of prefill). Its
/// `cache_control` is left out of every part: Claude Code moves that
/// breakpoint to the newest message each turn, and the prefix is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part<'a> {
    Text(Text<'a>),
    Other(u64),
    Mark(Block),
}

/// Where an Anthropic tool block starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Block {
    ToolUse,
    ToolResult,
}

/// The Responses API's `input`.
pub(super) enum InputField<'a> {
    Text(Text<'a>),
    Items(Vec<InputItem<'a>>),
}

pub(super) struct InputItem<'a> {
    pub role: Option<Cow<'a, str>>,
    pub kind: Option<Cow<'a, str>>,
    pub content: Option<Content<'a>>,
    /// A function call's name.
    pub name: Option<Text<'a>>,
    pub arguments: Option<Text<'a>>,
    /// A function call's output: a string, or parts (text, images, files).
    pub output: Option<Content<'a>>,
}

/// What one body's lists may hold, in units: a message, input item or
/// content part costs [`STRUCTURED`], a prompt element or token id one.
/// So at most 65,536 of the former (3.4 MB on wasm32) or 1,048,576 token
/// ids (more than any context window; 16 MB). A body over it is a parse
/// error (routed by load alone, like any other), where a 16 MiB body of
/// `{},` grew a worker's memory by 650 MB.
pub(super) const KEPT_UNITS: u32 = 1 << 20;

/// A structured list item's units: its size on wasm32 (32-52 bytes) over
/// a token id's (16).
pub(super) const STRUCTURED: u32 = 16;

/// Reads a whole body.
pub(super) fn read(body: &[u8]) -> Result<Body<'_>, JsonError> {
    // A UTF-8 byte order mark: the servers' parser (Python's `json` on
    // bytes) skips it, so the request is theirs to serve and ours to route.
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let mut r = Reader::with_budget(body, KEPT_UNITS);
    let mut b = Body {
        store: true,
        ..Body::default()
    };
    r.object(|r, key| {
        match &*key.key(r.at())? {
            b"model" => b.model = nullable(r, name)?,
            b"cache_salt" => b.cache_salt = nullable(r, name)?,
            // An object is the Responses API's prompt template reference
            // (`{"id": "pmpt_..."}`), not text to route by.
            b"prompt" if r.peek() == Some(b'{') => {
                r.skip()?;
                // The last `prompt` counts: a string one before it is gone.
                b.prompt = None;
            }
            b"prompt" => b.prompt = nullable(r, prompt)?,
            b"messages" => b.messages = nullable(r, |r| list(r, STRUCTURED, message))?,
            b"tools" => b.tools = nullable(r, Reader::skip)?,
            b"functions" => b.functions = nullable(r, Reader::skip)?,
            b"instructions" => b.instructions = nullable(r, text)?,
            // Anthropic's `system`: a string or text blocks. Another type
            // is no system prompt of that API's, and no reason to give up
            // routing an OpenAI body that happens to carry it.
            b"system" => b.system = lenient_content(r)?.map(without_attribution),
            b"input" => b.input = nullable(r, input)?,
            b"previous_response_id" => b.previous_response_id = lenient_name(r)?,
            b"store" => b.store = stores(r)?,
            // Any `request_id` member, `null` too: a name the filter puts
            // first loses to it (the server's parser keeps the last).
            b"request_id" => {
                r.skip()?;
                b.request_id = true;
            }
            _ => {
                r.skip()?;
            }
        }
        Ok(())
    })?;
    r.end()?;
    Ok(b)
}

/// Whether a `store` value stores the response. vLLM and SGLang store on
/// `true` only, read by pydantic's lax booleans: a number equal to 1
/// (`1`, `1.0`, `1e0`) and the strings "true", "yes", "on", "1", "t", "y"
/// in any case (escapes decoded) are true; `null`, `false` and its
/// spellings are not, and anything else the server refuses. Naming a
/// response that isn't stored misplaces nothing (no follow-up can find
/// it) but counts it as named and binds its session's start; not naming
/// one that is loses its follow-ups.
fn stores(r: &mut Reader<'_>) -> Result<bool, JsonError> {
    const TRUE: [&str; 6] = ["true", "yes", "on", "1", "t", "y"];
    let at = r.at();
    if let Ok(s) = r.string() {
        let word = s.name(at).ok();
        return Ok(word.is_some_and(|w| TRUE.iter().any(|t| t.eq_ignore_ascii_case(&w))));
    }
    let raw = r.skip()?;
    let one = || std::str::from_utf8(raw).ok()?.parse::<f64>().ok();
    Ok(raw == b"true" || one() == Some(1.0))
}

/// `null` as `None`, else the value `f` reads.
fn nullable<'a, T>(
    r: &mut Reader<'a>,
    f: impl FnOnce(&mut Reader<'a>) -> Result<T, JsonError>,
) -> Result<Option<T>, JsonError> {
    if r.null()? {
        return Ok(None);
    }
    f(r).map(Some)
}

/// An array's items as `f` reads them, each worth `units` of the body's
/// budget.
fn list<'a, T>(
    r: &mut Reader<'a>,
    units: u32,
    mut f: impl FnMut(&mut Reader<'a>) -> Result<T, JsonError>,
) -> Result<Vec<T>, JsonError> {
    let mut out = Vec::new();
    r.array(|r| {
        r.keep(units)?;
        out.push(f(r)?);
        Ok(())
    })?;
    Ok(out)
}

fn name<'a>(r: &mut Reader<'a>) -> Result<Cow<'a, str>, JsonError> {
    let at = r.at();
    r.string()?.name(at)
}

/// A string's decoded value; any other value is skipped as absent (a field
/// routing only follows: its wrong type is the server's to refuse).
fn lenient_name<'a>(r: &mut Reader<'a>) -> Result<Option<Cow<'a, str>>, JsonError> {
    let at = r.at();
    match r.string() {
        Ok(s) => Ok(s.name(at).ok()),
        Err(_) => r.skip().map(|_| None),
    }
}

fn text<'a>(r: &mut Reader<'a>) -> Result<Text<'a>, JsonError> {
    Ok(r.string()?.raw())
}

fn message<'a>(r: &mut Reader<'a>) -> Result<Message<'a>, JsonError> {
    let mut m = Message {
        role: None,
        content: None,
        tool_calls: None,
    };
    r.object(|r, key| {
        match &*key.key(r.at())? {
            b"role" => m.role = nullable(r, name)?,
            b"content" => m.content = nullable(r, content)?,
            b"tool_calls" => m.tool_calls = nullable(r, Reader::skip)?,
            _ => {
                r.skip()?;
            }
        }
        Ok(())
    })?;
    Ok(m)
}

fn content<'a>(r: &mut Reader<'a>) -> Result<Content<'a>, JsonError> {
    match r.peek() {
        Some(b'"') => text(r).map(Content::Text),
        Some(b'[') => parts(r, true).map(Content::Parts),
        _ => Err(r.error("a string or an array of content parts")),
    }
}

/// Content, or `None` (skipped) for a value of another type.
fn lenient_content<'a>(r: &mut Reader<'a>) -> Result<Option<Content<'a>>, JsonError> {
    match r.peek() {
        Some(b'"' | b'[') => content(r).map(Some),
        _ => r.skip().map(|_| None),
    }
}

/// The start of Claude Code's attribution block (>= 2.1.29, the first of
/// its `system` blocks: `x-anthropic-billing-header: cc_version=...;
/// cc_entrypoint=cli; cch=...;`), whose `cch` changes every request.
const ATTRIBUTION: &[u8] = b"x-anthropic-billing-header";

/// `system` without Claude Code's attribution block: vLLM drops a text
/// block that starts so before the chat template (as replica-sim does),
/// so the server's prompt is the same every turn. Rendered, it made every
/// turn of every session a new prompt right after the tools.
fn without_attribution(c: Content<'_>) -> Content<'_> {
    match c {
        Content::Parts(mut parts) => {
            parts.retain(|p| !matches!(p, Part::Text(t) if t.starts_with(ATTRIBUTION)));
            Content::Parts(parts)
        }
        text => text,
    }
}

/// An array of content parts, flat: a tool result's own parts follow its
/// mark. `outer` is false inside a tool result, whose parts are read no
/// deeper (a `content` there is digested like any other member).
fn parts<'a>(r: &mut Reader<'a>, outer: bool) -> Result<Vec<Part<'a>>, JsonError> {
    let mut out = Vec::new();
    r.array(|r| {
        r.keep(STRUCTURED)?;
        part(r, outer, &mut out)
    })?;
    Ok(out)
}

/// One content part into `out`: its text; a tool block's mark and what
/// it renders; else a digest of its members but `cache_control`.
fn part<'a>(r: &mut Reader<'a>, outer: bool, out: &mut Vec<Part<'a>>) -> Result<(), JsonError> {
    let mut t = None;
    let mut name = None;
    let mut input = None;
    let mut nested = None;
    let mut digest = 0u64;
    r.object(|r, key| {
        let key = key.key(r.at())?;
        match &*key {
            b"text" => t = nullable(r, text)?,
            b"input" => input = Some(r.skip()?),
            b"content" if outer && matches!(r.peek(), Some(b'"' | b'[')) => {
                nested = Some(match r.peek() {
                    Some(b'"') => vec![Part::Text(text(r)?)],
                    _ => parts(r, false)?,
                });
            }
            b"cache_control" => {
                r.skip()?;
            }
            // Any other member is digested, key and value in order: the
            // part as spelled but for its cache breakpoint. (A part with
            // text, input or content is rendered by those instead, so
            // they are not hashed twice.)
            _ => {
                let at = r.at();
                if *key == *b"name" && r.peek() == Some(b'"') {
                    name = Some(text(r)?);
                } else {
                    r.skip()?;
                }
                digest = xxh3_64_with_seed(r.since(at).trim_ascii(), digest ^ xxh3_64(&key));
            }
        }
        Ok(())
    })?;
    if let Some(t) = t {
        out.push(Part::Text(t));
    } else if let Some(input) = input {
        r.keep(2 * STRUCTURED)?;
        out.push(Part::Mark(Block::ToolUse));
        out.extend(name.map(Part::Text));
        out.push(Part::Text(input));
    } else if let Some(nested) = nested {
        r.keep(STRUCTURED)?;
        out.push(Part::Mark(Block::ToolResult));
        out.extend(nested);
    } else {
        out.push(Part::Other(digest));
    }
    Ok(())
}

fn input<'a>(r: &mut Reader<'a>) -> Result<InputField<'a>, JsonError> {
    match r.peek() {
        Some(b'"') => text(r).map(InputField::Text),
        Some(b'[') => list(r, STRUCTURED, input_item).map(InputField::Items),
        _ => Err(r.error("a string or an array of input items")),
    }
}

fn input_item<'a>(r: &mut Reader<'a>) -> Result<InputItem<'a>, JsonError> {
    let mut it = InputItem {
        role: None,
        kind: None,
        content: None,
        name: None,
        arguments: None,
        output: None,
    };
    r.object(|r, key| {
        match &*key.key(r.at())? {
            b"role" => it.role = nullable(r, name)?,
            b"type" => it.kind = nullable(r, name)?,
            b"content" => it.content = nullable(r, content)?,
            b"name" => it.name = nullable(r, text)?,
            b"arguments" => it.arguments = nullable(r, text)?,
            b"output" => it.output = nullable(r, content)?,
            _ => {
                r.skip()?;
            }
        }
        Ok(())
    })?;
    Ok(it)
}

/// One element of a completions `prompt` array.
enum Element<'a> {
    Text(Text<'a>),
    Token(i64),
    Tokens(Vec<i64>),
}

fn prompt<'a>(r: &mut Reader<'a>) -> Result<PromptField<'a>, JsonError> {
    match r.peek() {
        Some(b'"') => text(r).map(PromptField::Text),
        Some(b'[') => {
            let at = r.at();
            let items = list(r, 1, element)?;
            of_one_kind(items).ok_or(JsonError {
                at,
                expected: "a prompt array of one kind",
            })
        }
        _ => Err(r.error("a string, an array of strings, token ids or token id arrays")),
    }
}

fn element<'a>(r: &mut Reader<'a>) -> Result<Element<'a>, JsonError> {
    match r.peek() {
        Some(b'"') => text(r).map(Element::Text),
        Some(b'[') => list(r, 1, Reader::int).map(Element::Tokens),
        _ => r.int().map(Element::Token),
    }
}

fn of_one_kind(items: Vec<Element<'_>>) -> Option<PromptField<'_>> {
    match items.first() {
        None | Some(Element::Text(_)) => all(items, |e| match e {
            Element::Text(t) => Some(t),
            _ => None,
        })
        .map(PromptField::Texts),
        Some(Element::Token(_)) => all(items, |e| match e {
            Element::Token(t) => Some(t),
            _ => None,
        })
        .map(PromptField::Tokens),
        Some(Element::Tokens(_)) => all(items, |e| match e {
            Element::Tokens(t) => Some(t),
            _ => None,
        })
        .map(PromptField::TokenBatch),
    }
}

/// Every element unwrapped by `f`, or `None` if one is of another kind.
fn all<'a, T>(items: Vec<Element<'a>>, f: impl Fn(Element<'a>) -> Option<T>) -> Option<Vec<T>> {
    items.into_iter().map(f).collect()
}
