//! Panic-free versions of every host call the filter makes.
//!
//! The SDK's wrappers `panic!` on any status they don't expect (Envoy
//! answers a header read on a failed callout with BadArgument, refuses a
//! header edit, ...), and a panic traps the VM: every later request on
//! that worker fails, and a scraper VM that traps hands the lease to the
//! next VM, which traps the same way. The ABI functions are declared here
//! again returning the raw status code, so the filter gets an error value
//! to count and log instead. The one SDK call left is
//! `dispatch_http_call` (the SDK must register the callout token); it
//! panics only on statuses Envoy's `proxy_http_call` never returns.

#![allow(clashing_extern_declarations)]

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
}

pub fn log(level: LogLevel, message: &str) {
    // SAFETY: pointer and length of a live slice; the host copies it.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

/// Nanoseconds since the Unix epoch, if the host tells.
pub fn current_time_ns() -> Option<u64> {
    let mut t = 0u64;
    // SAFETY: `t` outlives the call.
    (unsafe { proxy_get_current_time_nanoseconds(&mut t) } == OK).then_some(t)
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), u32> {
    // SAFETY: no pointers.
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Take ownership of a host-allocated buffer (the SDK's exported allocator
/// made it: a leaked `Vec<u8>` of exactly `size` bytes).
///
/// SAFETY: `data` must be null or such a buffer, not owned by anyone else.
unsafe fn take_host_buffer(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

/// Up to `max` bytes of a host buffer (request body, callout response
/// body, plugin configuration); `None` when the host has none to give.
pub fn get_buffer(kind: BufferType, start: usize, max: usize) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a buffer pointer we then own (see above).
    let status = unsafe { proxy_get_buffer_bytes(kind, start, max, &mut data, &mut size) };
    let buf = unsafe { take_host_buffer(data, size) };
    (status == OK).then_some(buf)
}

/// Replace a host buffer's first `drop` bytes with `data`. Envoy edits a
/// buffered body only at its start (drains `drop` bytes, prepends
/// `data`) or past its end; anything else is refused.
pub fn set_buffer_head(kind: BufferType, drop: usize, data: &[u8]) -> Result<(), u32> {
    // SAFETY: pointer and length of a live slice; the host copies it.
    check(unsafe { proxy_set_buffer_bytes(kind, 0, drop, data.as_ptr(), data.len()) })
}

/// A shared-data value and its CAS token; `(None, None)` when absent.
pub fn get_shared_data(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), u32> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    let mut cas: u32 = 0;
    // SAFETY: as `get_buffer`; `cas` outlives the call.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    let buf = unsafe { take_host_buffer(data, size) };
    match status {
        OK => Ok(((!data.is_null()).then_some(buf), (cas != 0).then_some(cas))),
        NOT_FOUND => Ok((None, None)),
        other => Err(other),
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_add_header_map_value(
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
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
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
    replace_header_bytes(map, name, value.as_bytes())
}

/// `replace_header` with a value of any bytes (a request's own, written
/// back: the ABI takes bytes).
pub fn replace_header_bytes(map: MapType, name: &str, value: &[u8]) -> Result<(), u32> {
    // SAFETY: pointers and lengths come from live Rust slices; the host
    // copies the bytes before returning.
    check(unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Add a copy of a header, keeping the others (`set-cookie`: the
/// upstream's own cookies must stay).
pub fn add_header(map: MapType, name: &str, value: &str) -> Result<(), u32> {
    // SAFETY: as `replace_header`.
    check(unsafe {
        proxy_add_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
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
    let buf = unsafe { take_host_buffer(data, size) };
    if status != OK {
        return Vec::new();
    }
    crate::headers::parse(&buf)
}

/// A stream property (`path` segments, e.g. `["upstream", "address"]`);
/// `None` when absent or unreadable.
pub fn get_property(path: &[&str]) -> Option<Vec<u8>> {
    let joined = path.join("\0");
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: as `get_headers`.
    let status = unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut data, &mut size) };
    let buf = unsafe { take_host_buffer(data, size) };
    (status == OK && !data.is_null()).then_some(buf)
}

/// One header's value as raw bytes; `None` when absent or unreadable.
pub fn get_header(map: MapType, name: &str) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: as `get_headers`.
    let status =
        unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
    let buf = unsafe { take_host_buffer(data, size) };
    (status == OK && !data.is_null()).then_some(buf)
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
