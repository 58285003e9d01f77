//! The cross-worker key/value store (proxy-wasm shared data) as a trait, so
//! the index and load logic test natively against `MemStore`.
//!
//! Semantics follow Envoy's shared data: every value carries a CAS token; a
//! write with `Some(cas)` fails with `CasMismatch` if another writer got
//! there first; keys can't be listed and, in practice, not deleted, so every
//! user of the store keeps its key space bounded.

use std::cell::RefCell;
use std::collections::HashMap;

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    #[error("shared data host call failed: {0}")]
    Host(String),
}

pub trait Store {
    /// `(value, cas)`; `(None, None)` when the key was never written.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Write `value`; with `cas: Some(c)` only if the stored token is `c`.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// An in-memory store with Envoy's CAS semantics, for tests and benches.
#[derive(Default)]
pub struct MemStore {
    inner: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: RefCell<u32>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.inner.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every key written, for tests of the key space.
    pub fn keys(&self) -> Vec<String> {
        self.inner.borrow().keys().cloned().collect()
    }

    pub fn bytes(&self) -> usize {
        self.inner
            .borrow()
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

impl Store for MemStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.inner.borrow().get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.inner.borrow_mut();
        if let (Some(want), Some((_, have))) = (cas, map.get(key)) {
            if want != 0 && want != *have {
                return Err(StoreError::CasMismatch);
            }
        }
        let mut n = self.next_cas.borrow_mut();
        *n = n.wrapping_add(1).max(1);
        map.insert(key.to_string(), (value.to_vec(), *n));
        Ok(())
    }
}

/// One pool's view of the store: every key under the pool's scope
/// (`Config::scope`). Envoy keys shared data by `vm_id` alone, and every
/// shipped config uses one: two filter configs in one Envoy (two listeners,
/// two models) shared one discovered pool, one replica table and one
/// scraper lease, so one pool's requests were sent to the other's hosts
/// and only one pool was scraped.
pub struct Scoped<'a, S: ?Sized> {
    inner: &'a S,
    scope: &'a str,
}

impl<'a, S: Store + ?Sized> Scoped<'a, S> {
    pub fn new(inner: &'a S, scope: &'a str) -> Self {
        Scoped { inner, scope }
    }

    fn key(&self, key: &str) -> String {
        [self.scope, key].concat()
    }
}

impl<S: Store + ?Sized> Store for Scoped<'_, S> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.inner.get(&self.key(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.inner.set(&self.key(key), value, cas)
    }
}

/// A shared-data key: `prefix-router/<records>/<name>`, where `<records>`
/// names the version of every record this build writes (index, load
/// slots, slot counter, replica table, scraper lease, discovered pool).
///
/// Envoy keys shared data by `vm_id` alone, and every shipped config uses
/// one (`prefix-router`), so during a rollout the draining release's VMs
/// and the new one's share a map. A record of another version reads as
/// absent, which is safe for one read but not for a rollout: the old VMs
/// kept renewing the scraper lease and rewriting the replica table in
/// their format, and the new ones, reading no table, found no discovered
/// replica eligible and answered 503 until the old ones went. Releases
/// whose records differ now use disjoint keys (each has its own lease,
/// table and index; the old keys stay, bounded, until Envoy restarts);
/// releases with the same records share them, warm index included.
/// `store::tests::the_key_space_names_every_record_version` fails when a
/// version changes and this doesn't.
macro_rules! shared_key {
    ($name:literal) => {
        concat!("prefix-router/i3l6c1r4s2d1/", $name)
    };
}
pub(crate) use shared_key;

