//! HTTP surface of one replica: OpenAI-compatible inference, the Anthropic
//! Messages API, vLLM's tokenizer/render endpoints, metrics, and
//! admin/fault endpoints.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::engine::{Event, Submission, Usage};
use crate::fault::{Fault, Mode};
use crate::hash::chain_hashes;
use crate::messages;
use crate::metrics_fault::{self, MetricsFault};
use crate::openai::{self, Kind, Meta, Prepared};
use crate::replica::Replica;
use crate::responses;

type Shared = State<Arc<Replica>>;
type RawBody = Result<Bytes, BytesRejection>;

/// Large enough for prompts at max_model_len as text or id arrays.
const BODY_LIMIT: usize = 16 * 1024 * 1024;
pub const DELAY_HEADER: &str = "x-sim-delay-ms";

pub fn router(replica: Arc<Replica>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(stored_response))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset", post(reset))
        .route("/admin/fault", post(set_fault).get(get_fault))
        .route(
            "/admin/metrics-fault",
            post(set_metrics_fault).get(get_metrics_fault),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(replica.clone(), guard))
        .with_state(replica)
}

/// Applies the fault mode and stamps `x-served-by` on every response.
/// The admin fault endpoints are always answered, so a fault can be lifted.
async fn guard(State(r): Shared, req: Request, next: Next) -> Response {
    let admin = matches!(req.uri().path(), "/admin/fault" | "/admin/metrics-fault");
    let mut resp = if admin {
        next.run(req).await
    } else {
        gated(&r, req, next).await
    };
    resp.headers_mut()
        .insert("x-served-by", r.served_by.clone());
    resp
}

async fn gated(r: &Replica, req: Request, next: Next) -> Response {
    // The Messages API's clients read Anthropic's error shape.
    let anthropic = req.uri().path() == "/v1/messages";
    let refuse = |message: &str| {
        let e = error(StatusCode::SERVICE_UNAVAILABLE, message);
        if anthropic {
            Anthropic(e).into_response()
        } else {
            e.into_response()
        }
    };
    let mut modes = r.fault.subscribe();
    loop {
        let mode = modes.borrow_and_update().mode;
        match mode {
            Mode::Down => return refuse("replica is down (fault injection)"),
            Mode::Hang => {
                if modes.changed().await.is_err() {
                    return refuse("replica stopped");
                }
            }
            Mode::Ok | Mode::Slow => return next.run(req).await,
        }
    }
}

/// An error answered with an OpenAI-style body (small, unlike `Response`,
/// so it is cheap to pass around in `Result`s).
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            400..=499 => "invalid_request_error",
            503 => "service_unavailable_error",
            _ => "internal_server_error",
        };
        let code = self.status.as_u16();
        let body = json!({"error": {"message": self.message, "type": kind, "code": code}});
        (self.status, Json(body)).into_response()
    }
}

/// An error of the Messages API: Anthropic's shape,
/// `{"type": "error", "error": {"type", "message"}}`.
struct Anthropic(ApiError);

impl From<ApiError> for Anthropic {
    fn from(e: ApiError) -> Self {
        Anthropic(e)
    }
}

impl IntoResponse for Anthropic {
    fn into_response(self) -> Response {
        let body = messages::error_body(self.0.status.as_u16(), &self.0.message);
        (self.0.status, Json(body)).into_response()
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        message: message.into(),
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, message)
}

fn read_body(body: RawBody) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        error(status, e.body_text())
    })
}

type Answer = Result<Response, ApiError>;

async fn completions(State(r): Shared, headers: HeaderMap, body: RawBody) -> Answer {
    infer(r, Kind::Completion, &headers, body).await
}

async fn chat(State(r): Shared, headers: HeaderMap, body: RawBody) -> Answer {
    infer(r, Kind::Chat, &headers, body).await
}

/// A validated request with everything the engine and formatter need.
struct Job {
    prepared: Prepared,
    max_tokens: usize,
    lora: Option<usize>,
    meta: Meta,
}

async fn infer(r: Arc<Replica>, kind: Kind, headers: &HeaderMap, body: RawBody) -> Answer {
    let body = read_body(body)?;
    let prepared = openai::parse(kind, &body).map_err(bad_request)?;
    let (job, rx) = submit(&r, headers, prepared).await?;
    if job.prepared.stream {
        Ok(sse(job, rx))
    } else {
        collect(job, rx).await
    }
}

