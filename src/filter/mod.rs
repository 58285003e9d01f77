//! One HTTP stream through the filter, host-independent: strip the
//! client's destination header, pause an inference request until its body
//! is complete, read the body once, decide, write the destination header,
//! and account the request until its stream ends; or answer it (429/503).
//!
//! Every host call goes through [`Host`]: `host::Envoy` implements it over
//! the proxy-wasm ABI (`host/http.rs` is a thin adapter from the SDK's
//! callbacks to [`HttpFilter`]), and the tests use a fake, so the whole
//! request path runs natively.

pub mod stats;

#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::rc::Rc;

pub use proxy_wasm::types::Action;

use crate::affinity::{self, cookie, response};
use crate::config::{Affinity, Config, Mode, DEFAULT_DESTINATION_HEADER};
use crate::endpoint::{Endpoint, ReplicaId};
use crate::headers::{self, Pairs};
use crate::index::RecordStats;
use crate::load::{LoadBoard, Start};
use crate::prefix::{Checkpoint, Probe};
use crate::request::{Header, Responses};
use crate::route::{is_sheddable, Choice, Diagnostics, Hashed, Meta, Placed, Reject, Router};
use crate::score::Reason;
use crate::store::Store;
use stats::{Metrics, Stats};

/// The response header carrying `Router::explain` (with `debug_header`).
pub const DEBUG_HEADER: &str = "x-prefix-router-debug";

/// A header map the filter edits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Map {
    Request,
    Response,
}

/// The host calls an HTTP stream makes. Fallible calls return the host's
/// status code, for logging and counting; none of them may panic.
pub trait Host: Metrics {
    type Store: Store + ?Sized;

    /// Shared data, seen by every worker.
    fn store(&self) -> &Self::Store;
    /// Milliseconds since the Unix epoch (0 if the host can't tell).
    fn now_ms(&self) -> u64;
    /// Every request header, as raw bytes (empty if unreadable).
    fn request_headers(&self) -> Pairs;
    /// Remove every copy of a header.
    fn remove_header(&self, map: Map, name: &str) -> Result<(), u32>;
    /// The response's `:status`, in the response headers callback.
    fn response_status(&self) -> Option<u16>;
    /// The upstream host that answered (`ip:port`), once there is one.
    fn upstream_address(&self) -> Option<String>;
    /// Set a header to one value, replacing every copy.
    fn replace_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32>;
    /// `replace_header` with a value that needn't be UTF-8 (a request's
    /// own bytes, written back).
    fn replace_header_bytes(&self, map: Map, name: &str, value: &[u8]) -> Result<(), u32>;
    /// Add a copy of a header, keeping any others.
    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32>;
    /// Up to `max` bytes of the buffered request body; `None` when the
    /// host has none to give.
    fn request_body(&self, max: usize) -> Option<Vec<u8>>;
    /// Replace the buffered request body's first `drop` bytes with `head`
    /// (before it goes upstream; the rest stays where it is).
    fn replace_request_body_head(&self, drop: usize, head: &[u8]) -> Result<(), u32>;
    /// Answer the request from the filter instead of forwarding it.
    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), u32>;
}

/// Everything one VM's HTTP streams share (single-threaded: `Rc`).
pub struct Worker {
    pub router: Router,
    pub board: LoadBoard,
    pub stats: Stats,
    /// Requests this VM has routed (round-robin position in shadow mode).
    pub seq: u64,
}

impl Worker {
    /// `owner` must be unique per VM and never 0 (see `LoadBoard`).
    pub fn new<M: Metrics + ?Sized>(metrics: &M, config: Config, owner: u64) -> Worker {
        let stats = Stats::define(metrics, &config.static_endpoints);
        let router = Router::new(config);
        let board = LoadBoard::new(owner, router.stale_ms());
        Worker {
            router,
            board,
            stats,
            seq: 0,
        }
    }
}

/// The replica a stream was routed to, and the work it added there (taken
/// off again when the stream ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Routed {
    replica: ReplicaId,
    work: u64,
    /// What it counted as new content placed there.
    placed: Placed,
}

/// What the index credited the pick with: the prompt's checkpoints, and
/// what the pick held before. Kept until the response headers, which may
/// take the credit back (a refusal) or move it (served elsewhere, with
/// affinity on).
struct Credited {
    checkpoints: Vec<Checkpoint>,
    held: u32,
    /// The prompt's blocks (`Choice::blocks`), counted as sent to the pick.
    blocks: u32,
}

