//! One replica's inference engine: a tokio task that runs vLLM-style
//! scheduler steps. Each step decodes one token for every running sequence,
//! spends the rest of the token budget on (chunked) prefill, admits waiting
//! requests while sequences and KV blocks are available, then sleeps for the
//! step's simulated cost (scaled to real time) and emits the tokens.
//!
//! When there is no work the task parks on its channel: no polling, no idle
//! CPU. Per-step work is O(running sequences + blocks newly allocated).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::kv::{BlockId, KvCache};
use crate::metrics::Metrics;
use crate::preset::{EngineConfig, Work};
use crate::tokenizer::output_piece;

/// Queue depth between HTTP handlers and the engine; handlers wait when full.
const INBOX: usize = 1024;
/// If real time falls this far behind the simulated schedule (an overloaded
/// host), stop trying to catch up: catching up would compress later steps.
const MAX_LAG: Duration = Duration::from_millis(50);

/// A request as the engine sees it: already tokenized and block-hashed by the
/// handler, so that work stays off the engine task.
pub struct Submission {
    pub prompt_len: usize,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<u64>,
    pub max_tokens: usize,
    /// Index of the LoRA adapter, if the request names one.
    pub lora: Option<usize>,
    /// Varies the generated text between requests.
    pub seed: u64,
    pub events: mpsc::UnboundedSender<Event>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    Token(&'static str),
    Done(Usage),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ResetOutcome {
    /// Requests still in flight; their blocks survive the reset.
    pub in_flight: usize,
    pub cache_cleared: bool,
}

enum Msg {
    Submit(Submission),
    Reset(oneshot::Sender<ResetOutcome>),
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
}

impl EngineHandle {
    /// Queues a request; false if the engine is gone.
    pub async fn submit(&self, s: Submission) -> bool {
        self.tx.send(Msg::Submit(s)).await.is_ok()
    }

    pub async fn reset(&self) -> Option<ResetOutcome> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Msg::Reset(tx)).await.ok()?;
        rx.await.ok()
    }
}

/// Starts a replica's engine on the current tokio runtime.
pub fn spawn(cfg: EngineConfig, metrics: Arc<Metrics>, lora_names: Vec<String>) -> EngineHandle {
    let (tx, rx) = mpsc::channel(INBOX);
    let engine = Engine::new(cfg, metrics, rx, lora_names);
    tokio::spawn(engine.run());
    EngineHandle { tx }
}

struct Seq {
    sub: Submission,
    arrival_ms: f64,
    blocks: Vec<BlockId>,
    /// Prompt tokens whose KV exists (cached + computed).
    computed: usize,
    cached: usize,
    generated: usize,
    /// Leading prompt blocks already published to the cache.
    registered: usize,
    step_prefill: usize,
    step_decode: bool,
    done: bool,
}

impl Seq {
    fn prefilled(&self) -> bool {
        self.computed == self.sub.prompt_len
    }
}

/// Resident LoRA adapters, least recently used first.
struct Loras {
    max: usize,
    resident: Vec<usize>,
    names: Vec<String>,
}

struct Engine {
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    rx: mpsc::Receiver<Msg>,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    loras: Loras,
    /// Simulated clock (ms): advances by exactly each step's cost, and jumps
    /// to the real clock (scaled) after idle periods.
    sim_ms: f64,
    epoch: Instant,
    /// Real time at which the current step ends; accumulating deadlines keeps
    /// timer overshoot from adding up.
    deadline: Instant,
}

/// What one step does, in cost terms.
#[derive(Default)]
struct Plan {
    prefill_tokens: usize,
    decode_seqs: usize,
    /// See `preset::Work`.
    attention_pairs: f64,
    decode_context: usize,
    lora_load_ms: f64,
}

impl Plan {
    /// A prefill chunk: its tokens, and the context they attend to (what
    /// is computed before them, and half the chunk, causally).
    fn add_prefill(&mut self, s: &Seq) {
        let n = s.step_prefill as f64;
        self.prefill_tokens += s.step_prefill;
        self.attention_pairs += n * (s.computed as f64 + n / 2.0);
    }
}

