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
//! - [`route`]: one decision end to end.
//!
//! `host` is the thin layer that talks to Envoy.

pub mod affinity;
pub mod config;
pub mod discovery;
pub mod endpoint;
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
