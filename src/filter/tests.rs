//! The request path against a fake host: what Envoy's e2e tests check
//! through a real proxy, natively and call by call.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use super::stats::{MetricType, Metrics, P};
use super::*;
use crate::load;
use crate::metrics::ReplicaMetrics;
use crate::replicas::record_scrape;
use crate::store::MemStore;

const DEST: &str = DEFAULT_DESTINATION_HEADER;
const AFFINITY_KEY: &str = "0123456789abcdef0123456789abcdef-test";

/// A local reply the filter sent.
#[derive(Debug, Clone)]
struct Reply {
    status: u32,
    details: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// An Envoy stand-in: header maps, a body buffer, a clock, shared data,
/// stats, and a log of every edit the filter made, in order.
#[derive(Default)]
struct Fake {
    store: MemStore,
    now: Cell<u64>,
    request: RefCell<Pairs>,
    response: RefCell<Pairs>,
    body: RefCell<Vec<u8>>,
    replies: RefCell<Vec<Reply>>,
    /// Defined stats, by id: (name, value). Counters and gauges add,
    /// histograms keep their last record.
    stats: RefCell<Vec<(String, i64)>>,
    /// Host calls that change or read something, in order.
    calls: RefCell<Vec<String>>,
    /// Refuse writes to the request headers (a host that says no).
    refuse_request_writes: Cell<bool>,
    /// The upstream that answered (`upstream.address`).
    upstream: RefCell<Option<String>>,
    /// Refuse local replies (a host that says no).
    refuse_local_replies: Cell<bool>,
}

fn map_name(map: Map) -> &'static str {
    match map {
        Map::Request => "request",
        Map::Response => "response",
    }
}

impl Fake {
    fn new() -> Fake {
        let f = Fake::default();
        f.now.set(1_000_000);
        f
    }

    fn map(&self, map: Map) -> &RefCell<Pairs> {
        match map {
            Map::Request => &self.request,
            Map::Response => &self.response,
        }
    }

    /// The upstream's (or Envoy's) response headers arrive.
    fn respond(&self, status: u16) {
        *self.response.borrow_mut() = vec![(b":status".to_vec(), status.to_string().into_bytes())];
    }

    /// A new stream's request: headers as given, and its body.
    fn start(&self, headers: &[(&str, &[u8])], body: &[u8]) {
        *self.request.borrow_mut() = headers
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec()))
            .collect();
        *self.response.borrow_mut() = Vec::new();
        *self.body.borrow_mut() = body.to_vec();
        self.calls.borrow_mut().clear();
    }

    fn header(&self, map: Map, name: &str) -> Option<String> {
        headers::get_str(&self.map(map).borrow(), name).map(str::to_string)
    }

    fn count_of(&self, map: Map, name: &str) -> usize {
        self.map(map)
            .borrow()
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .count()
    }

    /// A stat by its name without the `prefix_router.` prefix (0 if never
    /// defined).
    fn stat(&self, name: &str) -> i64 {
        let full = format!("{P}.{name}");
        self.stats
            .borrow()
            .iter()
            .find(|(n, _)| *n == full)
            .map_or(0, |s| s.1)
    }

    fn calls(&self) -> Vec<String> {
        self.calls.borrow().clone()
    }
}

impl Metrics for Fake {
    fn define_metric(&self, _kind: MetricType, name: &str) -> Result<u32, u32> {
        let mut stats = self.stats.borrow_mut();
        if let Some(i) = stats.iter().position(|(n, _)| n == name) {
            return Ok(i as u32);
        }
        stats.push((name.to_string(), 0));
        Ok(stats.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), u32> {
        let mut stats = self.stats.borrow_mut();
        let s = stats.get_mut(id as usize).ok_or(2u32)?;
        s.1 += by;
        Ok(())
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), u32> {
        let mut stats = self.stats.borrow_mut();
        let s = stats.get_mut(id as usize).ok_or(2u32)?;
        s.1 = value as i64;
        Ok(())
    }
}

impl Host for Fake {
    type Store = MemStore;

    fn store(&self) -> &MemStore {
        &self.store
    }

    fn now_ms(&self) -> u64 {
        self.now.get()
    }

    fn request_headers(&self) -> Pairs {
        self.calls.borrow_mut().push("read request headers".into());
        self.request.borrow().clone()
    }

    fn upstream_address(&self) -> Option<String> {
        self.upstream.borrow().clone()
    }

    fn response_status(&self) -> Option<u16> {
        let status = self.header(Map::Response, ":status")?;
        status.parse().ok()
    }

    fn remove_header(&self, map: Map, name: &str) -> Result<(), u32> {
        self.calls
            .borrow_mut()
            .push(format!("remove {} {name}", map_name(map)));
        self.map(map)
            .borrow_mut()
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name.as_bytes()));
        Ok(())
    }

    fn replace_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32> {
        self.replace_header_bytes(map, name, value.as_bytes())
    }

    fn replace_header_bytes(&self, map: Map, name: &str, value: &[u8]) -> Result<(), u32> {
        if map == Map::Request && self.refuse_request_writes.get() {
            return Err(2);
        }
        self.calls
            .borrow_mut()
            .push(format!("replace {} {name}", map_name(map)));
        let mut m = self.map(map).borrow_mut();
        m.retain(|(k, _)| !k.eq_ignore_ascii_case(name.as_bytes()));
        m.push((name.as_bytes().to_vec(), value.to_vec()));
        Ok(())
    }

    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32> {
        self.calls
            .borrow_mut()
            .push(format!("add {} {name}", map_name(map)));
        let mut m = self.map(map).borrow_mut();
        m.push((name.as_bytes().to_vec(), value.as_bytes().to_vec()));
        Ok(())
    }

    fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        self.calls.borrow_mut().push(format!("read body {max}"));
        let b = self.body.borrow();
        Some(b.get(..max.min(b.len())).unwrap_or_default().to_vec())
    }

    fn replace_request_body_head(&self, drop: usize, head: &[u8]) -> Result<(), u32> {
        // As Envoy: drain `drop` bytes, prepend the head.
        let mut body = self.body.borrow_mut();
        assert!(drop <= body.len(), "{drop} of {}", body.len());
        self.calls
            .borrow_mut()
            .push(format!("write body head {drop} -> {}", head.len()));
        body.splice(..drop, head.iter().copied());
        Ok(())
    }

    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), u32> {
        if self.refuse_local_replies.get() {
            return Err(2);
        }
        self.calls.borrow_mut().push(format!("reply {status}"));
        self.replies.borrow_mut().push(Reply {
            status,
            details: details.to_string(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: String::from_utf8_lossy(body).into_owned(),
        });
        Ok(())
    }
}

const POOL: [&str; 4] = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"];

fn worker(fake: &Fake, extra: &str) -> Rc<RefCell<Worker>> {
    let eps: Vec<String> = POOL.iter().map(|e| format!("\"{e}\"")).collect();
    let json = format!(r#"{{"endpoints":[{}]{extra}}}"#, eps.join(","));
    let config = Config::parse(json.as_bytes()).unwrap();
    Rc::new(RefCell::new(Worker::new(fake, config, 7)))
}

/// `worker` over the pool without `gone` (a replica that left).
fn worker_without(fake: &Fake, gone: &str, extra: &str) -> Rc<RefCell<Worker>> {
    let eps: Vec<String> = POOL
        .iter()
        .filter(|&&e| e != gone)
        .map(|e| format!("\"{e}\""))
        .collect();
    let json = format!(r#"{{"endpoints":[{}]{extra}}}"#, eps.join(","));
    let config = Config::parse(json.as_bytes()).unwrap();
    Rc::new(RefCell::new(Worker::new(fake, config, 7)))
}

fn completion(prompt: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","prompt":"{prompt}"}}"#).into_bytes()
}

fn doc(n: usize) -> Vec<u8> {
    completion(&format!("Document {n}: ").repeat(100))
}

const POST: [(&str, &[u8]); 2] = [(":method", b"POST"), (":path", b"/v1/completions")];

/// One whole inference request (headers, then the body in one piece):
/// the stream, and what each callback answered.
fn post(fake: &Fake, w: &Rc<RefCell<Worker>>, extra: &[(&str, &[u8])], body: &[u8]) -> HttpFilter {
    let mut headers = POST.to_vec();
    headers.extend_from_slice(extra);
    fake.start(&headers, body);
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(fake, false), Action::Pause);
    assert_eq!(s.on_request_body(fake, body.len(), true), Action::Continue);
    s
}

/// Requests in flight per replica (and any replica with work left).
fn in_flight(fake: &Fake) -> HashMap<ReplicaId, u32> {
    load::snapshot(&fake.store, fake.now.get(), 60_000)
        .into_iter()
        .filter(|(_, l)| l.requests > 0 || l.work > 0)
        .map(|(id, l)| (id, l.requests))
        .collect()
}

fn id_of(addr: &str) -> ReplicaId {
    crate::endpoint::replica_id(addr)
}

#[test]
fn strip_pause_body_decide_write_then_log_in_that_order() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let body = doc(1);
    let mut headers = POST.to_vec();
    headers.push((DEST, b"10.9.9.9:80"));
    fake.start(&headers, &body);
    let mut s = HttpFilter::new(Some(w.clone()));
    // Headers: the client's destination is gone before anything else, and
    // the stream waits for its body.
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(fake.header(Map::Request, DEST), None);
    assert_eq!(
        fake.calls(),
        ["read request headers", &format!("remove request {DEST}")]
    );
    // A partial body: still waiting, nothing read.
    assert_eq!(
        s.on_request_body(&fake, body.len() / 2, false),
        Action::Pause
    );
    assert_eq!(fake.calls().len(), 2);
    // The whole body: read once, decided, written.
    assert_eq!(s.on_request_body(&fake, body.len(), true), Action::Continue);
    assert_eq!(
        fake.calls()[2..],
        [
            format!("read body {}", body.len()),
            format!("replace request {DEST}")
        ]
    );
    let pick = fake.header(Map::Request, DEST).unwrap();
    assert!(POOL.contains(&pick.as_str()), "{pick}");
    assert_eq!(fake.stat("client_destination_stripped"), 1);
    assert_eq!(fake.stat("requests_total"), 1);
    assert_eq!(fake.stat("decision.new_prefix"), 1);
    assert_eq!(
        fake.stat(&format!("replica.{}.routed", pick.replace(['.', ':'], "_"))),
        1
    );
    assert!(fake.stat("request_blocks_total") > 0);
    // In flight until the stream ends, however it ends; once.
    assert_eq!(in_flight(&fake), [(id_of(&pick), 1)].into());
    assert_eq!(s.on_response_headers(&fake), Action::Continue);
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
    // The same document again: same replica, a prefix hit.
    let again = post(&fake, &w, &[], &body);
    assert_eq!(fake.header(Map::Request, DEST), Some(pick));
    assert_eq!(fake.stat("decision.prefix_hit"), 1);
    drop(again);
    assert!(fake.replies.borrow().is_empty());
}