impl Engine {
    fn new(
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        rx: mpsc::Receiver<Msg>,
        names: Vec<String>,
    ) -> Self {
        let now = Instant::now();
        Self {
            kv: KvCache::new(cfg.kv_blocks),
            loras: Loras {
                max: cfg.max_loras,
                resident: Vec::new(),
                names,
            },
            cfg,
            metrics,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            sim_ms: 0.0,
            epoch: now,
            deadline: now,
        }
    }

    async fn run(mut self) {
        loop {
            if self.waiting.is_empty() && self.running.is_empty() && !self.park().await {
                return;
            }
            self.drain_inbox();
            let plan = self.schedule();
            if plan.prefill_tokens == 0 && plan.decode_seqs == 0 {
                // Only unadmittable or abandoned work: wait for news, with
                // gauges that no longer count what was dropped.
                self.drop_abandoned();
                self.publish_gauges();
                if self.running.is_empty() && !self.park().await {
                    return;
                }
                continue;
            }
            let work = Work {
                prefill: plan.prefill_tokens,
                decode: plan.decode_seqs,
                attention_pairs: plan.attention_pairs,
                decode_context: plan.decode_context,
            };
            let ms = self.cfg.step_cost(&work) + plan.lora_load_ms;
            self.sleep_sim(ms).await;
            self.sim_ms += ms;
            self.finish_step();
            self.publish_gauges();
        }
    }

    /// Blocks until a message arrives; false when all handles are gone.
    async fn park(&mut self) -> bool {
        let Some(msg) = self.rx.recv().await else {
            return false;
        };
        let now = Instant::now();
        let real_ms = now.duration_since(self.epoch).as_secs_f64() * 1000.0 / self.cfg.time_scale;
        self.sim_ms = self.sim_ms.max(real_ms);
        self.deadline = now;
        self.handle(msg);
        true
    }

    async fn sleep_sim(&mut self, ms: f64) {
        let now = Instant::now();
        if now.saturating_duration_since(self.deadline) > MAX_LAG {
            self.deadline = now;
        }
        self.deadline += Duration::from_secs_f64(ms * self.cfg.time_scale / 1000.0);
        tokio::time::sleep_until(self.deadline).await;
    }

    fn drain_inbox(&mut self) {
        while let Ok(msg) = self.rx.try_recv() {
            self.handle(msg);
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(sub) => self.waiting.push_back(Seq {
                sub,
                arrival_ms: self.sim_ms,
                blocks: Vec::new(),
                computed: 0,
                cached: 0,
                generated: 0,
                registered: 0,
                step_prefill: 0,
                step_decode: false,
                done: false,
            }),
            Msg::Reset(reply) => {
                let in_flight = self.waiting.len() + self.running.len();
                self.kv.clear_idle();
                self.metrics.reset();
                self.publish_gauges();
                let _ = reply.send(ResetOutcome {
                    in_flight,
                    cache_cleared: in_flight == 0,
                });
            }
        }
        self.metrics
            .gauges
            .waiting
            .store(self.waiting.len() as u64, Relaxed);
    }