/// Read-modify-write with bounded CAS retries. `f` returns the new value,
/// or `None` to leave the key as it is. Returns the number of retries used,
/// or the last error when they ran out (the caller degrades, never blocks).
pub fn update<S: Store + ?Sized>(
    store: &S,
    key: &str,
    max_retries: u32,
    mut f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
) -> Result<u32, StoreError> {
    let mut retries = 0;
    loop {
        let (value, cas) = store.get(key);
        let Some(new) = f(value.as_deref()) else {
            return Ok(retries);
        };
        // A missing key has no token; writing with cas 0 is unconditional in
        // Envoy, so a racing first write is possible but harmless here: all
        // records tolerate being overwritten by a peer's fresher view.
        match store.set(key, &new, Some(cas.unwrap_or(0))) {
            Ok(()) => return Ok(retries),
            Err(StoreError::CasMismatch) if retries < max_retries => retries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Read a key that contenders claim by compare-and-swap, creating it with
/// `neutral` (a value every contender reads as "free") when it is absent.
///
/// Envoy's shared data has no compare-and-swap on an absent key: every
/// write to one succeeds, so a first write can't pick one winner. So the
/// key is created first and claimed by CAS from there, on a later call:
/// `None` means "absent until now; created, try again". A creator never
/// claims in the same call, so a create that lands late (after a peer's
/// claim) can only wipe that claim, which its owner notices when it next
/// renews; it can never make two owners.
pub fn get_existing<S: Store + ?Sized>(
    store: &S,
    key: &str,
    neutral: &[u8],
) -> Option<(Option<Vec<u8>>, u32)> {
    match store.get(key) {
        (value, Some(cas)) => Some((value, cas)),
        (_, None) => {
            let _ = store.set(key, neutral, None);
            None
        }
    }
}

/// Every shared-data record is `[version u8][payload length u32][payload]`,
/// the payload written by `Writer` and read by `Reader`: little-endian
/// fixed-width fields, and byte strings framed like the payload itself.
///
/// A record of another version (an old format; a release with other
/// records no longer shares keys, see `shared_key`), a truncated one or
/// one with trailing bytes opens as `None`: every reader takes that as
/// "absent", never as data.
pub const HEADER_BYTES: usize = 5;

/// Builds one record: `new(version)`, the fields, then `finish`.
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new(version: u8, capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(HEADER_BYTES + capacity);
        buf.extend_from_slice(&[version, 0, 0, 0, 0]);
        Writer { buf }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.u32(v.to_bits())
    }

    /// A count the caller has bounded (`Reader::count` checks the bound).
    pub fn count(&mut self, n: usize) -> &mut Self {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// What `f` writes, behind its length: `Reader::bytes` takes it whole,
    /// so a frame whose content doesn't parse costs only itself.
    pub fn framed(&mut self, f: impl FnOnce(&mut Writer)) -> &mut Self {
        let at = self.buf.len();
        self.u32(0);
        f(self);
        self.close(at);
        self
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        self.framed(|w| w.buf.extend_from_slice(s.as_bytes()))
    }

    /// The sealed record.
    pub fn finish(mut self) -> Vec<u8> {
        self.close(1);
        self.buf
    }

    /// Fill in the length of the frame whose u32 length is at `at`.
    fn close(&mut self, at: usize) {
        let n = u32::try_from(self.buf.len() - at - 4).unwrap_or(u32::MAX);
        if let Some(len) = self.buf.get_mut(at..at + 4) {
            len.copy_from_slice(&n.to_le_bytes());
        }
    }
}

/// `payload` as a record of `version` (records are built with `Writer`;
/// this is for tests and fuzzing).
pub fn seal(version: u8, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer::new(version, payload.len());
    w.buf.extend_from_slice(payload);
    w.finish()
}

/// The payload of a record of `version`, if the record is one.
pub fn open(version: u8, record: &[u8]) -> Option<&[u8]> {
    let mut r = Reader::new(record);
    if r.u8()? != version {
        return None;
    }
    let payload = r.bytes()?;
    r.is_empty().then_some(payload)
}

/// Open a record of `version` and parse its payload with `f`, which must
/// consume it exactly; anything else is `None`.
pub fn decode<'a, T>(
    version: u8,
    record: &'a [u8],
    f: impl FnOnce(&mut Reader<'a>) -> Option<T>,
) -> Option<T> {
    let mut r = Reader::new(open(version, record)?);
    let value = f(&mut r)?;
    r.is_empty().then_some(value)
}

/// Reads `Writer`'s fields back; every read is `None` on short input, so a
/// truncated record decodes as absent instead of panicking.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    }

    pub fn f32(&mut self) -> Option<f32> {
        self.u32().map(f32::from_bits)
    }

    /// A `Writer::count`, if it is at most `max` (so a corrupt count can't
    /// make a reader allocate or loop far).
    pub fn count(&mut self, max: usize) -> Option<usize> {
        usize::try_from(self.u32()?).ok().filter(|&n| n <= max)
    }

    /// A `Writer::framed` frame, whole.
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u32()?).ok()?;
        self.take(n)
    }

    pub fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_keep_pools_apart() {
        let s = MemStore::new();
        let (a, b) = (Scoped::new(&s, "a/"), Scoped::new(&s, "b/"));
        a.set("k", b"one", None).unwrap();
        b.set("k", b"two", None).unwrap();
        assert_eq!(a.get("k").0.as_deref(), Some(&b"one"[..]));
        assert_eq!(b.get("k").0.as_deref(), Some(&b"two"[..]));
        assert_eq!(s.get("k"), (None, None));
        let mut keys = s.keys();
        keys.sort();
        assert_eq!(keys, ["a/k", "b/k"]);
        // Compare-and-swap works through a scope as on the store.
        let (_, cas) = a.get("k");
        assert_eq!(
            a.set("k", b"x", cas.map(|c| c + 1)),
            Err(StoreError::CasMismatch)
        );
        assert_eq!(a.set("k", b"x", cas), Ok(()));
    }

    #[test]
    fn the_key_space_names_every_record_version() {
        // A release that changes a record must not share keys with one
        // that doesn't (see `shared_key`): bump the name with the version.
        let records = format!(
            "i{}l{}c{}r{}s{}d{}",
            crate::index::VERSION,
            crate::load::VERSION,
            crate::load::COUNT_VERSION,
            crate::replicas::VERSION,
            crate::replicas::LEASE_VERSION,
            crate::discovery::VERSION,
        );
        assert_eq!(shared_key!(""), format!("prefix-router/{records}/"));
    }

    #[test]
    fn cas_mismatch_when_a_peer_wrote_first() {
        let s = MemStore::new();
        s.set("k", b"a", None).unwrap();
        let (_, cas) = s.get("k");
        s.set("k", b"b", cas).unwrap();
        assert_eq!(s.set("k", b"c", cas), Err(StoreError::CasMismatch));
        assert_eq!(s.get("k").0.as_deref(), Some(&b"b"[..]));
    }

    #[test]
    fn update_retries_then_gives_up() {
        let s = MemStore::new();
        s.set("k", &[0], None).unwrap();
        // A "peer" writes between our read and our write, every time.
        let mut calls = 0;
        let r = update(&s, "k", 3, |_| {
            calls += 1;
            s.set("k", &[9], None).unwrap();
            Some(vec![1])
        });
        assert_eq!(r, Err(StoreError::CasMismatch));
        assert_eq!(calls, 4);
        let r = update(&s, "k", 3, |v| Some(vec![v.unwrap()[0] + 1]));
        assert_eq!(r, Ok(0));
        assert_eq!(s.get("k").0.unwrap(), vec![10]);
    }

    #[test]
    fn records_round_trip_and_anything_else_opens_as_none() {
        let mut w = Writer::new(3, 0);
        w.u8(1).u32(2).u64(3).f32(4.5).count(6).str("seven");
        w.framed(|w| {
            w.u8(8);
        });
        let rec = w.finish();
        let read = |rec: &[u8]| {
            decode(3, rec, |r| {
                Some((
                    r.u8()?,
                    r.u32()?,
                    r.u64()?,
                    r.f32()?,
                    r.count(6)?,
                    r.str()?.to_string(),
                    r.bytes()?.to_vec(),
                ))
            })
        };
        let want = (1, 2, 3, 4.5, 6, "seven".to_string(), vec![8]);
        assert_eq!(read(&rec), Some(want));
        assert_eq!(open(3, &rec), Some(&rec[HEADER_BYTES..]));
        for cut in 0..rec.len() {
            assert_eq!(read(&rec[..cut]), None, "truncated at {cut}");
        }
        let mut longer = rec.clone();
        longer.push(0);
        assert_eq!(read(&longer), None);
        assert_eq!(
            read(&seal(3, &longer[HEADER_BYTES..])),
            None,
            "unread bytes"
        );
        assert!(open(2, &rec).is_none() && open(4, &rec).is_none());
        // A count above the reader's bound is refused.
        let mut w = Writer::new(1, 4);
        w.count(7);
        let rec = w.finish();
        assert_eq!(decode(1, &rec, |r| r.count(7)), Some(7));
        assert_eq!(decode(1, &rec, |r| r.count(6)), None);
        assert_eq!(seal(9, &[]), vec![9, 0, 0, 0, 0]);
    }

    #[test]
    fn reader_is_total() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u32(), None);
        assert_eq!(r.take(2), Some(&[2u8, 3][..]));
        assert!(r.is_empty());
    }
}