#[test]
fn a_client_destination_header_is_stripped_even_unconfigured_or_unreadable() {
    // Not configured (yet): nothing is routed, the header still goes.
    let fake = Fake::new();
    fake.start(&[(":method", b"GET"), (DEST, b"10.9.9.9:80")], b"");
    let mut s = HttpFilter::new(None);
    assert_eq!(s.on_request_headers(&fake, true), Action::Continue);
    assert_eq!(fake.header(Map::Request, DEST), None);
    // Every copy, whatever its bytes.
    let w = worker(&fake, "");
    fake.start(
        &[
            (":method", b"GET"),
            (DEST, b"10.9.9.9:80"),
            ("X-Gateway-Destination-Endpoint", &[0xff, 0xfe]),
        ],
        b"",
    );
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&fake, true), Action::Continue);
    assert_eq!(fake.count_of(Map::Request, DEST), 1, "ours only");
    assert!(POOL.contains(&fake.header(Map::Request, DEST).unwrap().as_str()));
    assert_eq!(fake.stat("client_destination_stripped"), 1);
    // A map the host couldn't give: removed anyway, not counted.
    fake.start(&[], b"");
    let mut s = HttpFilter::new(Some(w));
    s.on_request_headers(&fake, true);
    assert_eq!(fake.calls()[1], format!("remove request {DEST}"));
    assert_eq!(fake.stat("client_destination_stripped"), 1);
}

#[test]
fn requests_without_a_prompt_are_routed_at_once() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    for (headers, eos) in [
        (
            &[(":method", &b"GET"[..]), (":path", b"/v1/models")][..],
            false,
        ),
        (&POST[..], true),
        (
            &[(":method", &b"POST"[..]), (":path", b"/v1/embeddings")][..],
            false,
        ),
    ] {
        fake.start(headers, b"");
        let mut s = HttpFilter::new(Some(w.clone()));
        assert_eq!(s.on_request_headers(&fake, eos), Action::Continue);
        assert!(fake.header(Map::Request, DEST).is_some());
        // A later body isn't read.
        assert_eq!(s.on_request_body(&fake, 10, true), Action::Continue);
        assert!(!fake.calls().iter().any(|c| c.starts_with("read body")));
    }
    assert_eq!(fake.stat("decision.no_prompt"), 3);
    // An inference POST whose empty body ends the stream in a data frame
    // (HTTP/2, chunked): no prompt, as with end of stream on the headers,
    // and no parse error.
    fake.start(&POST, b"");
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(s.on_request_body(&fake, 0, true), Action::Continue);
    assert!(fake.header(Map::Request, DEST).is_some());
    assert_eq!(fake.stat("decision.no_prompt"), 4);
    assert_eq!(fake.stat("parse_errors"), 0);
}

#[test]
fn an_oversized_or_unparsable_body_is_routed_on_load_alone() {
    let fake = Fake::new();
    let w = worker(&fake, r#","max_body_bytes":1024"#);
    fake.start(&POST, &doc(1));
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(s.on_request_body(&fake, 2000, false), Action::Continue);
    assert_eq!(fake.stat("body_too_large"), 1);
    assert!(fake.header(Map::Request, DEST).is_some());
    assert!(!fake.calls().iter().any(|c| c.starts_with("read body")));
    // Buffering stopped: the rest of the body passes.
    assert_eq!(s.on_request_body(&fake, 3000, true), Action::Continue);
    post(&fake, &w, &[], b"{not json");
    assert_eq!(fake.stat("parse_errors"), 1);
    assert!(fake.header(Map::Request, DEST).is_some());
    assert_eq!(fake.stat("decision.no_prompt"), 2);
}

#[test]
fn trailers_complete_the_body() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let body = doc(3);
    fake.start(&POST, &body);
    let mut s = HttpFilter::new(Some(w));
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(s.on_request_body(&fake, body.len(), false), Action::Pause);
    assert_eq!(s.on_request_trailers(&fake), Action::Continue);
    assert!(fake.calls().contains(&format!("read body {}", 16 << 20)));
    assert!(fake.header(Map::Request, DEST).is_some());
    assert_eq!(fake.stat("decision.new_prefix"), 1);
    // Trailers of a stream that isn't waiting change nothing.
    assert_eq!(s.on_request_trailers(&fake), Action::Continue);
    assert_eq!(fake.stat("requests_total"), 1);
}

/// Every replica of the pool scraped with a queue over the threshold, then
/// a sheddable request (`doc(1)`): what its body callback answered, and
/// the stream.
fn sheddable_on_a_saturated_pool(fake: &Fake, w: &Rc<RefCell<Worker>>) -> (Action, HttpFilter) {
    sheddable_on_a_saturated_pool_at(fake, w, &POST, &doc(1))
}

/// `sheddable_on_a_saturated_pool` with these request headers and body.
fn sheddable_on_a_saturated_pool_at(
    fake: &Fake,
    w: &Rc<RefCell<Worker>>,
    request: &[(&str, &[u8])],
    body: &[u8],
) -> (Action, HttpFilter) {
    let ids: Vec<ReplicaId> = POOL.iter().map(|e| id_of(e)).collect();
    let busy = ReplicaMetrics {
        waiting: 9.0,
        ..ReplicaMetrics::default()
    };
    for &id in &ids {
        record_scrape(&fake.store, id, Ok(&busy), &ids, fake.now.get()).unwrap();
    }
    let mut headers = request.to_vec();
    headers.push(("x-prefix-router-priority", b"sheddable"));
    fake.start(&headers, body);
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(fake, false), Action::Pause);
    (s.on_request_body(fake, body.len(), true), s)
}

