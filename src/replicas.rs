//! The replica table: what the scraper learned about each replica (load
//! from its metrics page, scrape health), shared with every worker, and the
//! lease that makes exactly one VM the scraper at a time.
//!
//! One shared-data key holds the whole table (one writer at a time: the
//! lease holder), so a decision reads it with a single host call.

use std::collections::HashSet;

use crate::endpoint::ReplicaId;
use crate::metrics::{CacheCounters, ReplicaMetrics, MAX_LORA_ADAPTERS, MAX_LORA_NAME_BYTES};
use crate::store::{self, get_existing, shared_key, Reader, Store, StoreError, Writer};

const TABLE_KEY: &str = shared_key!("replicas");
const LEASE_KEY: &str = shared_key!("scrape-lease");
const BLIND_KEY: &str = shared_key!("scrape-blind");
const CONFIG_KEY: &str = shared_key!("scrape-config");
/// 2: each row framed by its own length, so one unreadable row costs only
/// itself; 3: the common record envelope (`store::Writer`); 4: the prefix
/// cache's measured hit rate. Tables of another version read as absent and
/// are rewritten.
pub(crate) const VERSION: u8 = 4;
/// The scraper lease's (unversioned before: two bare u64s).
/// 2: the holder's configuration generation.
pub(crate) const LEASE_VERSION: u8 = 2;
/// Bounds on what a record may carry (and a decoder will accept).
pub const MAX_ROWS: usize = 4096;
/// Largest queue/running count a row holds. Far above any real replica,
/// and still finite in f32 (a page saying 1e308 must not turn into
/// infinity and poison every reader's arithmetic).
pub const MAX_COUNT: f32 = 1e6;

/// Health thresholds, from config.
#[derive(Debug, Clone, Copy)]
pub struct HealthPolicy {
    pub staleness_ms: u64,
    pub unhealthy_after: u32,
}

/// One replica's row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub id: ReplicaId,
    /// When the last good scrape finished (0: never).
    pub last_ok_ms: u64,
    pub failures: u32,
    pub waiting: f32,
    pub running: f32,
    pub kv_usage: f32,
    pub max_lora: u32,
    pub running_lora: Vec<String>,
    pub waiting_lora: Vec<String>,
    pub cache: CacheRate,
}

/// The prefix cache's hit rate as the replica measures it: the increments
/// of its hit and lookup counters (tokens) between scrapes, summed with a
/// half-life of [`HIT_RATE_HALF_LIFE_MS`], so the rate follows the last
/// half minute or so of traffic whatever the scrape interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheRate {
    /// The counters at the last good scrape (`None`: none reported yet, or
    /// the page stopped reporting them).
    last: Option<CacheCounters>,
    queries: f32,
    hits: f32,
}

/// How fast old lookups stop counting.
pub const HIT_RATE_HALF_LIFE_MS: u64 = 20_000;
/// Lookups (tokens, decayed) below which a rate is not trusted: a few
/// prompts are not a measurement, and a replica's first cold prefill of a
/// long shared prompt (an agent's 15k-token tool list) must not read as
/// evicting on its own. Not much more: at 256k a replica with a quarter
/// of the KV cache was judged late, and lost its rate again as its
/// traffic fell with the prefixes that left (no gain on shared-prefix).
pub const HIT_RATE_MIN_QUERIES: f32 = 65_536.0;

impl CacheRate {
    /// The measured hit rate (0..=1), once enough lookups back it.
    pub fn hit_rate(&self) -> Option<f32> {
        (self.queries >= HIT_RATE_MIN_QUERIES).then(|| (self.hits / self.queries).clamp(0.0, 1.0))
    }

    /// The prompt tokens it looked up lately (decayed like the rate), once
    /// it reports its counters: its share of the pool's prefill traffic,
    /// the same from every gateway instance (`route::hot`).
    pub fn traffic(&self) -> Option<f32> {
        self.last.map(|_| self.queries)
    }

    /// Take the counters of a scrape `elapsed_ms` after the last one. A
    /// counter that went down (the server restarted) starts a new baseline.
    /// Old lookups decay whatever the page says: a replica whose pages
    /// stopped carrying the counters (another engine on the address) kept
    /// the rate it last measured, and stayed judged by it for as long.
    fn observe(&mut self, now: Option<CacheCounters>, elapsed_ms: u64) {
        let keep = 0.5f64.powf(elapsed_ms as f64 / HIT_RATE_HALF_LIFE_MS as f64);
        let (mut dq, mut dh) = (0.0, 0.0);
        if let (Some(before), Some(now)) = (self.last, now) {
            if now.queries >= before.queries && now.hits >= before.hits {
                dq = now.queries - before.queries;
                dh = (now.hits - before.hits).min(dq);
            }
        }
        self.queries = tokens(f64::from(self.queries) * keep + dq);
        self.hits = tokens(f64::from(self.hits) * keep + dh).min(self.queries);
        self.last = now;
    }

