//! Root context: configuration, per-VM state, the timer.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};
use xxhash_rust::xxh3::xxh3_64;

use super::abi;
use super::envoy::Envoy;
use super::http::Http;
use super::scrape::Scraper;
use super::shared::SharedData;
use crate::config::Config;
use crate::filter::Worker;
use crate::load;
use crate::replicas;
use crate::store::Scoped;

pub struct Root {
    worker: Option<Rc<RefCell<Worker>>>,
    scraper: Option<Scraper>,
    /// The pool's shared-data scope (`Config::scope`).
    scope: Rc<str>,
}

impl Root {
    pub fn new() -> Root {
        Root {
            worker: None,
            scraper: None,
            scope: Rc::from(""),
        }
    }
}

/// Never 0: owner 0 marks a free lease or load slot.
fn owner_id() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No entropy: fall back to the clock in nanoseconds, distinct per
        // VM start unless two start in the same nanosecond (in
        // milliseconds, the workers of one Envoy start together and
        // collided, and with them their load slots and response ids).
        let ns = abi::current_time_ns().unwrap_or(0);
        return (ns ^ 0x5bd1_e995_0000_0000) | 1;
    }
    u64::from_le_bytes(b) | 1
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let (Some(w), Some(s)) = (&self.worker, &mut self.scraper) else {
            return;
        };
        s.on_response(&w.borrow().router, token, body_size, super::now_ms());
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = if size == 0 {
            Vec::new()
        } else {
            abi::get_buffer(BufferType::PluginConfiguration, 0, size).unwrap_or_default()
        };
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // Returning false makes Envoy reject the plugin: a broken
                // config never routes traffic.
                log::error!("prefix-router: invalid plugin configuration: {e}");
                return false;
            }
        };
        let owner = owner_id();
        let scope: Rc<str> = Rc::from(config.scope.as_str());
        let worker = Worker::new(&Envoy, config, owner);
        let router = &worker.router;
        let mut tick = router.config.tick_ms;
        if let Some(s) = &router.config.scrape {
            tick = tick.min(s.interval_ms);
        } else {
            log::info!("prefix-router: metrics scraping off (set `cluster` to enable)");
        }
        if let Some(d) = &router.config.discovery {
            tick = tick.min(d.interval_ms);
        }
        if router.config.scrape.is_some() || router.config.discovery.is_some() {
            // A pushed configuration runs beside the old one until the old
            // listener has drained: the newer one's scraper takes the lease
            // (see `replicas::config_generation`).
            let shared = Scoped::new(&SharedData, &scope);
            let generation = replicas::config_generation(&shared, xxh3_64(&bytes));
            self.scraper = Some(Scraper::new(owner, generation, tick, Rc::clone(&scope)));
        }
        let tick = u32::try_from(tick).unwrap_or(u32::MAX);
        if let Err(status) = abi::set_tick_period_ms(tick) {
            // Without a timer there is no heartbeat and no scraping: refuse
            // to start rather than route on state that never refreshes.
            log::error!("prefix-router: could not set a {tick} ms timer: status {status}");
            return false;
        }
        log::info!("{}", router.config.started());
        for note in router.config.advice() {
            log::warn!("prefix-router: {note}");
        }
        // The discovered pool and the replica table are in shared data
        // already when this root context is a config change or a reload
        // (FAIL_RELOAD reloads on the request path): read them now, not
        // one tick later, or a discovery-only pool has no replica and
        // answers 503 until then.
        let mut worker = worker;
        worker.router.refresh(&Scoped::new(&SharedData, &scope));
        self.worker = Some(Rc::new(RefCell::new(worker)));
        self.scope = scope;
        true
    }

    fn on_tick(&mut self) {
        let Some(w) = &self.worker else { return };
        let now = super::now_ms();
        let shared = Scoped::new(&SharedData, &self.scope);
        {
            let mut w = w.borrow_mut();
            w.board.heartbeat(&shared, now);
            // The only place the pool is refreshed: every HTTP context of
            // this VM shares this router, and the tick is at most the
            // discovery interval.
            w.router.refresh(&shared);
            let w = &mut *w;
            let live = load::snapshot(&shared, now, w.router.stale_ms());
            w.stats.show_load(&Envoy, w.router.endpoints(), &live);
        }
        if let Some(s) = &mut self.scraper {
            s.tick(&w.borrow().router, now);
        }
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on it. Unconfigured, a context still
        // strips the destination header.
        Some(Box::new(Http::new(
            self.worker.clone(),
            Rc::clone(&self.scope),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
