#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| prefix_router::fuzz::admin_clusters(data));