/// Validate a prepared request, apply the delays and failures asked for,
/// and hand it to the engine: its job, and the engine's events for it.
async fn submit(
    r: &Arc<Replica>,
    headers: &HeaderMap,
    prepared: Prepared,
) -> Result<(Job, mpsc::UnboundedReceiver<Event>), ApiError> {
    let header_delay = delay_header(headers)?;
    let job = validate(r, prepared)?;
    if r.fail.should_fail() {
        return Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure (--fail-rate)",
        ));
    }
    let fault_delay = r.fault.borrow().delay_ms();
    hold(
        &r.metrics.gauges.delayed,
        header_delay.saturating_add(fault_delay),
    )
    .await;
    let (tx, rx) = mpsc::unbounded_channel();
    let sub = Submission {
        prompt_len: job.prepared.tokens.len(),
        block_hashes: chain_hashes(
            &job.prepared.tokens,
            r.settings.cfg.block_size,
            r.hash_seed(job.lora, job.prepared.cache_salt.as_deref()),
        ),
        max_tokens: job.max_tokens,
        lora: job.lora,
        seed: r.next_id.load(Relaxed),
        events: tx,
    };
    if !r.engine.submit(sub).await {
        return Err(error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"));
    }
    Ok((job, rx))
}

/// `POST /v1/responses`: the stored conversation it continues (404 when
/// this replica has none of that id), then the new input; stored in turn
/// once generated, unless `store` is false.
async fn responses(State(r): Shared, headers: HeaderMap, body: RawBody) -> Answer {
    let body = read_body(body)?;
    let req = responses::parse(&body).map_err(bad_request)?;
    let history = match &req.previous {
        Some(id) => r.responses.get(id).ok_or_else(|| not_stored(id))?,
        None => Vec::new(),
    };
    let prepared = Prepared {
        kind: Kind::Chat,
        model: req.model.clone(),
        cache_salt: req.cache_salt.clone(),
        tokens: crate::tokenizer::encode(&responses::render(&req, &history)),
        max_tokens: req.max_output_tokens,
        stream: req.stream,
        include_usage: false,
    };
    let (job, rx) = submit(&r, &headers, prepared).await?;
    let meta = responses::Meta {
        id: req
            .request_id
            .clone()
            .unwrap_or_else(|| responses::fresh_id(&job.meta.id)),
        model: job.meta.model.clone(),
        created: job.meta.created,
        previous: req.previous.clone(),
        store: req.store,
    };
    // What the next turn continues: this one's conversation and answer.
    let mut turns = history;
    turns.extend(req.input.iter().cloned());
    let keep = move |r: &Replica, id: &str, text: &str| {
        if req.store {
            let mut t = turns.clone();
            t.push(("assistant".into(), text.to_string()));
            r.responses.put(id.to_string(), t);
        }
    };
    if !job.prepared.stream {
        let (text, usage) = generated(rx).await?;
        keep(&r, &meta.id, &text);
        return Ok(Json(meta.object(Some((&text, &usage)))).into_response());
    }
    let created = responses::Meta::event(
        "response.created",
        0,
        json!({"response": meta.object(None)}),
    );
    let mut seq = 0u64;
    let mut text = String::new();
    let events = UnboundedReceiverStream::new(rx).map(move |ev| {
        seq += 1;
        let frame = match ev {
            Event::Token(t) => {
                text.push_str(t);
                let delta = json!({"item_id": format!("msg_{seq}"), "output_index": 0, "content_index": 0, "delta": t});
                responses::Meta::event("response.output_text.delta", seq, delta)
            }
            Event::Done(usage) => {
                keep(&r, &meta.id, &text);
                let done = json!({"response": meta.object(Some((&text, &usage)))});
                responses::Meta::event("response.completed", seq, done)
            }
        };
        Ok::<_, Infallible>(Bytes::from(frame))
    });
    let first = tokio_stream::once(Ok::<_, Infallible>(Bytes::from(created)));
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    Ok((headers, Body::from_stream(first.chain(events))).into_response())
}

