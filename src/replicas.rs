//! The replica table: what the scraper learned about each replica (load
//! from its metrics page, scrape health), shared with every worker, and the
//! lease that makes exactly one VM the scraper at a time.
//!
//! One shared-data key holds the whole table (one writer at a time: the
//! lease holder), so a decision reads it with a single host call.

use crate::endpoint::ReplicaId;
use crate::metrics::ReplicaMetrics;
use crate::store::{update, Reader, Store, StoreError};

const TABLE_KEY: &str = "prefix-router/replicas";
const LEASE_KEY: &str = "prefix-router/scrape-lease";
const VERSION: u8 = 1;
/// Bounds on what a record may carry (and a decoder will accept).
pub const MAX_ROWS: usize = 4096;
pub const MAX_ADAPTERS: usize = 16;
pub const MAX_ADAPTER_BYTES: usize = 128;

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
}

impl Row {
    pub fn healthy(&self, p: &HealthPolicy, now_ms: u64) -> bool {
        self.failures < p.unhealthy_after
            && self.last_ok_ms > 0
            && now_ms.saturating_sub(self.last_ok_ms) <= p.staleness_ms
    }

    fn apply_ok(&mut self, m: &ReplicaMetrics, now_ms: u64) {
        self.last_ok_ms = now_ms.max(1);
        self.failures = 0;
        self.waiting = m.waiting as f32;
        self.running = m.running as f32;
        self.kv_usage = m.kv_usage.clamp(0.0, 1.0) as f32;
        self.max_lora = m.max_lora.unwrap_or(0);
        self.running_lora = bounded(&m.running_lora);
        self.waiting_lora = bounded(&m.waiting_lora);
    }
}

fn bounded(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !n.is_empty() && n.len() <= MAX_ADAPTER_BYTES)
        .take(MAX_ADAPTERS)
        .cloned()
        .collect()
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    pub rows: Vec<Row>,
}

impl Table {
    pub fn row(&self, id: ReplicaId) -> Option<&Row> {
        self.rows.iter().find(|r| r.id == id)
    }

    fn row_mut(&mut self, id: ReplicaId) -> &mut Row {
        if let Some(i) = self.rows.iter().position(|r| r.id == id) {
            return &mut self.rows[i];
        }
        self.rows.push(Row {
            id,
            ..Row::default()
        });
        let last = self.rows.len() - 1;
        &mut self.rows[last]
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

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.rows.len() * 64);
        out.push(VERSION);
        put_u32(&mut out, self.rows.len() as u32);
        for r in &self.rows {
            out.extend_from_slice(&r.id.to_le_bytes());
            out.extend_from_slice(&r.last_ok_ms.to_le_bytes());
            put_u32(&mut out, r.failures);
            for f in [r.waiting, r.running, r.kv_usage] {
                out.extend_from_slice(&f.to_le_bytes());
            }
            put_u32(&mut out, r.max_lora);
            for list in [&r.running_lora, &r.waiting_lora] {
                out.push(list.len() as u8);
                for name in list {
                    out.push(name.len() as u8);
                    out.extend_from_slice(name.as_bytes());
                }
            }
        }
        out
    }

    /// A corrupt or truncated table reads as empty (everyone unknown, so
    /// eligible): it is never trusted, and the next scrape rewrites it.
    pub fn decode(buf: &[u8]) -> Table {
        decode_rows(&mut Reader::new(buf))
            .map(|rows| Table { rows })
            .unwrap_or_default()
    }

    pub fn load<S: Store + ?Sized>(store: &S) -> Table {
        store
            .get(TABLE_KEY)
            .0
            .map(|b| Table::decode(&b))
            .unwrap_or_default()
    }
}

