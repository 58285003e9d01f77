//! Native cost of one routing decision: parse + hash + index lookup +
//! load snapshot + score, for 1 KiB .. 1 MiB chat bodies and 8 .. 1,024
//! replicas. The index is warm: the request's document is already held by
//! one replica, as in the shared-prefix workload.
//!
//! - `decision/<n>_replicas/<bytes>`: static pool, no scraping (the replica
//!   table isn't read); 8 and 64 replicas at every size, 256 and 1,024 at
//!   16 KiB.
//! - `decision_scraped/<n>_replicas`: 16 KiB, scraping on, every replica
//!   with a row in the replica table and a request in flight: what a
//!   decision costs in a large pool (the table read grows with it).
//! - `scrape_round/*/<n>`: the scraper's work for one round over n
//!   replicas (`Table::record` per response, then `retain` + `publish`
//!   once; `first_round` also inserts every row), a worker's `Table::load`
//!   of the published table, the scraper's `eligible_count` per tick, and
//!   a worker's `Router::refresh` when discovery publishes a new pool.
//!
//! - `affinity/*`: minting and verifying a session-affinity token, and
//!   sealing and opening the affinity cookie (1 and 16 sessions).
//!
//! `cargo bench -p prefix-router --bench decision`

// A benchmark, not the filter: a broken setup should stop it loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::HashSet;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefix_router::config::Config;
use prefix_router::discovery;
use prefix_router::load::LoadBoard;
use prefix_router::metrics::ReplicaMetrics;
use prefix_router::replicas::Table;
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

fn endpoints(replicas: usize) -> Vec<String> {
    (0..replicas)
        .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1))
        .collect()
}

