//! HTTP/1.1 keep-alive client: a pool of connections per target, one
//! streaming request per connection at a time, SSE parsed as it arrives.

use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

type Sender = SendRequest<Full<Bytes>>;

/// Idle keep-alive connections to one `host:port`.
pub struct Pool {
    pub addr: String,
    idle: Mutex<Vec<Sender>>,
}

impl Pool {
    pub fn new(addr: String) -> Self {
        Pool {
            addr,
            idle: Mutex::new(Vec::new()),
        }
    }

    async fn get(&self) -> Result<Sender, String> {
        loop {
            let cached = self.idle.lock().map_or(None, |mut v| v.pop());
            let Some(mut s) = cached else { break };
            if !s.is_closed() && s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake {}: {e}", self.addr))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    fn put(&self, s: Sender) {
        if !s.is_closed() {
            if let Ok(mut v) = self.idle.lock() {
                v.push(s);
            }
        }
    }
}

/// prefix-router's explanation of its pick (its `debug_header` option).
const DEBUG_HEADER: &str = "x-prefix-router-debug";

/// What one request measured, in real milliseconds from just before the
/// request was written.
#[derive(Default, Debug)]
pub struct Outcome {
    pub status: u16,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Gaps between consecutive token chunks.
    pub itl_ms: Vec<f64>,
    pub chunks: u32,
    pub served_by: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Generated text (kept for multi-turn history).
    pub text: String,
    /// The response's session-affinity token (`--affinity-header`), for
    /// the conversation's next turn.
    pub affinity: Option<String>,
    /// The value the response set for the affinity cookie
    /// (`--affinity-cookie`), for the client's jar.
    pub cookie: Option<String>,
    /// prefix-router's decision, when the filter runs with `debug_header`.
    pub decision: Option<String>,
    /// The Responses API's id of this response (to continue it).
    pub response_id: Option<String>,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    /// A failure after the headers: vLLM and the routers in front of it
    /// answer 200, then an `error` event, then `[DONE]`.
    #[serde(default)]
    error: Option<serde_json::Value>,
    /// The Responses API's events: their type, a text delta, the response.
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    delta: Option<serde_json::Value>,
    #[serde(default)]
    response: Option<Response>,
    /// The Messages API's `message_start`: the message, with its usage.
    #[serde(default)]
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    usage: Option<Usage>,
}

/// The response object of a Responses API event.
#[derive(Deserialize)]
struct Response {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    usage: Option<ResponseUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ResponseUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<Delta>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    /// The Messages API's: the prompt (vLLM counts all of it here;
    /// Anthropic's own API only the part not read from its cache), and
    /// the part read from the cache.
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
}

/// What a client takes back from a response for its next requests
/// (empty names: nothing).
#[derive(Debug, Clone, Default)]
pub struct Echo {
    /// The header carrying a session-affinity token.
    pub header: String,
    /// The cookie carrying the sessions' replicas.
    pub cookie: String,
}

/// The value a `set-cookie` gives cookie `name`, if it is that cookie.
fn cookie_value(set_cookie: &str, name: &str) -> Option<String> {
    let pair = set_cookie.split(';').next()?.trim();
    let (n, v) = pair.split_once('=')?;
    (n.trim() == name).then(|| v.trim().to_string())
}

/// Sends one streaming request and reads the SSE stream to its end.
pub async fn send(
    pool: &Pool,
    path: &str,
    body: Bytes,
    headers: &[(String, String)],
    echo: &Echo,
) -> Outcome {
    let mut out = Outcome::default();
    let mut sender = match pool.get().await {
        Ok(s) => s,
        Err(e) => {
            out.error = Some(e);
            return out;
        }
    };
    let mut req = Request::post(path)
        .header("host", &pool.addr)
        .header("content-type", "application/json")
        .header("accept", "text/event-stream");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = match req.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("bad request: {e}"));
            return out;
        }
    };
    let t0 = Instant::now();
    let resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("send: {e}"));
            return out;
        }
    };
    out.status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    out.served_by = header("x-served-by");
    if !echo.header.is_empty() {
        out.affinity = header(&echo.header);
    }
    if !echo.cookie.is_empty() {
        out.cookie = (resp.headers().get_all("set-cookie").iter())
            .filter_map(|v| v.to_str().ok())
            .find_map(|v| cookie_value(v, &echo.cookie));
    }
    out.decision = header(DEBUG_HEADER);
    let ok = resp.status().is_success();
    let mut body = resp.into_body();
    let mut sse = Sse::new(t0);
    let mut err_body = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                out.error = Some(format!("body: {e}"));
                break;
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if !ok {
            if err_body.len() < 512 {
                err_body.extend_from_slice(&data);
            }
            continue;
        }
        sse.feed(&data, Instant::now(), &mut out);
    }
    out.e2e_ms = Some(ms(t0.elapsed()));
    if !ok {
        let msg = String::from_utf8_lossy(&err_body);
        out.error = Some(format!("HTTP {}: {}", out.status, msg.trim()));
    } else if out.error.is_none() && !sse.done {
        out.error = Some("stream ended without [DONE] (or its API's last event)".into());
    }
    if out.error.is_none() {
        pool.put(sender);
    }
    out
}