/// Fuzzing support: see `index::check_codec`.
#[doc(hidden)]
pub fn check_codec(buf: &[u8]) {
    let t = Table::decode(buf);
    assert!(t.rows.len() <= MAX_ROWS);
    assert_eq!(Table::decode(&t.encode()), t);
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn decode_rows(r: &mut Reader) -> Option<Vec<Row>> {
    if r.u8()? != VERSION {
        return None;
    }
    let n = r.u32()? as usize;
    if n > MAX_ROWS {
        return None;
    }
    let mut rows = Vec::with_capacity(n);
    for _ in 0..n {
        let id = r.u64()?;
        let last_ok_ms = r.u64()?;
        let failures = r.u32()?;
        let waiting = f32::from_bits(r.u32()?);
        let running = f32::from_bits(r.u32()?);
        let kv_usage = f32::from_bits(r.u32()?);
        let max_lora = r.u32()?;
        let running_lora = names(r)?;
        let waiting_lora = names(r)?;
        if !(waiting.is_finite() && running.is_finite() && kv_usage.is_finite()) {
            return None;
        }
        rows.push(Row {
            id,
            last_ok_ms,
            failures,
            waiting,
            running,
            kv_usage,
            max_lora,
            running_lora,
            waiting_lora,
        });
    }
    r.is_empty().then_some(rows)
}

fn names(r: &mut Reader) -> Option<Vec<String>> {
    let n = r.u8()? as usize;
    if n > MAX_ADAPTERS {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u8()? as usize;
        out.push(String::from_utf8(r.take(len)?.to_vec()).ok()?);
    }
    Some(out)
}

/// Record a scrape outcome for `id` (`Ok` metrics or a failure) in the
/// shared table, keeping only rows for `known` replicas so the table can't
/// grow past the pool.
pub fn record_scrape<S: Store + ?Sized>(
    store: &S,
    id: ReplicaId,
    outcome: Result<&ReplicaMetrics, ()>,
    known: &[ReplicaId],
    now_ms: u64,
) -> Result<u32, StoreError> {
    update(store, TABLE_KEY, 8, |old| {
        let mut t = old.map(Table::decode).unwrap_or_default();
        t.rows.retain(|r| known.contains(&r.id));
        let row = t.row_mut(id);
        match outcome {
            Ok(m) => row.apply_ok(m, now_ms),
            Err(()) => row.failures = row.failures.saturating_add(1),
        }
        Some(t.encode())
    })
}

/// The scraper lease: (owner, expiry). A VM scrapes only while it holds it;
/// if the holder stops renewing (VM gone), another takes over at expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// We hold it (renewed now).
    Held,
    /// We just took it over from another owner whose lease expired.
    TookOver,
    /// Someone else holds a live lease.
    Other,
}

pub fn acquire_lease<S: Store + ?Sized>(store: &S, owner: u64, now_ms: u64, ttl_ms: u64) -> Lease {
    let (value, cas) = store.get(LEASE_KEY);
    let current = value.as_deref().and_then(|b| {
        let mut r = Reader::new(b);
        Some((r.u64()?, r.u64()?))
    });
    let outcome = match current {
        Some((o, _)) if o == owner => Lease::Held,
        Some((_, expiry)) if now_ms < expiry => return Lease::Other,
        Some(_) => Lease::TookOver,
        None => Lease::Held,
    };
    let mut rec = owner.to_le_bytes().to_vec();
    rec.extend_from_slice(&(now_ms + ttl_ms).to_le_bytes());
    match store.set(LEASE_KEY, &rec, Some(cas.unwrap_or(0))) {
        Ok(()) => outcome,
        Err(_) => Lease::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

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
        t.row_mut(5).apply_ok(&metrics(2.0), 9);
        let good = t.encode();
        assert_eq!(Table::decode(&good), t);
        for cut in 0..good.len() {
            assert_eq!(Table::decode(&good[..cut]), Table::default());
        }
        let mut nan = t.clone();
        nan.rows[0].waiting = f32::NAN;
        assert_eq!(Table::decode(&nan.encode()), Table::default());
        assert_eq!(
            Table::decode(&[VERSION, 0xff, 0xff, 0xff, 0xff]),
            Table::default()
        );
    }

    #[test]
    fn lease_one_holder_and_takeover_after_expiry() {
        let s = MemStore::new();
        assert_eq!(acquire_lease(&s, 1, 0, 300), Lease::Held);
        assert_eq!(acquire_lease(&s, 2, 100, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 1, 200, 300), Lease::Held);
        // Holder 1 stops renewing at 200: expiry 500.
        assert_eq!(acquire_lease(&s, 2, 499, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 2, 500, 300), Lease::TookOver);
        assert_eq!(acquire_lease(&s, 1, 510, 300), Lease::Other);
        assert_eq!(acquire_lease(&s, 2, 600, 300), Lease::Held);
    }

    #[test]
    fn two_contenders_racing_for_a_free_lease_get_one_winner() {
        struct Racy<'a>(&'a MemStore);
        impl Store for Racy<'_> {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
                let v = self.0.get(key);
                // The rival writes between our read and our write.
                let mut rec = 7u64.to_le_bytes().to_vec();
                rec.extend_from_slice(&1000u64.to_le_bytes());
                self.0.set(key, &rec, None).unwrap();
                v
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
                self.0.set(key, value, cas)
            }
        }
        let s = MemStore::new();
        s.set(LEASE_KEY, &[0u8; 16], None).unwrap();
        assert_eq!(acquire_lease(&Racy(&s), 1, 10, 300), Lease::Other);
    }
}