/// `POST /v1/messages`: the Anthropic Messages API, converted into the
/// chat request vLLM makes of it (`messages.rs`), then served as chat.
async fn anthropic_messages(
    State(r): Shared,
    headers: HeaderMap,
    body: RawBody,
) -> Result<Response, Anthropic> {
    let body = read_body(body)?;
    let req = messages::parse(&body).map_err(bad_request)?;
    let prepared = Prepared {
        kind: Kind::Chat,
        model: Some(req.model.clone()),
        // vLLM's conversion passes no cache salt.
        cache_salt: None,
        tokens: crate::tokenizer::encode(&messages::render(&req)),
        max_tokens: Some(req.max_tokens),
        stream: req.stream,
        include_usage: false,
    };
    let (job, rx) = submit(&r, &headers, prepared).await?;
    let meta = messages::Meta {
        id: format!("msg_{}", job.meta.id.trim_start_matches("chatcmpl-")),
        model: job.meta.model.clone(),
        input_tokens: job.prepared.tokens.len(),
        max_tokens: job.max_tokens,
    };
    if !job.prepared.stream {
        let (text, usage) = generated(rx).await?;
        return Ok(Json(meta.message(&text, &usage)).into_response());
    }
    let opening = tokio_stream::once(Ok::<_, Infallible>(Bytes::from(meta.opening())));
    let events = UnboundedReceiverStream::new(rx).map(move |ev| {
        let frames = match ev {
            Event::Token(t) => messages::Meta::delta(t),
            Event::Done(usage) => meta.closing(&usage),
        };
        Ok::<_, Infallible>(Bytes::from(frames))
    });
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    Ok((headers, Body::from_stream(opening.chain(events))).into_response())
}

/// `GET /v1/responses/{id}`: the stored conversation's last answer.
async fn stored_response(
    State(r): Shared,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Answer {
    let turns = r.responses.get(&id).ok_or_else(|| not_stored(&id))?;
    let text = turns.last().map(|t| t.1.clone()).unwrap_or_default();
    Ok(Json(
        json!({"id": id, "object": "response", "status": "completed",
        "output": [{"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]}]}),
    )
    .into_response())
}

/// vLLM's answer for a response id it doesn't hold.
fn not_stored(id: &str) -> ApiError {
    error(
        StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
    )
}

fn delay_header(headers: &HeaderMap) -> Result<u64, ApiError> {
    let Some(v) = headers.get(DELAY_HEADER) else {
        return Ok(0);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| bad_request(format!("{DELAY_HEADER} must be a non-negative integer")))
}

/// Checks limits the way vLLM does and resolves defaults.
fn validate(r: &Replica, prepared: Prepared) -> Result<Job, ApiError> {
    let max_tokens = prepared
        .max_tokens
        .map_or(r.settings.default_max_tokens, |m| m as usize);
    if max_tokens == 0 {
        return Err(bad_request("max_tokens must be at least 1"));
    }
    let limit = r.settings.cfg.max_model_len;
    let prompt = prepared.tokens.len();
    if prompt + max_tokens > limit {
        return Err(bad_request(format!(
            "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            prompt + max_tokens
        )));
    }
    let lora = r.lora_index(prepared.model.as_deref());
    let id = r.next_id.fetch_add(1, Relaxed);
    let prefix = if prepared.kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let meta = Meta {
        kind: prepared.kind,
        id: format!("{prefix}-{}-{id}", r.port),
        created: unix_now(),
        model: prepared
            .model
            .clone()
            .unwrap_or_else(|| r.settings.model.clone()),
    };
    Ok(Job {
        prepared,
        max_tokens,
        lora,
        meta,
    })
}

/// Waits `ms` of real time, counted as waiting in the metrics meanwhile.
async fn hold(delayed: &AtomicU64, ms: u64) {
    if ms == 0 {
        return;
    }
    struct Counted<'a>(&'a AtomicU64);
    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Relaxed);
        }
    }
    delayed.fetch_add(1, Relaxed);
    let _counted = Counted(delayed);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Server-sent events: one `data:` frame per token as the engine produces
/// it, then the optional usage frame, then `[DONE]`.
fn sse(job: Job, rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let Job {
        prepared,
        max_tokens,
        meta,
        ..
    } = job;
    let include_usage = prepared.include_usage;
    let mut sent = 0;
    let frames = UnboundedReceiverStream::new(rx).map(move |ev| {
        let text = match ev {
            Event::Token(t) => {
                sent += 1;
                frame(&meta.chunk(t, sent == 1, sent == max_tokens))
            }
            Event::Done(usage) => {
                let mut s = if include_usage {
                    frame(&meta.usage_chunk(&usage))
                } else {
                    String::new()
                };
                s.push_str("data: [DONE]\n\n");
                s
            }
        };
        Ok::<_, Infallible>(Bytes::from(text))
    });
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    (headers, Body::from_stream(frames)).into_response()
}

fn frame(v: &Value) -> String {
    format!("data: {v}\n\n")
}

async fn collect(job: Job, rx: mpsc::UnboundedReceiver<Event>) -> Answer {
    let (text, usage) = generated(rx).await?;
    Ok(Json(job.meta.full(&text, &usage)).into_response())
}

/// The whole generated text and its usage, once the engine is done.
async fn generated(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<(String, Usage), ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(t) => text.push_str(t),
            Event::Done(usage) => return Ok((text, usage)),
        }
    }
    Err(error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "engine dropped the request",
    ))
}

