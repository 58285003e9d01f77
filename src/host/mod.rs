//! The only code that talks to the proxy-wasm host. Everything here is
//! glue: read headers/body, call the pure modules, write the header back.

mod abi;
mod http;
mod root;
mod scrape;
mod shared;
mod stats;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new())
    });
}}

/// Milliseconds since the Unix epoch from the host clock (0 if the host
/// can't tell, which only makes slots look stale, never panics).
pub(crate) fn now_ms() -> u64 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