    fn encode(&self, w: &mut Writer) {
        let (q, h) = self.last.map_or((-1.0, -1.0), |c| (c.queries, c.hits));
        w.u64(q.to_bits())
            .u64(h.to_bits())
            .f32(self.queries)
            .f32(self.hits);
    }

    fn decode(r: &mut Reader) -> Option<CacheRate> {
        let counter = |bits: u64| Some(f64::from_bits(bits)).filter(|v| v.is_finite() && *v >= 0.0);
        let (q, h) = (counter(r.u64()?), counter(r.u64()?));
        let queries = tokens(f64::from(r.f32()?));
        Some(CacheRate {
            last: q
                .zip(h)
                .map(|(queries, hits)| CacheCounters { queries, hits }),
            queries,
            hits: tokens(f64::from(r.f32()?)).min(queries),
        })
    }
}

/// The pool's mean prompt traffic (decayed tokens looked up) under which
/// replicas' shares of it are noise: a few prompts are not a measurement.
pub const MIN_MEAN_TRAFFIC: f32 = HIT_RATE_MIN_QUERIES;

/// Each replica's prompt traffic ([`CacheRate::traffic`]) over the mean
/// of them all: 1 is its even share. `None` unless every one reports it
/// and the mean is [`MIN_MEAN_TRAFFIC`] or more (a replica that doesn't
/// report would make the others look busy or idle by omission).
pub fn traffic_shares(traffic: &[Option<f32>]) -> Option<Vec<f32>> {
    let known: Vec<f32> = traffic.iter().copied().collect::<Option<_>>()?;
    if known.len() < 2 {
        return None;
    }
    // Summed in one order whatever the list's (another instance may list
    // the replicas otherwise, and an f32 sum in list order lost the small
    // counts to a big one's rounding on one instance and not the other).
    let mut sorted: Vec<f64> = known.iter().copied().map(f64::from).collect();
    sorted.sort_by(f64::total_cmp);
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    (mean >= f64::from(MIN_MEAN_TRAFFIC) && mean.is_finite()).then(|| {
        known
            .iter()
            .map(|&t| (f64::from(t) / mean) as f32)
            .collect()
    })
}

/// A count as a row keeps it: finite, 0..=MAX_COUNT (NaN reads as 0).
fn count(v: f64) -> f32 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, f64::from(MAX_COUNT)) as f32
    }
}

/// A decayed token sum as a row keeps it: finite, 0..=1e15 (NaN reads as
/// 0). Not clamped like a count: a busy replica looks up millions of
/// tokens a minute.
fn tokens(v: f64) -> f32 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1e15) as f32
    }
}

fn fraction(v: f32) -> f32 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1.0)
    }
}

impl Row {
    pub fn healthy(&self, p: &HealthPolicy, now_ms: u64) -> bool {
        self.failures < p.unhealthy_after
            && self.last_ok_ms > 0
            && crate::load::fresh(self.last_ok_ms, now_ms, p.staleness_ms)
    }

    fn apply_ok(&mut self, m: &ReplicaMetrics, now_ms: u64) {
        self.cache
            .observe(m.cache, now_ms.saturating_sub(self.last_ok_ms));
        self.last_ok_ms = now_ms.max(1);
        self.failures = 0;
        self.waiting = count(m.waiting);
        self.running = count(m.running);
        self.kv_usage = fraction(m.kv_usage as f32);
        self.max_lora = m.max_lora.unwrap_or(0);
        self.running_lora = bounded(&m.running_lora);
        self.waiting_lora = bounded(&m.waiting_lora);
    }

    /// A row whose body can't be read: known, never eligible, until the
    /// next scrape of it rewrites it.
    fn unreadable(id: ReplicaId) -> Row {
        Row {
            id,
            failures: u32::MAX,
            ..Row::default()
        }
    }

    fn encode(&self, w: &mut Writer) {
        w.u64(self.id).u64(self.last_ok_ms).u32(self.failures);
        w.f32(self.waiting).f32(self.running).f32(self.kv_usage);
        w.u32(self.max_lora);
        for list in [&self.running_lora, &self.waiting_lora] {
            w.u8(list.len() as u8);
            for name in list {
                w.str(name);
            }
        }
        self.cache.encode(w);
    }

    /// The body after the id. Values are sanitised again on the way in:
    /// whatever wrote the record, a reader never sees NaN or infinity.
    fn decode_body(id: ReplicaId, r: &mut Reader) -> Option<Row> {
        let row = Row {
            id,
            last_ok_ms: r.u64()?,
            failures: r.u32()?,
            waiting: count(f64::from(r.f32()?)),
            running: count(f64::from(r.f32()?)),
            kv_usage: fraction(r.f32()?),
            max_lora: r.u32()?,
            running_lora: names(r)?,
            waiting_lora: names(r)?,
            cache: CacheRate::decode(r)?,
        };
        r.is_empty().then_some(row)
    }
}

fn bounded(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !n.is_empty() && n.len() <= MAX_LORA_NAME_BYTES)
        .take(MAX_LORA_ADAPTERS)
        .cloned()
        .collect()
}

