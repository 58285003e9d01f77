//! prefix-router: an Envoy proxy-wasm filter that sends each LLM inference
//! request to the replica most likely to hold its prompt prefix in KV cache,
//! balanced against load.
//!
//! Pure, host-independent logic (tested natively and on wasm32):
//! - [`config`]: the plugin configuration, validated;
//! - [`request`]: OpenAI bodies → model and rendered prompt;
//! - [`prefix`]: prompt → chained block hashes;
//! - [`index`]: the shared prefix index (block hash → replicas);
//! - [`load`]: in-flight work per replica across workers;
//! - [`score`]: **where the decision is made**;
//! - [`route`]: one decision end to end;
//! - [`filter`]: one HTTP stream end to end (strip, pause, body, decide,
//!   header, accounting), over a [`filter::Host`] trait.
//!
//! `host` is the thin layer that talks to Envoy: the SDK's callbacks, and
//! `filter::Host` over the proxy-wasm ABI.

// The filter never panics on a non-test path (see Cargo.toml's lints);
// tests assert by panicking.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod affinity;
pub mod config;
pub mod discovery;
pub mod endpoint;
pub mod filter;
/// The fuzzing entry points: for the fuzz smoke test and cargo-fuzz only
/// (see the `fuzzing` feature).
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
pub mod headers;
pub mod index;
pub mod load;
pub mod metrics;
pub mod prefix;
pub mod replicas;
pub mod request;
pub mod route;
pub mod score;
pub mod scrape;
pub mod store;

// Not in test builds: a wasm32 test binary runs under plain WASI, which
// has no proxy-wasm imports.
#[cfg(all(target_arch = "wasm32", not(test)))]
mod host;
