//! Test harness: runs the real `replica-sim` binary on free loopback ports
//! and talks to it over HTTP. The child is killed on drop, so a failing
//! test never leaks a server.

#![allow(dead_code)] // each test file uses a different subset

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Sim {
    child: Child,
    pub addrs: Vec<String>,
}

impl Sim {
    /// Starts with the `fast` preset on OS-chosen ports, plus `args`.
    pub fn start(replicas: usize, args: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_replica-sim"))
            .args([
                "--port",
                "0",
                "--preset",
                "fast",
                "--replicas",
                &replicas.to_string(),
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn replica-sim");
        let stdout = child.stdout.take().expect("stdout");
        let mut sim = Sim {
            child,
            addrs: Vec::new(),
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        while sim.addrs.len() < replicas {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .expect("replica-sim did not announce its replicas in time");
            if let Some(addr) = line.strip_prefix("replica-sim listening on ") {
                sim.addrs.push(addr.trim().to_string());
            }
        }
        sim
    }

    pub fn addr(&self) -> &str {
        &self.addrs[0]
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(2))
        .timeout(timeout)
        .build()
}

pub struct Reply {
    pub status: u16,
    pub served_by: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn finish(r: Result<ureq::Response, ureq::Error>) -> Result<Reply, String> {
    let resp = match r {
        Ok(resp) | Err(ureq::Error::Status(_, resp)) => resp,
        Err(e) => return Err(e.to_string()),
    };
    let status = resp.status();
    let served_by = resp.header("x-served-by").map(str::to_string);
    let mut body = String::new();
    resp.into_reader()
        .read_to_string(&mut body)
        .map_err(|e| e.to_string())?;
    Ok(Reply {
        status,
        served_by,
        body,
    })
}

/// POST raw bytes; Err only on transport failure (including timeouts).
pub fn try_post(
    addr: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Reply, String> {
    let mut req = agent(timeout)
        .post(&format!("http://{addr}{path}"))
        .set("content-type", "application/json");
    for (k, v) in headers {
        req = req.set(k, v);
    }
    finish(req.send_string(body))
}

pub fn post(addr: &str, path: &str, body: &Value) -> Reply {
    try_post(addr, path, &body.to_string(), &[], Duration::from_secs(20)).expect("POST")
}

pub fn try_get(addr: &str, path: &str, timeout: Duration) -> Result<Reply, String> {
    finish(agent(timeout).get(&format!("http://{addr}{path}")).call())
}

pub fn get(addr: &str, path: &str) -> Reply {
    try_get(addr, path, Duration::from_secs(10)).expect("GET")
}

/// One sample's value from the metrics page (first series of that name).
pub fn metric(addr: &str, name: &str) -> f64 {
    let page = get(addr, "/metrics").body;
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Polls `cond` every 10 ms for up to `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// English-like text of about `words` words, distinct per `seed`.
pub fn text(seed: usize, words: usize) -> String {
    const W: [&str; 12] = [
        "prefix", "cache", "router", "token", "block", "model", "replica", "latency", "prompt",
        "system", "engine", "request",
    ];
    (0..words)
        .map(|i| {
            W[(i * 7 + seed * 13 + i / 5) % W.len()].to_string() + if i % 9 == 8 { "." } else { "" }
        })
        .collect::<Vec<_>>()
        .join(" ")
        + &format!(" seed{seed}")
}

/// Streams a completion, returning (seconds to first data frame, all frames).
pub fn stream(addr: &str, path: &str, body: &Value) -> (f64, Vec<String>) {
    let t0 = Instant::now();
    let resp = agent(Duration::from_secs(20))
        .post(&format!("http://{addr}{path}"))
        .send_string(&body.to_string())
        .expect("stream request");
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    let mut reader = BufReader::new(resp.into_reader());
    let mut frames = Vec::new();
    let mut ttft = None;
    let mut raw = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).expect("read SSE") == 0 {
            break;
        }
        ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        raw.push_str(&line);
    }
    // Every frame is exactly "data: ...\n\n".
    assert!(
        raw.ends_with("\n\n"),
        "stream must end with a blank line: {raw:?}"
    );
    for f in raw.trim_end_matches("\n\n").split("\n\n") {
        let payload = f
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("bad frame {f:?}"));
        assert!(!payload.contains('\n'));
        frames.push(payload.to_string());
    }
    (ttft.expect("no frames"), frames)
}

/// How a raw response's connection ended.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// The server closed it (FIN).
    Eof,
    /// The server reset it (RST).
    Reset,
    /// Still open when the time limit passed.
    TimedOut,
}

/// A response read off the socket as is: no client library framing checks,
/// so a short, stalled or binary body is observable byte for byte.
#[derive(Debug)]
pub struct RawReply {
    pub status: u16,
    /// Lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub end: End,
    pub elapsed: Duration,
}

impl RawReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn content_length(&self) -> usize {
        self.header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no content-length: {:?}", self.headers))
    }

    /// All promised bytes arrived and the server closed cleanly.
    pub fn complete(&self) -> bool {
        self.end == End::Eof && self.body.len() == self.content_length()
    }
}

/// GET with `Connection: close`, reading until the server closes or resets
/// the connection or `limit` passes. Panics if no response head arrives.
pub fn raw_get(addr: &str, path: &str, limit: Duration) -> RawReply {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send request");
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let end = loop {
        let left = (t0 + limit).saturating_duration_since(Instant::now());
        if left.is_zero() {
            break End::TimedOut;
        }
        s.set_read_timeout(Some(left)).expect("set timeout");
        match s.read(&mut chunk) {
            Ok(0) => break End::Eof,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                break End::TimedOut
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break End::Reset,
            Err(e) => panic!("read {addr}{path}: {e}"),
        }
    };
    let elapsed = t0.elapsed();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head from {addr}{path}: {end:?}"));
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    RawReply {
        status,
        headers,
        body: buf[split + 4..].to_vec(),
        end,
        elapsed,
    }
}