/// Rows sorted by id, so a decision finds each in O(log n).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    rows: Vec<Row>,
}

impl Table {
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    pub fn row(&self, id: ReplicaId) -> Option<&Row> {
        self.rows
            .binary_search_by_key(&id, |r| r.id)
            .ok()
            .and_then(|i| self.rows.get(i))
    }

    fn row_mut(&mut self, id: ReplicaId) -> Option<&mut Row> {
        let i = match self.rows.binary_search_by_key(&id, |r| r.id) {
            Ok(i) => i,
            Err(_) if self.rows.len() >= MAX_ROWS => return None,
            Err(i) => {
                self.rows.insert(
                    i,
                    Row {
                        id,
                        ..Row::default()
                    },
                );
                i
            }
        };
        self.rows.get_mut(i)
    }

    /// Record one scrape outcome for `id` (`Ok` metrics or a failure).
    pub fn record(&mut self, id: ReplicaId, outcome: Result<&ReplicaMetrics, ()>, now_ms: u64) {
        let Some(row) = self.row_mut(id) else { return };
        match outcome {
            Ok(m) => row.apply_ok(m, now_ms),
            Err(()) => row.failures = row.failures.saturating_add(1),
        }
    }

    /// Drop rows of replicas no longer in the pool, so the table can't
    /// grow past it.
    pub fn retain(&mut self, known: &HashSet<ReplicaId>) {
        self.rows.retain(|r| known.contains(&r.id));
    }

    /// Eligibility of `id`: unknown replicas (not scraped yet) are eligible,
    /// so routing works from the first request and without scraping.
    pub fn eligible(&self, id: ReplicaId, p: &HealthPolicy, now_ms: u64) -> bool {
        match self.row(id) {
            None => true,
            Some(r) if r.last_ok_ms == 0 => r.failures < p.unhealthy_after,
            Some(r) => r.healthy(p, now_ms),
        }
    }

    /// Each row is framed on its own, so one unreadable row costs only
    /// itself.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(VERSION, 4 + self.rows.len() * 48);
        w.count(self.rows.len());
        for row in &self.rows {
            w.framed(|w| row.encode(w));
        }
        w.finish()
    }

    /// A table whose framing is broken reads as empty (everyone unknown,
    /// so eligible): never trusted, and the next scrape rewrites it. A row
    /// whose body is broken costs only that row, which reads as unhealthy.
    pub fn decode(buf: &[u8]) -> Table {
        let rows = store::decode(VERSION, buf, |r| {
            let n = r.count(MAX_ROWS)?;
            let mut rows = Vec::with_capacity(n);
            for _ in 0..n {
                let mut body = Reader::new(r.bytes()?);
                // Without an id the row can't be attributed: skip it.
                let Some(id) = body.u64() else { continue };
                rows.push(Row::decode_body(id, &mut body).unwrap_or_else(|| Row::unreadable(id)));
            }
            Some(rows)
        });
        let mut rows = rows.unwrap_or_default();
        rows.sort_by_key(|r| r.id);
        rows.dedup_by_key(|r| r.id);
        Table { rows }
    }

    pub fn load<S: Store + ?Sized>(store: &S) -> Table {
        store
            .get(TABLE_KEY)
            .0
            .map(|b| Table::decode(&b))
            .unwrap_or_default()
    }

    /// Write the whole table (only the lease holder writes it).
    pub fn publish<S: Store + ?Sized>(&self, store: &S) -> Result<(), StoreError> {
        store.set(TABLE_KEY, &self.encode(), None)
    }
}

/// Fuzzing support: see `index::check_codec`.
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub fn check_codec(buf: &[u8]) {
    for record in [buf, &store::seal(VERSION, buf)] {
        let t = Table::decode(record);
        assert!(t.rows.len() <= MAX_ROWS);
        assert!(t.rows.iter().all(|r| r.waiting.is_finite()
            && r.running.is_finite()
            && (0.0..=1.0).contains(&r.kv_usage)));
        assert_eq!(Table::decode(&t.encode()), t);
    }
    for record in [buf, &store::seal(LEASE_VERSION, buf)] {
        if let Some((owner, expiry, generation)) = decode_lease(record) {
            assert_eq!(
                decode_lease(&lease_record(owner, expiry, generation)),
                Some((owner, expiry, generation))
            );
        }
    }
}

fn names(r: &mut Reader) -> Option<Vec<String>> {
    let n = usize::from(r.u8()?);
    if n > MAX_LORA_ADAPTERS {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str()?;
        if name.len() > MAX_LORA_NAME_BYTES {
            return None;
        }
        out.push(name.to_string());
    }
    Some(out)
}

/// Record one scrape outcome straight into the shared table (read, apply,
/// write): what the scraper does in batches, for tests and tools.
pub fn record_scrape<S: Store + ?Sized>(
    store: &S,
    id: ReplicaId,
    outcome: Result<&ReplicaMetrics, ()>,
    known: &[ReplicaId],
    now_ms: u64,
) -> Result<(), StoreError> {
    let mut t = Table::load(store);
    t.retain(&known.iter().copied().collect());
    t.record(id, outcome, now_ms);
    t.publish(store)
}

