//! Load generator for replica-sim: starts one `replica-sim` process with N
//! replicas, measures its idle CPU, then drives closed-loop streaming
//! completions over loopback for a fixed time per configuration and prints a
//! table (medians over runs).
//!
//!   cargo build --release -p replica-sim --examples
//!   target/release/examples/load --sim target/release/replica-sim
//!
//! Every loop is bounded by `--seconds`; the child is killed on exit.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[derive(Parser, Debug)]
struct Args {
    /// Path of the replica-sim binary.
    #[arg(long, default_value = "target/release/replica-sim")]
    sim: String,
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    #[arg(long, default_value = "a10g-7b")]
    preset: String,
    /// Time scales to test.
    #[arg(long, value_delimiter = ',', default_value = "1,0.1")]
    time_scale: Vec<f64>,
    /// Concurrent streams to test.
    #[arg(long, value_delimiter = ',', default_value = "200")]
    concurrency: Vec<usize>,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Words in each prompt (a shared per-replica prefix plus a unique tail).
    #[arg(long, default_value_t = 300)]
    prompt_words: usize,
    #[arg(long, default_value_t = 3.0)]
    idle_seconds: f64,
}

/// Child process killed on drop.
struct Sim {
    child: Child,
    addrs: Vec<String>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_sim(a: &Args, scale: f64) -> Sim {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(&a.sim)
        .args([
            "--port",
            "0",
            "--replicas",
            &a.replicas.to_string(),
            "--preset",
            &a.preset,
        ])
        .args(["--time-scale", &scale.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start replica-sim (build it with --release first)");
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    let addrs: Vec<String> = out
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| {
            l.strip_prefix("replica-sim listening on ")
                .map(str::to_string)
        })
        .take(a.replicas)
        .collect();
    assert_eq!(addrs.len(), a.replicas, "replica-sim did not start");
    Sim { child, addrs }
}

/// CPU seconds (user + system) used so far by `pid`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = after
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // After the ")" field 3 (state) is not numeric, so utime/stime (fields
    // 14/15) sit at indices 10/11 of the numeric ones.
    let ticks = f.get(10).copied().unwrap_or(0.0) + f.get(11).copied().unwrap_or(0.0);
    ticks / clock_ticks()
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

#[derive(Default)]
struct Tally {
    requests: u64,
    errors: u64,
    tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft: Vec<f64>,
}

fn prompt(replica: usize, unique: u64, words: usize) -> String {
    const W: [&str; 10] = [
        "cache", "prefix", "router", "token", "replica", "model", "engine", "block", "latency",
        "stream",
    ];
    let shared: Vec<&str> = (0..words.saturating_sub(20))
        .map(|i| W[(i * 3 + replica) % W.len()])
        .collect();
    format!(
        "System {replica}: {} Question {unique}: why {} ?",
        shared.join(" "),
        W[unique as usize % W.len()]
    )
}

/// One worker: keeps one keep-alive connection and sends streaming
/// requests back to back until `stop`.
async fn worker(
    addr: String,
    replica: usize,
    id: u64,
    a: Arc<Args>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok(stream) = TcpStream::connect(&addr).await else {
            tally.lock().unwrap().errors += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok((mut sender, conn)) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
        else {
            continue;
        };
        tokio::spawn(conn);
        while !stop.load(Ordering::Relaxed) && sender.ready().await.is_ok() {
            n += 1;
            let body = serde_json::json!({
                "prompt": prompt(replica, id * 1_000_000 + n, a.prompt_words),
                "max_tokens": a.max_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            let req = Request::post("/v1/completions")
                .header("host", &addr)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .expect("request");
            if one_request(&mut sender, req, &tally).await.is_err() {
                tally.lock().unwrap().errors += 1;
                break;
            }
        }
    }
}

async fn one_request(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    req: Request<Full<Bytes>>,
    tally: &Mutex<Tally>,
) -> Result<(), ()> {
    let t0 = Instant::now();
    let resp = sender.send_request(req).await.map_err(|_| ())?;
    if !resp.status().is_success() {
        return Err(());
    }
    let mut body = resp.into_body();
    let mut ttft = None;
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ())?;
        if let Some(d) = frame.data_ref() {
            ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            buf.extend_from_slice(d);
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let frames: Vec<&str> = text
        .split("\n\n")
        .filter_map(|f| f.strip_prefix("data: "))
        .collect();
    if frames.last() != Some(&"[DONE]") {
        return Err(());
    }
    let usage = frames.iter().rev().find_map(|f| {
        serde_json::from_str::<serde_json::Value>(f)
            .ok()
            .filter(|v| v["usage"].is_object())
    });
    let mut t = tally.lock().unwrap();
    t.requests += 1;
    t.tokens += frames.len().saturating_sub(2) as u64;
    if let Some(u) = usage {
        t.prompt_tokens += u["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        t.cached_tokens += u["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    t.ttft.extend(ttft);
    Ok(())
}

struct Run {
    rps: f64,
    tok_s: f64,
    ttft_p50: f64,
    ttft_p99: f64,
    hit: f64,
    sim_cpu: f64,
    client_cpu: f64,
    errors: u64,
}

async fn run_once(a: &Arc<Args>, sim: &Sim, concurrency: usize) -> Run {
    for addr in &sim.addrs {
        let _ = reset(addr).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut tasks = Vec::new();
    for i in 0..concurrency {
        let r = i % sim.addrs.len();
        tasks.push(tokio::spawn(worker(
            sim.addrs[r].clone(),
            r,
            i as u64,
            a.clone(),
            stop.clone(),
            tally.clone(),
        )));
    }
    // Warm-up: let the pipeline fill before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (sim_cpu0, me0) = (cpu_seconds(sim.child.id()), cpu_seconds(std::process::id()));
    let start = std::mem::take(&mut *tally.lock().unwrap());
    drop(start);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.seconds)).await;
    let wall = t0.elapsed().as_secs_f64();
    let t = std::mem::take(&mut *tally.lock().unwrap());
    let (sim_cpu1, me1) = (cpu_seconds(sim.child.id()), cpu_seconds(std::process::id()));
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    let mut ttft = t.ttft.clone();
    ttft.sort_by(f64::total_cmp);
    Run {
        rps: t.requests as f64 / wall,
        tok_s: t.tokens as f64 / wall,
        ttft_p50: percentile(&ttft, 0.5),
        ttft_p99: percentile(&ttft, 0.99),
        hit: t.cached_tokens as f64 / (t.prompt_tokens.max(1)) as f64,
        sim_cpu: (sim_cpu1 - sim_cpu0) / wall * 100.0,
        client_cpu: (me1 - me0) / wall * 100.0,
        errors: t.errors,
    }
}

async fn reset(addr: &str) -> Result<(), ()> {
    let stream = TcpStream::connect(addr).await.map_err(|_| ())?;
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|_| ())?;
    tokio::spawn(conn);
    let req = Request::post("/reset")
        .header("host", addr)
        .body(Full::new(Bytes::new()))
        .map_err(|_| ())?;
    s.send_request(req).await.map(|_| ()).map_err(|_| ())
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

#[tokio::main]
async fn main() {
    let a = Arc::new(Args::parse());
    println!(
        "replica-sim load: {} replicas, preset {}, max_tokens {}, ~{} words/prompt, {} s x {} runs (medians)",
        a.replicas, a.preset, a.max_tokens, a.prompt_words, a.seconds, a.runs
    );
    println!("| time-scale | streams | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | prefix hit | sim CPU % | client CPU % | errors |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &scale in &a.time_scale {
        let sim = start_sim(&a, scale);
        let idle0 = cpu_seconds(sim.child.id());
        tokio::time::sleep(Duration::from_secs_f64(a.idle_seconds)).await;
        let idle = (cpu_seconds(sim.child.id()) - idle0) / a.idle_seconds * 100.0;
        println!("| {scale} | idle | - | - | - | - | - | {idle:.2} | - | - |");
        for &c in &a.concurrency {
            let mut runs = Vec::new();
            for _ in 0..a.runs {
                runs.push(run_once(&a, &sim, c).await);
            }
            let m = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
            let errors: u64 = runs.iter().map(|r| r.errors).sum();
            println!(
                "| {scale} | {c} | {:.1} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {errors} |",
                m(|r| r.rps),
                m(|r| r.tok_s),
                m(|r| r.ttft_p50) * 1000.0,
                m(|r| r.ttft_p99) * 1000.0,
                m(|r| r.hit),
                m(|r| r.sim_cpu),
                m(|r| r.client_cpu),
            );
        }
    }
}