/// The server-sent events of a streamed completion as they arrive: text
/// and usage into an `Outcome`; the arrival of the piece that completes
/// the first event with text, from `t0`, as the TTFT, and the gaps
/// between such events as inter-token latencies.
struct Sse {
    t0: Instant,
    buf: Vec<u8>,
    last: Option<Instant>,
    /// `data: [DONE]` was seen.
    done: bool,
}

impl Sse {
    fn new(t0: Instant) -> Self {
        Sse {
            t0,
            buf: Vec::new(),
            last: None,
            done: false,
        }
    }

    /// A piece of the body, received at `now`; events may span pieces.
    fn feed(&mut self, data: &[u8], now: Instant, out: &mut Outcome) {
        // Events end with a blank line, and SSE lines may end in CRLF (a
        // proxy or server that writes them would otherwise never end an
        // event, and every request read as cut short). A CR never occurs
        // raw inside a JSON payload.
        self.buf.extend(data.iter().filter(|&&b| b != b'\r'));
        while let Some(end) = find(&self.buf, b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            for line in event.split(|&b| b == b'\n') {
                if let Some(payload) = line.strip_prefix(b"data:") {
                    self.data(payload.trim_ascii(), now, out);
                }
            }
        }
    }

    fn data(&mut self, payload: &[u8], now: Instant, out: &mut Outcome) {
        if payload == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(payload) else {
            return;
        };
        if let Some(e) = chunk.error {
            out.error.get_or_insert_with(|| format!("error event: {e}"));
        }
        let piece: String = match chunk.kind.as_deref() {
            Some(kind) if kind == "error" || kind.starts_with("response.") => {
                self.response_event(kind, chunk.delta, chunk.response, payload, out)
            }
            Some(kind) if MESSAGE_EVENTS.contains(&kind) => {
                let usage = chunk.message.and_then(|m| m.usage).or(chunk.usage);
                self.message_event(kind, chunk.delta, usage, out)
            }
            _ => {
                if let Some(u) = chunk.usage {
                    out.prompt_tokens = Some(u.prompt_tokens);
                    out.cached_tokens = u.prompt_tokens_details.map(|d| d.cached_tokens);
                }
                (chunk.choices.into_iter())
                    .filter_map(|c| c.text.or(c.delta.and_then(|d| d.content)))
                    .collect()
            }
        };
        if piece.is_empty() {
            return;
        }
        out.chunks += 1;
        out.text.push_str(&piece);
        match self.last {
            None => out.ttft_ms = Some(ms(now - self.t0)),
            Some(prev) => out.itl_ms.push(ms(now - prev)),
        }
        self.last = Some(now);
    }
}

impl Sse {
    /// A Responses API event: its text, if a delta. The stream ends with
    /// `response.completed`, or `response.incomplete` (cut at
    /// `max_output_tokens`, as OpenAI's servers end the bench's short
    /// answers); no `[DONE]`. `failed` and `error` are failures.
    fn response_event(
        &mut self,
        kind: &str,
        delta: Option<serde_json::Value>,
        response: Option<Response>,
        payload: &[u8],
        out: &mut Outcome,
    ) -> String {
        if let Some(r) = response {
            out.response_id = r.id.or(out.response_id.take());
            if let Some(u) = r.usage {
                out.prompt_tokens = Some(u.input_tokens);
                out.cached_tokens = u.input_tokens_details.map(|d| d.cached_tokens);
            }
            if let Some(e) = r.error.filter(|e| !e.is_null()) {
                out.error.get_or_insert_with(|| format!("{kind}: {e}"));
            }
        }
        match kind {
            "response.output_text.delta" => {
                return delta
                    .and_then(|d| d.as_str().map(str::to_string))
                    .unwrap_or_default();
            }
            "response.completed" | "response.incomplete" => self.done = true,
            "response.failed" | "error" => {
                let what = String::from_utf8_lossy(&payload[..payload.len().min(300)]).into_owned();
                out.error
                    .get_or_insert_with(|| format!("{kind} event: {what}"));
            }
            _ => {}
        }
        String::new()
    }
}