/// The scraper lease: (owner, expiry, generation). A VM scrapes only while
/// it holds it; if the holder stops renewing (VM gone), another takes over
/// at expiry, and a newer configuration's VM at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// We hold it (renewed now).
    Held,
    /// We just took it over from another owner whose lease expired.
    TookOver,
    /// Someone else holds a live lease.
    Other,
}

fn lease_record(owner: u64, expiry_ms: u64, generation: u64) -> Vec<u8> {
    let mut w = Writer::new(LEASE_VERSION, 24);
    w.u64(owner).u64(expiry_ms).u64(generation);
    w.finish()
}

/// (owner, expiry, the owner's `config_generation`); `None` if
/// unreadable, which a contender takes over.
fn decode_lease(buf: &[u8]) -> Option<(u64, u64, u64)> {
    store::decode(LEASE_VERSION, buf, |r| Some((r.u64()?, r.u64()?, r.u64()?)))
}

/// (configuration hash, its generation): versioned with the lease.
fn config_record(hash: u64, generation: u64) -> Vec<u8> {
    let mut w = Writer::new(LEASE_VERSION, 16);
    w.u64(hash).u64(generation);
    w.finish()
}

fn decode_config(buf: &[u8]) -> Option<(u64, u64)> {
    store::decode(LEASE_VERSION, buf, |r| Some((r.u64()?, r.u64()?)))
}

/// The generation of the scraping configuration whose hash is `hash`, in
/// this scope: one for every root context of one configuration (each
/// worker's VM), and above every earlier one's for a configuration pushed
/// since. Envoy runs a pushed configuration (LDS, ECDS) beside the old one
/// until the old listener has drained (`--drain-time-s`, 600 s by
/// default), old root contexts ticking; the lease goes to the newest
/// generation, so the pushed settings scrape the pool at once, not after
/// the drain. 0 when the record can't be written: that scraper never
/// pre-empts, and takes the lease only when it lapses.
pub fn config_generation<S: Store + ?Sized>(store: &S, hash: u64) -> u64 {
    for _ in 0..8 {
        let Some((value, cas)) = get_existing(store, CONFIG_KEY, &config_record(0, 0)) else {
            continue;
        };
        let next = match value.as_deref().and_then(decode_config) {
            Some((h, g)) if h == hash => return g,
            Some((_, g)) => g.saturating_add(1),
            None => 1,
        };
        if store
            .set(CONFIG_KEY, &config_record(hash, next), Some(cas))
            .is_ok()
        {
            return next;
        }
    }
    0
}

/// Whether `owner` still holds the lease (expired or not: nobody took it
/// yet). A holder whose timer ran late can lose the lease without
/// knowing, while its scrape answers are still arriving; it checks this
/// before it writes the table, so a late round can't overwrite the new
/// holder's (and re-admit a replica the new holder has seen fail).
pub fn holds_lease<S: Store + ?Sized>(store: &S, owner: u64) -> bool {
    store
        .get(LEASE_KEY)
        .0
        .as_deref()
        .and_then(decode_lease)
        .is_some_and(|(o, _, _)| o == owner)
}

/// When the scraper's next round is due, given this tick's time and the
/// round that was due: rounds keep their cadence (a tick that fires a
/// little early, as timers do, doesn't push its round a whole period
/// later), and a tick within `slack_ms` of the due time counts as on
/// time. `None`: not due yet. Without the slack a round every interval
/// became one every two now and then, which let the lease (two
/// intervals) lapse while its holder was alive. A due time further ahead
/// than one interval (and the slack) was set before the wall clock
/// stepped back: due now, or nothing would run until the clock got back
/// there.
pub fn next_round(now_ms: u64, due_ms: u64, interval_ms: u64, slack_ms: u64) -> Option<u64> {
    let waiting = now_ms.saturating_add(slack_ms) < due_ms;
    let stepped_back = due_ms > now_ms.saturating_add(interval_ms).saturating_add(slack_ms);
    if waiting && !stepped_back {
        return None;
    }
    if stepped_back {
        return Some(now_ms.saturating_add(interval_ms));
    }
    Some(now_ms.max(due_ms).saturating_add(interval_ms))
}

/// `owner` must not be 0: owner 0 is the free lease a first contact writes.
/// `generation`: the owner's `config_generation`; a live lease of an older
/// one is taken over.
pub fn acquire_lease<S: Store + ?Sized>(
    store: &S,
    owner: u64,
    generation: u64,
    now_ms: u64,
    ttl_ms: u64,
) -> Lease {
    let Some((value, cas)) = get_existing(store, LEASE_KEY, &lease_record(0, 0, 0)) else {
        return Lease::Other;
    };
    let current = value.as_deref().and_then(decode_lease);
    let outcome = match current {
        Some((o, _, _)) if o == owner => Lease::Held,
        Some((0, _, _)) => Lease::Held,
        // Its holder runs a configuration that was since replaced, and
        // lives on only until its listener has drained.
        Some((_, _, g)) if g < generation => Lease::TookOver,
        // A lease that runs out further ahead than one term was written
        // before the wall clock stepped back: its holder may be long dead.
        Some((_, expiry, _)) if now_ms < expiry && expiry <= now_ms.saturating_add(ttl_ms) => {
            return Lease::Other
        }
        _ => Lease::TookOver,
    };
    let record = lease_record(owner, now_ms.saturating_add(ttl_ms), generation);
    match store.set(LEASE_KEY, &record, Some(cas)) {
        Ok(()) => outcome,
        Err(_) => Lease::Other,
    }
}

