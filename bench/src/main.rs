//! prefix-bench: load generator for prefix-router benchmarks.
//!
//! Sends OpenAI streaming requests over HTTP/1.1 keep-alive to one or more
//! targets (routers), open loop (Poisson arrivals) or closed loop (N
//! clients), and measures per request: time to first token (first SSE data
//! chunk), inter-token gaps, end-to-end latency, errors, and which replica
//! served (`x-served-by`). Writes one JSON document: config, summary,
//! per-request records, its own CPU time, and the workload's cache-hit upper
//! bound (token ids from a replica's `/tokenize`).
//!
//! Every run is bounded: `--max-duration` stops sending, `--drain` later
//! every request still in flight is cut and counted as an error.

mod client;
mod content;
mod stats;
mod text;
mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use tokio::time::Instant as TInstant;

use client::{Outcome, Pool};
use stats::Record;
use workload::{Api, Conversation, Plan, Planned, Session};

#[derive(Parser, Debug)]
#[command(
    name = "prefix-bench",
    version,
    about = "Load generator for prefix-router benchmarks"
)]
struct Cli {
    /// Router address(es), host:port, comma-separated. Clients (closed loop,
    /// conversations) or requests (open loop) are spread over them in turn.
    #[arg(long, value_delimiter = ',', required = true)]
    target: Vec<String>,
    #[arg(long, value_enum, default_value_t = Mode::Open)]
    mode: Mode,
    /// Open loop: mean arrivals per simulated second (Poisson). 0 = all at once.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Closed loop: concurrent clients, each sending back to back.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Real seconds per simulated second (match replica-sim --time-scale):
    /// arrival gaps and think times are multiplied by it, reported latencies
    /// divided by it. Records keep real milliseconds.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Multiplies request / group / conversation counts (keeps lengths).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Header carrying the group / conversation id (for session-affinity
    /// routers such as Envoy ring hash). Empty = don't send.
    #[arg(long, default_value = "x-session-id")]
    session_header: String,
    /// Response header carrying a session-affinity token (prefix-router's
    /// `affinity.header`): conversations and agent sessions send the last
    /// one back on their next turn, as a client that opts in does. Empty =
    /// don't.
    #[arg(long, default_value = "")]
    affinity_header: String,
    /// Cookie carrying prefix-router's sessions (`affinity.cookie`), kept
    /// in a jar as an SDK client keeps it (each response's cookie replaces
    /// the last; see `--cookie-jars`). Empty = no cookies.
    #[arg(long, default_value = "")]
    affinity_cookie: String,
    /// With `--affinity-cookie`: one client's jar for every request
    /// (`shared`), or one per conversation, agent session or group
    /// (`session`: a client per session).
    #[arg(long, value_enum, default_value_t = Jars::Shared)]
    cookie_jars: Jars,
    /// Conversations and agent sessions send their id as
    /// `prompt_cache_key`, as coding agents do (OpenAI's routing hint).
    #[arg(long)]
    prompt_cache_key: bool,
    /// Send each request to a target picked at random (seeded), not by
    /// client or in turn: what a cloud load balancer in front of several
    /// gateway instances does to a conversation's turns.
    #[arg(long)]
    random_target: bool,
    /// Real seconds after which no new request is sent.
    #[arg(long, default_value_t = 600.0)]
    max_duration: f64,
    /// Real seconds after --max-duration (or the last send) before requests
    /// still in flight are cut and counted as errors.
    #[arg(long, default_value_t = 60.0)]
    drain: f64,
    /// Open loop: at most this many requests in flight; an arrival beyond it
    /// is counted as an error ("overload") instead of queueing in the client.
    #[arg(long, default_value_t = 4096)]
    max_inflight: usize,
    /// Replica (host:port) whose /tokenize gives token ids for the cache-hit
    /// upper bound. Unset = no bound.
    #[arg(long)]
    tokenize: Option<String>,
    /// KV block size (tokens) for the upper bound.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Number of replicas behind the router (for the request-share figure).
    #[arg(long, default_value_t = 0)]
    replicas: usize,
    /// Worker threads of the client runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Write the JSON document here (default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Leave per-request records out of the JSON.
    #[arg(long)]
    no_records: bool,
    /// Send nothing: write the planned requests as a JSONL trace in the
    /// replay format (timestamp, path, session_id, turn, body) to --out or
    /// stdout. Sessions get start + think times as timestamps. Not for
    /// multi-turn (its history holds the server's answers) or
    /// agentic-responses (its bodies name the server's responses);
    /// agentic-messages writes its `/v1/messages` bodies, which replay
    /// does not send.
    #[arg(long)]
    dry_run: bool,
    #[command(subcommand)]
    workload: Workload,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Open,
    Closed,
}