#[test]
fn no_eligible_replica_is_a_503_and_a_saturated_pool_sheds_with_a_429() {
    let fake = Fake::new();
    let w = worker(&fake, r#","cluster":"pool""#);
    // Sheddable and every replica saturated: 429, and the stream stays
    // paused (the reply is the answer).
    let (action, mut s) = sheddable_on_a_saturated_pool(&fake, &w);
    assert_eq!(action, Action::Pause);
    let (ids, now, body): (Vec<ReplicaId>, _, _) = (
        POOL.iter().map(|e| id_of(e)).collect(),
        fake.now.get(),
        doc(1),
    );
    let r = fake.replies.borrow().last().cloned().unwrap();
    assert_eq!((r.status, r.details.as_str()), (429, "saturated"));
    assert!(r.headers.contains(&("retry-after".into(), "1".into())));
    assert!(r
        .headers
        .contains(&("content-type".into(), "application/json".into())));
    let json: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(json["error"]["type"], "saturated");
    assert_eq!(json["error"]["code"], 429);
    assert_eq!(fake.header(Map::Request, DEST), None);
    assert_eq!(fake.stat("shed_429"), 1);
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
    // Not sheddable: routed.
    post(&fake, &w, &[], &body);
    assert!(fake.header(Map::Request, DEST).is_some());
    // Every replica failed its scrapes: routed over all of them, whatever
    // the priority (their stale queues shed nothing), and counted.
    for &id in &ids {
        for _ in 0..3 {
            record_scrape(&fake.store, id, Err(()), &ids, now).unwrap();
        }
    }
    let mut s = post(
        &fake,
        &w,
        &[("x-prefix-router-priority", b"sheddable")],
        &body,
    );
    assert!(fake.header(Map::Request, DEST).is_some());
    assert_eq!(fake.stat("routed_blind"), 1);
    assert_eq!(fake.stat("unavailable_503"), 0);
    assert_eq!(fake.replies.borrow().len(), 1);
    s.on_log(&fake);
}

/// A worker whose pool comes from discovery alone, before any answer: empty.
fn empty_pool(fake: &Fake) -> Rc<RefCell<Worker>> {
    let cfg = Config::parse(
        br#"{"discovery":{"cluster":"pool","admin_cluster":"admin"},"cluster":"pool"}"#,
    )
    .unwrap();
    Rc::new(RefCell::new(Worker::new(fake, cfg, 7)))
}

#[test]
fn an_empty_pool_is_a_503_with_the_cause() {
    let fake = Fake::new();
    let w = empty_pool(&fake);
    let body = doc(1);
    fake.start(&POST, &body);
    let mut s = HttpFilter::new(Some(w));
    s.on_request_headers(&fake, false);
    assert_eq!(s.on_request_body(&fake, body.len(), true), Action::Pause);
    let r = fake.replies.borrow().last().cloned().unwrap();
    assert_eq!((r.status, r.details.as_str()), (503, "no_replica"));
    assert!(!r.headers.iter().any(|h| h.0 == "retry-after"));
    assert!(r.body.contains("the pool is empty"), "{}", r.body);
    assert_eq!(fake.header(Map::Request, DEST), None);
    assert_eq!(fake.stat("unavailable_503"), 1);
}

/// The body of the filter's last local reply.
fn last_reply_json(fake: &Fake) -> (u32, serde_json::Value) {
    let r = fake.replies.borrow().last().cloned().unwrap();
    assert!(r
        .headers
        .contains(&("content-type".into(), "application/json".into())));
    (r.status, serde_json::from_str(&r.body).unwrap())
}

/// An Anthropic Messages API client (Claude Code, the `anthropic` SDKs)
/// reads an error as `{"type": "error", "error": {"type", "message"}}`,
/// the type one of the API's (`rate_limit_error`, `overloaded_error`),
/// as the replicas behind the filter answer on `/v1/messages`. Review
/// finding: the filter's own 429 and 503 were OpenAI-shaped there
/// (`error.type` `saturated` or `no_replica`, no top-level `type`).
#[test]
fn refusals_on_the_messages_api_are_in_anthropic_error_shape() {
    let messages = br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Summarise our refund policy for a laptop bought three weeks ago, please."}]}"#;
    let anthropic = |kind: &str, json: &serde_json::Value| {
        assert_eq!(json["type"], "error", "{json}");
        assert_eq!(json["error"]["type"], kind, "{json}");
        assert!(json["error"]["message"].is_string(), "{json}");
        assert_eq!(json.as_object().unwrap().len(), 2, "{json}");
        assert!(json["error"].get("code").is_none(), "{json}");
    };
    // Shed on a saturated pool: a 429 with `retry-after`, a rate limit.
    for path in [&b"/v1/messages"[..], b"/v1/messages?beta=true"] {
        let fake = Fake::new();
        let w = worker(&fake, r#","cluster":"pool""#);
        let request = [(":method", &b"POST"[..]), (":path", path)];
        let (action, _) = sheddable_on_a_saturated_pool_at(&fake, &w, &request, messages);
        assert_eq!(action, Action::Pause);
        let r = fake.replies.borrow().last().cloned().unwrap();
        assert_eq!((r.status, r.details.as_str()), (429, "saturated"));
        assert!(r.headers.contains(&("retry-after".into(), "1".into())));
        let (_, json) = last_reply_json(&fake);
        anthropic("rate_limit_error", &json);
        assert!(json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("saturated"));
        assert_eq!(fake.stat("shed_429"), 1);
    }
    // An empty pool: a 503, overloaded (as the replicas say a 503 or 529
    // on this API), on the inference path, on `count_tokens` (routed by
    // load), and on any path from a client that names the API's version.
    let fake = Fake::new();
    let w = empty_pool(&fake);
    for (path, extra, body) in [
        (&b"/v1/messages"[..], None, &messages[..]),
        (b"/v1/messages/count_tokens?beta=true", None, messages),
        (b"/v1/completions", Some(&b"2023-06-01"[..]), &doc(1)[..]),
    ] {
        let mut request = vec![(":method", &b"POST"[..]), (":path", path)];
        if let Some(v) = extra {
            request.push(("anthropic-version", v));
        }
        fake.start(&request, body);
        let replies = fake.replies.borrow().len();
        let mut s = HttpFilter::new(Some(w.clone()));
        // Answered at once (`count_tokens` isn't an inference path), or
        // once the body is in; paused either way.
        assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
        if fake.replies.borrow().len() == replies {
            assert_eq!(s.on_request_body(&fake, body.len(), true), Action::Pause);
        }
        assert_eq!(fake.replies.borrow().len(), replies + 1);
        let (status, json) = last_reply_json(&fake);
        assert_eq!(status, 503);
        anthropic("overloaded_error", &json);
        assert!(json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the pool is empty"));
    }
    assert_eq!(fake.stat("unavailable_503"), 3);
    // An OpenAI client's refusal keeps its shape.
    fake.start(&POST, &doc(1));
    let mut s = HttpFilter::new(Some(w));
    s.on_request_headers(&fake, false);
    assert_eq!(s.on_request_body(&fake, doc(1).len(), true), Action::Pause);
    let (_, json) = last_reply_json(&fake);
    assert_eq!(json["error"]["type"], "no_replica");
    assert_eq!(json["error"]["code"], 503);
    assert!(json.get("type").is_none());
}

#[test]
fn affinity_tokens_are_read_stripped_verified_and_issued() {
    let fake = Fake::new();
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#);
    let w = worker(&fake, &extra);
    let header = crate::config::DEFAULT_AFFINITY_HEADER;
    // First turn: no token; the response carries one naming the replica.
    let mut s = post(&fake, &w, &[], &doc(1));
    let pick = fake.header(Map::Request, DEST).unwrap();
    fake.respond(200);
    s.on_response_headers(&fake);
    let token = fake.header(Map::Response, header).unwrap();
    let now_s = fake.now.get() / 1000;
    assert_eq!(
        affinity::verify(AFFINITY_KEY.as_bytes(), token.as_bytes(), now_s, 3600),
        Ok(id_of(&pick))
    );
    s.on_log(&fake);
    // Next turns, with other content: the token wins, and the upstream
    // never sees it.
    for n in 2..6 {
        let mut s = post(&fake, &w, &[(header, token.as_bytes())], &doc(n));
        assert_eq!(fake.header(Map::Request, DEST).as_ref(), Some(&pick));
        assert_eq!(fake.header(Map::Request, header), None);
        s.on_log(&fake);
    }
    assert_eq!(fake.stat("decision.affinity"), 4);
    // A failed response (a 5xx from the replica, or Envoy's own 503 or
    // 504 once retries ran out) names no replica to come back to, nor
    // does a refusal (the turn didn't run there).
    for status in [400, 404, 429, 500, 503, 504] {
        let mut s = post(&fake, &w, &[], &doc(7));
        fake.respond(status);
        s.on_response_headers(&fake);
        assert_eq!(fake.header(Map::Response, header), None, "{status}");
        s.on_log(&fake);
    }
    // A forged token: stripped, counted, not followed.
    let forged = affinity::mint(b"another key, also at least 32 bytes long", 1, now_s);
    post(&fake, &w, &[(header, forged.as_bytes())], &doc(9));
    assert_eq!(fake.header(Map::Request, header), None);
    assert_eq!(fake.stat("affinity.rejected"), 1);
    assert_eq!(fake.stat("decision.affinity"), 4);
}

/// Conversation `c` at its `turns`-th turn, below a system prompt all
/// conversations share.
fn conversation(c: usize, turns: usize) -> Vec<u8> {
    crate::route::tests::chat(c, turns).into_bytes()
}

/// One turn through a filter with the affinity cookie `pr`: the client's
/// cookie header, and what the response set (the cookie's value, and the
/// whole `set-cookie` of ours).
fn cookie_turn(
    fake: &Fake,
    w: &Rc<RefCell<Worker>>,
    jar: Option<&str>,
    body: &[u8],
) -> (String, Option<(String, String)>) {
    cookie_turn_answered(fake, w, jar, body, 200)
}

/// `cookie_turn`, answered with `status`.
fn cookie_turn_answered(
    fake: &Fake,
    w: &Rc<RefCell<Worker>>,
    jar: Option<&str>,
    body: &[u8],
    status: u16,
) -> (String, Option<(String, String)>) {
    let cookie = jar.map(|j| format!("theirs=1; pr={j}"));
    let extra: Vec<(&str, &[u8])> = cookie.iter().map(|c| ("cookie", c.as_bytes())).collect();
    let mut s = post(fake, w, &extra, body);
    let pick = fake.header(Map::Request, DEST).unwrap();
    if jar.is_some() {
        // Only ours leaves the request.
        assert_eq!(
            fake.header(Map::Request, "cookie").as_deref(),
            Some("theirs=1")
        );
    }
    fake.respond(status);
    fake.response
        .borrow_mut()
        .push((b"set-cookie".to_vec(), b"upstream=kept".to_vec()));
    s.on_response_headers(fake);
    let ours = fake
        .response
        .borrow()
        .iter()
        .filter(|(k, _)| k == b"set-cookie")
        .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
        .find(|v| v.starts_with("pr="));
    assert_eq!(
        fake.count_of(Map::Response, "set-cookie"),
        1 + usize::from(ours.is_some())
    );
    s.on_log(fake);
    let set = ours.map(|v| (v[3..v.find(';').unwrap()].to_string(), v));
    (pick, set)
}

#[test]
fn an_affinity_cookie_leads_each_session_of_a_shared_jar_to_its_replica() {
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    // Two gateway instances: their own shared data, one key.
    let (a, b) = (Fake::new(), Fake::new());
    let (wa, wb) = (worker(&a, &extra), worker(&b, &extra));
    // Instance A starts conversations 0..4, all with one client's jar.
    let mut jar: Option<String> = None;
    let mut home = Vec::new();
    for c in 0..4 {
        let (pick, set) = cookie_turn(&a, &wa, jar.as_deref(), &conversation(c, 1));
        let (value, whole) = set.unwrap();
        assert!(
            whole.ends_with("; Max-Age=3600; Path=/; HttpOnly; SameSite=Lax"),
            "{whole}"
        );
        jar = Some(value);
        home.push(pick);
    }
    assert_eq!(
        a.stat("decision.affinity"),
        0,
        "no conversation continues another"
    );
    // Their next turns reach instance B, which knows none of them, in
    // another order (so that it would place them otherwise): each follows
    // its own entry in the shared cookie.
    for turns in 2..4 {
        for c in (0..4).rev() {
            let (pick, set) = cookie_turn(&b, &wb, jar.as_deref(), &conversation(c, turns));
            assert_eq!(pick, home[c], "conversation {c}, turn {turns}");
            jar = Some(set.unwrap().0);
        }
    }
    assert_eq!(b.stat("decision.affinity"), 8);
    assert_eq!(b.stat("affinity.rejected"), 0);
    // One entry per conversation: each turn replaced its previous one.
    let now_s = b.now.get() / 1000;
    let key = AFFINITY_KEY.as_bytes();
    let opened = cookie::Jar::open(key, jar.as_deref().unwrap().as_bytes(), now_s, 3600).unwrap();
    assert_eq!(opened.probes().len(), 4);
    // A turn refused upstream (rate limited) ran nowhere: no cookie, and
    // the client's jar still leads the conversation to its replica.
    for status in [429, 503] {
        let (pick, set) =
            cookie_turn_answered(&b, &wb, jar.as_deref(), &conversation(2, 4), status);
        assert_eq!((pick.as_str(), set), (home[2].as_str(), None), "{status}");
    }
    assert_eq!(b.stat("decision.affinity"), 10);
    // A new conversation with the same jar: placed as any, not followed.
    cookie_turn(&b, &wb, jar.as_deref(), &conversation(9, 1));
    assert_eq!(b.stat("decision.affinity"), 10);
    // A forged cookie: stripped, counted, not followed.
    let entry = cookie::Entry {
        replica: 1,
        bytes: 1,
        hash: 1,
        issued: now_s as u32,
    };
    let forged = cookie::Jar::default()
        .with(entry, 8)
        .seal(b"another key, also at least 32 bytes long");
    cookie_turn(&b, &wb, Some(&forged), &conversation(0, 4));
    assert_eq!(b.stat("affinity.rejected"), 1);
    assert_eq!(b.stat("decision.affinity"), 10);
}

#[test]
fn a_session_whose_newest_cookie_was_overwritten_still_follows_its_previous_turn() {
    // Two sessions of one jar in flight at once: the client keeps the
    // cookie of whichever response came last, which was made from the jar
    // its request carried. The other session's newest entry is lost; its
    // previous turn's entry is still there, and its next prompt starts
    // with that one too.
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    let (a, b) = (Fake::new(), Fake::new());
    let (wa, wb) = (worker(&a, &extra), worker(&b, &extra));
    let (home0, set) = cookie_turn(&a, &wa, None, &conversation(0, 1));
    let (home1, set) = cookie_turn(&a, &wa, Some(&set.unwrap().0), &conversation(1, 1));
    let jar = set.unwrap().0;
    // Turn 2 of both, sent with the same jar; 1 answers first, then 0.
    cookie_turn(&a, &wa, Some(&jar), &conversation(1, 2));
    let (_, last) = cookie_turn(&a, &wa, Some(&jar), &conversation(0, 2));
    let jar = last.unwrap().0;
    // Turn 3 of each reaches instance B, which knows neither.
    let (p1, _) = cookie_turn(&b, &wb, Some(&jar), &conversation(1, 3));
    let (p0, _) = cookie_turn(&b, &wb, Some(&jar), &conversation(0, 3));
    assert_eq!((p0, p1), (home0, home1));
    assert_eq!(b.stat("decision.affinity"), 2);
}

#[test]
fn the_affinity_cookie_is_secure_over_tls_and_needs_a_prompt() {
    let fake = Fake::new();
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    let w = worker(&fake, &extra);
    let mut s = post(
        &fake,
        &w,
        &[("x-forwarded-proto", b"https")],
        &conversation(1, 1),
    );
    fake.respond(200);
    s.on_response_headers(&fake);
    let set = fake.header(Map::Response, "set-cookie").unwrap();
    assert!(set.starts_with("pr=") && set.ends_with("; Secure"), "{set}");
    // Under one block of prompt: nothing to know its next turn by.
    let mut s = post(&fake, &w, &[], &completion("hi"));
    fake.respond(200);
    s.on_response_headers(&fake);
    assert_eq!(fake.header(Map::Response, "set-cookie"), None);
    // The header token is issued either way.
    assert!(fake
        .header(Map::Response, crate::config::DEFAULT_AFFINITY_HEADER)
        .is_some());
}

#[test]
fn the_debug_header_is_ours_or_none() {
    for on in [true, false] {
        let fake = Fake::new();
        let w = worker(&fake, &format!(r#","debug_header":{on}"#));
        let mut s = post(&fake, &w, &[], &doc(1));
        let pick = fake.header(Map::Request, DEST).unwrap();
        // Whatever an upstream (or a client, echoed) put there.
        fake.response
            .borrow_mut()
            .push((DEBUG_HEADER.into(), b"replica=evil".to_vec()));
        assert_eq!(s.on_response_headers(&fake), Action::Continue);
        if on {
            assert_eq!(fake.count_of(Map::Response, DEBUG_HEADER), 1);
            let d = fake.header(Map::Response, DEBUG_HEADER).unwrap();
            assert!(
                d.starts_with(&format!("replica={pick}; reason=new_prefix")),
                "{d}"
            );
            // Every replica's cost.
            assert!(POOL.iter().all(|e| d.contains(&format!("{e}="))), "{d}");
        } else {
            assert_eq!(fake.count_of(Map::Response, DEBUG_HEADER), 0);
        }
    }
}

#[test]
fn a_refused_header_write_is_counted_and_nothing_is_accounted() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    fake.refuse_request_writes.set(true);
    let mut s = post(&fake, &w, &[], &doc(1));
    assert_eq!(fake.stat("header_write_errors"), 1);
    assert_eq!(fake.stat("requests_total"), 0);
    assert!(in_flight(&fake).is_empty());
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
}

#[test]
fn shadow_mode_routes_with_the_baseline_and_counts_both() {
    let fake = Fake::new();
    let w = worker(&fake, r#","mode":"shadow","shadow_baseline":"round_robin""#);
    let mut picks = Vec::new();
    for n in 0..8 {
        let mut s = post(&fake, &w, &[], &doc(n % 2));
        picks.push(fake.header(Map::Request, DEST).unwrap());
        s.on_log(&fake);
    }
    // Round robin over the pool, whatever the prefix says.
    assert_eq!(
        picks[..4]
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len(),
        4
    );
    assert_eq!(fake.stat("shadow.requests"), 8);
    assert!(
        fake.stat("shadow.matched_blocks_total")
            > fake.stat("shadow.baseline_matched_blocks_total")
    );
    assert_eq!(fake.stat("requests_total"), 8);
}

#[test]
fn a_replica_that_leaves_the_pool_shows_nothing_in_flight_and_is_forgotten() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let eps = w.borrow().router.endpoints().to_vec();
    let busy = HashMap::from([(
        eps[0].id(),
        load::Load {
            requests: 3,
            ..load::Load::default()
        },
    )]);
    let gauge = format!("replica.{}.inflight", eps[0].stat_label());
    let mut wk = w.borrow_mut();
    wk.stats.show_load(&fake, &eps, &busy);
    assert_eq!(fake.stat(&gauge), 3);
    // The pool loses its first replica (a pod replaced): its gauge reads
    // 0, not its last count, and this VM keeps stats for the pool only.
    wk.stats.show_load(&fake, &eps[1..], &busy);
    assert_eq!(fake.stat(&gauge), 0);
    assert_eq!(wk.stats.replicas.len(), eps.len() - 1);
    // Back again: the same stat, shown again.
    wk.stats.show_load(&fake, &eps, &busy);
    assert_eq!(fake.stat(&gauge), 3);
    assert_eq!(wk.stats.replicas.len(), eps.len());
}

#[test]
fn the_expected_hit_rate_gauge_reads_0_once_it_is_no_longer_measured() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let eps = w.borrow().router.endpoints().to_vec();
    let gauge = format!("replica.{}.cache_expected_percent", eps[0].stat_label());
    let mut wk = w.borrow_mut();
    let sent = HashMap::from([(
        eps[0].id(),
        load::Load {
            sent: 4000,
            placed: 1000,
            ..load::Load::default()
        },
    )]);
    wk.stats.show_load(&fake, &eps, &sent);
    assert_eq!(fake.stat(&gauge), 75);
    // The traffic stopped and the counts decayed under what backs a rate
    // (or the slots expired): 0, as documented, not the last rate, which
    // stayed on the dashboards as if measured.
    let decayed = HashMap::from([(
        eps[0].id(),
        load::Load {
            sent: 400,
            placed: 100,
            ..load::Load::default()
        },
    )]);
    wk.stats.show_load(&fake, &eps, &decayed);
    assert_eq!(fake.stat(&gauge), 0);
    wk.stats.show_load(&fake, &eps, &sent);
    wk.stats.show_load(&fake, &eps, &HashMap::new());
    assert_eq!(fake.stat(&gauge), 0);
}

#[test]
fn a_request_served_elsewhere_moves_its_load_and_its_token_there() {
    let fake = Fake::new();
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#);
    let w = worker(&fake, &extra);
    let header = crate::config::DEFAULT_AFFINITY_HEADER;
    let mut s = post(&fake, &w, &[], &doc(1));
    let pick = fake.header(Map::Request, DEST).unwrap();
    let pick = pick.split(',').next().unwrap().to_string();
    let other = POOL.iter().find(|&&e| e != pick).unwrap().to_string();
    assert_eq!(in_flight(&fake), [(id_of(&pick), 1)].into());
    // The pick refused or failed it; Envoy's retry went to `other`.
    *fake.upstream.borrow_mut() = Some(other.clone());
    fake.respond(200);
    s.on_response_headers(&fake);
    assert_eq!(in_flight(&fake), [(id_of(&other), 1)].into());
    let token = fake.header(Map::Response, header).unwrap();
    let now_s = fake.now.get() / 1000;
    assert_eq!(
        affinity::verify(AFFINITY_KEY.as_bytes(), token.as_bytes(), now_s, 3600),
        Ok(id_of(&other))
    );
    assert_eq!(fake.stat("served_elsewhere"), 1);
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
    // The prompt moved in the index too: the next request with it and no
    // token goes where it was served, not back to the pick.
    let mut s = post(&fake, &w, &[], &doc(1));
    let again = fake.header(Map::Request, DEST).unwrap();
    assert_eq!(again.split(',').next(), Some(other.as_str()));
    s.on_log(&fake);
    // Served by the pick, or by an address outside the pool: nothing moves.
    for outside in [false, true] {
        let mut s = post(&fake, &w, &[], &doc(2));
        let pick = fake.header(Map::Request, DEST).unwrap();
        let pick = pick.split(',').next().unwrap().to_string();
        let upstream = if outside {
            "192.0.2.1:80"
        } else {
            pick.as_str()
        };
        *fake.upstream.borrow_mut() = Some(upstream.to_string());
        fake.respond(200);
        s.on_response_headers(&fake);
        assert_eq!(in_flight(&fake), [(id_of(&pick), 1)].into());
        s.on_log(&fake);
    }
    assert_eq!(fake.stat("served_elsewhere"), 1);
}

#[test]
fn a_refused_request_leaves_its_prompt_uncredited_on_its_pick() {
    // Refusals ran nothing; a 500, 502 or 504 may have computed the prompt
    // before failing, and a success did.
    for (status, uncredited) in [
        (429, true),
        (404, true),
        (400, true),
        (503, true),
        (307, true),
        (200, false),
        (500, false),
        (502, false),
        (504, false),
    ] {
        for affinity in ["", &format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#)] {
            let fake = Fake::new();
            let w = worker(&fake, affinity);
            // The pick held the document's first half before; the refusal
            // takes back only the rest.
            let half = completion(&"Document 1: ".repeat(50));
            let mut s = post(&fake, &w, &[], &half);
            let pick = fake.header(Map::Request, DEST).unwrap();
            let pick = pick.split(',').next().unwrap().to_string();
            fake.respond(200);
            s.on_response_headers(&fake);
            s.on_log(&fake);
            let mut s = post(&fake, &w, &[], &doc(1));
            assert_eq!(
                fake.header(Map::Request, DEST).unwrap().split(',').next(),
                Some(pick.as_str())
            );
            *fake.upstream.borrow_mut() = Some(pick.clone());
            fake.respond(status);
            s.on_response_headers(&fake);
            s.on_log(&fake);
            // The same prompt again finds on the pick what it holds.
            let mut s = post(&fake, &w, &[], &doc(1));
            let (held, blocks) = (fake.stat("matched_blocks"), fake.stat("request_blocks"));
            s.on_log(&fake);
            match uncredited {
                true => assert!(
                    0 < held && held <= blocks / 2,
                    "{status}: {held} of {blocks}"
                ),
                false => assert_eq!(held, blocks, "{status}"),
            }
            assert_eq!(
                fake.stat("index.uncredited"),
                i64::from(uncredited),
                "{status}"
            );
            assert_eq!(in_flight(&fake), HashMap::new(), "{status}");
        }
    }
}

/// Envoy's 408 is its own timeout once the request was sent (the stream
/// idle timeout, which the production config relies on instead of a route
/// timeout, or a max stream duration): Envoy stopped waiting, as with a
/// 504, and the server may have computed the prompt (a long non-streaming
/// generation sends no byte until it ends). It keeps the credit.
#[test]
fn envoys_408_after_the_request_was_sent_keeps_the_prompt_credited() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let mut s = post(&fake, &w, &[], &doc(1));
    let pick = fake.header(Map::Request, DEST).unwrap();
    fake.respond(408);
    s.on_response_headers(&fake);
    s.on_log(&fake);
    assert_eq!(fake.stat("index.uncredited"), 0);
    let mut s = post(&fake, &w, &[], &doc(1));
    let (held, blocks) = (fake.stat("matched_blocks"), fake.stat("request_blocks"));
    s.on_log(&fake);
    assert_eq!(fake.header(Map::Request, DEST), Some(pick));
    assert_eq!(held, blocks);
    assert_eq!(in_flight(&fake), HashMap::new());
}

/// `doc(1)` routed, then answered `status` by another replica than the
/// pick (the pick refused the connection and Envoy retried): the stream
/// after its response headers, the pick, and the replica that answered.
fn answered_elsewhere(
    fake: &Fake,
    w: &Rc<RefCell<Worker>>,
    status: u16,
) -> (HttpFilter, String, String) {
    let mut s = post(fake, w, &[], &doc(1));
    let pick = fake.header(Map::Request, DEST).unwrap();
    let pick = pick.split(',').next().unwrap().to_string();
    let other = POOL.iter().find(|&&e| e != pick).unwrap().to_string();
    *fake.upstream.borrow_mut() = Some(other.clone());
    fake.respond(status);
    s.on_response_headers(fake);
    (s, pick, other)
}

#[test]
fn a_failure_served_elsewhere_keeps_its_prompt_where_it_failed() {
    // The pick refused the connection and Envoy's retry went to `other`,
    // which failed the request: a 500, 502 or 504 may have computed the
    // prompt there (it keeps the credit), a 503 ran it nowhere. The pick
    // ran nothing either way, and no token names anyone.
    let header = crate::config::DEFAULT_AFFINITY_HEADER;
    for (status, kept) in [(500, true), (502, true), (504, true), (503, false)] {
        let fake = Fake::new();
        let w = worker(&fake, &format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#));
        let (mut s, _, other) = answered_elsewhere(&fake, &w, status);
        assert_eq!(fake.header(Map::Response, header), None, "{status}");
        assert_eq!(in_flight(&fake), [(id_of(&other), 1)].into(), "{status}");
        s.on_log(&fake);
        assert_eq!(fake.stat("served_elsewhere"), 1, "{status}");
        let mut s = post(&fake, &w, &[], &doc(1));
        let (held, blocks) = (fake.stat("matched_blocks"), fake.stat("request_blocks"));
        let next = fake.header(Map::Request, DEST).unwrap();
        s.on_log(&fake);
        if kept {
            assert_eq!(next.split(',').next(), Some(other.as_str()), "{status}");
            assert_eq!(held, blocks, "{status}");
        } else {
            assert_eq!(held, 0, "{status}: nobody holds it");
        }
    }
}

/// New content placed per replica lately (`load::Load::branches`), as the
/// next placement of new content reads it.
fn branches(fake: &Fake) -> HashMap<ReplicaId, u32> {
    load::snapshot(&fake.store, fake.now.get(), 60_000)
        .into_iter()
        .filter(|(_, l)| l.branches > 0)
        .map(|(id, l)| (id, l.branches))
        .collect()
}

#[test]
fn new_content_counts_where_it_started_not_where_it_was_refused() {
    let fake = Fake::new();
    let w = worker(&fake, &format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#));
    let first = |s: &str| s.split(',').next().unwrap().to_string();
    // Served by the pick: counted there.
    let mut s = post(&fake, &w, &[], &doc(1));
    let pick = first(&fake.header(Map::Request, DEST).unwrap());
    *fake.upstream.borrow_mut() = Some(pick.clone());
    fake.respond(200);
    s.on_response_headers(&fake);
    s.on_log(&fake);
    assert_eq!(branches(&fake), [(id_of(&pick), 1)].into());
    // Refused (a 429): counted nowhere.
    let mut s = post(&fake, &w, &[], &doc(2));
    let refused = first(&fake.header(Map::Request, DEST).unwrap());
    *fake.upstream.borrow_mut() = Some(refused.clone());
    fake.respond(429);
    s.on_response_headers(&fake);
    s.on_log(&fake);
    assert_eq!(
        branches(&fake),
        [(id_of(&pick), 1)].into(),
        "{refused} refused"
    );
    // Served elsewhere (the pick refused the connection): counted there.
    let mut s = post(&fake, &w, &[], &doc(3));
    let third = first(&fake.header(Map::Request, DEST).unwrap());
    let other = POOL
        .iter()
        .find(|&&e| e != third && e != pick)
        .unwrap()
        .to_string();
    *fake.upstream.borrow_mut() = Some(other.clone());
    fake.respond(200);
    s.on_response_headers(&fake);
    s.on_log(&fake);
    assert_eq!(
        branches(&fake),
        [(id_of(&pick), 1), (id_of(&other), 1)].into(),
        "{third}"
    );
}

#[test]
fn a_refused_turn_leaves_its_session_counted_where_it_was() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    let turn = |t: usize| crate::route::tests::agent(0, t).into_bytes();
    let serve = |body: &[u8], status: u16| -> String {
        let mut s = post(&fake, &w, &[], body);
        let pick = fake.header(Map::Request, DEST).unwrap();
        let pick = pick.split(',').next().unwrap().to_string();
        *fake.upstream.borrow_mut() = Some(pick.clone());
        fake.respond(status);
        s.on_response_headers(&fake);
        s.on_log(&fake);
        pick
    };
    serve(&turn(0), 200);
    serve(&turn(1), 200);
    let home = serve(&turn(2), 200);
    assert_eq!(serve(&turn(2), 200), home);
    let before = branches(&fake);
    // The home is busy (another VM's long turn): the next turn spills,
    // and is refused there (a 429). The session is still at home.
    let mut other = load::LoadBoard::new(99, 60_000);
    let busy = load::Start {
        work: 6_000,
        ..load::Start::default()
    };
    other.start(&fake.store, id_of(&home), busy, fake.now.get());
    let spills = fake.stat("decision.load_spill");
    let went = serve(&turn(3), 429);
    assert_eq!(fake.stat("decision.load_spill"), spills + 1, "{went}");
    assert_ne!(went, home);
    other.finish(&fake.store, id_of(&home), 6_000, fake.now.get());
    assert_eq!(branches(&fake), before, "home {home}, refused at {went}");
}

#[test]
fn a_refusal_with_no_prompt_credited_is_not_counted_uncredited() {
    let fake = Fake::new();
    let w = worker(&fake, "");
    fake.start(&[(":method", b"GET"), (":path", b"/v1/models/nope")], b"");
    let mut s = HttpFilter::new(Some(w.clone()));
    s.on_request_headers(&fake, true);
    assert!(fake.header(Map::Request, DEST).is_some());
    fake.respond(404);
    s.on_response_headers(&fake);
    s.on_log(&fake);
    assert_eq!(fake.stat("index.uncredited"), 0);
}

/// The stat names in README's Stats table, braces expanded, `<ip_port>`
/// left as is, each with the `prefix_router.` prefix.
fn documented_stats() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let table = readme.split("\n## Stats\n").nth(1).unwrap_or_default();
    let table = table.split("\n## ").next().unwrap_or_default();
    let mut names = Vec::new();
    for row in table.lines().filter(|l| l.starts_with("| `")) {
        let first = row.split(" | ").next().unwrap_or_default();
        for name in first.split('`').skip(1).step_by(2) {
            let name = match name.starts_with(P) {
                true => name.to_string(),
                false => format!("{P}.{name}"),
            };
            match (name.split_once('{'), name.split_once('}')) {
                (Some((head, rest)), Some((_, tail))) => {
                    let inside = rest.split('}').next().unwrap_or_default();
                    names.extend(inside.split(',').map(|v| format!("{head}{v}{tail}")));
                }
                _ => names.push(name),
            }
        }
    }
    names
}

#[test]
fn every_stat_the_filter_defines_is_documented() {
    let fake = Fake::new();
    let _w = worker(&fake, "");
    // And the scraper VM's.
    stats::ScraperStats::define(&fake);
    for e in POOL {
        stats::ScrapeGauges::define(&fake, &e.parse().unwrap());
    }
    let documented = documented_stats();
    assert!(documented.len() >= 30, "{documented:?}");
    let labels: Vec<String> = POOL
        .iter()
        .map(|e| e.parse::<Endpoint>().unwrap().stat_label())
        .collect();
    let defined = fake.stats.borrow().clone();
    assert!(defined.len() >= 30);
    for (name, _) in defined {
        let generic = labels.iter().fold(name.clone(), |n, l| {
            n.replace(&format!(".{l}."), ".<ip_port>.")
        });
        assert!(
            documented.contains(&generic),
            "{name} is not in README's Stats table"
        );
    }
}

/// Shadow mode only records what prefix-router would do: a sheddable
/// request it would refuse on saturated replicas is routed with the
/// baseline (which never sheds) and counted, while route mode sheds it.
#[test]
fn shadow_mode_counts_what_it_would_shed_and_routes_it() {
    let answer = |mode: &str| {
        let fake = Fake::new();
        let w = worker(&fake, &format!(r#","cluster":"pool","mode":"{mode}""#));
        let (action, _) = sheddable_on_a_saturated_pool(&fake, &w);
        let replies: Vec<u32> = fake.replies.borrow().iter().map(|r| r.status).collect();
        let routed = fake.header(Map::Request, DEST).is_some();
        let would_shed = fake.stat("shadow.would_shed");
        (action, replies, routed, would_shed)
    };
    assert_eq!(answer("route"), (Action::Pause, vec![429], false, 0));
    assert_eq!(answer("shadow"), (Action::Continue, vec![], true, 1));
}

/// Review finding: shadow mode promises that nothing changes for clients
/// (docs/operators-guide.md), but with `affinity` configured its responses
/// still carried a token header and a `set-cookie` naming the baseline's
/// pick: a new cookie in every browser and SDK jar while only measuring.
#[test]
fn shadow_mode_issues_no_affinity_token_or_cookie() {
    let issued = |mode: &str| {
        let fake = Fake::new();
        let extra =
            format!(r#","mode":"{mode}","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
        let w = worker(&fake, &extra);
        let (_, set) = cookie_turn(&fake, &w, None, &conversation(1, 2));
        let token = fake.header(Map::Response, crate::config::DEFAULT_AFFINITY_HEADER);
        (token.is_some(), set.is_some())
    };
    assert_eq!(issued("route"), (true, true));
    assert_eq!(issued("shadow"), (false, false));
}

/// A chat below a system prompt whose rendering ends on a block boundary
/// (1,536 bytes: 24 blocks of 64), then `turns` as (role, content).
fn aligned_chat(turns: &[(&str, &str)]) -> Vec<u8> {
    let system = "s".repeat(1521);
    let mut messages = vec![format!(r#"{{"role":"system","content":"{system}"}}"#)];
    messages.extend(
        turns
            .iter()
            .map(|(r, c)| format!(r#"{{"role":"{r}","content":"{c}"}}"#)),
    );
    format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(",")).into_bytes()
}

#[test]
fn a_new_conversation_that_shares_only_a_system_prompt_follows_no_cookie_entry() {
    // Conversation A's first question is short: all of it lies in the
    // prompt's last, partial block, so the whole blocks of its prompt are
    // the system prompt every conversation shares.
    let a1 = aligned_chat(&[("user", "What is the refund policy?")]);
    let text = crate::request::extract(&a1, 1 << 20).unwrap().text;
    assert_eq!(
        text.len() / 64,
        24,
        "A's whole blocks are the system prompt"
    );
    let long = "Conversation B asks a long question. ".repeat(40);
    let b1 = aligned_chat(&[("user", &long)]);
    let a2 = aligned_chat(&[
        ("user", "What is the refund policy?"),
        ("assistant", "Thirty days."),
        ("user", &"And for opened items? ".repeat(20)),
    ]);
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    let (a, b) = (Fake::new(), Fake::new());
    let (wa, wb) = (worker(&a, &extra), worker(&b, &extra));
    let (home_a, set) = cookie_turn(&a, &wa, None, &a1);
    // Another conversation in the same jar (README: "A new conversation
    // in the same jar follows nothing").
    let (_, set) = cookie_turn(&a, &wa, Some(&set.unwrap().0), &b1);
    assert_eq!(
        a.stat("decision.affinity"),
        0,
        "B's first turn followed A's entry"
    );
    // A's next turn, at another instance, still finds its own entry.
    let (pick, _) = cookie_turn(&b, &wb, Some(&set.unwrap().0), &a2);
    assert_eq!(b.stat("decision.affinity"), 1, "A lost its entry to B");
    assert_eq!(pick, home_a);
}

#[test]
fn the_affinity_cookie_is_stripped_beside_a_cookie_that_is_not_utf8() {
    // README: the cookie is "removed from the request before it goes
    // upstream (the client's other cookies stay)".
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    let fake = Fake::new();
    let w = worker(&fake, &extra);
    let (_, set) = cookie_turn(&fake, &w, None, &conversation(0, 1));
    let jar = set.unwrap().0;
    let mut header = format!("pr={jar}; theirs=").into_bytes();
    header.extend_from_slice(&[0xe9, b'1']);
    let s = post(&fake, &w, &[("cookie", &header)], &conversation(0, 2));
    let sent = fake.request.borrow().clone();
    let cookie: Vec<&[u8]> = sent
        .iter()
        .filter(|(k, _)| k == b"cookie")
        .map(|(_, v)| v.as_slice())
        .collect();
    assert_eq!(cookie, vec![&b"theirs=\xe91"[..]]);
    assert_eq!(fake.stat("decision.affinity"), 1);
    drop(s);
}

/// One Responses API create on a fresh stream: its path, its
/// `content-length`, the body.
fn responses_post(fake: &Fake, w: &Rc<RefCell<Worker>>, body: &str) -> HttpFilter {
    let len = body.len().to_string();
    let headers = [
        (":method", &b"POST"[..]),
        (":path", b"/v1/responses"),
        ("content-length", len.as_bytes()),
    ];
    fake.start(&headers, body.as_bytes());
    let mut s = HttpFilter::new(Some(w.clone()));
    assert_eq!(s.on_request_headers(fake, false), Action::Pause);
    assert_eq!(s.on_request_body(fake, body.len(), true), Action::Continue);
    s
}

/// The `request_id` the filter gave a body, if any.
fn request_id(fake: &Fake) -> Option<String> {
    let body = fake.body.borrow();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["request_id"].as_str().map(str::to_string)
}

const RESPONSES: &str = r#","inference_paths":["/v1/completions","/v1/responses"]"#;

#[test]
fn a_stored_response_is_named_for_its_replica_and_its_follow_ups_reach_it_from_any_instance() {
    let extra = format!(r#"{RESPONSES},"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#);
    // Two gateway instances: their own shared data, one key.
    let (a, b) = (Fake::new(), Fake::new());
    let (wa, wb) = (worker(&a, &extra), worker(&b, &extra));
    let first = r#"{"model":"m","instructions":"Be brief.","input":"What is a KV cache?"}"#;
    responses_post(&a, &wa, first);
    let home = a.header(Map::Request, DEST).unwrap();
    let id = request_id(&a).expect("named");
    assert_eq!(
        response::replica_of(AFFINITY_KEY.as_bytes(), id.as_bytes()),
        Ok(id_of(&home))
    );
    // The rest of the body as it came, and a length that says so.
    let sent = a.body.borrow().clone();
    assert_eq!(
        a.header(Map::Request, "content-length"),
        Some(sent.len().to_string())
    );
    let mut v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    v.as_object_mut().unwrap().remove("request_id");
    assert_eq!(v, serde_json::from_str::<serde_json::Value>(first).unwrap());
    assert_eq!(a.stat("responses.named"), 1);
    // Instance B never saw it, and its own ranking would put the
    // follow-up (a prompt it has never seen) by load: with the other
    // replicas idle and the home busy, anywhere but home.
    let mut held = Vec::new();
    for i in 0..64 {
        let mut s = post(&b, &wb, &[], &doc(100 + i));
        if b.header(Map::Request, DEST).as_deref() == Some(home.as_str()) {
            held.push(s);
        } else {
            s.on_log(&b);
        }
    }
    assert_eq!(in_flight(&b), [(id_of(&home), held.len() as u32)].into());
    assert!(held.len() >= 2, "{}", held.len());
    for turn in 0..3 {
        let next =
            format!(r#"{{"model":"m","previous_response_id":"{id}","input":"And turn {turn}?"}}"#);
        responses_post(&b, &wb, &next);
        assert_eq!(
            b.header(Map::Request, DEST),
            Some(home.clone()),
            "turn {turn}"
        );
    }
    assert_eq!(b.stat("decision.stored_response"), 3);
    assert_eq!(b.stat("responses.unknown"), 0);
    // Each follow-up is stored too, under its own new name.
    assert_eq!(b.stat("responses.named"), 3);
    // Reading it back by its path goes there as well.
    for path in [
        format!("/v1/responses/{id}"),
        format!("/v1/responses/{id}/cancel"),
    ] {
        b.start(&[(":method", b"GET"), (":path", path.as_bytes())], b"");
        let mut s = HttpFilter::new(Some(wb.clone()));
        assert_eq!(s.on_request_headers(&b, true), Action::Continue);
        assert_eq!(b.header(Map::Request, DEST), Some(home.clone()), "{path}");
    }
    assert_eq!(b.stat("decision.stored_response"), 5);
}

#[test]
fn responses_the_filter_did_not_name_are_left_alone_and_counted() {
    let extra = format!(r#"{RESPONSES},"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#);
    let fake = Fake::new();
    let w = worker(&fake, &extra);
    // Not stored, or named by the client: the body goes as it came.
    for body in [
        r#"{"model":"m","input":"hi","store":false}"#,
        r#"{"model":"m","input":"hi","store":null}"#,
        r#"{"model":"m","input":"hi","request_id":"mine"}"#,
        // A `request_id` anywhere, even `null`, even after another: the
        // server's parser keeps a key's last value, so a name put first
        // would lose to it (the filter counted such a response named,
        // and the server named it itself).
        r#"{"model":"m","input":"hi","request_id":null}"#,
        r#"{"model":"m","input":"hi","request_id":"mine","request_id":null}"#,
    ] {
        responses_post(&fake, &w, body);
        assert_eq!(*fake.body.borrow(), body.as_bytes(), "{body}");
        assert!(!fake.calls().iter().any(|c| c.starts_with("write body")));
    }
    assert_eq!(fake.stat("responses.named"), 0);
    // Ids the server made, another key minted, or a client forged: routed
    // as any request, and counted.
    let foreign = response::mint(b"another key, also 32 bytes long!", id_of(POOL[0]), 0, 1);
    for id in ["resp_0123456789abcdef", foreign.as_str()] {
        let body = format!(r#"{{"model":"m","previous_response_id":"{id}","input":"hi"}}"#);
        responses_post(&fake, &w, &body);
        assert!(fake.header(Map::Request, DEST).is_some());
    }
    assert_eq!(fake.stat("responses.unknown"), 2);
    assert_eq!(fake.stat("decision.stored_response"), 0);
    // An id of the wrong type is the server's to refuse: the prompt still
    // routes by its prefix.
    responses_post(
        &fake,
        &w,
        r#"{"model":"m","previous_response_id":7,"input":"hi"}"#,
    );
    assert_eq!(fake.stat("parse_errors"), 0);
    // Other paths take `input` too (embeddings): never renamed.
    let embed = format!(
        r#","inference_paths":["/v1/responses","/v1/embeddings"],"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#
    );
    let we = worker(&fake, &embed);
    let named = fake.stat("responses.named");
    let body = r#"{"model":"m","input":"Embed this sentence, please."}"#;
    fake.start(
        &[(":method", b"POST"), (":path", b"/v1/embeddings")],
        body.as_bytes(),
    );
    let mut s = HttpFilter::new(Some(we));
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(s.on_request_body(&fake, body.len(), true), Action::Continue);
    assert_eq!(*fake.body.borrow(), body.as_bytes());
    assert_eq!(fake.stat("responses.named"), named);
    // Without the option nothing is renamed or followed.
    let plain = worker(
        &fake,
        &format!(r#"{RESPONSES},"affinity":{{"key":"{AFFINITY_KEY}"}}"#),
    );
    let body = r#"{"model":"m","input":"hi"}"#;
    responses_post(&fake, &plain, body);
    assert_eq!(*fake.body.borrow(), body.as_bytes());
}

#[test]
fn a_named_response_served_elsewhere_is_counted_misplaced() {
    let extra = format!(r#"{RESPONSES},"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#);
    let fake = Fake::new();
    let w = worker(&fake, &extra);
    // Served where it was named, or not named (store false), or named and
    // served by another replica after the pick refused it.
    // A 404 elsewhere stored nothing (a follow-up whose replica refused
    // the connection, answered by the next address).
    for (body, elsewhere, status, misplaced) in [
        (r#"{"model":"m","input":"a"}"#, false, 200, 0),
        (r#"{"model":"m","input":"b","store":false}"#, true, 200, 0),
        (r#"{"model":"m","input":"c"}"#, true, 404, 0),
        (r#"{"model":"m","input":"d"}"#, true, 200, 1),
    ] {
        let mut s = responses_post(&fake, &w, body);
        let pick = fake.header(Map::Request, DEST).unwrap();
        let pick = pick.split(',').next().unwrap().to_string();
        let other = POOL.iter().find(|&&e| e != pick).unwrap().to_string();
        *fake.upstream.borrow_mut() = Some(if elsewhere { other } else { pick });
        fake.respond(status);
        s.on_response_headers(&fake);
        s.on_log(&fake);
        assert_eq!(fake.stat("responses.misplaced"), misplaced, "{body}");
    }
    assert_eq!(fake.stat("served_elsewhere"), 3);
    // With a fallback listed: stored on it, it is where follow-ups look;
    // on a replica the header didn't list (Envoy's fallback policy), not.
    let w = worker(&fake, &format!(r#"{extra},"max_fallbacks":1"#));
    for (listed, misplaced) in [(true, 1), (false, 2)] {
        let mut s = responses_post(&fake, &w, r#"{"model":"m","input":"e"}"#);
        let dest = fake.header(Map::Request, DEST).unwrap();
        let (_, second) = dest.split_once(',').unwrap();
        let outside = POOL.iter().find(|&&e| !dest.contains(e)).unwrap();
        *fake.upstream.borrow_mut() = Some(if listed { second } else { outside }.to_string());
        fake.respond(200);
        s.on_response_headers(&fake);
        s.on_log(&fake);
        assert_eq!(fake.stat("responses.misplaced"), misplaced, "{dest}");
    }
}

#[test]
fn a_create_its_home_refused_is_found_on_the_homes_successor_from_any_instance() {
    let extra = format!(
        r#"{RESPONSES},"max_fallbacks":1,"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#
    );
    // Instance A names a create after its pick and lists the pick's
    // successor; the pick refuses it, and the successor stores it.
    let (a, b) = (Fake::new(), Fake::new());
    let (wa, wb) = (worker(&a, &extra), worker(&b, &extra));
    let mut s = responses_post(&a, &wa, r#"{"model":"m","input":"What is a KV cache?"}"#);
    let listed = a.header(Map::Request, DEST).unwrap();
    let (home, succ) = listed.split_once(',').unwrap();
    let id = request_id(&a).unwrap();
    assert_eq!(a.header(Map::Request, "x-envoy-retry-on"), None);
    *a.upstream.borrow_mut() = Some(succ.to_string());
    a.respond(200);
    s.on_response_headers(&a);
    s.on_log(&a);
    assert_eq!(a.stat("served_elsewhere"), 1);
    assert_eq!(a.stat("responses.misplaced"), 0);
    // Instance B, busy elsewhere than A, lists the same two for each
    // follow-up and asks Envoy to retry the home's 404 on the successor;
    // each follow-up is named after the home again, so its own
    // follow-ups look in the same two places.
    // (Its successor is the busiest there: by load it would be listed last.)
    let mut held = Vec::new();
    for i in 0..64 {
        let mut s = post(&b, &wb, &[], &doc(100 + i));
        let dest = b.header(Map::Request, DEST).unwrap();
        if dest.split(',').next() == Some(succ) {
            held.push(s);
        } else {
            s.on_log(&b);
        }
    }
    assert!(held.len() >= 2, "{}", held.len());
    let mut previous = id;
    for turn in 0..3 {
        let next = format!(
            r#"{{"model":"m","previous_response_id":"{previous}","input":"And turn {turn}?"}}"#
        );
        responses_post(&b, &wb, &next);
        assert_eq!(
            b.header(Map::Request, DEST).as_deref(),
            Some(listed.as_str())
        );
        assert_eq!(
            b.header(Map::Request, "x-envoy-retry-on").as_deref(),
            Some("retriable-status-codes")
        );
        assert_eq!(
            b.header(Map::Request, "x-envoy-retriable-status-codes")
                .as_deref(),
            Some("404")
        );
        previous = request_id(&b).unwrap();
        assert_eq!(
            response::replica_of(AFFINITY_KEY.as_bytes(), previous.as_bytes()),
            Ok(id_of(home))
        );
    }
    assert_eq!(b.stat("decision.stored_response"), 3);
    // The home has left the pool (a replica that died): the follow-up
    // goes to its successor first, where a create the home refused is.
    let c = Fake::new();
    let wc = worker_without(&c, home, &extra);
    let next =
        format!(r#"{{"model":"m","previous_response_id":"{previous}","input":"Still there?"}}"#);
    responses_post(&c, &wc, &next);
    let dest = c.header(Map::Request, DEST).unwrap();
    assert_eq!(dest.split(',').next(), Some(succ), "{dest}");
    assert_eq!(c.stat("responses.unknown"), 1);
}

#[test]
fn a_follow_up_whose_replica_left_the_pool_is_counted_and_routed() {
    let extra = format!(r#"{RESPONSES},"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#);
    let fake = Fake::new();
    let w = worker(&fake, &extra);
    let gone = response::mint(AFFINITY_KEY.as_bytes(), id_of("10.9.9.9:80"), 0, 1);
    let body = format!(r#"{{"model":"m","previous_response_id":"{gone}","input":"hi"}}"#);
    responses_post(&fake, &w, &body);
    let pick = fake.header(Map::Request, DEST).unwrap();
    // Its first successor, where a create it refused would be.
    let first = POOL
        .iter()
        .max_by_key(|&&e| crate::score::rendezvous(id_of("10.9.9.9:80"), id_of(e)))
        .unwrap();
    assert_eq!(&pick, first);
    assert_eq!(fake.stat("responses.unknown"), 1);
    assert_eq!(fake.stat("decision.stored_response"), 1);
    // Its own response keeps the name it continues.
    let next = request_id(&fake).unwrap();
    assert_eq!(
        response::replica_of(AFFINITY_KEY.as_bytes(), next.as_bytes()),
        Ok(id_of("10.9.9.9:80"))
    );
}

#[test]
fn a_follow_up_of_a_gone_replica_refused_by_its_successor_is_found_by_the_next() {
    // The home is gone: the follow-up lists its successors S1, S2; S1
    // refuses and S2 stores it. Named after the home, its own follow-up
    // lists S1, S2 again (named after S1, it listed S1's successors,
    // which need not include S2). And a create served by a host the
    // filter doesn't know is stored where no follow-up looks.
    let extra = format!(
        r#"{RESPONSES},"max_fallbacks":1,"affinity":{{"key":"{AFFINITY_KEY}","response_ids":true}}"#
    );
    for home in POOL {
        let f = Fake::new();
        let w = worker_without(&f, home, &extra);
        let r0 = response::mint(AFFINITY_KEY.as_bytes(), id_of(home), 0, 1);
        let body = format!(r#"{{"model":"m","previous_response_id":"{r0}","input":"t1"}}"#);
        let mut s = responses_post(&f, &w, &body);
        let listed = f.header(Map::Request, DEST).unwrap();
        let (_, second) = listed.split_once(',').unwrap();
        let r1 = request_id(&f).unwrap();
        *f.upstream.borrow_mut() = Some(second.to_string());
        f.respond(200);
        s.on_response_headers(&f);
        s.on_log(&f);
        let body = format!(r#"{{"model":"m","previous_response_id":"{r1}","input":"t2"}}"#);
        responses_post(&f, &w, &body);
        assert_eq!(
            f.header(Map::Request, DEST).as_deref(),
            Some(listed.as_str()),
            "{home}"
        );
        assert_eq!(f.stat("responses.misplaced"), 0, "{home}");
        // Served by a host outside the pool: misplaced.
        let mut s = responses_post(&f, &w, r#"{"model":"m","input":"x"}"#);
        *f.upstream.borrow_mut() = Some("10.0.0.9:80".to_string());
        f.respond(200);
        s.on_response_headers(&f);
        s.on_log(&f);
        assert_eq!(f.stat("responses.misplaced"), 1, "{home}");
    }
}

#[test]
fn stored_sessions_below_one_preamble_spread_from_their_first_turn() {
    // Every later turn follows the first by name, so where a first turn
    // lands binds its session: short first questions below a shared
    // preamble are spread by load, not left with the preamble's holder.
    let homes = |response_ids: bool| {
        let extra = format!(
            r#"{RESPONSES},"gateways":3,"affinity":{{"key":"{AFFINITY_KEY}","response_ids":{response_ids}}}"#
        );
        let fake = Fake::new();
        let w = worker(&fake, &extra);
        let preamble = "You are a careful assistant. ".repeat(40);
        let mut held = Vec::new();
        let mut homes = std::collections::HashSet::new();
        for c in 0..8 {
            let body =
                format!(r#"{{"model":"m","instructions":"{preamble}","input":"Session {c}?"}}"#);
            held.push(responses_post(&fake, &w, &body));
            homes.insert(fake.header(Map::Request, DEST).unwrap());
        }
        homes.len()
    };
    // The control: with the preamble's holder, or its one alternative.
    assert!(homes(false) <= 2);
    assert_eq!(homes(true), 4);
}

/// Prompt blocks counted per replica lately: new content placed there
/// (`load::Load::placed`) and all blocks sent there (`sent`), as the next
/// decision (and `cache_expected_percent`) reads them.
fn blocks_counted(fake: &Fake) -> HashMap<ReplicaId, (u32, u32)> {
    load::snapshot(&fake.store, fake.now.get(), 60_000)
        .into_iter()
        .filter(|(_, l)| l.placed > 0 || l.sent > 0)
        .map(|(id, l)| (id, (l.placed, l.sent)))
        .collect()
}

#[test]
fn a_refused_request_leaves_no_blocks_placed_on_its_pick() {
    // A refusal ran nothing (README, "A refusal computed nothing"): the
    // pick's credit and its session count go; so must the blocks the
    // commit counted as new content placed in its cache, or the spread
    // term and the tie-break keep new prefixes off a replica that never
    // computed them, and its expected hit rate counts prompts it never saw.
    for status in [429, 503, 404] {
        let fake = Fake::new();
        let w = worker(&fake, "");
        let mut s = post(&fake, &w, &[], &doc(1));
        let pick = fake.header(Map::Request, DEST).unwrap();
        let pick = pick.split(',').next().unwrap().to_string();
        let blocks = fake.stat("request_blocks") as u32;
        assert!(blocks > 0);
        assert_eq!(
            blocks_counted(&fake),
            [(id_of(&pick), (blocks, blocks))].into()
        );
        *fake.upstream.borrow_mut() = Some(pick.clone());
        fake.respond(status);
        s.on_response_headers(&fake);
        s.on_log(&fake);
        assert_eq!(fake.stat("index.uncredited"), 1, "{status}");
        assert_eq!(blocks_counted(&fake), HashMap::new(), "{status}");
    }
}

#[test]
fn blocks_placed_move_with_a_request_served_elsewhere() {
    // The pick refused the connection; Envoy's retry went to `other`,
    // which computed the prompt (a success, or a 500 after prefill): the
    // index credit, the load and the session count move there, and so
    // must the new content the commit counted on the pick.
    for status in [200, 500] {
        let fake = Fake::new();
        let w = worker(&fake, &format!(r#","affinity":{{"key":"{AFFINITY_KEY}"}}"#));
        let (mut s, pick, other) = answered_elsewhere(&fake, &w, status);
        let blocks = fake.stat("request_blocks") as u32;
        s.on_log(&fake);
        assert_eq!(fake.stat("served_elsewhere"), 1);
        assert_eq!(
            blocks_counted(&fake),
            [(id_of(&other), (blocks, blocks))].into(),
            "{status}: pick {pick}"
        );
    }
}

#[test]
fn a_success_served_outside_the_pool_names_no_replica() {
    // Envoy's fallback policy (or a host this VM doesn't know yet) served
    // the turn: the pick ran nothing. A token or cookie naming the pick
    // sends the session's next turn to a replica that never held it; the
    // client's last token or cookie still says where the session is.
    let header = crate::config::DEFAULT_AFFINITY_HEADER;
    let fake = Fake::new();
    let extra = format!(r#","affinity":{{"key":"{AFFINITY_KEY}","cookie":"pr"}}"#);
    let w = worker(&fake, &extra);
    let mut s = post(&fake, &w, &[], &conversation(0, 1));
    assert!(fake.header(Map::Request, DEST).is_some());
    *fake.upstream.borrow_mut() = Some("192.0.2.1:80".to_string());
    fake.respond(200);
    s.on_response_headers(&fake);
    assert_eq!(fake.header(Map::Response, header), None);
    assert_eq!(fake.count_of(Map::Response, "set-cookie"), 0);
    s.on_log(&fake);
    assert!(in_flight(&fake).is_empty());
    // Nor is the prompt looked for on the pick, nor counted there as a
    // session started.
    assert_eq!(fake.stat("index.uncredited"), 1);
    assert_eq!(branches(&fake), HashMap::new());
    let mut s = post(&fake, &w, &[], &conversation(0, 1));
    assert_eq!(fake.stat("matched_blocks"), 0);
    s.on_log(&fake);
}

#[test]
fn a_refusal_the_host_would_not_send_does_not_hang_the_stream() {
    // The pool is empty (or the request is shed) and the host refuses the
    // local reply: paused, the stream is never answered nor resumed (the
    // client waits for a timeout, its buffered body held). Going on
    // without a destination, Envoy answers it (original_dst: a 503) or
    // its fallback policy routes it.
    let fake = Fake::new();
    let w = empty_pool(&fake);
    fake.refuse_local_replies.set(true);
    let body = doc(1);
    fake.start(&POST, &body);
    let mut s = HttpFilter::new(Some(w));
    assert_eq!(s.on_request_headers(&fake, false), Action::Pause);
    assert_eq!(s.on_request_body(&fake, body.len(), true), Action::Continue);
    assert_eq!(fake.header(Map::Request, DEST), None);
    s.on_log(&fake);
}

/// `decision.credit_withheld` counts requests, as its siblings
/// `replica_evicting` and `replica_hot` do and as the README's stats
/// table says: a request whose prefix two evicting replicas held (two
/// copies) added 2.
#[test]
fn credit_withheld_counts_requests_not_replicas() {
    let h = Fake::new();
    let stats = Stats::define(&h, &[]);
    let choice = Choice {
        order: vec![0],
        reason: Reason::NewPrefix,
        blocks: 8,
        matched: 0,
        stamped: 0,
        work: 16,
        matches: crate::index::Matches::default(),
        home: None,
        withheld: 2,
        evicting: 2,
        hot: 0,
        blind: false,
    };
    count(&h, &stats, &choice, RecordStats::default());
    assert_eq!(h.stat("decision.credit_withheld"), 1);
    assert_eq!(h.stat("decision.replica_evicting"), 1);
    assert_eq!(h.stat("requests_total"), 1);
}
