//! The least a filter that routes on the request body does in Envoy, as a
//! proxy-wasm module of its own: strip the client's destination header,
//! hold the headers, buffer the body until it is complete, read it into
//! the VM once, and write the destination header (the first of the
//! configured `endpoints`). No parsing, no hashing, no shared data, no
//! stats.
//!
//! `scripts/bench-overhead` measures it beside prefix-router (as
//! `body-floor`), so the added latency splits into what any body-routing
//! wasm filter pays in this Envoy (buffering, the copy into the VM, the VM
//! entries) and what prefix-router's decision adds on top. Built by
//! `scripts/build`:
//! `cargo build --release --target wasm32-wasip1 --example body_floor`.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

const DESTINATION: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Floor { endpoint: String::new() })
    });
}}

struct Floor {
    endpoint: String,
}

impl Context for Floor {}

impl RootContext for Floor {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let first = serde_json::from_slice::<serde_json::Value>(&config)
            .ok()
            .and_then(|v| v["endpoints"][0].as_str().map(str::to_string));
        match first {
            Some(e) => {
                self.endpoint = e;
                true
            }
            None => false,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            endpoint: self.endpoint.clone(),
        }))
    }
}

struct Stream {
    endpoint: String,
}

impl Context for Stream {}

// The SDK's calls panic on a status they don't expect; the calls here are
// made only where Envoy allows them (headers are held until the body is
// read), as prefix-router makes them.
impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.set_http_request_header(DESTINATION, None);
        if end_of_stream {
            self.set_http_request_header(DESTINATION, Some(&self.endpoint));
            return Action::Continue;
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        std::hint::black_box(&body);
        self.set_http_request_header(DESTINATION, Some(&self.endpoint));
        Action::Continue
    }
}