#[derive(Subcommand, Debug)]
enum Workload {
    /// G groups sharing a long prefix (RAG document / system prompt) + a
    /// short unique question per request, groups interleaved at random.
    /// Defaults: the published run (150 x 2,048 tokens, 9,000 prompts).
    SharedPrefix {
        #[arg(long, default_value_t = 150)]
        groups: usize,
        #[arg(long, default_value_t = 9000)]
        prompts: usize,
        #[arg(long, default_value_t = 2048)]
        prefix_tokens: usize,
        #[arg(long, default_value_t = 32)]
        question_tokens: usize,
    },
    /// C concurrent conversations x T turns over the chat API; each turn
    /// resends the whole history plus a new user message, after a think time.
    MultiTurn {
        #[arg(long, default_value_t = 11)]
        conversations: usize,
        #[arg(long, default_value_t = 10)]
        turns: usize,
        /// System prompt shared by every conversation.
        #[arg(long, default_value_t = 256)]
        system_tokens: usize,
        /// The first user message (e.g. a pasted document).
        #[arg(long, default_value_t = 1024)]
        first_turn_tokens: usize,
        #[arg(long, default_value_t = 96)]
        user_tokens: usize,
        /// Mean think time between turns, simulated seconds (exponential).
        #[arg(long, default_value_t = 2.0)]
        think: f64,
    },
    /// Every request: one long shared system message (instructions + JSON
    /// tool definitions, longer than any fixed hashing window), then one of
    /// G documents (Zipf-skewed popularity) and a question. Chat API.
    LongPreamble {
        #[arg(long, default_value_t = 2000)]
        prompts: usize,
        #[arg(long, default_value_t = 64)]
        documents: usize,
        /// Bytes of the shared system message.
        #[arg(long, default_value_t = 40_000)]
        preamble_bytes: usize,
        #[arg(long, default_value_t = 1000)]
        doc_tokens_min: usize,
        #[arg(long, default_value_t = 2000)]
        doc_tokens_max: usize,
        #[arg(long, default_value_t = 32)]
        question_tokens: usize,
        /// Zipf exponent of document popularity (0 = uniform).
        #[arg(long, default_value_t = 0.8)]
        zipf: f64,
    },
    /// S agent sessions (closed loop each) sharing a tool set + system
    /// prompt; every turn resends the history plus an assistant tool call
    /// and its tool result, after a think time. Chat API with `tools`.
    Agentic {
        #[arg(long, default_value_t = 8)]
        sessions: usize,
        #[arg(long, default_value_t = 10)]
        min_turns: usize,
        #[arg(long, default_value_t = 30)]
        max_turns: usize,
        /// Bytes of the shared part (`tools` JSON + system prompt).
        #[arg(long, default_value_t = 40_000)]
        shared_bytes: usize,
        /// The task (first user message), tokens.
        #[arg(long, default_value_t = 400)]
        task_tokens: usize,
        #[arg(long, default_value_t = 2048)]
        result_bytes_min: usize,
        #[arg(long, default_value_t = 8192)]
        result_bytes_max: usize,
        /// Mean think time (tool execution) between turns, simulated s.
        #[arg(long, default_value_t = 5.0)]
        think: f64,
        /// Sessions start uniformly over this many simulated seconds.
        #[arg(long, default_value_t = 30.0)]
        ramp: f64,
        /// `responses`: the Responses API with stored responses, each turn
        /// continuing the last by `previous_response_id` (the workload is
        /// then named agentic-responses). `messages`: the Anthropic
        /// Messages API (`/v1/messages`) as Claude Code sends it, the whole
        /// history every turn (agentic-messages).
        #[arg(long, value_enum, default_value_t = workload::Api::Chat)]
        api: workload::Api,
    },
    /// Short independent prompts with no shared prefix (the control).
    Unique {
        #[arg(long, default_value_t = 2000)]
        prompts: usize,
        #[arg(long, default_value_t = 256)]
        prompt_tokens: usize,
    },
    /// Replay a JSONL trace: {"timestamp": s, "prompt"|"messages"|"body": ..}.
    Replay {
        file: PathBuf,
        /// Replay this many times faster than the trace's timestamps.
        #[arg(long, default_value_t = 1.0)]
        speedup: f64,
    },
}

fn scaled(n: usize, scale: f64) -> usize {
    ((n as f64 * scale).round() as usize).max(1)
}

