//! The SDK's HTTP callbacks, handed to the host-independent request path
//! (`filter::HttpFilter`) with the ABI as its host.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::envoy::Stream;
use crate::filter::{HttpFilter, Worker};

pub struct Http {
    filter: HttpFilter,
    /// The pool's shared-data scope (`Config::scope`).
    scope: Rc<str>,
}

impl Http {
    pub fn new(worker: Option<Rc<RefCell<Worker>>>, scope: Rc<str>) -> Http {
        Http {
            filter: HttpFilter::new(worker),
            scope,
        }
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.filter
            .on_request_headers(&Stream::new(&self.scope), end_of_stream)
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.filter
            .on_request_body(&Stream::new(&self.scope), size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        self.filter.on_request_trailers(&Stream::new(&self.scope))
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        self.filter.on_response_headers(&Stream::new(&self.scope))
    }

    fn on_log(&mut self) {
        self.filter.on_log(&Stream::new(&self.scope))
    }
}