/// A stream's affinity cookie (with `affinity.cookie`): the sessions the
/// client's cookie held, and what this request adds to them.
#[derive(Default)]
struct Cookie {
    jar: cookie::Jar,
    /// The client came over TLS: the cookie is set `Secure`.
    secure: bool,
    /// This request's prompt (all of it), the anchor of its entry.
    anchor: Option<Probe>,
}

/// One HTTP stream's state.
pub struct HttpFilter {
    worker: Option<Rc<RefCell<Worker>>>,
    /// Set once the destination header is written.
    routed: Option<Routed>,
    credited: Option<Credited>,
    debug: Option<String>,
    waiting_for_body: bool,
    /// The priority header's value, read with the others in one host call.
    priority: Option<String>,
    /// The replica a verified affinity token from the client names.
    affinity: Option<ReplicaId>,
    cookie: Option<Cookie>,
    /// The replica holding the stored response the path names
    /// (`GET /v1/responses/{id}`), with `affinity.response_ids`.
    stored: Option<ReplicaId>,
    /// The request came with a `content-length`, which a renamed body's
    /// must replace.
    content_length: bool,
    /// Its path creates a Responses API response (with
    /// `affinity.response_ids`): only such bodies are named or pinned.
    creates_response: bool,
    /// Its response was named (after the pick, or after the replica of
    /// the response it continues): the replicas the destination header
    /// listed, where its follow-ups look for it (empty when not named).
    named: Vec<ReplicaId>,
    /// An Anthropic Messages API request (see `messages_api`): the
    /// filter's own answers take that API's error shape.
    anthropic: bool,
}

impl HttpFilter {
    /// `worker` is `None` while the plugin is unconfigured: the stream is
    /// then only stripped of the destination header.
    pub fn new(worker: Option<Rc<RefCell<Worker>>>) -> HttpFilter {
        HttpFilter {
            worker,
            routed: None,
            credited: None,
            debug: None,
            waiting_for_body: false,
            priority: None,
            affinity: None,
            cookie: None,
            stored: None,
            content_length: false,
            creates_response: false,
            named: Vec::new(),
            anthropic: false,
        }
    }

    pub fn on_request_headers<H: Host>(&mut self, h: &H, end_of_stream: bool) -> Action {
        // First, before anything can fail: a client never picks the upstream.
        // All headers come in one host call, as bytes: a value that isn't
        // UTF-8 must not be able to panic the VM.
        let headers = h.request_headers();
        self.strip_destination(h, &headers);
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        let is_inference = {
            let w = worker.borrow();
            let cfg = &w.router.config;
            self.priority = headers::get_str(&headers, &cfg.priority_header).map(str::to_string);
            self.anthropic = messages_api(&headers);
            if let Some(a) = &cfg.affinity {
                self.affinity = read_affinity(h, &w, a, &headers);
                if let Some(name) = &a.cookie {
                    self.cookie = Some(read_cookie(h, &w, a, name, &headers));
                }
                if a.response_ids {
                    let path = headers::get_str(&headers, ":path").unwrap_or("");
                    self.stored = response::id_in_path(path, &cfg.inference_paths)
                        .and_then(|id| stored_replica(h, &w, a, id.as_bytes()));
                    self.content_length = headers::get(&headers, "content-length").is_some();
                    self.creates_response = response::creates(path, &cfg.inference_paths);
                }
            }
            let post = headers::get_str(&headers, ":method")
                .is_some_and(|m| m.eq_ignore_ascii_case("POST"));
            post && headers::get_str(&headers, ":path").is_some_and(|p| cfg.is_inference_path(p))
        };
        if end_of_stream || !is_inference {
            return self.proceed(h, None);
        }
        // Hold the headers until the body is complete; needs
        // `allow_on_headers_stop_iteration: true` in the plugin config.
        self.waiting_for_body = true;
        Action::Pause
    }