    /// Decides this step's work: decodes first (they hold KV already), then
    /// continues partial prefills, then admits new requests in FCFS order.
    fn schedule(&mut self) -> Plan {
        // As vLLM aborts a request whose client left, wherever it waits:
        // dropped only at the head of the queue, it counted as waiting
        // (and a router shunned the replica) until it got there.
        self.waiting.retain(|s| !s.sub.events.is_closed());
        let mut plan = Plan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        for s in &mut self.running {
            s.step_decode = s.prefilled();
            s.step_prefill = 0;
            if s.step_decode {
                budget -= 1;
                plan.decode_seqs += 1;
                plan.decode_context += s.sub.prompt_len + s.generated;
            }
        }
        for s in self.running.iter_mut().filter(|s| !s.step_decode) {
            s.step_prefill = (s.sub.prompt_len - s.computed).min(budget);
            budget -= s.step_prefill;
            plan.add_prefill(s);
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut s) = self.admit_next(&mut plan) else {
                break;
            };
            s.step_prefill = (s.sub.prompt_len - s.computed).min(budget);
            budget -= s.step_prefill;
            plan.add_prefill(&s);
            self.running.push(s);
        }
        plan
    }

    /// Takes the first waiting request whose adapter can be loaded, if its
    /// KV blocks fit. As vLLM's scheduler does, a request waiting for an
    /// adapter slot is skipped and stays where it is (it blocked every
    /// request behind it, base-model ones too), while one short of KV
    /// blocks stops admission (head of line).
    fn admit_next(&mut self, plan: &mut Plan) -> Option<Seq> {
        let at = (self.waiting.iter()).position(|s| self.lora_fits(s.sub.lora))?;
        let head = self.waiting.get(at)?;
        let lora = head.sub.lora;
        let bs = self.cfg.block_size;
        let total = (head.sub.prompt_len + head.sub.max_tokens).div_ceil(bs);
        // At least one prompt token must be computed to produce logits, as in
        // vLLM: a fully cached prompt recomputes its last block.
        let max_hit = head.sub.prompt_len.saturating_sub(1) / bs;
        let alloc = self.kv.allocate(&head.sub.block_hashes, max_hit, total)?;
        plan.lora_load_ms += self.load_lora(lora);
        let mut s = self.waiting.remove(at)?;
        s.blocks = alloc.blocks;
        s.registered = alloc.hit_blocks;
        s.cached = alloc.hit_blocks * bs;
        s.computed = s.cached;
        let c = &self.metrics.counters;
        c.prefix_queries.fetch_add(s.sub.prompt_len as u64, Relaxed);
        c.prefix_hits.fetch_add(s.cached as u64, Relaxed);
        Some(s)
    }

    fn lora_fits(&self, lora: Option<usize>) -> bool {
        let Some(a) = lora else { return true };
        self.loras.resident.contains(&a)
            || self.loras.resident.len() < self.loras.max
            || self.loras.resident.iter().any(|r| !self.lora_in_use(*r))
    }

    fn lora_in_use(&self, a: usize) -> bool {
        self.running.iter().any(|s| s.sub.lora == Some(a))
    }

    /// Makes `lora` resident (most recently used); returns the load cost.
    fn load_lora(&mut self, lora: Option<usize>) -> f64 {
        let Some(a) = lora else { return 0.0 };
        if let Some(i) = self.loras.resident.iter().position(|r| *r == a) {
            self.loras.resident.remove(i);
            self.loras.resident.push(a);
            return 0.0;
        }
        if self.loras.resident.len() >= self.loras.max {
            if let Some(i) = self
                .loras
                .resident
                .iter()
                .position(|r| !self.lora_in_use(*r))
            {
                self.loras.resident.remove(i);
            }
        }
        self.loras.resident.push(a);
        self.cfg.lora_load_ms
    }

    /// Applies the step that just elapsed: advances prefills, publishes newly
    /// full blocks, emits tokens, retires finished or abandoned sequences.
    fn finish_step(&mut self) {
        let now = self.sim_ms;
        let bs = self.cfg.block_size;
        for s in &mut self.running {
            if s.step_prefill > 0 {
                s.computed += s.step_prefill;
                let full = (s.computed / bs).min(s.sub.block_hashes.len());
                for i in s.registered..full {
                    self.kv.register(s.blocks[i], s.sub.block_hashes[i]);
                }
                s.registered = s.registered.max(full);
            }
            let first = s.step_prefill > 0 && s.prefilled();
            if first {
                self.metrics.observe_ttft((now - s.arrival_ms) / 1000.0);
                let c = &self.metrics.counters;
                c.prompt_tokens.fetch_add(s.sub.prompt_len as u64, Relaxed);
            }
            if first || s.step_decode {
                emit(s, now, &self.metrics);
            } else if s.sub.events.is_closed() {
                s.done = true;
            }
        }
        let kv = &mut self.kv;
        self.running.retain(|s| {
            if s.done {
                kv.release(&s.blocks);
            }
            !s.done
        });
    }

    fn drop_abandoned(&mut self) {
        let kv = &mut self.kv;
        self.running.retain(|s| {
            let gone = s.sub.events.is_closed();
            if gone {
                kv.release(&s.blocks);
            }
            !gone
        });
    }

    fn publish_gauges(&self) {
        let g = &self.metrics.gauges;
        g.waiting.store(self.waiting.len() as u64, Relaxed);
        g.running.store(self.running.len() as u64, Relaxed);
        self.metrics.set_kv_usage(self.kv.usage());
        if !self.loras.names.is_empty() {
            let names = &self.loras.names;
            let running = adapter_list(names, self.running.iter().filter_map(|s| s.sub.lora));
            let waiting = adapter_list(names, self.waiting.iter().filter_map(|s| s.sub.lora));
            self.metrics.set_lora(running, waiting);
        }
    }
}

