//! Root context: configuration, per-VM state, the timer.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use super::http::Http;
use super::shared::SharedData;
use super::stats::Stats;
use crate::config::Config;
use crate::load::LoadBoard;
use crate::route::Router;

/// Everything one VM's HTTP contexts share (single-threaded: `Rc`).
pub struct Worker {
    pub router: Router,
    pub board: LoadBoard,
    pub stats: Stats,
}

pub struct Root {
    worker: Option<Rc<RefCell<Worker>>>,
}

impl Root {
    pub fn new() -> Root {
        Root { worker: None }
    }
}

fn owner_id() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No entropy: fall back to the clock, still distinct per VM start.
        return super::now_ms() ^ 0x5bd1_e995_0000_0000;
    }
    u64::from_le_bytes(b)
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = if size == 0 {
            Vec::new()
        } else {
            self.get_plugin_configuration().unwrap_or_default()
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
        let stats = Stats::define(&config.endpoints);
        let router = Router::new(config);
        let board = LoadBoard::new(owner_id(), router.stale_ms());
        self.set_tick_period(Duration::from_millis(router.config.tick_ms));
        log::info!(
            "prefix-router: configured with {} replicas, header `{}`",
            router.config.endpoints.len(),
            router.config.destination_header
        );
        self.worker = Some(Rc::new(RefCell::new(Worker {
            router,
            board,
            stats,
        })));
        true
    }

    fn on_tick(&mut self) {
        if let Some(w) = &self.worker {
            w.borrow_mut().board.heartbeat(&SharedData, super::now_ms());
        }
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on it. Unconfigured, a context still
        // strips the destination header.
        Some(Box::new(Http::new(self.worker.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