fn router_with(replicas: usize, extra: &str) -> Router {
    let eps: Vec<String> = endpoints(replicas)
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect();
    let json = format!(r#"{{"endpoints":[{}]{extra}}}"#, eps.join(","));
    Router::new(Config::parse(json.as_bytes()).expect("bench config"))
}

fn router(replicas: usize) -> Router {
    router_with(replicas, "")
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for &size in &[1 << 10, 16 << 10, 256 << 10, 1 << 20] {
        let pools: &[usize] = if size == 16 << 10 {
            &[8, 64, 256, 1024]
        } else {
            &[8, 64]
        };
        for &replicas in pools {
            let r = router(replicas);
            let store = MemStore::new();
            let mut board = LoadBoard::new(1, 60_000);
            let b = body(size);
            // Warm the index with this document on one replica.
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

/// Metrics as a busy replica's page reports them.
fn page(i: usize) -> ReplicaMetrics {
    ReplicaMetrics {
        waiting: (i % 5) as f64,
        running: (i % 17) as f64,
        kv_usage: (i % 10) as f64 / 10.0,
        ..ReplicaMetrics::default()
    }
}

/// A large pool as the scraper sees it: scraping on, every replica scraped
/// and with work in flight.
fn decision_scraped(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_scraped");
    let size = 16 << 10;
    for &replicas in &[8usize, 64, 256, 1024] {
        let r = router_with(replicas, r#","cluster":"pool""#);
        let store = MemStore::new();
        let mut table = Table::default();
        for (i, e) in r.endpoints().iter().enumerate() {
            table.record(e.id(), Ok(&page(i)), 1000);
        }
        table.publish(&store).expect("mem store");
        let mut board = LoadBoard::new(1, 60_000);
        for i in 0..replicas {
            let h = Hashed::of(
                &request::extract(body(1 << 10).as_bytes(), 1 << 20).expect("body"),
                &r.config,
            );
            let mut c = r.decide(&store, &h, Meta::default(), 1000).expect("pool");
            c.order = vec![i];
            r.commit(&store, &mut board, &c, &Hashed::default(), 1000);
        }
        let b = body(size);
        let (_, h) = Hashed::parse(b.as_bytes(), &r.config).expect("body");
        let first = r.decide(&store, &h, Meta::default(), 1000).expect("pool");
        r.commit(&store, &mut board, &first, &h, 1000);
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
        // The decision alone (no parse and hash): what grows with the pool.
        g.bench_with_input(
            BenchmarkId::new(format!("{replicas}_replicas_decide_only"), size),
            &h,
            |bench, h| bench.iter(|| r.decide(&store, h, Meta::default(), 1000).expect("pool")),
        );
    }
    g.finish();
}

/// The scraper's bookkeeping for one round of n scrapes, and one worker's
/// read of the result.
fn scrape_round(c: &mut Criterion) {
    let mut g = c.benchmark_group("scrape_round");
    for &replicas in &[8usize, 64, 256, 1024] {
        let r = router(replicas);
        let ids: Vec<u64> = r.endpoints().iter().map(|e| e.id()).collect();
        let known: HashSet<u64> = ids.iter().copied().collect();
        let pages: Vec<ReplicaMetrics> = (0..replicas).map(page).collect();
        let store = MemStore::new();
        let mut table = Table::default();
        let mut now = 1000;
        // Steady state: every row exists (a first round also inserts).
        for (id, m) in ids.iter().zip(&pages) {
            table.record(*id, Ok(m), now);
        }
        g.bench_function(BenchmarkId::new("record_publish", replicas), |bench| {
            bench.iter(|| {
                now += 100;
                for (id, m) in ids.iter().zip(&pages) {
                    table.record(*id, Ok(m), now);
                    std::hint::black_box(table.row(*id));
                }
                table.retain(&known);
                table.publish(&store).expect("mem store");
            })
        });
        g.bench_function(BenchmarkId::new("first_round", replicas), |bench| {
            bench.iter(|| {
                let mut t = Table::default();
                for (id, m) in ids.iter().zip(&pages) {
                    t.record(*id, Ok(m), 1000);
                }
                t.retain(&known);
                t.publish(&store).expect("mem store");
            })
        });
        g.bench_function(BenchmarkId::new("load", replicas), |bench| {
            bench.iter(|| Table::load(&store))
        });
        g.bench_function(BenchmarkId::new("eligible_count", replicas), |bench| {
            bench.iter(|| r.eligible_count(&store, 1000))
        });
        // A worker picking up a newly discovered pool (every tick on which
        // discovery published a change): decode it, merge it with the
        // static list.
        let json = r#"{"discovery":{"cluster":"pool","admin_cluster":"admin"},"cluster":"pool"}"#;
        let mut found = Router::new(Config::parse(json.as_bytes()).expect("bench config"));
        let eps = r.endpoints().to_vec();
        g.bench_function(BenchmarkId::new("discovery_refresh", replicas), |bench| {
            bench.iter(|| {
                discovery::publish(&store, &eps);
                found.refresh(&store);
                assert_eq!(found.endpoints().len(), replicas);
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = decision, decision_scraped, scrape_round
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

/// Session affinity (opt-in): a token minted on each 2xx and verified on
/// each request that carries one; the cookie sealed and opened likewise,
/// with 1 and 16 (the default most) sessions.
fn affinity(c: &mut Criterion) {
    use prefix_router::affinity::{self, cookie};
    let key = b"0123456789abcdef0123456789abcdef";
    let mut g = c.benchmark_group("affinity");
    g.bench_function("token_mint", |b| {
        b.iter(|| affinity::mint(key, 0xdead_beef, 1_000_000))
    });
    let t = affinity::mint(key, 0xdead_beef, 1_000_000);
    g.bench_function("token_verify", |b| {
        b.iter(|| affinity::verify(key, t.as_bytes(), 1_000_001, 3600).expect("token"))
    });
    for sessions in [1u32, 16] {
        let jar = (0..sessions).fold(cookie::Jar::default(), |j, i| {
            let e = cookie::Entry {
                replica: u64::from(i),
                bytes: 1000 + i,
                hash: u64::from(i) << 20,
                issued: 1_000_000,
            };
            j.with(e, 16)
        });
        g.bench_function(BenchmarkId::new("cookie_seal", sessions), |b| {
            b.iter(|| jar.seal(key))
        });
        let v = jar.seal(key);
        g.bench_function(BenchmarkId::new("cookie_open", sessions), |b| {
            b.iter(|| cookie::Jar::open(key, v.as_bytes(), 1_000_001, 3600).expect("cookie"))
        });
    }
    g.finish();
}

criterion_group! {
    name = part_benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = parts, affinity
}
criterion_main!(benches, part_benches);