/// Sends the next token of `s`, and its usage when it is the last one.
fn emit(s: &mut Seq, now_ms: f64, metrics: &Metrics) {
    let text = output_piece(s.sub.seed, s.generated);
    s.generated += 1;
    metrics.counters.generation_tokens.fetch_add(1, Relaxed);
    if s.sub.events.send(Event::Token(text)).is_err() {
        s.done = true;
        return;
    }
    if s.generated < s.sub.max_tokens {
        return;
    }
    s.done = true;
    let usage = Usage {
        prompt_tokens: s.sub.prompt_len,
        completion_tokens: s.generated,
        cached_tokens: s.cached,
    };
    if s.sub.events.send(Event::Done(usage)).is_ok() {
        metrics.counters.request_success.fetch_add(1, Relaxed);
        metrics.observe_e2e((now_ms - s.arrival_ms) / 1000.0);
    }
}

/// Adapter names as the comma-separated label value vLLM uses.
fn adapter_list(names: &[String], ids: impl Iterator<Item = usize>) -> String {
    let mut v: Vec<usize> = ids.collect();
    v.sort_unstable();
    v.dedup();
    let named: Vec<&str> = v
        .iter()
        .filter_map(|i| names.get(*i).map(String::as_str))
        .collect();
    named.join(",")
}

#[cfg(test)]
mod tests {
    //! Engine behaviour under tokio's paused clock: sleeps complete exactly,
    //! so timings equal the cost model to the nanosecond.

    use super::*;
    use crate::hash::chain_hashes;
    use crate::metrics::Info;
    use crate::preset::Preset;