fn plan(cli: &Cli) -> Result<(String, Plan, Value), String> {
    let rate = if cli.mode == Mode::Open {
        cli.rate
    } else {
        0.0
    };
    Ok(match &cli.workload {
        Workload::SharedPrefix {
            groups,
            prompts,
            prefix_tokens,
            question_tokens,
        } => {
            let p = workload::SharedPrefix {
                groups: scaled(*groups, cli.scale),
                prompts: scaled(*prompts, cli.scale),
                prefix_tokens: *prefix_tokens,
                question_tokens: *question_tokens,
                max_tokens: cli.max_tokens,
            };
            let params = json!({"groups": p.groups, "prompts": p.prompts,
                "prefix_tokens": p.prefix_tokens, "question_tokens": p.question_tokens});
            (
                "shared-prefix".into(),
                workload::shared_prefix(&p, &cli.model, cli.seed, rate),
                params,
            )
        }
        Workload::MultiTurn {
            conversations,
            turns,
            system_tokens,
            first_turn_tokens,
            user_tokens,
            think,
        } => {
            let p = workload::MultiTurn {
                conversations: scaled(*conversations, cli.scale),
                turns: *turns,
                system_tokens: *system_tokens,
                first_turn_tokens: *first_turn_tokens,
                user_tokens: *user_tokens,
                think_s: *think,
            };
            let params = json!({"conversations": p.conversations, "turns": p.turns,
                "system_tokens": p.system_tokens, "first_turn_tokens": p.first_turn_tokens,
                "user_tokens": p.user_tokens, "think_s": p.think_s});
            (
                "multi-turn".into(),
                workload::multi_turn(&p, cli.seed),
                params,
            )
        }
        Workload::Unique {
            prompts,
            prompt_tokens,
        } => {
            let p = workload::Unique {
                prompts: scaled(*prompts, cli.scale),
                prompt_tokens: *prompt_tokens,
                max_tokens: cli.max_tokens,
            };
            let params = json!({"prompts": p.prompts, "prompt_tokens": p.prompt_tokens});
            (
                "unique".into(),
                workload::unique(&p, &cli.model, cli.seed, rate),
                params,
            )
        }
        Workload::LongPreamble {
            prompts,
            documents,
            preamble_bytes,
            doc_tokens_min,
            doc_tokens_max,
            question_tokens,
            zipf,
        } => {
            let p = workload::LongPreamble {
                prompts: scaled(*prompts, cli.scale),
                documents: *documents,
                preamble_bytes: *preamble_bytes,
                doc_tokens: (*doc_tokens_min, *doc_tokens_max),
                question_tokens: *question_tokens,
                zipf: *zipf,
                max_tokens: cli.max_tokens,
            };
            let top = text::Zipf::new(p.documents.max(1), p.zipf).p(0);
            let params = json!({"prompts": p.prompts, "documents": p.documents,
                "preamble_bytes": p.preamble_bytes, "doc_tokens": [p.doc_tokens.0, p.doc_tokens.1],
                "question_tokens": p.question_tokens, "zipf": p.zipf,
                "hottest_document_share": top});
            (
                "long-preamble".into(),
                workload::long_preamble(&p, &cli.model, cli.seed, rate),
                params,
            )
        }
        Workload::Agentic {
            sessions,
            min_turns,
            max_turns,
            shared_bytes,
            task_tokens,
            result_bytes_min,
            result_bytes_max,
            think,
            ramp,
            api,
        } => {
            let p = workload::Agentic {
                sessions: scaled(*sessions, cli.scale),
                turns: (*min_turns, *max_turns),
                shared_bytes: *shared_bytes,
                task_tokens: *task_tokens,
                result_bytes: (*result_bytes_min, *result_bytes_max),
                think_s: *think,
                ramp_s: *ramp,
                api: *api,
            };
            let params = json!({"sessions": p.sessions, "turns": [p.turns.0, p.turns.1],
                "shared_bytes": p.shared_bytes, "task_tokens": p.task_tokens,
                "result_bytes": [p.result_bytes.0, p.result_bytes.1],
                "think_s": p.think_s, "ramp_s": p.ramp_s});
            let name = match api {
                workload::Api::Chat => "agentic",
                workload::Api::Responses => "agentic-responses",
                workload::Api::Messages => "agentic-messages",
            };
            (name.into(), workload::agentic(&p, cli.seed), params)
        }
        Workload::Replay { file, speedup } => {
            let plan = workload::replay(file, &cli.model, cli.max_tokens, *speedup)?;
            let params = json!({"file": file, "speedup": speedup});
            ("replay".into(), plan, params)
        }
    })
}

/// Whose cookie jar a request uses (`--cookie-jars`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Jars {
    Shared,
    Session,
}

/// One request to send.
struct Ask<'a> {
    path: &'a str,
    body: &'a Value,
    /// What the server renders, as a chat or completions body, when the
    /// body alone doesn't say (a stored response continued): for the
    /// cache-hit bound. `None`: the body.
    prompt: Option<&'a Value>,
    /// Group or session key.
    key: &'a str,
    turn: Option<usize>,
    /// The request's index in a plan of requests (open or closed loop),
    /// which picks its target with `--random-target`.
    index: Option<usize>,
    /// The session-affinity token to send back.
    affinity: Option<&'a str>,
}

impl<'a> Ask<'a> {
    /// A request outside any session.
    fn one(path: &'a str, body: &'a Value, key: &'a str) -> Self {
        Ask {
            path,
            body,
            prompt: None,
            key,
            turn: None,
            index: None,
            affinity: None,
        }
    }

    /// Request `index` of a plan of requests.
    fn planned(index: usize, path: &'a str, body: &'a Value, key: &'a str) -> Self {
        Ask {
            index: Some(index),
            ..Ask::one(path, body, key)
        }
    }
}

/// Shared state of one run.
struct Run {
    pools: Vec<Pool>,
    t0: TInstant,
    hard_deadline: TInstant,
    session_header: String,
    echo: client::Echo,
    /// The clients' cookie jars (the affinity cookie's last value), by
    /// session key, or all under "" (`--cookie-jars shared`).
    jars: Mutex<HashMap<String, String>>,
    jar_per_session: bool,
    /// `Some(seed)`: targets are picked per request (`--random-target`).
    random_target: Option<u64>,
    records: Mutex<Vec<Record>>,
    itl: Mutex<Vec<f64>>,
    /// Bodies sent, by request id (for the upper bound).
    sent: Mutex<Vec<(usize, f64, Value)>>,
    next_id: AtomicUsize,
    keep_bodies: bool,
}

