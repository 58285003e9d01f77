//! Per-request context: strip, pause, read the body once, decide, write the
//! destination header, account the request until its stream ends.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::abi;
use super::root::Worker;
use super::shared::SharedData;
use crate::affinity;
use crate::config::{Mode, DEFAULT_DESTINATION_HEADER};
use crate::endpoint::ReplicaId;
use crate::headers;
use crate::route::{is_sheddable, Choice, Hashed, Meta, Reject};
use crate::score::Reason;

const DEBUG_HEADER: &str = "x-prefix-router-debug";

pub struct Http {
    worker: Option<Rc<RefCell<Worker>>>,
    /// Set once the destination header is written: (replica, work added).
    routed: Option<(ReplicaId, u64)>,
    debug: Option<String>,
    waiting_for_body: bool,
    /// The priority header's value, read with the others in one host call.
    priority: Option<String>,
    /// The replica a verified affinity token from the client names.
    affinity: Option<ReplicaId>,
}

impl Http {
    pub fn new(worker: Option<Rc<RefCell<Worker>>>) -> Http {
        Http {
            worker,
            routed: None,
            debug: None,
            waiting_for_body: false,
            priority: None,
            affinity: None,
        }
    }

    /// Decide and write the header. `body` is the complete request body when
    /// there is one worth parsing. Returns false when the filter answered
    /// the request itself (429/503): the stream must stay paused then.
    fn route(&mut self, body: Option<&[u8]>) -> bool {
        let Some(worker) = self.worker.clone() else {
            return true;
        };
        let mut guard = worker.borrow_mut();
        let w = &mut *guard;
        let cfg = &w.router.config;
        let (hashed, model) = hash_body(w, body);
        let now = super::now_ms();
        let meta = Meta {
            model: model.as_deref(),
            sheddable: self.priority.as_deref().is_some_and(is_sheddable),
            affinity: self.affinity,
        };
        let choice = match w.router.decide(&SharedData, &hashed, meta, now) {
            Ok(c) => c,
            Err(reject) => {
                if reject.status == 429 {
                    w.stats.shed_429.inc()
                } else {
                    w.stats.unavailable_503.inc()
                }
                self.reject(&reject);
                return false;
            }
        };
        w.seq += 1;
        #[cfg(feature = "fault-injection")]
        if cfg.debug_trap_on_request == Some(w.seq) {
            // Deliberate, and only in the test build: it exercises Envoy's
            // failure_policy.
            #[allow(clippy::panic)]
            {
                panic!("prefix-router: debug_trap_on_request reached ({})", w.seq);
            }
        }
        if self.affinity.is_some() && choice.reason != Reason::Affinity {
            // A valid token whose replica is gone, ineligible or overloaded.
            w.stats.affinity_rejected.inc();
        }
        let choice = apply_mode(w, choice);
        let Some(&first) = choice.order.first() else {
            return true;
        };
        let Some(ep) = w.router.endpoint(first).cloned() else {
            return true;
        };
        let value = w.router.header_value(&choice);
        if let Err(status) =
            abi::replace_header(MapType::HttpRequestHeaders, &cfg.destination_header, &value)
        {
            log::warn!(
                "prefix-router: could not set `{}`: status {status}",
                cfg.destination_header
            );
            w.stats.header_write_errors.inc();
            return true;
        }
        let rec = w
            .router
            .commit(&SharedData, &mut w.board, &choice, &hashed, now);
        self.routed = Some((ep.id(), choice.work));
        w.stats.ensure_replica(&ep);
        self.count(w, &choice, ep.id(), rec);
        if cfg.debug_header {
            self.debug = Some(w.router.explain(&choice));
        }
        true
    }

    fn reject(&self, r: &Reject) {
        let body = serde_json::json!({
            "error": {"message": r.message, "type": r.kind, "code": r.status}
        })
        .to_string();
        let mut headers = vec![("content-type", "application/json")];
        if r.status == 429 {
            headers.push(("retry-after", "1"));
        }
        if let Err(status) = abi::send_local_response(r.status, r.kind, &headers, body.as_bytes()) {
            log::warn!(
                "prefix-router: could not send {} reply: status {status}",
                r.status
            );
        }
    }