    fn start(cfg: EngineConfig) -> (EngineHandle, Arc<Metrics>) {
        let info = Info {
            model: "m".into(),
            block_size: 16,
            num_gpu_blocks: cfg.kv_blocks,
            max_lora: 1,
            has_lora: true,
        };
        let metrics = Arc::new(Metrics::new(info));
        (spawn(cfg, metrics.clone(), vec!["ad".into()]), metrics)
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32)
            .map(|i| 100 + (seed * 7919 + i) % 40_000)
            .collect()
    }

    async fn submit(
        h: &EngineHandle,
        tokens: &[u32],
        max_tokens: usize,
        lora: Option<usize>,
    ) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        let seed = lora.map_or(0, |_| 99);
        let sub = Submission {
            prompt_len: tokens.len(),
            block_hashes: chain_hashes(tokens, 16, seed),
            max_tokens,
            lora,
            seed: 0,
            events: tx,
        };
        assert!(h.submit(sub).await);
        rx
    }

    /// Runs one request to completion: (simulated TTFT in ms, usage).
    async fn run(
        h: &EngineHandle,
        m: &Metrics,
        tokens: &[u32],
        max_tokens: usize,
        lora: Option<usize>,
    ) -> (f64, Usage) {
        let (sum0, n0) = m.ttft_totals();
        let mut rx = submit(h, tokens, max_tokens, lora).await;
        while let Some(ev) = rx.recv().await {
            if let Event::Done(u) = ev {
                let (sum1, n1) = m.ttft_totals();
                assert_eq!(n1, n0 + 1);
                return ((sum1 - sum0) * 1000.0, u);
            }
        }
        panic!("engine dropped the request");
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3
    }

    #[tokio::test(start_paused = true)]
    async fn repeated_prefix_is_served_from_cache() {
        let cfg = Preset::Fast.config();
        let (h, m) = start(cfg.clone());
        let p = prompt(1, 1000);
        let (cold, u1) = run(&h, &m, &p, 2, None).await;
        // Two chunks of <=512 tokens: 2 step overheads + 1000 prefill tokens.
        assert!(close(cold, 2.0 * 0.5 + 1000.0 * 0.01), "cold ttft {cold}");
        assert_eq!(
            u1,
            Usage {
                prompt_tokens: 1000,
                completion_tokens: 2,
                cached_tokens: 0
            }
        );
        let (warm, u2) = run(&h, &m, &p, 2, None).await;
        assert_eq!(
            u2.cached_tokens, 992,
            "999 tokens rounded down to 16-token blocks"
        );
        assert!(close(warm, 0.5 + 8.0 * 0.01), "warm ttft {warm}");
        assert!(cold / warm > 15.0);
        // A different continuation of the same prefix reuses the shared blocks.
        let mut q = p[..640].to_vec();
        q.extend(prompt(2, 100));
        let (_, u3) = run(&h, &m, &q, 1, None).await;
        assert_eq!(u3.cached_tokens, 640);
        assert_eq!(m.counters.prefix_hits.load(Relaxed), 992 + 640);
        assert_eq!(m.counters.prefix_queries.load(Relaxed), 2740);
        assert_eq!(m.counters.request_success.load(Relaxed), 3);
        assert_eq!(m.counters.generation_tokens.load(Relaxed), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn fully_cached_prompt_still_computes_its_last_block() {
        let (h, m) = start(Preset::Fast.config());
        let p = prompt(3, 64);
        run(&h, &m, &p, 1, None).await;
        let (_, u) = run(&h, &m, &p, 1, None).await;
        assert_eq!(u.cached_tokens, 48);
    }

    #[tokio::test(start_paused = true)]
    async fn excess_requests_wait_for_a_sequence_slot() {
        let cfg = Preset::Fast.config();
        let (h, m) = start(cfg.clone());
        let mut rxs = Vec::new();
        for i in 0..(cfg.max_num_seqs as u32 + 4) {
            rxs.push(submit(&h, &prompt(10 + i, 40), 50, None).await);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(m.gauges.running.load(Relaxed), cfg.max_num_seqs as u64);
        assert_eq!(m.gauges.waiting.load(Relaxed), 4);
        assert!(f64::from_bits(m.gauges.kv_usage.load(Relaxed)) > 0.0);
        for mut rx in rxs {
            while !matches!(rx.recv().await, Some(Event::Done(_)) | None) {}
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(m.gauges.running.load(Relaxed), 0);
        assert_eq!(m.gauges.waiting.load(Relaxed), 0);
        assert_eq!(f64::from_bits(m.gauges.kv_usage.load(Relaxed)), 0.0);
    }

    /// Round-robin over distinct 2000-token prefixes, two rounds; returns the
    /// second round's hit rate.
    async fn second_round_hit_rate(prefixes: u32) -> f64 {
        let (h, m) = start(Preset::Fast.config()); // 512 blocks = 8192 tokens
        let mut hits = 0;
        let mut queries = 0;
        for round in 0..2 {
            for i in 0..prefixes {
                let (_, u) = run(&h, &m, &prompt(100 + i, 2000), 1, None).await;
                if round == 1 {
                    hits += u.cached_tokens;
                    queries += u.prompt_tokens;
                }
            }
        }
        hits as f64 / queries as f64
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_pressure_evicts_and_hit_rate_falls() {
        let fits = second_round_hit_rate(3).await; // 375 blocks: fits
        let thrash = second_round_hit_rate(6).await; // 750 blocks: LRU thrash
        assert!(fits > 0.99, "fits {fits}");
        assert!(thrash < 0.5, "thrash {thrash}");
    }

    #[tokio::test(start_paused = true)]
    async fn reset_empties_idle_cache_and_counters() {
        let (h, m) = start(Preset::Fast.config());
        let p = prompt(5, 300);
        run(&h, &m, &p, 1, None).await;
        let out = h.reset().await.unwrap();
        assert_eq!(
            out,
            ResetOutcome {
                in_flight: 0,
                cache_cleared: true
            }
        );
        assert_eq!(m.counters.prompt_tokens.load(Relaxed), 0);
        let (_, u) = run(&h, &m, &p, 1, None).await;
        assert_eq!(u.cached_tokens, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn lora_load_costs_time_once_and_separates_kv() {
        let cfg = Preset::Fast.config();
        let (h, m) = start(cfg.clone());
        let p = prompt(6, 100);
        let (base, _) = run(&h, &m, &p, 1, None).await;
        let (first, u) = run(&h, &m, &p, 1, Some(0)).await;
        assert_eq!(u.cached_tokens, 0, "adapter KV is not the base model's");
        assert!(close(first - base, cfg.lora_load_ms), "{first} vs {base}");
        let (again, u) = run(&h, &m, &p, 1, Some(0)).await;
        assert_eq!(u.cached_tokens, 96);
        assert!(again < base);
    }

    /// A request waiting for an adapter slot doesn't hold up a base-model
    /// request behind it (vLLM skips it and keeps scheduling).
    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_an_adapter_slot_does_not_block_the_queue() {
        let (h, _m) = start(Preset::Fast.config()); // max_loras 1
        let mut a = submit(&h, &prompt(34, 32), 300, Some(0)).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut b = submit(&h, &prompt(35, 32), 1, Some(1)).await;
        let mut c = submit(&h, &prompt(36, 32), 1, None).await;
        while !matches!(c.recv().await, Some(Event::Done(_)) | None) {}
        let mut a_done = false;
        while let Ok(ev) = a.try_recv() {
            a_done |= matches!(ev, Event::Done(_));
        }
        assert!(
            !a_done,
            "the base request waited for adapter 0's whole request"
        );
        // The adapter request still runs once the slot is free.
        while !matches!(b.recv().await, Some(Event::Done(_)) | None) {}
        let mut a_done = false;
        while let Ok(ev) = a.try_recv() {
            a_done |= matches!(ev, Event::Done(_));
        }
        assert!(a_done, "adapter 1 ran while adapter 0 held the only slot");
    }

    /// Requests whose clients left while they waited are dropped when
    /// they reach the head of the queue; the waiting gauge says so even
    /// when nothing is left to run (before, it kept showing them on an
    /// idle replica until the next request, and a router shunned it).
    #[tokio::test(start_paused = true)]
    async fn requests_abandoned_while_waiting_leave_the_waiting_gauge() {
        let cfg = Preset::Fast.config();
        let (h, m) = start(cfg.clone());
        let mut busy = Vec::new();
        for i in 0..cfg.max_num_seqs as u32 {
            busy.push(submit(&h, &prompt(40 + i, 40), 50, None).await);
        }
        let mut gone = Vec::new();
        for i in 0..3 {
            gone.push(submit(&h, &prompt(60 + i, 40), 50, None).await);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(m.gauges.waiting.load(Relaxed), 3);
        drop(gone);
        for mut rx in busy {
            while !matches!(rx.recv().await, Some(Event::Done(_)) | None) {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(m.gauges.running.load(Relaxed), 0);
        assert_eq!(m.gauges.waiting.load(Relaxed), 0);
    }

    /// A client that leaves from behind the head of the queue leaves the
    /// waiting gauge at the next step, not when its turn comes.
    #[tokio::test(start_paused = true)]
    async fn requests_abandoned_behind_the_head_leave_the_waiting_gauge_at_once() {
        let cfg = Preset::Fast.config();
        let (h, m) = start(cfg.clone());
        let mut busy = Vec::new();
        for i in 0..cfg.max_num_seqs as u32 {
            busy.push(submit(&h, &prompt(40 + i, 40), 500, None).await);
        }
        let head = submit(&h, &prompt(59, 40), 50, None).await;
        let mut gone = Vec::new();
        for i in 0..3 {
            gone.push(submit(&h, &prompt(60 + i, 40), 50, None).await);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(m.gauges.waiting.load(Relaxed), 4);
        drop(gone);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(m.gauges.running.load(Relaxed), cfg.max_num_seqs as u64);
        assert_eq!(
            m.gauges.waiting.load(Relaxed),
            1,
            "only the head still waits"
        );
        drop((head, busy));
    }

    #[tokio::test(start_paused = true)]
    async fn abandoned_requests_release_their_blocks() {
        let (h, m) = start(Preset::Fast.config());
        let rx = submit(&h, &prompt(7, 500), 200, None).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(f64::from_bits(m.gauges.kv_usage.load(Relaxed)) > 0.0);
        drop(rx);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(m.gauges.running.load(Relaxed), 0);
        assert_eq!(f64::from_bits(m.gauges.kv_usage.load(Relaxed)), 0.0);
    }
}
