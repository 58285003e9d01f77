//! A short, deterministic fuzz run on stable Rust, part of `scripts/test`:
//! every seed in `tests/fuzz-seeds`, then thousands of mutations of each
//! (bit flips, truncations, splices, byte insertions), through the same
//! entry points as the cargo-fuzz targets in `fuzz/`. The long runs are
//! `scripts/fuzz`.

// A test: it asserts by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use prefix_router::fuzz;

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seeds(dir: &str) -> Vec<Vec<u8>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-seeds")
        .join(dir);
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .map(|e| std::fs::read(e.expect("entry").path()).expect("seed"))
        .collect();
    out.sort();
    assert!(!out.is_empty());
    out
}

fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.truncate(rng.below(v.len() + 1)),
            2 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, *b"{}[]\",:\\0\xff".get(rng.below(11)).unwrap_or(&0));
            }
            3 if !other.is_empty() => {
                let cut = rng.below(v.len() + 1);
                let from = rng.below(other.len());
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            _ if !v.is_empty() => {
                let i = rng.below(v.len());
                v.remove(i);
            }
            _ => {}
        }
    }
    v
}

fn run(dir: &str, rounds: usize, target: fn(&[u8])) -> usize {
    let seeds = seeds(dir);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut n = 0;
    for s in &seeds {
        target(s);
        n += 1;
    }
    for _ in 0..rounds {
        let a = &seeds[rng.below(seeds.len())];
        let b = &seeds[rng.below(seeds.len())];
        target(&mutate(&mut rng, a, b));
        n += 1;
    }
    n
}

#[test]
fn request_bodies() {
    assert!(run("request", 20_000, fuzz::request_body) > 20_000);
    // The big and deep ones, once each.
    let big = format!(
        r#"{{"model":"m","prompt":"{}"}}"#,
        "lorem ipsum ".repeat(90_000)
    );
    fuzz::request_body(big.as_bytes());
    let deep = format!(
        r#"{{"messages":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    fuzz::request_body(deep.as_bytes());
}

#[test]
fn metrics_pages() {
    assert!(run("metrics", 20_000, fuzz::metrics_page) > 20_000);
}

#[test]
fn plugin_configs() {
    assert!(run("config", 20_000, fuzz::plugin_config) > 20_000);
}

#[test]
fn admin_clusters_json() {
    assert!(run("admin", 20_000, fuzz::admin_clusters) > 20_000);
}

#[test]
fn shared_records() {
    // Records are binary: mutate real encodings from the request seeds'
    // bytes as well as random bytes.
    let mut rng = Rng(7);
    for len in 0..20_000usize {
        let v: Vec<u8> = (0..len % 300).map(|_| rng.next() as u8).collect();
        fuzz::shared_records(&v);
    }
    assert!(run("request", 5_000, fuzz::shared_records) > 5_000);
}

#[test]
fn affinity_values() {
    assert!(run("affinity", 20_000, fuzz::affinity_values) > 20_000);
}
