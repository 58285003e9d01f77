//! Panic-free versions of the few host calls used on the request path.
//!
//! The SDK's wrappers `panic!` on any status they don't expect (for example
//! when Envoy refuses a header edit), and a panic traps the worker's VM. The
//! ABI functions are declared here again returning the raw status code, so
//! the filter gets an error value to count and log instead.

#![allow(clashing_extern_declarations)]

use proxy_wasm::types::{MapType, MetricType};

const OK: u32 = 0;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: MetricType,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
}

/// Status code 8 is CAS_MISMATCH in the proxy-wasm ABI.
pub const CAS_MISMATCH: u32 = 8;

fn check(status: u32) -> Result<(), u32> {
    if status == OK {
        Ok(())
    } else {
        Err(status)
    }
}

pub fn replace_header(map: MapType, name: &str, value: &str) -> Result<(), u32> {
    // SAFETY: pointers and lengths come from live Rust slices; the host
    // copies the bytes before returning.
    check(unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Every header of `map` as raw bytes (see `headers` for why not `String`).
pub fn get_headers(map: MapType) -> crate::headers::Pairs {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer to a buffer it allocated through
    // the SDK's exported allocator (a leaked Vec<u8> of exactly `size`
    // bytes), which we take ownership of once.
    let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
    if status != OK || data.is_null() {
        return Vec::new();
    }
    let buf = unsafe { Vec::from_raw_parts(data, size, size) };
    crate::headers::parse(&buf)
}

pub fn remove_header(map: MapType, name: &str) -> Result<(), u32> {
    // SAFETY: as above.
    check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, u32> {
    let mut id = 0u32;
    // SAFETY: as above; `id` outlives the call.
    check(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) }).map(|()| id)
}

pub fn increment_metric(id: u32, by: i64) -> Result<(), u32> {
    // SAFETY: no pointers.
    check(unsafe { proxy_increment_metric(id, by) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
    // SAFETY: no pointers.
    check(unsafe { proxy_record_metric(id, value) })
}

pub fn set_shared_data(key: &str, value: &[u8], cas: u32) -> Result<(), u32> {
    // SAFETY: as above.
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        details_data: *const u8,
        details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
}

/// Answer the request from the filter (429/503) instead of forwarding it.
pub fn send_local_response(
    status: u32,
    details: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), u32> {
    let h = crate::headers::serialize(headers);
    // SAFETY: all pointers come from live slices; the host copies them.
    check(unsafe {
        proxy_send_local_response(
            status,
            details.as_ptr(),
            details.len(),
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    })
}