impl Run {
    /// Sends one request, bounded by the hard deadline, and records it.
    async fn request(&self, target: usize, ask: Ask<'_>) -> Outcome {
        let Ask {
            path,
            body,
            prompt,
            key,
            turn,
            index,
            affinity,
        } = ask;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let n = self.pools.len().max(1);
        let target = match (self.random_target, turn, index) {
            // A session's turn by the session and turn: ids follow the order
            // the turns were sent in, which the router's speed decides, so
            // the same turn reached a different instance from run to run.
            (Some(seed), Some(t), _) => {
                (text::Rng::derive(seed, key, t as u64).next_u64() % n as u64) as usize
            }
            // A planned request by its index, for the same reason: ids follow
            // the order its task and its neighbours' ran in, not the plan's.
            (Some(seed), None, Some(i)) => pick(seed, i, n),
            (Some(seed), None, None) => pick(seed, id, n),
            (None, ..) => target,
        };
        let start_s = self.t0.elapsed().as_secs_f64();
        let bytes = Bytes::from(body.to_string());
        let mut headers = Vec::new();
        if !self.session_header.is_empty() {
            headers.push((self.session_header.clone(), key.to_string()));
        }
        if let Some(token) = affinity.filter(|_| !self.echo.header.is_empty()) {
            headers.push((self.echo.header.clone(), token.to_string()));
        }
        let jar_key = if self.jar_per_session { key } else { "" };
        let jar = self.jars.lock().ok().and_then(|j| j.get(jar_key).cloned());
        if let Some(value) = jar.filter(|_| !self.echo.cookie.is_empty()) {
            headers.push(("cookie".into(), format!("{}={value}", self.echo.cookie)));
        }
        let pool = &self.pools[target % self.pools.len()];
        let out = match tokio::time::timeout_at(
            self.hard_deadline,
            client::send(pool, path, bytes, &headers, &self.echo),
        )
        .await
        {
            Ok(o) => o,
            Err(_) => Outcome {
                error: Some("cut at the run's deadline".into()),
                ..Outcome::default()
            },
        };
        if let (Some(value), Ok(mut jars)) = (&out.cookie, self.jars.lock()) {
            jars.insert(jar_key.to_string(), value.clone());
        }
        self.record(id, target, start_s, key, turn, &out);
        if self.keep_bodies {
            if let Ok(mut s) = self.sent.lock() {
                s.push((id, start_s, prompt.unwrap_or(body).clone()));
            }
        }
        out
    }

    fn record(
        &self,
        id: usize,
        target: usize,
        start_s: f64,
        key: &str,
        turn: Option<usize>,
        out: &Outcome,
    ) {
        let itl_mean = (!out.itl_ms.is_empty())
            .then(|| out.itl_ms.iter().sum::<f64>() / out.itl_ms.len() as f64);
        let ok = out.error.is_none() && (200..300).contains(&out.status);
        let rec = Record {
            id,
            key: key.to_string(),
            turn,
            target: target % self.pools.len(),
            start_s,
            status: out.status,
            ok,
            error: out.error.clone(),
            ttft_ms: out.ttft_ms,
            e2e_ms: out.e2e_ms,
            itl_mean_ms: itl_mean,
            chunks: out.chunks,
            served_by: out.served_by.clone(),
            prompt_tokens: out.prompt_tokens,
            cached_tokens: out.cached_tokens,
            decision: out.decision.clone(),
        };
        if ok {
            if let Ok(mut v) = self.itl.lock() {
                v.extend_from_slice(&out.itl_ms);
            }
        }
        if let Ok(mut v) = self.records.lock() {
            v.push(rec);
        }
    }

    /// A session that stopped (a failed turn, the send deadline) records
    /// each turn it never sent as an error: left out, a router whose
    /// slowest sessions ran out of time showed fewer requests, all ok, and
    /// its percentiles without their late, long-history turns.
    fn unsent(&self, target: usize, key: &str, turns: std::ops::Range<usize>, why: &str) {
        for t in turns {
            self.error_record(target, key, Some(t), &format!("not sent: {why}"));
        }
    }

    fn error_record(&self, target: usize, key: &str, turn: Option<usize>, msg: &str) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let out = Outcome {
            error: Some(msg.into()),
            ..Outcome::default()
        };
        self.record(id, target, self.t0.elapsed().as_secs_f64(), key, turn, &out);
    }
}

/// A target for request `id`: uniform, and the same for a given seed
/// (splitmix64 of seed and id), so runs are repeatable.
fn pick(seed: u64, id: usize, n: usize) -> usize {
    let mut z = seed ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % n.max(1) as u64) as usize
}