    fn proceed(&mut self, body: Option<&[u8]>) -> Action {
        if self.route(body) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn count(&self, w: &Worker, c: &Choice, id: ReplicaId, rec: crate::index::RecordStats) {
        let s = &w.stats;
        s.requests.inc();
        s.decision(c.reason).inc();
        if c.blocks > 0 {
            s.request_blocks.record(c.blocks as u64);
            s.matched_blocks.record(c.matched as u64);
            s.request_blocks_total.add(c.blocks as i64);
            s.matched_blocks_total.add(c.matched as i64);
        }
        if let Some(r) = s.replica(id) {
            r.routed.inc();
        }
        // Zero increments are host calls for nothing: skip them.
        for (m, v) in [
            (s.index_entries, rec.inserted),
            (s.index_evictions, rec.evicted),
            (s.index_cas_retries, rec.cas_retries),
            (s.index_write_failures, rec.failed),
        ] {
            if v > 0 {
                m.add(v as i64);
            }
        }
    }

    /// Remove any client-sent destination header (all copies). Also when
    /// the map couldn't be read (empty): removal is cheap insurance and the
    /// header is routing authority.
    fn strip_destination(&self, headers: &headers::Pairs) {
        let w = self.worker.as_ref().map(|w| w.borrow());
        let name = w.as_ref().map_or(DEFAULT_DESTINATION_HEADER, |w| {
            w.router.config.destination_header.as_str()
        });
        if !headers.is_empty() && headers::get(headers, name).is_none() {
            return;
        }
        if !headers.is_empty() {
            if let Some(w) = &w {
                w.stats.client_destination_stripped.inc();
            }
        }
        if abi::remove_header(MapType::HttpRequestHeaders, name).is_err() {
            log::warn!("prefix-router: could not strip `{name}`");
        }
    }

    fn body_limit(&self) -> usize {
        self.worker
            .as_ref()
            .map(|w| w.borrow().router.config.max_body_bytes)
            .unwrap_or(0)
    }
}

/// The client's affinity token, verified, and stripped from the request
/// (the upstream has no use for it). A forged, expired or foreign token is
/// counted and ignored, never followed.
fn read_affinity(
    w: &Worker,
    a: &crate::config::Affinity,
    headers: &headers::Pairs,
) -> Option<ReplicaId> {
    let token = headers::get(headers, &a.header)?;
    let _ = abi::remove_header(MapType::HttpRequestHeaders, &a.header);
    let now_s = super::now_ms() / 1000;
    match affinity::verify(a.key.as_bytes(), token, now_s, a.max_age_s) {
        Ok(id) => Some(id),
        Err(e) => {
            log::debug!("prefix-router: affinity token ignored: {e}");
            w.stats.affinity_rejected.inc();
            None
        }
    }
}

/// Parse and hash the body (none: nothing to hash). A body that doesn't
/// parse is counted and routed on load alone.
fn hash_body(w: &Worker, body: Option<&[u8]>) -> (Hashed, Option<String>) {
    let cfg = &w.router.config;
    let Some(b) = body else {
        return (Hashed::default(), None);
    };
    // The whole prompt: its checkpoints reach its end (see `prefix`).
    match Hashed::parse(b, cfg) {
        Ok((header, hashed)) => (hashed, Some(header.model)),
        Err(e) => {
            // Debug level: a client sending junk must not flood logs.
            log::debug!("prefix-router: unparsable inference body: {e}");
            w.stats.parse_errors.inc();
            (Hashed::default(), None)
        }
    }
}

/// In shadow mode, swap in the baseline's pick and record both.
fn apply_mode(w: &Worker, choice: Choice) -> Choice {
    match w.router.config.mode {
        Mode::Route => choice,
        Mode::Shadow => {
            let sh = w.router.shadow(choice, w.seq);
            let s = &w.stats;
            s.shadow_requests.inc();
            s.shadow_matched.add(sh.ours_matched as i64);
            s.shadow_baseline_matched.add(sh.routed.matched as i64);
            if sh.routed.order.first() == Some(&sh.ours) {
                s.shadow_agree.inc();
            }
            sh.routed
        }
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // First, before anything can fail: a client never picks the upstream.
        // All headers come in one host call, as bytes: a value that isn't
        // UTF-8 must not be able to panic the VM.
        let headers = abi::get_headers(MapType::HttpRequestHeaders);
        self.strip_destination(&headers);
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        let is_inference = {
            let w = worker.borrow();
            let cfg = &w.router.config;
            self.priority = headers::get_str(&headers, &cfg.priority_header).map(str::to_string);
            if let Some(a) = &cfg.affinity {
                self.affinity = read_affinity(&w, a, &headers);
            }
            let post = headers::get_str(&headers, ":method")
                .is_some_and(|m| m.eq_ignore_ascii_case("POST"));
            post && headers::get_str(&headers, ":path").is_some_and(|p| cfg.is_inference_path(p))
        };
        if end_of_stream || !is_inference {
            return self.proceed(None);
        }
        // Hold the headers until the body is complete; needs
        // `allow_on_headers_stop_iteration: true` in the plugin config.
        self.waiting_for_body = true;
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !self.waiting_for_body {
            return Action::Continue;
        }
        if size > self.body_limit() {
            // Too big to parse: route on load alone, stop buffering.
            if let Some(w) = &self.worker {
                w.borrow().stats.body_too_large.inc();
            }
            self.waiting_for_body = false;
            return self.proceed(None);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.waiting_for_body = false;
        let body = abi::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        self.proceed(Some(&body))
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        if self.waiting_for_body {
            // Trailers end the stream: the buffered body is complete.
            self.waiting_for_body = false;
            let body = abi::get_buffer(BufferType::HttpRequestBody, 0, self.body_limit())
                .unwrap_or_default();
            return self.proceed(Some(&body));
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        // Whatever an upstream or client put there, only ours goes out.
        let _ = abi::remove_header(MapType::HttpResponseHeaders, DEBUG_HEADER);
        if let Some(d) = &self.debug {
            let _ = abi::replace_header(MapType::HttpResponseHeaders, DEBUG_HEADER, d);
        }
        if let (Some((id, _)), Some(w)) = (self.routed, &self.worker) {
            let w = w.borrow();
            if let Some(a) = &w.router.config.affinity {
                // The session's replica, for the client to send back to
                // whichever gateway instance it reaches next.
                let token = affinity::mint(a.key.as_bytes(), id, super::now_ms() / 1000);
                let _ = abi::replace_header(MapType::HttpResponseHeaders, &a.header, &token);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // Runs once per stream however it ended (done, reset, error), so
        // in-flight accounting can't leak.
        let (Some((id, work)), Some(w)) = (self.routed.take(), &self.worker) else {
            return;
        };
        let mut w = w.borrow_mut();
        w.board.finish(&SharedData, id, work, super::now_ms());
    }
}
