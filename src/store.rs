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

/// Little-endian fixed-width field readers that return `None` on short
/// input, so a truncated record decodes as absent instead of panicking.
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

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn reader_is_total() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u32(), None);
        assert_eq!(r.take(2), Some(&[2u8, 3][..]));
        assert!(r.is_empty());
    }
}
