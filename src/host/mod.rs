//! The only code that talks to the proxy-wasm host. Everything here is
//! glue: `abi` makes the host calls (the only `unsafe` code), `envoy`
//! offers them to the request path (`filter`) as its `Host`, `http` and
//! `root` adapt the SDK's callbacks, `scrape` runs the scraper VM's
//! callouts.

mod abi;
mod envoy;
mod http;
mod root;
mod scrape;
mod shared;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    // Our own logger, not the SDK's: the SDK's unwraps the host's answer.
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    std::panic::set_hook(Box::new(|info| {
        abi::log(LogLevel::Critical, &format!("prefix-router: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new())
    });
}}

/// `log` records to Envoy's log, through the panic-free ABI.
struct HostLogger;

static LOGGER: HostLogger = HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let level = match r.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        abi::log(level, &r.args().to_string());
    }

    fn flush(&self) {}
}

/// Milliseconds since the Unix epoch from the host clock (0 if the host
/// can't tell, which only makes slots look stale, never panics).
pub(crate) fn now_ms() -> u64 {
    abi::current_time_ns().map_or(0, |ns| ns / 1_000_000)
}
