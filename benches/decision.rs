//! Native cost of one routing decision: parse + hash + index lookup +
//! load snapshot + score (+ commit), for 1 KiB .. 1 MiB chat bodies and 8 or
//! 64 replicas. The index is warm: the request's document is already held
//! by one replica, as in the shared-prefix workload.
//!
//! `cargo bench -p prefix-router --bench decision`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefix_router::config::Config;
use prefix_router::load::LoadBoard;
use prefix_router::request;
use prefix_router::route::{Hashed, Meta, Router};
use prefix_router::store::MemStore;

fn body(bytes: usize) -> String {
    let doc: String = "The quick brown fox jumps over the lazy dog. "
        .chars()
        .cycle()
        .take(bytes)
        .collect();
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"You answer from the document."}},{{"role":"user","content":"{doc}"}}],"stream":true}}"#
    )
}

fn router(replicas: usize) -> Router {
    let eps: Vec<String> = (0..replicas)
        .map(|i| format!("\"10.0.{}.{}:8000\"", i / 250, i % 250 + 1))
        .collect();
    let json = format!(r#"{{"endpoints":[{}]}}"#, eps.join(","));
    Router::new(Config::parse(json.as_bytes()).expect("bench config"))
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for &size in &[1 << 10, 16 << 10, 256 << 10, 1 << 20] {
        for &replicas in &[8usize, 64] {
            let r = router(replicas);
            let store = MemStore::new();
            let mut board = LoadBoard::new(1, 60_000);
            let b = body(size);
            // Warm the index with this document on one replica, and put
            // some work in flight everywhere.
            let p = request::extract(b.as_bytes(), 1 << 20).expect("body");
            let h = Hashed::of(&p, &r.config);
            let first = r.decide(&store, &h, Meta::default(), 1000).expect("pool");
            r.commit(&store, &mut board, &first, &h, 1000);
            g.throughput(Throughput::Bytes(b.len() as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("{replicas}_replicas"), size),
                &b,
                |bench, b| {
                    bench.iter(|| {
                        let (_, h) = Hashed::parse(b.as_bytes(), &r.config).expect("body");
                        let c = r.decide(&store, &h, Meta::default(), 1000).expect("pool");
                        std::hint::black_box(r.header_value(&c))
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = decision
}

/// The parts of a decision, to see what dominates.
fn parts(c: &mut Criterion) {
    let mut g = c.benchmark_group("parts");
    let r = router(8);
    for &size in &[16 << 10, 256 << 10, 1 << 20] {
        let b = body(size);
        let cap = r.config.max_body_bytes;
        g.bench_with_input(BenchmarkId::new("extract", size), &b, |bench, b| {
            bench.iter(|| request::extract(b.as_bytes(), cap).expect("body"))
        });
        let p = request::extract(b.as_bytes(), cap).expect("body");
        g.bench_with_input(BenchmarkId::new("hash", size), &p, |bench, p| {
            bench.iter(|| Hashed::of(p, &r.config))
        });
        g.bench_with_input(BenchmarkId::new("parse_and_hash", size), &b, |bench, b| {
            bench.iter(|| Hashed::parse(b.as_bytes(), &r.config).expect("body"))
        });
        // The rest of a decision: index lookup, load snapshot, ranking
        // (the document warm on one replica).
        let store = MemStore::new();
        let mut board = LoadBoard::new(1, 60_000);
        let (_, h) = Hashed::parse(b.as_bytes(), &r.config).expect("body");
        let first = r.decide(&store, &h, Meta::default(), 1000).expect("pool");
        r.commit(&store, &mut board, &first, &h, 1000);
        g.bench_with_input(BenchmarkId::new("decide", size), &h, |bench, h| {
            bench.iter(|| r.decide(&store, h, Meta::default(), 1000).expect("pool"))
        });
    }
    g.finish();
}

criterion_group! {
    name = part_benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = parts
}
criterion_main!(benches, part_benches);