/// The Messages API's event types (`error` is handled with the
/// Responses API's, the same shape).
const MESSAGE_EVENTS: [&str; 7] = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
];

impl Sse {
    /// A Messages API event: its text, if a `text_delta`. The prompt and
    /// cached tokens come from `message_start` and then `message_delta`
    /// (the later wins; `input_tokens` taken as the whole prompt, as vLLM
    /// reports it); the stream ends with `message_stop`, no `[DONE]`.
    fn message_event(
        &mut self,
        kind: &str,
        delta: Option<serde_json::Value>,
        usage: Option<Usage>,
        out: &mut Outcome,
    ) -> String {
        if let Some(u) = usage {
            if let Some(n) = u.input_tokens {
                out.prompt_tokens = Some(n);
            }
            if let Some(n) = u.cache_read_input_tokens {
                out.cached_tokens = Some(n);
            }
        }
        match kind {
            "content_block_delta" => delta
                .filter(|d| d["type"] == "text_delta")
                .and_then(|d| d["text"].as_str().map(str::to_string))
                .unwrap_or_default(),
            "message_stop" => {
                self.done = true;
                String::new()
            }
            _ => String::new(),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// POST a JSON body and return the JSON answer (used for /tokenize).
pub async fn post_json(pool: &Pool, path: &str, body: Bytes) -> Result<serde_json::Value, String> {
    let mut sender = pool.get().await?;
    let req = Request::post(path)
        .header("host", &pool.addr)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    pool.put(sender);
    if !status.is_success() {
        return Err(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("bad JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn events_split_across_pieces_give_text_ttft_gaps_and_usage() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n",
            at(40),
            &mut out,
        );
        assert_eq!(out.chunks, 0, "an event counts once its blank line is in");
        sse.feed(
            b"\n: keep-alive\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            at(50),
            &mut out,
        );
        sse.feed(
            b"data: {\"choices\":[{\"text\":\"lo\"}]}\n\ndata: {\"choices\":[],",
            at(75),
            &mut out,
        );
        sse.feed(
            b"\"usage\":{\"prompt_tokens\":900,\"prompt_tokens_details\":{\"cached_tokens\":640}}}\n\ndata: [DONE]\n\n",
            at(90),
            &mut out,
        );
        assert_eq!(out.text, "Hello");
        assert_eq!(
            out.chunks, 2,
            "the role-only delta and the usage carry no text"
        );
        assert_eq!(
            out.ttft_ms,
            Some(50.0),
            "the first text's event completed at 50 ms"
        );
        assert_eq!(out.itl_ms, vec![25.0]);
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens),
            (Some(900), Some(640))
        );
        assert!(sse.done);
    }

    #[test]
    fn events_with_crlf_line_ends_are_read() {
        let t0 = Instant::now();
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r\n\r",
            t0 + Duration::from_millis(30),
            &mut out,
        );
        sse.feed(b"\ndata: [DONE]\r\n\r\n", t0, &mut out);
        assert_eq!(out.text, "Hi");
        assert_eq!(
            out.ttft_ms,
            Some(0.0),
            "the event completed with its last byte"
        );
        assert!(sse.done);
    }

    #[test]
    fn responses_events_give_the_id_text_ttft_usage_and_the_end() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
            at(5),
            &mut out,
        );
        assert_eq!(
            (out.response_id.as_deref(), out.ttft_ms),
            (Some("resp_1"), None)
        );
        sse.feed(
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n\
              data: {\"type\":\"response.output_text.delta\",\"delta\":\" there\"}\n\n",
            at(30),
            &mut out,
        );
        assert!(!sse.done);
        sse.feed(
            b"data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":700,\"input_tokens_details\":{\"cached_tokens\":512}}}}\n\n",
            at(40),
            &mut out,
        );
        assert_eq!(out.text, "Hi there");
        assert_eq!((out.chunks, out.ttft_ms), (2, Some(30.0)));
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens),
            (Some(700), Some(512))
        );
        assert!(sse.done && out.error.is_none());

        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"data: {\"type\":\"response.failed\",\"response\":{\"id\":\"resp_2\",\"error\":{\"code\":\"server_error\"}}}\n\n",
            at(5),
            &mut out,
        );
        assert!(
            out.error
                .as_deref()
                .is_some_and(|e| e.contains("server_error")),
            "{out:?}"
        );
        assert!(!sse.done);

        // Cut at max_output_tokens: a complete answer.
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"data: {\"type\":\"response.incomplete\",\"response\":{\"id\":\"resp_3\",\"status\":\"incomplete\"}}\n\n",
            at(5),
            &mut out,
        );
        assert!(sse.done && out.error.is_none(), "{out:?}");
        assert_eq!(out.response_id.as_deref(), Some("resp_3"));
    }

    #[test]
    fn messages_events_give_the_text_ttft_usage_and_the_end() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"content\":[],\"usage\":{\"input_tokens\":700,\"output_tokens\":0}}}\n\n\
              event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
              event: ping\ndata: {\"type\": \"ping\"}\n\n",
            at(5),
            &mut out,
        );
        assert_eq!(
            (out.prompt_tokens, out.ttft_ms, out.chunks),
            (Some(700), None, 0)
        );
        // A thinking delta is no text; the first text delta is the TTFT.
        sse.feed(
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hm\"}}\n\n\
              event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n",
            at(20),
            &mut out,
        );
        assert_eq!(out.ttft_ms, None, "the event isn't complete yet");
        sse.feed(b"\n", at(30), &mut out);
        sse.feed(
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" there\"}}\n\n\
              event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
              event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":700,\"output_tokens\":2,\"cache_read_input_tokens\":512}}\n\n",
            at(45),
            &mut out,
        );
        assert_eq!(out.text, "Hi there");
        assert_eq!((out.chunks, out.ttft_ms), (2, Some(30.0)));
        assert_eq!(out.itl_ms, vec![15.0]);
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens),
            (Some(700), Some(512))
        );
        assert!(!sse.done, "not before message_stop");
        sse.feed(
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            at(50),
            &mut out,
        );
        assert!(sse.done && out.error.is_none(), "{out:?}");

        // An error event (Anthropic's shape) fails the request.
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
            at(5),
            &mut out,
        );
        assert!(
            out.error
                .as_deref()
                .is_some_and(|e| e.contains("overloaded_error")),
            "{out:?}"
        );
        assert!(!sse.done);
    }

    #[test]
    fn the_affinity_cookie_is_picked_out_of_the_set_cookies() {
        assert_eq!(
            cookie_value("pr=abc; Max-Age=60; Path=/; HttpOnly", "pr").as_deref(),
            Some("abc")
        );
        assert_eq!(cookie_value("upstream=1; Path=/", "pr"), None);
        assert_eq!(cookie_value("prx=1", "pr"), None);
        assert_eq!(cookie_value("no pair", "pr"), None);
    }

    /// A stream that fails after its headers (200, an `error` event,
    /// `[DONE]`) is an error, not a success without a first token.
    #[tokio::test]
    async fn a_200_stream_with_an_error_event_is_an_error() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; 65536];
            let _ = s.read(&mut buf);
            let body = "data: {\"error\":{\"message\":\"upstream reset\",\"code\":502}}\n\ndata: [DONE]\n\n";
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(resp.as_bytes()).unwrap();
        });
        let pool = Pool::new(addr);
        let out = send(
            &pool,
            "/v1/completions",
            Bytes::from_static(b"{}"),
            &[],
            &Echo::default(),
        )
        .await;
        assert_eq!((out.status, out.chunks, out.ttft_ms), (200, 0, None));
        assert!(
            out.error
                .as_deref()
                .is_some_and(|e| e.contains("upstream reset")),
            "{out:?}"
        );
    }

    #[test]
    fn a_stream_without_done_or_with_bad_json_is_not_done() {
        let t0 = Instant::now();
        let mut out = Outcome::default();
        let mut sse = Sse::new(t0);
        sse.feed(
            b"data: {not json\n\ndata: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            t0,
            &mut out,
        );
        assert_eq!(out.text, "a");
        assert!(!sse.done);
    }
}