/// vLLM's render shape for completions: one generate request per prompt
/// (here always one: batches are served as one sequence).
async fn render_completion(State(r): Shared, body: RawBody) -> Answer {
    render(r, Kind::Completion, body)
}

/// vLLM's render shape for chat: a single object with `token_ids`.
async fn render_chat(State(r): Shared, body: RawBody) -> Answer {
    render(r, Kind::Chat, body)
}

fn render(r: Arc<Replica>, kind: Kind, body: RawBody) -> Answer {
    let body = read_body(body)?;
    let p = openai::parse(kind, &body).map_err(bad_request)?;
    let max_tokens = p
        .max_tokens
        .map_or(r.settings.default_max_tokens, |m| m as usize);
    let model = p.model.clone().unwrap_or_else(|| r.settings.model.clone());
    let v = json!({
        "request_id": format!("render-{}-{}", r.port, r.next_id.fetch_add(1, Relaxed)),
        "model": model,
        "token_ids": p.tokens,
        "prompt_token_ids": p.tokens,
        "sampling_params": {"max_tokens": max_tokens},
        "features": null,
    });
    Ok(match kind {
        Kind::Completion => Json(json!([v])).into_response(),
        Kind::Chat => Json(v).into_response(),
    })
}

async fn tokenize(State(r): Shared, body: RawBody) -> Answer {
    let tokens = openai::parse_tokenize(&read_body(body)?).map_err(bad_request)?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": r.settings.cfg.max_model_len,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response())
}

async fn models(State(r): Shared) -> Response {
    let s = &r.settings;
    let created = unix_now();
    let card = |id: &str, parent: Value| {
        json!({
            "id": id, "object": "model", "created": created, "owned_by": "vllm",
            "root": id, "parent": parent, "max_model_len": s.cfg.max_model_len, "permission": []
        })
    };
    let mut data = vec![card(&s.model, Value::Null)];
    data.extend(s.loras.iter().map(|l| card(l, json!(s.model))));
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// The page, as the replica's metrics fault (normally `ok`) shapes it.
async fn metrics(State(r): Shared) -> Response {
    // Subscribe before reading, so a stall sees any later change.
    let mut changes = r.metrics_fault.subscribe();
    let fault = changes.borrow_and_update().clone();
    metrics_fault::respond(&fault, &r.metrics, changes)
}

async fn reset(State(r): Shared) -> Answer {
    let stopped = || error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
    let outcome = r.engine.reset().await.ok_or_else(stopped)?;
    let body = json!({"status": "ok", "in_flight": outcome.in_flight, "cache_cleared": outcome.cache_cleared});
    Ok(Json(body).into_response())
}

async fn set_fault(State(r): Shared, body: RawBody) -> Answer {
    let f: Fault = serde_json::from_slice(&read_body(body)?).map_err(|e| {
        bad_request(format!(
            "invalid fault: {e}; expected {{\"mode\":\"ok\"|\"slow\"|\"down\"|\"hang\",\"delay_ms\":N}}"
        ))
    })?;
    r.fault.send_replace(f);
    Ok(Json(f).into_response())
}

async fn get_fault(State(r): Shared) -> Response {
    Json(*r.fault.borrow()).into_response()
}

async fn set_metrics_fault(State(r): Shared, body: RawBody) -> Answer {
    let f: MetricsFault = serde_json::from_slice(&read_body(body)?).map_err(|e| {
        bad_request(format!(
            "invalid metrics fault: {e}; expected {{\"mode\":\"ok\"|\"reset\"|\"stall\"|\"huge\"|\"absurd\"|\"error\"|\"garbage\",\"bytes\":N,\"stall_ms\":N,\"values\":{{\"NAME\":V}}}}"
        ))
    })?;
    f.validate()
        .map_err(|e| bad_request(format!("invalid metrics fault: {e}")))?;
    r.metrics_fault.send_replace(f.clone());
    Ok(Json(f).into_response())
}

async fn get_metrics_fault(State(r): Shared) -> Response {
    Json(r.metrics_fault.borrow().clone()).into_response()
}

async fn not_found() -> ApiError {
    error(StatusCode::NOT_FOUND, "no such endpoint")
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