async fn run_open(run: Arc<Run>, reqs: Vec<Planned>, cli: &Cli, send_deadline: TInstant) {
    let inflight = Arc::new(tokio::sync::Semaphore::new(cli.max_inflight.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, r) in reqs.into_iter().enumerate() {
        let at = run.t0 + Duration::from_secs_f64(r.at * cli.time_scale);
        if at > send_deadline {
            break;
        }
        tokio::time::sleep_until(at).await;
        let Ok(permit) = inflight.clone().try_acquire_owned() else {
            run.error_record(i, &r.key, None, "overload: client max-inflight reached");
            continue;
        };
        let run = run.clone();
        tasks.spawn(async move {
            run.request(i, Ask::planned(i, r.path, &r.body, &r.key))
                .await;
            drop(permit);
        });
        // Reap finished tasks so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

async fn run_closed(run: Arc<Run>, reqs: Vec<Planned>, cli: &Cli, send_deadline: TInstant) {
    let reqs = Arc::new(reqs);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..cli.concurrency.max(1) {
        let (run, reqs, next) = (run.clone(), reqs.clone(), next.clone());
        tasks.spawn(async move {
            // The deadline before taking a request, so every request taken
            // is sent and the rest are left for `unsent` below.
            while TInstant::now() <= send_deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(r) = reqs.get(i) else { break };
                run.request(client, Ask::planned(i, r.path, &r.body, &r.key))
                    .await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    // Requests never sent are errors, as a session's unsent turns are:
    // left out, a slower router's summary covered fewer requests.
    let taken = next.load(Ordering::Relaxed).min(reqs.len());
    for (i, r) in reqs.iter().enumerate().skip(taken) {
        run.error_record(i, &r.key, None, "not sent: the run's send deadline passed");
    }
}

async fn run_conversations(
    run: Arc<Run>,
    convs: Vec<Conversation>,
    cli: &Cli,
    send_deadline: TInstant,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let (scale, model, max_tokens) = (cli.time_scale, cli.model.clone(), cli.max_tokens);
    let cache_key = cli.prompt_cache_key;
    for (c, conv) in convs.into_iter().enumerate() {
        let (run, model) = (run.clone(), model.clone());
        tasks.spawn(async move {
            tokio::time::sleep(Duration::from_secs_f64(conv.start * scale)).await;
            let mut messages = vec![json!({"role": "system", "content": conv.system})];
            let mut token: Option<String> = None;
            let total = conv.user_turns.len();
            for (t, user) in conv.user_turns.iter().enumerate() {
                if t > 0 {
                    tokio::time::sleep(Duration::from_secs_f64(conv.think[t] * scale)).await;
                }
                if TInstant::now() > send_deadline {
                    run.unsent(c, &conv.key, t..total, "the run's send deadline passed");
                    break;
                }
                messages.push(json!({"role": "user", "content": user}));
                let mut body = workload::chat(&model, messages.clone(), max_tokens);
                if cache_key {
                    body["prompt_cache_key"] = json!(conv.key);
                }
                let out = run
                    .request(
                        c,
                        Ask {
                            turn: Some(t),
                            affinity: token.as_deref(),
                            ..Ask::one("/v1/chat/completions", &body, &conv.key)
                        },
                    )
                    .await;
                if out.error.is_some() {
                    // The conversation can't go on without its answer.
                    run.unsent(c, &conv.key, t + 1..total, "an earlier turn failed");
                    break;
                }
                token = out.affinity.clone().or(token);
                messages.push(json!({"role": "assistant", "content": out.text}));
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// One task per agent session: each turn waits for the previous answer,
/// then the think time; the history is planned (see `workload::Session`).
async fn run_sessions(run: Arc<Run>, sessions: Vec<Session>, cli: &Cli, send_deadline: TInstant) {
    let mut tasks = tokio::task::JoinSet::new();
    let (scale, model, max_tokens) = (cli.time_scale, cli.model.clone(), cli.max_tokens);
    let cache_key = cli.prompt_cache_key;
    for (c, session) in sessions.into_iter().enumerate() {
        let (run, model) = (run.clone(), model.clone());
        tasks.spawn(async move {
            tokio::time::sleep(Duration::from_secs_f64(session.start * scale)).await;
            let mut token: Option<String> = None;
            // Responses API: the stored response to continue, and the
            // answers so far (what the server stored).
            let (mut previous, mut answers): (Option<String>, Vec<String>) = (None, Vec::new());
            let total = session.turns();
            for t in 0..total {
                if t > 0 {
                    tokio::time::sleep(Duration::from_secs_f64(session.think[t] * scale)).await;
                }
                if TInstant::now() > send_deadline {
                    run.unsent(c, &session.key, t..total, "the run's send deadline passed");
                    break;
                }
                let (path, mut body, prompt) = match session.api {
                    Api::Chat => (
                        "/v1/chat/completions",
                        session.body(t, &model, max_tokens),
                        None,
                    ),
                    Api::Responses => (
                        "/v1/responses",
                        session.responses_body(t, previous.as_deref(), &model, max_tokens),
                        Some(session.responses_prompt(t, &answers, &model)),
                    ),
                    Api::Messages => (
                        "/v1/messages",
                        session.messages_body(t, &model, max_tokens),
                        Some(session.messages_prompt(t, &model)),
                    ),
                };
                // OpenAI's routing hint; the Messages API has none.
                if cache_key && session.api != Api::Messages {
                    body["prompt_cache_key"] = json!(session.key);
                }
                let ask = Ask {
                    prompt: prompt.as_ref(),
                    turn: Some(t),
                    affinity: token.as_deref(),
                    ..Ask::one(path, &body, &session.key)
                };
                let out = run.request(c, ask).await;
                if out.error.is_some() {
                    // An agent stops when a step fails.
                    run.unsent(c, &session.key, t + 1..total, "an earlier turn failed");
                    break;
                }
                token = out.affinity.clone().or(token);
                if session.api == Api::Responses {
                    let Some(id) = out.response_id else {
                        run.unsent(c, &session.key, t + 1..total, "no response id to continue");
                        break;
                    };
                    previous = Some(id);
                    answers.push(out.text);
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// Token ids of every sent request (in send order) from a replica's
/// /tokenize, then the upper bound.
async fn bound(run: &Run, addr: &str, block_size: usize) -> Result<stats::UpperBound, String> {
    let mut sent = run.sent.lock().map(|v| v.clone()).unwrap_or_default();
    sent.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let pool = Arc::new(Pool::new(addr.to_string()));
    let queries: Vec<Value> = sent
        .iter()
        .map(|(_, _, b)| match (b.get("prompt"), b.get("messages")) {
            (Some(p), _) => json!({"model": b.get("model"), "prompt": p}),
            (None, Some(m)) => match b.get("tools") {
                Some(t) => json!({"model": b.get("model"), "messages": m, "tools": t}),
                None => json!({"model": b.get("model"), "messages": m}),
            },
            _ => json!({"prompt": ""}),
        })
        .collect();
    let queries = Arc::new(queries);
    let next = Arc::new(AtomicUsize::new(0));
    let results: Arc<Mutex<Vec<Option<Vec<u32>>>>> =
        Arc::new(Mutex::new(vec![None; queries.len()]));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (pool, queries, next, results) =
            (pool.clone(), queries.clone(), next.clone(), results.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(q) = queries.get(i) else {
                    return Ok::<(), String>(());
                };
                let v = client::post_json(&pool, "/tokenize", Bytes::from(q.to_string())).await?;
                let ids: Vec<u32> = v
                    .get("tokens")
                    .and_then(Value::as_array)
                    .ok_or("no tokens in /tokenize answer")?
                    .iter()
                    .filter_map(|t| t.as_u64().map(|x| x as u32))
                    .collect();
                if let Ok(mut r) = results.lock() {
                    r[i] = Some(ids);
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| e.to_string())??;
    }
    let prompts: Vec<Vec<u32>> = results
        .lock()
        .map_err(|e| e.to_string())?
        .iter()
        .map(|x| x.clone().unwrap_or_default())
        .collect();
    Ok(stats::upper_bound(&prompts, block_size))
}

/// `--dry-run`: the plan as a replayable JSONL trace.
fn dry_run(cli: &Cli, name: &str, plan: &Plan) -> Result<(), String> {
    let mut lines: Vec<Value> = Vec::new();
    match plan {
        Plan::Requests(reqs) => {
            for r in reqs {
                lines.push(
                    json!({"timestamp": r.at, "path": r.path, "session_id": r.key, "body": r.body}),
                );
            }
        }
        Plan::Sessions(sessions) if sessions.iter().any(|s| s.api == Api::Responses) => {
            return Err(format!(
                "--dry-run: {name} names the server's stored responses"
            ));
        }
        Plan::Sessions(sessions) => {
            for s in sessions {
                let mut at = s.start;
                for t in 0..s.turns() {
                    if t > 0 {
                        at += s.think[t];
                    }
                    let (path, body) = match s.api {
                        Api::Messages => (
                            "/v1/messages",
                            s.messages_body(t, &cli.model, cli.max_tokens),
                        ),
                        _ => (
                            "/v1/chat/completions",
                            s.body(t, &cli.model, cli.max_tokens),
                        ),
                    };
                    lines.push(json!({"timestamp": at, "path": path,
                        "session_id": s.key, "turn": t, "body": body}));
                }
            }
            lines.sort_by(|a, b| {
                a["timestamp"]
                    .as_f64()
                    .unwrap_or(0.0)
                    .total_cmp(&b["timestamp"].as_f64().unwrap_or(0.0))
            });
        }
        Plan::Conversations(_) => {
            return Err(format!("--dry-run: {name} depends on the server's answers"));
        }
    }
    let bytes: Vec<usize> = lines.iter().map(|l| l["body"].to_string().len()).collect();
    eprintln!(
        "prefix-bench: {name} (dry run): {} requests, body bytes min {} mean {} max {}",
        lines.len(),
        bytes.iter().min().unwrap_or(&0),
        bytes.iter().sum::<usize>() / bytes.len().max(1),
        bytes.iter().max().unwrap_or(&0),
    );
    let mut text = String::new();
    for l in &lines {
        text.push_str(&l.to_string());
        text.push('\n');
    }
    match &cli.out {
        Some(p) => std::fs::write(p, text).map_err(|e| format!("write {}: {e}", p.display())),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

async fn main_async(cli: Cli) -> Result<(), String> {
    if !(cli.time_scale > 0.0 && cli.time_scale.is_finite()) {
        return Err("--time-scale must be > 0".into());
    }
    let (name, plan, params) = plan(&cli)?;
    if cli.dry_run {
        return dry_run(&cli, &name, &plan);
    }
    let t0 = TInstant::now();
    let send_deadline = t0 + Duration::from_secs_f64(cli.max_duration.max(0.0));
    let hard_deadline = send_deadline + Duration::from_secs_f64(cli.drain.max(0.0));
    let run = Arc::new(Run {
        pools: cli.target.iter().map(|t| Pool::new(t.clone())).collect(),
        t0,
        hard_deadline,
        session_header: cli.session_header.clone(),
        echo: client::Echo {
            header: cli.affinity_header.clone(),
            cookie: cli.affinity_cookie.clone(),
        },
        jars: Mutex::new(HashMap::new()),
        jar_per_session: cli.cookie_jars == Jars::Session,
        random_target: cli.random_target.then_some(cli.seed),
        records: Mutex::new(Vec::new()),
        itl: Mutex::new(Vec::new()),
        sent: Mutex::new(Vec::new()),
        next_id: AtomicUsize::new(0),
        keep_bodies: cli.tokenize.is_some(),
    });
    let cpu0 = stats::self_cpu_seconds();
    let wall0 = Instant::now();
    let planned = match &plan {
        Plan::Requests(r) => r.len(),
        Plan::Conversations(c) => c.iter().map(|c| c.user_turns.len()).sum(),
        Plan::Sessions(s) => s.iter().map(Session::turns).sum(),
    };
    let shape = match (&plan, cli.mode) {
        (Plan::Requests(_), Mode::Open) => "open loop",
        (Plan::Requests(_), Mode::Closed) => "closed loop",
        _ => "closed loop per session",
    };
    eprintln!(
        "prefix-bench: {name}, {planned} requests, {shape}, targets {}",
        cli.target.join(",")
    );
    match plan {
        Plan::Requests(reqs) => match cli.mode {
            Mode::Open => run_open(run.clone(), reqs, &cli, send_deadline).await,
            Mode::Closed => run_closed(run.clone(), reqs, &cli, send_deadline).await,
        },
        Plan::Conversations(convs) => {
            run_conversations(run.clone(), convs, &cli, send_deadline).await
        }
        Plan::Sessions(sessions) => run_sessions(run.clone(), sessions, &cli, send_deadline).await,
    }
    let wall = wall0.elapsed().as_secs_f64();
    let cpu = stats::self_cpu_seconds() - cpu0;
    let mut records = run.records.lock().map(|v| v.clone()).unwrap_or_default();
    records.sort_by_key(|r| r.id);
    let itl = run.itl.lock().map(|v| v.clone()).unwrap_or_default();
    let summary = stats::summarize(&records, &itl, cli.time_scale, cli.replicas);
    let upper = match &cli.tokenize {
        Some(addr) => match bound(&run, addr, cli.block_size).await {
            Ok(b) => json!(b),
            Err(e) => json!({"error": e}),
        },
        None => Value::Null,
    };
    eprintln!(
        "prefix-bench: {} ok, {} errors in {:.1}s; TTFT p50 {:.0} ms p95 {:.0} ms (simulated); client CPU {:.2}s ({:.0}% of one core)",
        summary.ok,
        summary.errors,
        wall,
        summary.ttft_ms.p50,
        summary.ttft_ms.p95,
        cpu,
        100.0 * cpu / wall.max(1e-9)
    );
    let doc = json!({
        "workload": name,
        "params": params,
        "config": {
            "targets": cli.target, "mode": format!("{:?}", cli.mode).to_lowercase(),
            "rate": cli.rate, "concurrency": cli.concurrency, "time_scale": cli.time_scale,
            "model": cli.model, "max_tokens": cli.max_tokens, "seed": cli.seed,
            "scale": cli.scale, "session_header": cli.session_header,
            "max_duration_s": cli.max_duration, "drain_s": cli.drain,
        },
        "summary": summary,
        "upper_bound": upper,
        "loadgen": {"cpu_s": cpu, "wall_s": wall, "cpu_util": cpu / wall.max(1e-9), "threads": cli.threads},
        "records": if cli.no_records { Value::Null } else { json!(records) },
    });
    let text = serde_json::to_string(&doc).map_err(|e| e.to_string())?;
    match &cli.out {
        Some(p) => std::fs::write(p, text).map_err(|e| format!("write {}: {e}", p.display()))?,
        None => println!("{text}"),
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("prefix-bench: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(main_async(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefix-bench: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn random_targets_are_uniform_and_repeatable() {
        let mut n = [0usize; 3];
        for id in 0..30_000 {
            n[pick(7, id, 3)] += 1;
        }
        assert!(n.iter().all(|&c| (9_000..11_000).contains(&c)), "{n:?}");
        assert_eq!(pick(7, 123, 3), pick(7, 123, 3));
        assert_eq!(pick(7, 5, 1), 0);
    }
}

/// Session runs against local stand-ins: a dead port, or a server that
/// answers every request after `delay` with one token.
#[cfg(test)]
mod session_tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use clap::Parser;

    use super::{run_sessions, stats, Cli, Plan, Pool, Run, Session, TInstant};

    fn dead_port() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    }

    pub(super) fn slow_server(delay: Duration) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let (mut buf, mut chunk) = (Vec::new(), vec![0u8; 65536]);
                    loop {
                        let n = s.read(&mut chunk).unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap_or(0));
                        if buf.len() >= p + 4 + len {
                            break;
                        }
                    }
                    std::thread::sleep(delay);
                    let body =
                        "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n";
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes());
                });
            }
        });
        addr
    }

    fn agentic(targets: &str, extra: &[&str]) -> (Cli, Vec<Session>) {
        let mut args = vec![
            "prefix-bench",
            "--target",
            targets,
            "--time-scale",
            "0.0001",
        ];
        args.extend_from_slice(extra);
        let cli = Cli::parse_from(args);
        let Ok((_, Plan::Sessions(sessions), _)) = super::plan(&cli) else {
            panic!("an agentic plan");
        };
        (cli, sessions)
    }

    pub(super) fn run(cli: &Cli, random: bool, hard: Duration) -> Arc<Run> {
        let t0 = TInstant::now();
        Arc::new(Run {
            pools: cli.target.iter().map(|t| Pool::new(t.clone())).collect(),
            t0,
            hard_deadline: t0 + hard,
            session_header: String::new(),
            echo: Default::default(),
            jars: Default::default(),
            jar_per_session: false,
            random_target: random.then_some(cli.seed),
            records: Default::default(),
            itl: Default::default(),
            sent: Default::default(),
            next_id: Default::default(),
            keep_bodies: false,
        })
    }

    /// Turns a session never sent (it stopped at a failed turn, or the
    /// send deadline passed) are errors in the summary, so two routers'
    /// summaries cover the same planned requests.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn turns_a_session_never_sent_are_counted_as_errors() {
        let (cli, sessions) = agentic(&dead_port(), &["agentic", "--sessions", "3"]);
        let planned: usize = sessions.iter().map(Session::turns).sum();
        let r = run(&cli, false, Duration::from_secs(10));
        run_sessions(r.clone(), sessions, &cli, r.hard_deadline).await;
        let recs = r.records.lock().unwrap().clone();
        let s = stats::summarize(&recs, &[], cli.time_scale, 4);
        assert_eq!((s.requests, s.errors), (planned, planned));

        let (cli, sessions) = agentic(
            &slow_server(Duration::from_millis(100)),
            &["agentic", "--sessions", "2"],
        );
        let planned: usize = sessions.iter().map(Session::turns).sum();
        let r = run(&cli, false, Duration::from_secs(6));
        run_sessions(r.clone(), sessions, &cli, r.t0 + Duration::from_millis(700)).await;
        let recs = r.records.lock().unwrap().clone();
        let s = stats::summarize(&recs, &[], cli.time_scale, 1);
        assert_eq!(s.requests, planned);
        assert!(s.ok > 0 && s.errors > 0, "{} ok, {} errors", s.ok, s.errors);
        assert!(recs.iter().filter(|r| !r.ok).all(|r| r
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("not sent"))));
    }

    /// With random instances, a session's turn reaches the same instance
    /// in every run, whatever order the turns happened to be sent in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_turn_goes_to_the_same_instance_in_every_run() {
        let addr = slow_server(Duration::from_millis(20));
        let targets = format!("{addr},{addr},{addr}");
        let extra = [
            "--random-target",
            "agentic",
            "--sessions",
            "4",
            "--min-turns",
            "3",
            "--max-turns",
            "3",
        ];
        let mut maps = Vec::new();
        for _ in 0..4 {
            let (cli, sessions) = agentic(&targets, &extra);
            let r = run(&cli, true, Duration::from_secs(20));
            run_sessions(r.clone(), sessions, &cli, r.t0 + Duration::from_secs(10)).await;
            let recs = r.records.lock().unwrap().clone();
            assert!(recs.iter().all(|r| r.ok), "{recs:?}");
            let m: BTreeMap<(String, usize), usize> = recs
                .iter()
                .map(|r| ((r.key.clone(), r.turn.unwrap()), r.target))
                .collect();
            maps.push(m);
        }
        assert_eq!(maps[0].len(), 12);
        assert!(maps.windows(2).all(|w| w[0] == w[1]), "{maps:?}");
        let used: std::collections::BTreeSet<usize> = maps[0].values().copied().collect();
        assert!(used.len() > 1, "{used:?}");
    }
}

/// Open- and closed-loop runs against a local stand-in.
#[cfg(test)]
mod open_tests {
    use std::time::Duration;

    use clap::Parser;

    use super::session_tests::{run, slow_server};
    use super::{pick, run_closed, run_open, stats, Cli, Plan};

    /// With random instances, request i of the plan goes to the instance
    /// its seed and index pick, whichever order the sends' tasks ran in
    /// (they all start at once here): two routers' runs send the same
    /// request to the same instance.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_open_loop_request_goes_to_the_instance_its_plan_index_picks() {
        let addr = slow_server(Duration::from_millis(5));
        let targets = format!("{addr},{addr},{addr}");
        let cli = Cli::parse_from([
            "prefix-bench",
            "--target",
            &targets,
            "--random-target",
            "--rate",
            "0",
            "unique",
            "--prompts",
            "500",
            "--prompt-tokens",
            "8",
        ]);
        let Ok((_, Plan::Requests(reqs), _)) = super::plan(&cli) else {
            panic!("a request plan");
        };
        let r = run(&cli, true, Duration::from_secs(20));
        run_open(r.clone(), reqs, &cli, r.t0 + Duration::from_secs(10)).await;
        let recs = r.records.lock().unwrap().clone();
        assert_eq!(recs.len(), 500);
        for rec in &recs {
            assert!(rec.ok, "{rec:?}");
            let i: usize = rec.key.strip_prefix("req-").unwrap().parse().unwrap();
            assert_eq!(
                rec.target,
                pick(cli.seed, i, 3),
                "request {i} (sent as {})",
                rec.id
            );
        }
    }

    /// Closed loop: the requests the clients never sent before the send
    /// deadline are errors in the summary, as a session's unsent turns
    /// are; left out, a slower router's summary covered fewer requests.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn closed_loop_requests_never_sent_are_counted_as_errors() {
        let addr = slow_server(Duration::from_millis(100));
        let cli = Cli::parse_from([
            "prefix-bench",
            "--target",
            &addr,
            "--mode",
            "closed",
            "--concurrency",
            "2",
            "unique",
            "--prompts",
            "20",
            "--prompt-tokens",
            "8",
        ]);
        let Ok((_, Plan::Requests(reqs), _)) = super::plan(&cli) else {
            panic!("a request plan");
        };
        let r = run(&cli, false, Duration::from_secs(20));
        run_closed(r.clone(), reqs, &cli, r.t0 + Duration::from_millis(250)).await;
        let recs = r.records.lock().unwrap().clone();
        let s = stats::summarize(&recs, &[], cli.time_scale, 1);
        assert_eq!(s.requests, 20);
        assert!(s.ok > 0 && s.ok < 20, "{} ok", s.ok);
        assert_eq!(s.errors, 20 - s.ok);
        assert!(recs.iter().filter(|r| !r.ok).all(|r| r
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("not sent"))));
        // Every planned request once.
        let mut keys: Vec<&str> = recs.iter().map(|r| r.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 20);
    }
}
