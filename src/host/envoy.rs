//! The filter's `Host` (and `Metrics`) over the proxy-wasm ABI: every call
//! goes through the panic-free wrappers in `abi`.

use proxy_wasm::types::{BufferType, MapType, MetricType};

use super::abi;
use super::shared::SharedData;
use crate::filter::stats::Metrics;
use crate::filter::{Host, Map};
use crate::headers::Pairs;
use crate::store::Scoped;

/// The Envoy this VM runs in (stateless: the host keeps the state).
pub struct Envoy;

fn map_type(map: Map) -> MapType {
    match map {
        Map::Request => MapType::HttpRequestHeaders,
        Map::Response => MapType::HttpResponseHeaders,
    }
}

impl Metrics for Envoy {
    fn define_metric(&self, kind: MetricType, name: &str) -> Result<u32, u32> {
        abi::define_metric(kind, name)
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), u32> {
        abi::increment_metric(id, by)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), u32> {
        abi::record_metric(id, value)
    }
}

/// One HTTP stream's host: Envoy, with the shared data of the stream's
/// pool (`Config::scope`).
pub struct Stream<'a> {
    shared: Scoped<'a, SharedData>,
}

impl<'a> Stream<'a> {
    pub fn new(scope: &'a str) -> Self {
        Stream {
            shared: Scoped::new(&SharedData, scope),
        }
    }
}

impl Metrics for Stream<'_> {
    fn define_metric(&self, kind: MetricType, name: &str) -> Result<u32, u32> {
        Envoy.define_metric(kind, name)
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), u32> {
        Envoy.increment_metric(id, by)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), u32> {
        Envoy.record_metric(id, value)
    }
}

impl<'a> Host for Stream<'a> {
    type Store = Scoped<'a, SharedData>;

    fn store(&self) -> &Self::Store {
        &self.shared
    }

    fn now_ms(&self) -> u64 {
        super::now_ms()
    }

    fn request_headers(&self) -> Pairs {
        abi::get_headers(MapType::HttpRequestHeaders)
    }

    fn remove_header(&self, map: Map, name: &str) -> Result<(), u32> {
        abi::remove_header(map_type(map), name)
    }

    fn upstream_address(&self) -> Option<String> {
        String::from_utf8(abi::get_property(&["upstream", "address"])?).ok()
    }

    fn response_status(&self) -> Option<u16> {
        let raw = abi::get_header(MapType::HttpResponseHeaders, ":status")?;
        std::str::from_utf8(&raw).ok()?.parse().ok()
    }

    fn replace_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32> {
        abi::replace_header(map_type(map), name, value)
    }

    fn replace_header_bytes(&self, map: Map, name: &str, value: &[u8]) -> Result<(), u32> {
        abi::replace_header_bytes(map_type(map), name, value)
    }

    fn add_header(&self, map: Map, name: &str, value: &str) -> Result<(), u32> {
        abi::add_header(map_type(map), name, value)
    }

    fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        abi::get_buffer(BufferType::HttpRequestBody, 0, max)
    }

    fn replace_request_body_head(&self, drop: usize, head: &[u8]) -> Result<(), u32> {
        abi::set_buffer_head(BufferType::HttpRequestBody, drop, head)
    }

    fn send_local_response(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), u32> {
        abi::send_local_response(status, details, headers, body)
    }
}