/// Whether no replica passing its scrapes (`blind`) is news to the
/// process: `Some(blind)` once per change, whichever VM scrapes. The lease
/// moves between VMs; each VM remembering what it had said warned again
/// after every takeover. A lost write (a race) is someone else's news.
pub fn blind_news<S: Store + ?Sized>(store: &S, blind: bool) -> Option<bool> {
    let (said, cas) = store.get(BLIND_KEY);
    if said.as_deref().is_some_and(|v| v == [1]) == blind {
        return None;
    }
    store
        .set(BLIND_KEY, &[u8::from(blind)], cas)
        .ok()
        .map(|()| blind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;
    use std::cell::RefCell;

    const P: HealthPolicy = HealthPolicy {
        staleness_ms: 2000,
        unhealthy_after: 3,
    };

    fn metrics(waiting: f64) -> ReplicaMetrics {
        ReplicaMetrics {
            waiting,
            running: 2.0,
            kv_usage: 0.5,
            running_lora: vec!["sql-lora".into()],
            max_lora: Some(4),
            ..ReplicaMetrics::default()
        }
    }

    #[test]
    fn health_state_machine() {
        let s = MemStore::new();
        let known = [1, 2];
        // Unknown before the first scrape: eligible.
        assert!(Table::load(&s).eligible(1, &P, 0));
        record_scrape(&s, 1, Ok(&metrics(3.0)), &known, 1000).unwrap();
        let t = Table::load(&s);
        assert!(t.eligible(1, &P, 1500));
        assert_eq!(t.row(1).unwrap().waiting, 3.0);
        assert_eq!(t.row(1).unwrap().running_lora, vec!["sql-lora"]);
        // Stale after staleness_ms without a good scrape.
        assert!(!t.eligible(1, &P, 3001));
        // Failures: still eligible until `unhealthy_after` in a row.
        for i in 0..3 {
            assert!(Table::load(&s).eligible(1, &P, 1100 + i));
            record_scrape(&s, 1, Err(()), &known, 1100 + i).unwrap();
        }
        assert!(!Table::load(&s).eligible(1, &P, 1200));
        // One good scrape brings it back.
        record_scrape(&s, 1, Ok(&metrics(0.0)), &known, 1300).unwrap();
        assert!(Table::load(&s).eligible(1, &P, 1400));
        // A replica that never answered is out after enough failures.
        for _ in 0..3 {
            record_scrape(&s, 2, Err(()), &known, 1400).unwrap();
        }
        assert!(!Table::load(&s).eligible(2, &P, 1400));
    }

    #[test]
    fn measured_hit_rate_follows_the_counters() {
        let s = MemStore::new();
        let scrape = |q: f64, h: f64, at: u64| {
            let m = ReplicaMetrics {
                cache: Some(CacheCounters {
                    queries: q,
                    hits: h,
                }),
                ..metrics(0.0)
            };
            record_scrape(&s, 1, Ok(&m), &[1], at).unwrap();
            Table::load(&s).row(1).unwrap().cache.hit_rate()
        };
        // Lifetime totals before the first scrape don't count: a baseline.
        assert_eq!(scrape(1e9, 1e8, 1_000), None);
        // Under the minimum of lookups: no rate yet.
        assert_eq!(scrape(1e9 + 1_000.0, 1e8 + 900.0, 2_000), None);
        // 90% of the next million tokens hit.
        let r = scrape(1e9 + 1_001_000.0, 1e8 + 900_900.0, 3_000).unwrap();
        assert!((r - 0.9).abs() < 0.01, "{r}");
        // Then nothing hits: the rate falls with the half-life, not at once.
        let r = scrape(
            1e9 + 2_001_000.0,
            1e8 + 900_900.0,
            3_000 + HIT_RATE_HALF_LIFE_MS,
        )
        .unwrap();
        assert!((0.25..0.35).contains(&r), "{r}");
        let later = 3_000 + 10 * HIT_RATE_HALF_LIFE_MS;
        let r = scrape(1e9 + 12_001_000.0, 1e8 + 900_900.0, later).unwrap();
        assert!(r < 0.01, "{r}");
        // A restart (counters back near 0) starts a new baseline and keeps
        // the rate; hits above queries (a broken exporter) count as queries.
        assert!(scrape(10.0, 5.0, later + 100).unwrap() < 0.01);
        // (10M lookups at 0% weigh against these 1M at 100%.)
        let r = scrape(1_000_010.0, 5_000_005.0, later + 200).unwrap();
        assert!((0.08..0.12).contains(&r), "{r}");
        // A page without the counters: the rate decays, no new baseline.
        record_scrape(&s, 1, Ok(&metrics(0.0)), &[1], later + 300).unwrap();
        let r = Table::load(&s).row(1).unwrap().cache;
        assert!(r.hit_rate().is_some());
        assert_eq!(r, CacheRate { last: None, ..r });
    }

    /// Pages that stop carrying the prefix-cache counters (another engine
    /// on the address) leave the rate to decay: ten minutes later the
    /// replica is no longer judged on what it measured before.
    #[test]
    fn a_rate_without_counters_decays_away() {
        let s = MemStore::new();
        let page = |cache: Option<CacheCounters>| ReplicaMetrics {
            cache,
            ..ReplicaMetrics::default()
        };
        let c = |q: f64, h: f64| {
            Some(CacheCounters {
                queries: q,
                hits: h,
            })
        };
        record_scrape(&s, 1, Ok(&page(c(0.0, 0.0))), &[1], 1_000).unwrap();
        record_scrape(&s, 1, Ok(&page(c(1e6, 1e5))), &[1], 2_000).unwrap();
        let r = Table::load(&s).row(1).unwrap().cache.hit_rate();
        assert!(r.is_some_and(|r| (r - 0.1).abs() < 0.01), "{r:?}");
        let mut now = 2_000;
        for _ in 0..6_000 {
            now += 100;
            record_scrape(&s, 1, Ok(&page(None)), &[1], now).unwrap();
        }
        let row = Table::load(&s).row(1).unwrap().clone();
        let policy = HealthPolicy {
            staleness_ms: 2000,
            unhealthy_after: 3,
        };
        assert!(row.healthy(&policy, now));
        assert_eq!(row.cache.hit_rate(), None);
    }

    #[test]
    fn rows_of_removed_replicas_are_dropped() {
        let s = MemStore::new();
        record_scrape(&s, 1, Ok(&metrics(1.0)), &[1, 2], 10).unwrap();
        record_scrape(&s, 2, Ok(&metrics(1.0)), &[2], 10).unwrap();
        let t = Table::load(&s);
        assert!(t.row(1).is_none());
        assert!(t.row(2).is_some());
    }

    #[test]
    fn corrupt_tables_read_as_empty() {
        let mut t = Table::default();
        t.record(5, Ok(&metrics(2.0)), 9);
        let good = t.encode();
        assert_eq!(Table::decode(&good), t);
        for cut in 0..good.len() {
            assert_eq!(Table::decode(&good[..cut]), Table::default());
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(Table::decode(&longer), Table::default());
        let too_many = store::seal(VERSION, &[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(Table::decode(&too_many), Table::default());
        // The same table in the version-2 layout (no envelope).
        let mut v2 = vec![2];
        v2.extend_from_slice(&good[store::HEADER_BYTES..]);
        assert_eq!(Table::decode(&v2), Table::default());
    }

    #[test]
    fn absurd_values_are_clamped_and_never_poison_the_table() {
        // Before: 1e308 was stored as f32 infinity, the reader rejected the
        // whole table, and every replica (a failing one too) looked
        // unknown, so eligible and idle.
        let s = MemStore::new();
        let known = [1, 2];
        let absurd = ReplicaMetrics {
            waiting: 1e308,
            running: f64::INFINITY,
            kv_usage: f64::NAN,
            ..ReplicaMetrics::default()
        };
        record_scrape(&s, 1, Ok(&absurd), &known, 1000).unwrap();
        for _ in 0..3 {
            record_scrape(&s, 2, Err(()), &known, 1000).unwrap();
        }
        let t = Table::load(&s);
        let r1 = t.row(1).unwrap();
        assert_eq!(
            (r1.waiting, r1.running, r1.kv_usage),
            (MAX_COUNT, MAX_COUNT, 0.0)
        );
        assert!(t.eligible(1, &P, 1000));
        assert!(!t.eligible(2, &P, 1000), "the failing replica stays out");
    }

    #[test]
    fn one_unreadable_row_costs_only_itself() {
        let mut t = Table::default();
        t.record(1, Ok(&metrics(1.0)), 10);
        t.record(2, Ok(&metrics(2.0)), 10);
        let mut buf = t.encode();
        // Row 1's running-adapter count: make it claim more names than
        // allowed. Rows start after the header and the row count, each
        // behind its u32 length.
        let row1 = store::HEADER_BYTES + 4;
        let row1_len = u32::from_le_bytes(buf[row1..row1 + 4].try_into().unwrap()) as usize;
        let body = row1 + 4;
        let lists_at = body + 8 + 8 + 4 + 12 + 4;
        assert!(lists_at < body + row1_len);
        buf[lists_at] = 200;
        let back = Table::decode(&buf);
        assert_eq!(back.rows().len(), 2);
        assert_eq!(back.row(2), t.row(2));
        assert!(!back.eligible(1, &P, 10), "unreadable row: not trusted");
        // Non-finite floats written by anything read back sanitised.
        let mut raw = t.encode();
        let waiting_at = body + 8 + 8 + 4;
        raw[waiting_at..waiting_at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert_eq!(Table::decode(&raw).row(1).unwrap().waiting, MAX_COUNT);
    }

    #[test]
    fn rows_are_found_by_id_in_any_insertion_order() {
        let mut t = Table::default();
        for id in [9u64, 3, 7, 1, 5] {
            t.record(id, Ok(&metrics(id as f64)), 10);
        }
        for id in [1u64, 3, 5, 7, 9] {
            assert_eq!(t.row(id).unwrap().waiting, id as f32);
        }
        assert!(t.row(4).is_none());
        assert_eq!(Table::decode(&t.encode()), t);
    }

    #[test]
    fn lease_one_holder_and_takeover_after_expiry() {
        let s = MemStore::new();
        // First contact creates the free lease; claims are CAS from there.
        assert_eq!(acquire_lease(&s, 1, 0, 0, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, 0, 0, 300), Lease::Held);
        assert_eq!(acquire_lease(&s, 2, 0, 100, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, 0, 200, 300), Lease::Held);
        // Holder 1 stops renewing at 200: expiry 500.
        assert_eq!(acquire_lease(&s, 2, 0, 499, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 2, 0, 500, 300), Lease::TookOver);
        assert_eq!(acquire_lease(&s, 1, 0, 510, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 2, 0, 600, 300), Lease::Held);
        // The old holder learns it lost the lease before writing.
        assert!(!holds_lease(&s, 1));
        assert!(holds_lease(&s, 2));
        // A lease in another layout (the unversioned one of before) reads
        // as absent: taken over, by compare-and-swap.
        let mut old = 2u64.to_le_bytes().to_vec();
        old.extend_from_slice(&10_000u64.to_le_bytes());
        s.set(LEASE_KEY, &old, None).unwrap();
        assert_eq!(acquire_lease(&s, 1, 0, 700, 300), Lease::TookOver);
        assert_eq!(acquire_lease(&s, 2, 0, 710, 300), Lease::Other);
    }

    /// Envoy runs a pushed configuration beside the old one until the old
    /// listener has drained (600 s by default), old root contexts ticking
    /// and renewing their lease: the pushed settings (a fixed
    /// `metrics_path`) scraped nothing until then. A newer generation takes
    /// a live lease at once; roots of one configuration share theirs, so
    /// they never take it from each other.
    #[test]
    fn a_pushed_configuration_takes_the_lease_from_a_live_older_one() {
        let s = MemStore::new();
        let old = config_generation(&s, 0xa);
        assert_eq!(config_generation(&s, 0xa), old, "another worker's root");
        let new = config_generation(&s, 0xb);
        assert!(new > old);
        assert_eq!(config_generation(&s, 0xb), new);
        assert_eq!(acquire_lease(&s, 1, old, 0, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, old, 0, 300), Lease::Held);
        assert_eq!(acquire_lease(&s, 2, old, 100, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, old, 100, 300), Lease::Held);
        assert_eq!(acquire_lease(&s, 3, new, 150, 300), Lease::TookOver);
        assert_eq!(acquire_lease(&s, 1, old, 200, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 4, new, 210, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 3, new, 250, 300), Lease::Held);
        assert!(!holds_lease(&s, 1));
        // Rolled back: a configuration seen before is pushed anew.
        assert!(config_generation(&s, 0xa) > new);
    }

    /// The wall clock steps back an hour after the holder died: the lease
    /// it wrote runs out an hour ahead, and is taken over at once, not an
    /// hour later. A live holder renews it as before.
    #[test]
    fn a_lease_from_before_a_clock_step_back_is_taken_over() {
        let s = MemStore::new();
        let t0 = 10_000_000;
        assert_eq!(acquire_lease(&s, 1, 0, t0, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, 0, t0, 300), Lease::Held);
        let back = t0 - 3_600_000;
        assert_eq!(acquire_lease(&s, 2, 0, back, 300), Lease::TookOver);
        assert_eq!(acquire_lease(&s, 2, 0, back + 100, 300), Lease::Held);
        assert_eq!(acquire_lease(&s, 1, 0, back + 150, 300), Lease::Other);
    }

    #[test]
    fn nobody_holds_an_absent_or_unreadable_lease() {
        let s = MemStore::new();
        assert!(!holds_lease(&s, 1));
        s.set(LEASE_KEY, b"garbage", None).unwrap();
        assert!(!holds_lease(&s, 1));
        // The free lease a first contact writes belongs to nobody we know.
        s.set(LEASE_KEY, &lease_record(0, 0, 0), None).unwrap();
        assert!(!holds_lease(&s, 1));
    }

    #[test]
    fn rounds_keep_their_cadence_through_early_and_late_ticks() {
        // Interval 100, ticks every 100 with 50 of slack.
        let round = |now, due| next_round(now, due, 100, 50);
        // The first tick is always due.
        assert_eq!(round(1_000, 0), Some(1_100));
        // A tick 1 ms early is on time, and the next round stays on the grid.
        assert_eq!(round(1_099, 1_100), Some(1_200));
        // A tick well before the due time waits.
        assert_eq!(round(1_040, 1_100), None);
        // A late tick starts the next period from when it ran.
        assert_eq!(round(1_180, 1_100), Some(1_280));
        // Over a run of jittery ticks a round runs on every one of them.
        let mut due = 0;
        let mut rounds = 0;
        for k in 0..100u64 {
            let jitter = [0, 3, 0, 2, 1][(k % 5) as usize];
            let now = 10_000 + k * 100 - jitter;
            if let Some(next) = round(now, due) {
                due = next;
                rounds += 1;
            }
        }
        assert_eq!(rounds, 100);
        // No slack, as before: an early tick skips its round.
        assert_eq!(next_round(1_099, 1_100, 100, 0), None);
    }

    /// The wall clock steps forward an hour for a moment (a bad NTP
    /// sample) and back: the round that came due then lies an hour ahead,
    /// further than one interval from any tick under a clock that only
    /// moves forward. Before, no round ran until the clock got there:
    /// no lease renewal, no scrape, no discovery for an hour, and every
    /// replica went stale (the router blind).
    #[test]
    fn a_round_due_past_a_clock_step_back_runs_at_once() {
        let t0 = 10_000_000;
        let ahead = t0 + 3_600_000;
        let due = next_round(ahead, 0, 100, 50).unwrap();
        assert_eq!(due, ahead + 100);
        // Back to the real time: due now, and on the grid from here.
        assert_eq!(next_round(t0, due, 100, 50), Some(t0 + 100));
        assert_eq!(next_round(t0 + 40, t0 + 100, 100, 50), None);
        // Discovery's longer interval, checked on the scrape's ticks:
        // a due time up to one interval ahead is the normal wait.
        assert_eq!(next_round(t0 + 100, t0 + 1_000, 1_000, 50), None);
        assert_eq!(next_round(t0 + 100, t0 + 1_100, 1_000, 50), None);
    }

    /// A store where `rival` runs once, between our first read and our
    /// next write: the worst interleaving for a read-then-write.
    struct Interleaved<'a, F: Fn()> {
        inner: &'a MemStore,
        rival: RefCell<Option<F>>,
    }

    impl<F: Fn()> Store for Interleaved<'_, F> {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if let Some(rival) = self.rival.borrow_mut().take() {
                rival();
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn two_contenders_on_an_empty_store_never_both_hold() {
        // Before: an absent key made the write unconditional, and both
        // contenders returned Held.
        let s = MemStore::new();
        let held = RefCell::new(std::collections::BTreeSet::new());
        let racing = Interleaved {
            inner: &s,
            rival: RefCell::new(Some(|| {
                // B runs its first and second contact while A sits between
                // its read (absent) and its write.
                for _ in 0..2 {
                    if acquire_lease(&s, 2, 0, 10, 300) != Lease::Other {
                        held.borrow_mut().insert(2);
                    }
                }
            })),
        };
        if acquire_lease(&racing, 1, 0, 10, 300) != Lease::Other {
            held.borrow_mut().insert(1);
        }
        assert!(held.borrow().len() <= 1, "two holders: {:?}", held.borrow());
        // A's late create wiped B's claim; from here on exactly one holds.
        let holders: Vec<u64> = [1, 2]
            .into_iter()
            .filter(|&o| acquire_lease(&s, o, 0, 20, 300) != Lease::Other)
            .collect();
        assert_eq!(holders.len(), 1, "{holders:?}");
    }

    #[test]
    fn two_contenders_racing_for_a_free_lease_get_one_winner() {
        struct Racy<'a>(&'a MemStore);
        impl Store for Racy<'_> {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
                let v = self.0.get(key);
                // The rival writes between our read and our write.
                self.0.set(key, &lease_record(7, 1000, 0), None).unwrap();
                v
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
                self.0.set(key, value, cas)
            }
        }
        let s = MemStore::new();
        s.set(LEASE_KEY, &lease_record(0, 0, 0), None).unwrap();
        assert_eq!(acquire_lease(&Racy(&s), 1, 0, 10, 300), Lease::Other);
        assert_eq!(
            decode_lease(&s.get(LEASE_KEY).0.unwrap()),
            Some((7, 1000, 0))
        );
    }

    #[test]
    fn blindness_is_news_once_each_way_for_every_vm() {
        let store = MemStore::new();
        assert_eq!(blind_news(&store, false), None);
        assert_eq!(blind_news(&store, true), Some(true));
        // Another VM took the lease: the process has said it already.
        assert_eq!(blind_news(&store, true), None);
        assert_eq!(blind_news(&store, false), Some(false));
        assert_eq!(blind_news(&store, false), None);
        assert_eq!(blind_news(&store, true), Some(true));
    }
}