    pub fn on_request_body<H: Host>(&mut self, h: &H, size: usize, end_of_stream: bool) -> Action {
        if !self.waiting_for_body {
            return Action::Continue;
        }
        if size > self.body_limit() {
            // Too big to parse: route on load alone, stop buffering.
            if let Some(w) = &self.worker {
                w.borrow().stats.body_too_large.inc(h);
            }
            self.waiting_for_body = false;
            return self.proceed(h, None);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.waiting_for_body = false;
        let body = h.request_body(size).unwrap_or_default();
        self.proceed(h, Some(&body))
    }

    pub fn on_request_trailers<H: Host>(&mut self, h: &H) -> Action {
        if self.waiting_for_body {
            // Trailers end the stream: the buffered body is complete.
            self.waiting_for_body = false;
            let body = h.request_body(self.body_limit()).unwrap_or_default();
            return self.proceed(h, Some(&body));
        }
        Action::Continue
    }

    pub fn on_response_headers<H: Host>(&mut self, h: &H) -> Action {
        // Whatever an upstream or client put there, only ours goes out.
        let _ = h.remove_header(Map::Response, DEBUG_HEADER);
        if let Some(d) = &self.debug {
            let _ = h.replace_header(Map::Response, DEBUG_HEADER, d);
        }
        if self.routed.is_none() {
            return Action::Continue;
        }
        let status = h.response_status();
        if status.is_some_and(ran_nothing) {
            self.uncredit(h);
        }
        let affinity_on =
            (self.worker.as_ref()).is_some_and(|w| w.borrow().router.config.affinity.is_some());
        let Some(status) = status.filter(|_| affinity_on) else {
            return Action::Continue;
        };
        let success = (200..300).contains(&status);
        // Whatever the status: a 500, 502 or 504 keeps the prompt's credit
        // (see `ran_nothing`), on the replica that failed it, which is not
        // the pick when the pick refused the connection first.
        let nameable = self.follow_the_upstream(h, success);
        // Only a success from a replica of the pool names one to come back
        // to. Not a failure (an upstream 5xx, or Envoy's own 503 or 504
        // once retries ran out), a refusal (a 429 from a replica that is
        // rate limiting, a 404 for a stored response it doesn't hold, a
        // 400), nor an answer from a host outside the pool: the session's
        // replica is where the client's last token or cookie says.
        if !success || !nameable {
            return Action::Continue;
        }
        if let (Some(routed), Some(w)) = (self.routed, &self.worker) {
            let w = w.borrow();
            // Shadow mode only measures: its clients get no new header or
            // cookie (the token would name the baseline's pick anyway).
            let route = w.router.config.mode == Mode::Route;
            if let Some(a) = w.router.config.affinity.as_ref().filter(|_| route) {
                // The session's replica, for the client to send back to
                // whichever gateway instance it reaches next.
                let now_s = h.now_ms() / 1000;
                let token = affinity::mint(a.key.as_bytes(), routed.replica, now_s);
                let _ = h.replace_header(Map::Response, &a.header, &token);
                if let (Some(name), Some(c)) = (&a.cookie, &self.cookie) {
                    set_cookie(h, a, name, c, routed.replica, now_s);
                }
            }
        }
        Action::Continue
    }

    /// The pick was credited with the prompt when the request was sent;
    /// a refusal ran nothing there (see `ran_nothing`), so the credit goes.
    /// Before any move to the replica that answered: a refusal moves no
    /// prompt either.
    ///
    /// The credit isn't per request: another request sent there while
    /// this one was in flight found the prompt credited, and if the
    /// replica served it (it computed the prompt) while refusing this one,
    /// the index loses that copy too, and the next request with the
    /// prompt is placed as new (one prefill more). A refusal comes back
    /// at once, so the window is short.
    fn uncredit<H: Host>(&mut self, h: &H) {
        let (Some(routed), Some(w)) = (self.routed.as_mut(), &self.worker) else {
            return;
        };
        let mut w = w.borrow_mut();
        // Nor did new content start there: a session's first turn is placed
        // again, elsewhere or later, and a session the turn moved is still
        // where it was.
        match std::mem::take(&mut routed.placed) {
            Placed::Nothing => {}
            Placed::New => w.board.withdraw_branch(routed.replica),
            Placed::Moved { from } => {
                w.board.withdraw_branch(routed.replica);
                w.board.restore_branch(from);
            }
        }
        let Some(c) = self.credited.take() else {
            return;
        };
        // Nor is the prompt new content in its cache, or sent there.
        w.board.unsend(routed.replica, c.blocks, c.held);
        w.stats.index_uncredited.inc(h);
        let r = (w.router).uncredit(h.store(), &c.checkpoints, routed.replica, c.held);
        if r.failed > 0 {
            w.stats.index_write_failures.add(h, i64::from(r.failed));
        }
    }

    /// Envoy may have served the request elsewhere than the pick: the
    /// header's next address after a refused connection, a reset or a
    /// retried 503, or the fallback policy. The affinity token names the
    /// replica that answered (a token naming the pick sent the session
    /// back to the replica that had just failed it), and the request's work
    /// in flight moves there, and so does the prompt in the index (the next
    /// turn without a token looked for it on the pick alone). Only with
    /// affinity on, for the token: reading `upstream.address` from Envoy
    /// costs ~20-30 µs a request (16 KiB chat, added p50 +93-106 µs against
    /// +75-80 without it).
    /// `stored`: the answer is a success, so a named response was stored
    /// where it was served. False when a host outside the pool answered
    /// (no replica of the pool can be named for it, and the pick keeps
    /// nothing of the request but its load until it ends).
    fn follow_the_upstream<H: Host>(&mut self, h: &H, stored: bool) -> bool {
        let (Some(routed), Some(w)) = (self.routed.as_mut(), &self.worker) else {
            return true;
        };
        let Some(addr) = h.upstream_address() else {
            return true;
        };
        let Ok(served) = addr.parse::<crate::endpoint::Endpoint>() else {
            return true;
        };
        let mut w = w.borrow_mut();
        if served.id() == routed.replica {
            return true;
        }
        if stored && !self.named.is_empty() && !self.named.contains(&served.id()) {
            // Stored under its name where no follow-up looks: the header
            // listed the name's successors, and Envoy went past them (its
            // fallback policy, or a host the filter doesn't know). On a
            // successor it is found. (A 4xx stored nothing.)
            w.stats.responses_misplaced.inc(h);
        }
        let known = w.router.endpoints().iter().any(|e| e.id() == served.id());
        if !known {
            // The pick ran nothing, whatever the status: the prompt's
            // credit and its count as new content go, as for a refusal.
            drop(w);
            self.uncredit(h);
            return false;
        }
        let now = h.now_ms();
        w.board.finish(h.store(), routed.replica, routed.work, now);
        // New content placed on the pick (a session's first turn) started
        // where it was served: the next session counts it there.
        if routed.placed.counts() {
            w.board.withdraw_branch(routed.replica);
        }
        let mut moved = Start {
            work: routed.work,
            branch: routed.placed.counts(),
            ..Start::default()
        };
        // The prompt's blocks were sent, and new content placed, where it
        // was served (not after a refusal: `uncredit` took them back).
        if let Some(c) = &self.credited {
            w.board.unsend(routed.replica, c.blocks, c.held);
            moved.blocks = c.blocks;
            // Looked up here, on this rare path, not kept from the
            // decision for every request.
            moved.held = w.router.held(h.store(), &c.checkpoints, served.id());
        }
        w.board.start(h.store(), served.id(), moved, now);
        if let Some(c) = self.credited.take() {
            let (from, to) = (routed.replica, served.id());
            let r = w
                .router
                .served_elsewhere(h.store(), &c.checkpoints, from, c.held, to, now);
            if r.failed > 0 {
                w.stats.index_write_failures.add(h, i64::from(r.failed));
            }
        }
        w.stats.served_elsewhere.inc(h);
        routed.replica = served.id();
        true
    }

    /// Runs once per stream however it ended (done, reset, error), so
    /// in-flight accounting can't leak.
    pub fn on_log<H: Host>(&mut self, h: &H) {
        let (Some(routed), Some(w)) = (self.routed.take(), &self.worker) else {
            return;
        };
        let mut w = w.borrow_mut();
        w.board
            .finish(h.store(), routed.replica, routed.work, h.now_ms());
    }

    fn proceed<H: Host>(&mut self, h: &H, body: Option<&[u8]>) -> Action {
        if self.route(h, body) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    /// Decide and write the header. `body` is the complete request body when
    /// there is one worth parsing. Returns false when the filter answered
    /// the request itself (429/503): the stream must stay paused then.
    fn route<H: Host>(&mut self, h: &H, body: Option<&[u8]>) -> bool {
        let Some(worker) = self.worker.clone() else {
            return true;
        };
        let mut guard = worker.borrow_mut();
        let w = &mut *guard;
        let probes = self.cookie.as_ref().map(|c| c.jar.probes());
        let (hashed, header) = hash_body(h, w, body, probes.as_deref());
        let now = h.now_ms();
        // A Responses API body on its own path only: embeddings and
        // pooling take `input` too.
        let responses = (header.as_ref())
            .and_then(|hd| hd.responses.as_ref())
            .filter(|_| self.creates_response);
        let stored = self.stored.or_else(|| {
            let a = w.router.config.response_ids()?;
            let id = responses?.previous.as_deref()?;
            stored_replica(h, w, a, id.as_bytes())
        });
        let names = self.names_response(w, responses);
        let meta = Meta {
            model: header.as_ref().map(|hd| hd.model.as_str()),
            sheddable: self.priority.as_deref().is_some_and(is_sheddable),
            // A token the client sent on purpose comes first.
            affinity: self.affinity.or(self.session_in_cookie(&hashed)),
            stored,
            named: names,
            // A first turn: a client that resends the whole conversation
            // (stored or not) is found by its prefix as before.
            session_start: names && stored.is_none() && !hashed.later_turn,
        };
        let (choice, why) = match decide(h, w, &hashed, meta, now) {
            Ok(d) => d,
            // A reply the host wouldn't send leaves nothing to wait for:
            // the stream goes on without a destination (Envoy's own 503,
            // or its fallback policy), not paused for good.
            Err(reject) => return !refuse(h, &w.stats, &reject, self.anthropic),
        };
        w.seq += 1;
        #[cfg(feature = "fault-injection")]
        trap_if_asked(w);
        if meta.affinity.is_some() && choice.reason != Reason::Affinity {
            // A valid token whose replica is gone, ineligible or overloaded.
            w.stats.affinity_rejected.inc(h);
        }
        let home = choice.order.first().and_then(|&i| w.router.endpoint(i));
        if meta.stored.is_some() && home.map(Endpoint::id) != meta.stored {
            // Its replica is gone or ineligible: only a create it refused
            // is on a successor.
            w.stats.responses_unknown.inc(h);
        }
        let choice = apply_mode(h, w, choice, why.as_ref());
        let Some(ep) = write_destination(h, w, &choice) else {
            return true;
        };
        // Only stored responses need the list (and only they pay for it).
        let listed = match names || meta.stored.is_some() {
            true => w.router.listed(&choice),
            false => Vec::new(),
        };
        if meta.stored.is_some() && listed.len() > 1 && w.router.config.mode == Mode::Route {
            retry_where_listed(h, w);
        }
        if let (true, Some(body)) = (names, body) {
            // A follow-up's own response goes under the name of the one it
            // continues, even on a successor: its own follow-up then looks
            // in the same places.
            if self.name_response(h, w, meta.stored.unwrap_or(ep.id()), body) {
                self.named = listed;
            }
        }
        let (rec, placed) = w
            .router
            .commit(h.store(), &mut w.board, &choice, &hashed, now);
        self.routed = Some(Routed {
            replica: ep.id(),
            work: choice.work,
            placed,
        });
        if !hashed.is_empty() {
            self.credited = Some(Credited {
                checkpoints: hashed.checkpoints,
                held: choice.matched,
                blocks: choice.blocks,
            });
        }
        w.stats.ensure_replica(h, &ep).routed.inc(h);
        count(h, &w.stats, &choice, rec);
        if let (true, Some(why)) = (w.router.config.debug_header, &why) {
            self.debug = Some(w.router.explain(&choice, why));
        }
        true
    }

    /// Remove any client-sent destination header (all copies). Also when
    /// the map couldn't be read (empty): removal is cheap insurance and the
    /// header is routing authority.
    fn strip_destination<H: Host>(&self, h: &H, headers: &Pairs) {
        let w = self.worker.as_ref().map(|w| w.borrow());
        let name = w.as_ref().map_or(DEFAULT_DESTINATION_HEADER, |w| {
            w.router.config.destination_header.as_str()
        });
        if !headers.is_empty() && headers::get(headers, name).is_none() {
            return;
        }
        if !headers.is_empty() {
            if let Some(w) = &w {
                w.stats.client_destination_stripped.inc(h);
            }
        }
        if h.remove_header(Map::Request, name).is_err() {
            log::warn!("prefix-router: could not strip `{name}`");
        }
    }

    /// The replica of the session in the cookie that this prompt
    /// continues; the entries it continues make way for its own.
    fn session_in_cookie(&mut self, hashed: &Hashed) -> Option<ReplicaId> {
        let c = self.cookie.as_mut()?;
        let replica = c.jar.replica_for(&hashed.probes);
        c.jar.forget_continued(&hashed.probes);
        // At least a block: an anchor shorter is too little to tell a
        // session by.
        c.anchor = hashed.end.filter(|_| !hashed.is_empty());
        replica
    }

    /// The request's response will be stored, and named by this filter.
    /// Not in shadow mode, which promises requests go as before.
    fn names_response(&self, w: &Worker, responses: Option<&Responses>) -> bool {
        let cfg = &w.router.config;
        let on = cfg.response_ids().is_some() && cfg.mode == Mode::Route;
        on && responses.is_some_and(|r| r.store && !r.named)
    }

    /// Name the stored response after the replica that will hold it (see
    /// `affinity::response`); whether it was. On any failure the body goes
    /// as it came: the server names the response itself, as without the
    /// option.
    fn name_response<H: Host>(&self, h: &H, w: &Worker, replica: ReplicaId, body: &[u8]) -> bool {
        let Some(a) = w.router.config.response_ids() else {
            return false;
        };
        // Unique per request: this VM's id and its request count.
        let nonce = w.board.owner().rotate_left(32) ^ w.seq;
        let id = response::mint(a.key.as_bytes(), replica, h.now_ms() / 1000, nonce);
        let Some(named) = response::request_id_head(body, &id) else {
            return false;
        };
        // The length first: a body whose length says otherwise would reach
        // the server cut or hang it.
        let length = |n: usize| h.replace_header(Map::Request, "content-length", &n.to_string());
        if self.content_length && length(named.len_with(body.len())).is_err() {
            w.stats.header_write_errors.inc(h);
            return false;
        }
        if let Err(status) = h.replace_request_body_head(named.drop, &named.head) {
            log::warn!("prefix-router: could not name a stored response: status {status}");
            if self.content_length && length(body.len()).is_err() {
                w.stats.header_write_errors.inc(h);
            }
            return false;
        }
        w.stats.responses_named.inc(h);
        true
    }

    fn body_limit(&self) -> usize {
        self.worker
            .as_ref()
            .map(|w| w.borrow().router.config.max_body_bytes)
            .unwrap_or(0)
    }
}

/// The decision, with every replica's cost and load only when something
/// reads them (the debug header, shadow mode).
fn decide<H: Host>(
    h: &H,
    w: &Worker,
    hashed: &Hashed,
    meta: Meta,
    now: u64,
) -> Result<(Choice, Option<Diagnostics>), Reject> {
    let cfg = &w.router.config;
    if cfg.mode == Mode::Shadow {
        // Shadow mode only records: the baseline it stands in for never
        // sheds, so a request prefix-router would shed is counted and
        // routed.
        let explained = |meta| w.router.decide_explained(h.store(), hashed, meta, now);
        return match explained(meta) {
            Err(r) if r.status == 429 => {
                w.stats.shadow_would_shed.inc(h);
                explained(Meta {
                    sheddable: false,
                    ..meta
                })
            }
            other => other,
        }
        .map(|(c, d)| (c, Some(d)));
    }
    if cfg.debug_header {
        w.router
            .decide_explained(h.store(), hashed, meta, now)
            .map(|(c, d)| (c, Some(d)))
    } else {
        w.router
            .decide(h.store(), hashed, meta, now)
            .map(|c| (c, None))
    }
}

/// A request of the Anthropic Messages API: its path (before any query)
/// ends in `/messages` or `/messages/count_tokens`, or it names the API's
/// version (`anthropic-version`, which Anthropic's SDKs and Claude Code
/// send on every request, whatever the path it was given).
fn messages_api(headers: &Pairs) -> bool {
    let path = headers::get_str(headers, ":path").unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    path.ends_with("/messages")
        || path.ends_with("/messages/count_tokens")
        || headers::get(headers, "anthropic-version").is_some()
}

/// The error type the Messages API gives a status: a 429 is always
/// `rate_limit_error`; a 503 is `overloaded_error`, what its clients
/// treat as a busy service to retry (as the replicas answer on this path).
fn anthropic_error_type(status: u32) -> &'static str {
    match status {
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// Answer a request the filter won't route (counted): an OpenAI-style
/// error body, or for a Messages API request (`anthropic`) the shape of
/// that API's errors, which its clients parse (`type: "error"` and an
/// `error` whose `type` is one of the API's). Whether the reply was sent.
fn refuse<H: Host>(h: &H, s: &Stats, r: &Reject, anthropic: bool) -> bool {
    if r.status == 429 {
        s.shed_429.inc(h)
    } else {
        s.unavailable_503.inc(h)
    }
    let body = match anthropic {
        true => serde_json::json!({
            "type": "error",
            "error": {"type": anthropic_error_type(r.status), "message": r.message}
        }),
        false => serde_json::json!({
            "error": {"message": r.message, "type": r.kind, "code": r.status}
        }),
    }
    .to_string();
    let mut headers = vec![("content-type", "application/json")];
    if r.status == 429 {
        headers.push(("retry-after", "1"));
    }
    match h.send_local_response(r.status, r.kind, &headers, body.as_bytes()) {
        Ok(()) => true,
        Err(status) => {
            log::warn!(
                "prefix-router: could not send {} reply: status {status}",
                r.status
            );
            false
        }
    }
}

/// Write the destination header for `choice`. The replica it names first,
/// or `None` when it names none or the header couldn't be written (logged
/// and counted; the request goes on without it).
fn write_destination<H: Host>(h: &H, w: &Worker, choice: &Choice) -> Option<Endpoint> {
    let &first = choice.order.first()?;
    let ep = w.router.endpoint(first).cloned()?;
    let name = &w.router.config.destination_header;
    let value = w.router.header_value(choice);
    if let Err(status) = h.replace_header(Map::Request, name, &value) {
        log::warn!("prefix-router: could not set `{name}`: status {status}");
        w.stats.header_write_errors.inc(h);
        return None;
    }
    Some(ep)
}

/// A follow-up of a stored response may find it on the home's successors
/// (`score::stored`): a create the home refused went there. Envoy is
/// asked to retry a 404 down the header's addresses, as it retries a
/// refused connection by its route's policy; the route's `num_retries`
/// (1 when it has no retry policy) bounds how far. A 404 from a model
/// server for a response it doesn't hold means nothing ran.
fn retry_where_listed<H: Host>(h: &H, w: &Worker) {
    for (name, value) in [
        ("x-envoy-retry-on", "retriable-status-codes"),
        ("x-envoy-retriable-status-codes", "404"),
    ] {
        if let Err(status) = h.replace_header(Map::Request, name, value) {
            log::warn!("prefix-router: could not set `{name}`: status {status}");
            w.stats.header_write_errors.inc(h);
        }
    }
}

/// Deliberate, and only in the test build: it exercises Envoy's
/// failure_policy.
#[cfg(feature = "fault-injection")]
fn trap_if_asked(w: &Worker) {
    if w.router.config.debug_trap_on_request == Some(w.seq) {
        #[allow(clippy::panic)]
        {
            panic!("prefix-router: debug_trap_on_request reached ({})", w.seq);
        }
    }
}

/// A response that says the request ran nowhere: a 4xx (a 429 from a
/// replica that is rate limiting, a 404 for a stored response it doesn't
/// hold, a 400), a 3xx (a redirect) or a 503 (a refused connection once
/// retries ran out, an overloaded server). Not a 500, 502 or 504: the
/// prompt may have been computed before the server failed or Envoy gave
/// up waiting, and a model server keeps the blocks it computed. Nor a 408:
/// Envoy's own timeout of a request it had sent (the stream idle timeout,
/// which ends a long non-streaming generation when the route has none, or
/// a max stream duration), a 504 by another name.
fn ran_nothing(status: u16) -> bool {
    ((300..500).contains(&status) && status != 408) || status == 503
}

fn count<H: Host>(h: &H, s: &Stats, c: &Choice, rec: RecordStats) {
    s.requests.inc(h);
    s.decision(c.reason).inc(h);
    if c.blocks > 0 {
        s.request_blocks.record(h, c.blocks as u64);
        s.matched_blocks.record(h, c.matched as u64);
        s.request_blocks_total.add(h, c.blocks as i64);
        s.matched_blocks_total.add(h, c.matched as i64);
    }
    // Zero increments are host calls for nothing: skip them. The
    // `decision.*` counters count requests, however many replicas each
    // one concerned.
    for (m, v) in [
        (s.credit_withheld, u32::from(c.withheld > 0)),
        (s.replica_evicting, u32::from(c.evicting > 0)),
        (s.replica_hot, u32::from(c.hot > 0)),
        (s.index_entries, rec.inserted),
        (s.index_evictions, rec.evicted),
        (s.index_cas_retries, rec.cas_retries),
        (s.index_write_failures, rec.failed),
        (s.routed_blind, u32::from(c.blind)),
    ] {
        if v > 0 {
            m.add(h, v as i64);
        }
    }
}

/// The replica a stored response's id names, if this filter's key minted
/// it; else counted (another key, the server's own id, forged).
fn stored_replica<H: Host>(h: &H, w: &Worker, a: &Affinity, id: &[u8]) -> Option<ReplicaId> {
    match response::replica_of(a.key.as_bytes(), id) {
        Ok(r) => Some(r),
        Err(e) => {
            log::debug!("prefix-router: response id not followed: {e}");
            w.stats.responses_unknown.inc(h);
            None
        }
    }
}

/// The client's affinity token, verified, and stripped from the request
/// (the upstream has no use for it). A forged, expired or foreign token is
/// counted and ignored, never followed.
fn read_affinity<H: Host>(h: &H, w: &Worker, a: &Affinity, headers: &Pairs) -> Option<ReplicaId> {
    let token = headers::get(headers, &a.header)?;
    let _ = h.remove_header(Map::Request, &a.header);
    let now_s = h.now_ms() / 1000;
    match affinity::verify(a.key.as_bytes(), token, now_s, a.max_age_s) {
        Ok(id) => Some(id),
        Err(e) => {
            log::debug!("prefix-router: affinity token ignored: {e}");
            w.stats.affinity_rejected.inc(h);
            None
        }
    }
}

/// The client's affinity cookie, verified, and stripped from the request.
/// A forged, expired or foreign one is counted and ignored.
fn read_cookie<H: Host>(h: &H, w: &Worker, a: &Affinity, name: &str, headers: &Pairs) -> Cookie {
    let mut c = Cookie {
        secure: cookie::over_tls(headers),
        ..Cookie::default()
    };
    let Some(value) = cookie::find(headers, name) else {
        return c;
    };
    match cookie::without(headers, name).as_deref() {
        Some(b"") => drop(h.remove_header(Map::Request, "cookie")),
        Some(rest) => drop(h.replace_header_bytes(Map::Request, "cookie", rest)),
        None => {}
    }
    match cookie::Jar::open(a.key.as_bytes(), value, h.now_ms() / 1000, a.max_age_s) {
        Ok(jar) => c.jar = jar,
        Err(e) => {
            log::debug!("prefix-router: affinity cookie ignored: {e}");
            w.stats.affinity_rejected.inc(h);
        }
    }
    c
}

/// Add this request's session to the client's cookie (a prompt of at
/// least one block: an anchor to know its next turn by).
fn set_cookie<H: Host>(
    h: &H,
    a: &Affinity,
    name: &str,
    c: &Cookie,
    replica: ReplicaId,
    now_s: u64,
) {
    let Some(anchor) = c.anchor else {
        return;
    };
    let entry = cookie::Entry {
        replica,
        bytes: anchor.bytes,
        hash: anchor.hash,
        issued: now_s as u32,
    };
    let value = c.jar.with(entry, a.cookie_sessions).seal(a.key.as_bytes());
    let header = cookie::set_cookie(name, &value, a.max_age_s, c.secure);
    let _ = h.add_header(Map::Response, "set-cookie", &header);
}

/// Parse and hash the body (none: nothing to hash), and with the affinity
/// cookie the prefixes of `probes` bytes and the prompt's end. A body that doesn't parse is counted and routed on
/// load alone.
fn hash_body<H: Host>(
    h: &H,
    w: &Worker,
    body: Option<&[u8]>,
    probes: Option<&[u32]>,
) -> (Hashed, Option<Header>) {
    // An empty body is no body, however the stream ended: end of stream on
    // the headers, or an empty last data frame (HTTP/2, chunked). Only the
    // latter reached the parser and counted as a parse error.
    let Some(b) = body.filter(|b| !b.is_empty()) else {
        return (Hashed::default(), None);
    };
    // The whole prompt: its checkpoints reach its end (see `prefix`).
    match Hashed::parse_probing(b, &w.router.config, probes) {
        Ok((header, hashed)) => (hashed, Some(header)),
        Err(e) => {
            // Debug level: a client sending junk must not flood logs.
            log::debug!("prefix-router: unparsable inference body: {e}");
            w.stats.parse_errors.inc(h);
            (Hashed::default(), None)
        }
    }
}

/// In shadow mode, swap in the baseline's pick and record both.
fn apply_mode<H: Host>(h: &H, w: &Worker, choice: Choice, why: Option<&Diagnostics>) -> Choice {
    // Shadow mode always asks for the diagnostics (see `route`).
    let (Mode::Shadow, Some(why)) = (w.router.config.mode, why) else {
        return choice;
    };
    let sh = w.router.shadow(choice, why, w.seq);
    let s = &w.stats;
    s.shadow_requests.inc(h);
    s.shadow_matched.add(h, sh.ours_matched as i64);
    s.shadow_baseline_matched.add(h, sh.routed.matched as i64);
    if sh.routed.order.first() == Some(&sh.ours) {
        s.shadow_agree.inc(h);
    }
    sh.routed
}
