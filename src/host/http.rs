//! The SDK's HTTP callbacks, handed to the host-independent request path
//! (`filter::HttpFilter`) with the ABI as its host.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::envoy::Envoy;
use crate::filter::{HttpFilter, Worker};

pub struct Http(HttpFilter);

impl Http {
    pub fn new(worker: Option<Rc<RefCell<Worker>>>) -> Http {
        Http(HttpFilter::new(worker))
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.0.on_request_headers(&Envoy, end_of_stream)
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.0.on_request_body(&Envoy, size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.0.on_request_trailers(&Envoy)
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        self.0.on_response_headers(&Envoy)
    }

    fn on_log(&mut self) {
        self.0.on_log(&Envoy)
    }
}
