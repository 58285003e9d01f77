#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| prefix_router::fuzz::affinity_values(data));
