//! In-flight work per replica, counted across all Envoy workers.
//!
//! Each worker VM owns one slot key (`prefix-router/<records>/load/<n>`) and is its
//! only writer, so counting never contends; readers sum the fresh slots.
//! A slot carries a heartbeat: when a VM dies (or is reloaded) its counts
//! stop being fresh and drop out of the sum, so a crashed worker can't leak
//! in-flight counts forever, and its slot is reused by the next VM.

use std::collections::BTreeMap;
use std::collections::HashMap;

use crate::endpoint::ReplicaId;
use crate::store::{self, get_existing, shared_key, update, Store, Writer};

/// 2: placed content; 3: the common record envelope (`store::Writer`);
/// 4: placed branches; 5: blocks sent; 6: branches withdrawn.
pub(crate) const VERSION: u8 = 6;
/// The slot counter's (unversioned before: a bare u32).
pub(crate) const COUNT_VERSION: u8 = 1;
/// Placed-content estimates halve this often: roughly how long a model
/// server keeps an unused prefix before other traffic evicts it.
pub const PLACED_HALF_LIFE_MS: u64 = 60_000;
const SLOTS_KEY: &str = shared_key!("load/slots");
/// Bound on slot keys: more VMs than this share no counts (logged).
pub const MAX_SLOTS: u32 = 256;
/// Bound on the replicas one slot counts: every endpoint of a full pool
/// (static and discovered), and as many again that left it lately.
const MAX_LOADS: usize = crate::config::MAX_ENDPOINTS * 4;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    pub requests: u32,
    /// Estimated outstanding work, in prefix blocks (see `score`).
    pub work: u64,
    /// Prefix blocks recently sent to the replica that it didn't hold
    /// (new content in its cache), decaying with `PLACED_HALF_LIFE_MS`: how
    /// full of other groups' prefixes it is, for placing new ones.
    pub placed: u32,
    /// New prefixes or branches placed on the replica recently, decaying
    /// like `placed`: how many groups, documents or sessions it took on,
    /// whatever their size, each of which brings its followers there.
    pub branches: u32,
    /// Prefix blocks recently sent to the replica, decaying like `placed`:
    /// of these, all but `placed` were blocks the index credited it with,
    /// the share of hits it should measure (`route::evicting`).
    pub sent: u32,
    /// In a slot only: sessions another VM placed on the replica that this
    /// VM saw move on (`LoadBoard::withdraw_branch`), decaying like
    /// `branches`. A snapshot takes them off the sum of `branches` (and
    /// shows 0 here).
    pub withdrawn: u32,
}

/// The index must have expected this many blocks of hits on a replica
/// lately (64 KiB of prompt, about 16k tokens) before the rate it expects
/// there is given: with less, a few cold requests decide.
pub const MIN_EXPECTED_BLOCKS: u32 = 1024;

impl Load {
    /// The share of the blocks sent here lately that the index credited
    /// the replica with, once it expected `MIN_EXPECTED_BLOCKS` of hits:
    /// what its own prefix cache should report hitting.
    pub fn expected_hit_rate(&self) -> Option<f32> {
        let held = self.sent.saturating_sub(self.placed);
        (held >= MIN_EXPECTED_BLOCKS).then(|| held as f32 / self.sent as f32)
    }
}

/// One request as it starts on a replica: what the board counts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Start {
    /// Work in flight until it finishes (see `score`).
    pub work: u64,
    /// Its prompt's blocks, and how many of them the index credited the
    /// replica with: the rest is new content placed there.
    pub blocks: u32,
    pub held: u32,
    /// It placed new content there (a new prefix, or new content below a
    /// shared trunk).
    pub branch: bool,
}

#[derive(Debug, PartialEq, Eq)]
struct Slot {
    owner: u64,
    heartbeat_ms: u64,
    loads: Vec<(ReplicaId, Load)>,
}

fn slot_key(i: u32) -> String {
    format!(concat!(shared_key!("load/"), "{}"), i)
}

fn encode(s: &Slot) -> Vec<u8> {
    let mut w = Writer::new(VERSION, 20 + s.loads.len() * 36);
    w.u64(s.owner).u64(s.heartbeat_ms).count(s.loads.len());
    for (id, l) in &s.loads {
        w.u64(*id)
            .u32(l.requests)
            .u64(l.work)
            .u32(l.placed)
            .u32(l.branches)
            .u32(l.sent)
            .u32(l.withdrawn);
    }
    w.finish()
}

/// Malformed → `None`: a corrupt slot is ignored, never trusted.
fn decode(buf: &[u8]) -> Option<Slot> {
    store::decode(VERSION, buf, |r| {
        let (owner, heartbeat_ms) = (r.u64()?, r.u64()?);
        let n = r.count(MAX_LOADS)?;
        let mut loads = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let (requests, work) = (r.u32()?, r.u64()?);
            let (placed, branches, sent) = (r.u32()?, r.u32()?, r.u32()?);
            let withdrawn = r.u32()?;
            loads.push((
                id,
                Load {
                    requests,
                    work,
                    placed,
                    branches,
                    sent,
                    withdrawn,
                },
            ));
        }
        Some(Slot {
            owner,
            heartbeat_ms,
            loads,
        })
    })
}

/// The slot counter: how many slot keys exist (at most `MAX_SLOTS`).
fn encode_count(n: u32) -> Vec<u8> {
    let mut w = Writer::new(COUNT_VERSION, 4);
    w.u32(n);
    w.finish()
}

/// A missing or unreadable counter reads as 0 (no slots known yet).
fn decode_count(buf: &[u8]) -> u32 {
    store::decode(COUNT_VERSION, buf, |r| r.u32())
        .unwrap_or(0)
        .min(MAX_SLOTS)
}

/// Fuzzing support: see `index::check_codec`.
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub fn check_codec(buf: &[u8]) {
    for record in [buf, &store::seal(VERSION, buf)] {
        if let Some(slot) = decode(record) {
            assert_eq!(decode(&encode(&slot)).as_ref(), Some(&slot));
        }
    }
    for record in [buf, &store::seal(COUNT_VERSION, buf)] {
        let n = decode_count(record);
        assert!(n <= MAX_SLOTS);
        assert_eq!(decode_count(&encode_count(n)), n);
    }
}

/// One VM's view: its own counts (authoritative) and its slot.
pub struct LoadBoard {
    owner: u64,
    slot: Option<u32>,
    local: BTreeMap<ReplicaId, Load>,
    stale_ms: u64,
    last_decay_ms: u64,
}

impl LoadBoard {
    /// `owner` must be unique per VM (random); `stale_ms` is how long a slot
    /// without heartbeat still counts.
    pub fn new(owner: u64, stale_ms: u64) -> Self {
        LoadBoard {
            owner,
            slot: None,
            local: BTreeMap::new(),
            stale_ms,
            last_decay_ms: 0,
        }
    }

    /// This VM's id (unique per VM).
    pub fn owner(&self) -> u64 {
        self.owner
    }

    pub fn local(&self, id: ReplicaId) -> Load {
        self.local.get(&id).copied().unwrap_or_default()
    }

    pub fn slot(&self) -> Option<u32> {
        self.slot
    }

    /// A request starts on `id`.
    pub fn start<S: Store + ?Sized>(&mut self, store: &S, id: ReplicaId, s: Start, now_ms: u64) {
        let l = self.local.entry(id).or_default();
        l.requests = l.requests.saturating_add(1);
        l.work = l.work.saturating_add(s.work);
        l.placed = l.placed.saturating_add(s.blocks.saturating_sub(s.held));
        l.branches = l.branches.saturating_add(u32::from(s.branch));
        l.sent = l.sent.saturating_add(s.blocks);
        self.publish(store, now_ms);
    }

    /// A session placed on `id` moved on (see `route::Choice::home`): it no
    /// longer counts among `id`'s recent placements. Published with the
    /// next `start`.
    ///
    /// Another VM may have placed it there (a client's pooled connections
    /// reach any worker): its count is in that VM's slot, which only that
    /// VM writes. Then this one records the move (`withdrawn`), and the
    /// sum over slots drops by one all the same. Left as a no-op, half the
    /// moves with two workers kept counting at the replica they left, and
    /// the sessions placed after them avoided it (agentic: 3/2/1/2 sessions
    /// on four replicas).
    pub fn withdraw_branch(&mut self, id: ReplicaId) {
        let l = self.local.entry(id).or_default();
        match l.branches.checked_sub(1) {
            Some(n) => l.branches = n,
            None => l.withdrawn = l.withdrawn.saturating_add(1),
        }
    }

    /// Undo a `withdraw_branch` of `id`: the move it recorded didn't
    /// happen (the replica it went to refused the turn). Published with the
    /// next `start` or `finish`.
    pub fn restore_branch(&mut self, id: ReplicaId) {
        let l = self.local.entry(id).or_default();
        match l.withdrawn.checked_sub(1) {
            Some(n) => l.withdrawn = n,
            None => l.branches = l.branches.saturating_add(1),
        }
    }

    /// Take back what `start` counted on `id` for a prompt of `blocks`
    /// (`held` of them credited there): it never ran there (refused, or
    /// served elsewhere). Published with the next `start` or `finish`.
    pub fn unsend(&mut self, id: ReplicaId, blocks: u32, held: u32) {
        if let Some(l) = self.local.get_mut(&id) {
            l.placed = l.placed.saturating_sub(blocks.saturating_sub(held));
            l.sent = l.sent.saturating_sub(blocks);
        }
    }

    pub fn finish<S: Store + ?Sized>(&mut self, store: &S, id: ReplicaId, work: u64, now_ms: u64) {
        if let Some(l) = self.local.get_mut(&id) {
            l.requests = l.requests.saturating_sub(1);
            l.work = l.work.saturating_sub(work);
        }
        self.publish(store, now_ms);
    }

    /// Halve placed content once per half-life; forget idle replicas.
    fn decay(&mut self, now_ms: u64) {
        // After the wall clock steps back (NTP), halving resumes from the
        // new time: counted from the last halving, nothing decayed until
        // the clock was back there, as long as the step.
        if self.last_decay_ms == 0 || now_ms < self.last_decay_ms {
            self.last_decay_ms = now_ms;
        }
        let halvings = now_ms.saturating_sub(self.last_decay_ms) / PLACED_HALF_LIFE_MS;
        if halvings > 0 {
            self.last_decay_ms += halvings * PLACED_HALF_LIFE_MS;
            let halve = |n: u32| n.checked_shr(halvings.min(31) as u32).unwrap_or(0);
            for l in self.local.values_mut() {
                l.placed = halve(l.placed);
                l.branches = halve(l.branches);
                l.sent = halve(l.sent);
                l.withdrawn = halve(l.withdrawn);
            }
        }
        self.local.retain(|_, l| *l != Load::default());
        self.trim();
    }

    /// Keep at most `MAX_LOADS` replicas' counts, every one with work in
    /// flight first: ids of replicas long gone (a discovered pool's pods
    /// replaced in rollouts) stay until their recent counts decay, and a
    /// slot with more than a reader accepts was dropped whole, live
    /// requests included, and looked free to other VMs.
    fn trim(&mut self) {
        let excess = self.local.len().saturating_sub(MAX_LOADS);
        if excess == 0 {
            return;
        }
        let mut idle: Vec<(u64, ReplicaId)> = (self.local.iter())
            .filter(|(_, l)| l.requests == 0 && l.work == 0)
            .map(|(id, l)| (u64::from(l.sent) + u64::from(l.branches), *id))
            .collect();
        idle.sort_unstable();
        for (_, id) in idle.into_iter().take(excess) {
            self.local.remove(&id);
        }
    }

    /// What this VM publishes: at most `MAX_LOADS` entries, which a reader
    /// always accepts. (After `trim` more are left only when every one has
    /// work in flight: more replicas busy with this VM's requests than two
    /// full pools.)
    fn published(&self) -> Vec<(ReplicaId, Load)> {
        (self.local.iter().take(MAX_LOADS))
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// Called on the timer: keeps the slot fresh while the VM lives.
    pub fn heartbeat<S: Store + ?Sized>(&mut self, store: &S, now_ms: u64) {
        if self.slot.is_some() || !self.local.is_empty() {
            self.publish_checked(store, now_ms);
        }
    }

    /// Per-request path: write our counts to our slot with one unconditional
    /// write (we are its only writer). Whether a peer took the slot over is
    /// checked on the timer (`heartbeat` -> `publish_checked`), which
    /// bounds how long a stolen slot can be overwritten to one tick; the
    /// thief notices too (its own checked write finds our id) and moves.
    fn publish<S: Store + ?Sized>(&mut self, store: &S, now_ms: u64) {
        let Some(slot) = self.slot else {
            return self.publish_checked(store, now_ms);
        };
        self.decay(now_ms);
        let record = encode(&Slot {
            owner: self.owner,
            heartbeat_ms: now_ms,
            loads: self.published(),
        });
        let _ = store.set(&slot_key(slot), &record, None);
    }

    /// Write our counts to our slot, claiming one first if needed. If a peer
    /// took our slot (we looked dead), claim another: our local counts are
    /// the truth and move with us.
    fn publish_checked<S: Store + ?Sized>(&mut self, store: &S, now_ms: u64) {
        self.decay(now_ms);
        for _ in 0..2 {
            let Some(slot) = self.slot.or_else(|| self.claim(store, now_ms)) else {
                return;
            };
            self.slot = Some(slot);
            let record = encode(&Slot {
                owner: self.owner,
                heartbeat_ms: now_ms,
                loads: self.published(),
            });
            let mut stolen = false;
            let _ = update(store, &slot_key(slot), 4, |old| {
                stolen = old.and_then(decode).is_some_and(|s| s.owner != self.owner);
                (!stolen).then(|| record.clone())
            });
            if !stolen {
                return;
            }
            log::info!("load slot {slot} was taken over by another VM; claiming a new one");
            self.slot = None;
        }
    }

    /// Take the first slot that is free or whose owner stopped heartbeating;
    /// else append a new one (bounded by `MAX_SLOTS`). Every claim is a
    /// compare-and-swap on a key that exists (see `store::get_existing`):
    /// two VMs starting together can't both take one slot. A create that
    /// lands late can still wipe a fresh claim; its owner sees that on its
    /// next checked write and moves (`publish_checked`).
    fn claim<S: Store + ?Sized>(&self, store: &S, now_ms: u64) -> Option<u32> {
        let known = slot_count(store);
        if let Some(i) = (0..known).find(|&i| self.take(store, i, now_ms)) {
            return Some(i);
        }
        let (value, cas) = existing(store, SLOTS_KEY, &encode_count(0))?;
        let n = value.as_deref().map(decode_count).unwrap_or(0);
        if n >= MAX_SLOTS {
            log::warn!("all {MAX_SLOTS} load slots are live; this VM's load is not shared");
            return None;
        }
        // One try each: on a mismatch a peer got there first, and the
        // next publish scans again (a slot may even be free by then).
        store.set(SLOTS_KEY, &encode_count(n + 1), Some(cas)).ok()?;
        self.take(store, n, now_ms).then_some(n)
    }

    /// Claim slot `i` if it is free (never used, corrupt, or its owner
    /// stopped heartbeating), by compare-and-swap.
    fn take<S: Store + ?Sized>(&self, store: &S, i: u32, now_ms: u64) -> bool {
        let key = slot_key(i);
        let Some((value, cas)) = existing(store, &key, &free_slot()) else {
            return false;
        };
        let free = match value.as_deref().map(decode) {
            None | Some(None) => true,
            Some(Some(s)) => s.owner == 0 || !fresh(s.heartbeat_ms, now_ms, self.stale_ms),
        };
        let mine = encode(&Slot {
            owner: self.owner,
            heartbeat_ms: now_ms,
            loads: Vec::new(),
        });
        free && store.set(&key, &mine, Some(cas)).is_ok()
    }
}

/// A slot nobody holds (owner 0, never heard from): what a first contact
/// creates, so that claims are compare-and-swaps.
fn free_slot() -> Vec<u8> {
    encode(&Slot {
        owner: 0,
        heartbeat_ms: 0,
        loads: Vec::new(),
    })
}

/// `get_existing`, then read the key it created: a slot or the counter
/// may be claimed in the same call, because a claim wiped by a late create
/// is caught by its owner's next checked write.
fn existing<S: Store + ?Sized>(
    store: &S,
    key: &str,
    neutral: &[u8],
) -> Option<(Option<Vec<u8>>, u32)> {
    get_existing(store, key, neutral).or_else(|| match store.get(key) {
        (value, Some(cas)) => Some((value, cas)),
        _ => None,
    })
}

pub fn slot_count<S: Store + ?Sized>(store: &S) -> u32 {
    store
        .get(SLOTS_KEY)
        .0
        .as_deref()
        .map(decode_count)
        .unwrap_or(0)
}

/// Whether a heartbeat at `beat_ms` is within `stale_ms` of now, either
/// way. `now_ms` is Envoy's wall clock: after it steps back (NTP), a dead
/// VM's last heartbeat lies in the future, and read as age 0 it kept the
/// VM's counts, and its slot, for as long as the step.
pub(crate) fn fresh(beat_ms: u64, now_ms: u64, stale_ms: u64) -> bool {
    now_ms.abs_diff(beat_ms) <= stale_ms
}

/// Sum of every fresh slot: the pool's in-flight work right now.
pub fn snapshot<S: Store + ?Sized>(
    store: &S,
    now_ms: u64,
    stale_ms: u64,
) -> HashMap<ReplicaId, Load> {
    let slots = slot_count(store);
    let mut out: HashMap<ReplicaId, Load> = HashMap::new();
    for i in 0..slots.min(MAX_SLOTS) {
        let Some(slot) = store.get(&slot_key(i)).0.as_deref().and_then(decode) else {
            continue;
        };
        if !fresh(slot.heartbeat_ms, now_ms, stale_ms) {
            continue;
        }
        for (id, l) in slot.loads {
            let t = out.entry(id).or_default();
            t.requests = t.requests.saturating_add(l.requests);
            t.work = t.work.saturating_add(l.work);
            t.placed = t.placed.saturating_add(l.placed);
            t.branches = t.branches.saturating_add(l.branches);
            t.sent = t.sent.saturating_add(l.sent);
            t.withdrawn = t.withdrawn.saturating_add(l.withdrawn);
        }
    }
    for t in out.values_mut() {
        t.branches = t.branches.saturating_sub(t.withdrawn);
        t.withdrawn = 0;
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::MemStore;

    /// A request of `new_blocks` the replica didn't hold.
    pub(crate) fn started(work: u64, new_blocks: u32, branch: bool) -> Start {
        Start {
            work,
            blocks: new_blocks,
            held: 0,
            branch,
        }
    }

    #[test]
    fn workers_counts_add_up_and_drain_to_zero() {
        let s = MemStore::new();
        let mut w1 = LoadBoard::new(1, 1000);
        let mut w2 = LoadBoard::new(2, 1000);
        w1.start(&s, 10, started(5, 0, false), 0);
        w2.start(&s, 10, started(7, 0, false), 0);
        w2.start(&s, 20, started(1, 0, false), 0);
        assert_ne!(w1.slot(), w2.slot());
        let snap = snapshot(&s, 1, 1000);
        assert_eq!(
            snap[&10],
            Load {
                requests: 2,
                work: 12,
                ..Load::default()
            }
        );
        assert_eq!(snap[&20].requests, 1);
        w1.finish(&s, 10, 5, 2);
        w2.finish(&s, 10, 7, 2);
        w2.finish(&s, 20, 1, 2);
        assert!(snapshot(&s, 3, 1000).is_empty());
    }

    #[test]
    fn a_dead_workers_counts_expire_and_its_slot_is_reused() {
        let s = MemStore::new();
        let mut dead = LoadBoard::new(1, 1000);
        dead.start(&s, 10, started(5, 0, false), 0);
        assert_eq!(snapshot(&s, 500, 1000)[&10].requests, 1);
        assert!(snapshot(&s, 1500, 1000).is_empty());
        let mut next = LoadBoard::new(2, 1000);
        next.start(&s, 11, started(1, 0, false), 1500);
        assert_eq!(next.slot(), dead.slot());
        assert_eq!(slot_count(&s), 1);
    }

    #[test]
    fn a_vm_whose_slot_was_taken_moves_with_its_counts() {
        let s = MemStore::new();
        let mut slow = LoadBoard::new(1, 1000);
        slow.start(&s, 10, started(5, 0, false), 0);
        // Looked dead at t=2000, so a new VM took slot 0.
        let mut fresh = LoadBoard::new(2, 1000);
        fresh.start(&s, 11, started(1, 0, false), 2000);
        assert_eq!(fresh.slot(), Some(0));
        slow.heartbeat(&s, 2001);
        assert_eq!(slow.slot(), Some(1));
        let snap = snapshot(&s, 2002, 1000);
        assert_eq!(snap[&10].requests, 1);
        assert_eq!(snap[&11].requests, 1);
    }

    #[test]
    fn placed_content_outlives_requests_and_decays() {
        let s = MemStore::new();
        let mut w = LoadBoard::new(1, 1_000_000);
        for (work, branch) in [(5, true), (6, true), (7, false)] {
            w.start(&s, 10, started(work, 64, branch), 1);
            w.finish(&s, 10, work, 2);
        }
        let snap = snapshot(&s, 3, 1_000_000);
        assert_eq!(snap[&10].requests, 0);
        assert_eq!((snap[&10].placed, snap[&10].branches), (192, 2));
        w.heartbeat(&s, 1 + PLACED_HALF_LIFE_MS);
        let later = snapshot(&s, 2 + PLACED_HALF_LIFE_MS, 1_000_000)[&10];
        assert_eq!((later.placed, later.branches), (96, 1));
        w.heartbeat(&s, 1 + 20 * PLACED_HALF_LIFE_MS);
        assert!(snapshot(&s, 2 + 20 * PLACED_HALF_LIFE_MS, 1_000_000).is_empty());
    }

    #[test]
    fn the_expected_hit_rate_is_the_credited_share_of_what_was_sent() {
        let s = MemStore::new();
        let mut w = LoadBoard::new(1, 1_000_000);
        let mut w2 = LoadBoard::new(2, 1_000_000);
        // A cold prompt, then three that the index credited with 90% each.
        let cold = Start {
            blocks: 1000,
            ..Start::default()
        };
        w.start(&s, 10, cold, 1);
        let s90 = Start {
            blocks: 400,
            held: 360,
            ..Start::default()
        };
        w.start(&s, 10, s90, 1);
        w2.start(&s, 10, s90, 1);
        w2.start(&s, 10, s90, 1);
        let l = snapshot(&s, 2, 1_000_000)[&10];
        assert_eq!((l.sent, l.placed), (2200, 1120));
        assert_eq!(l.expected_hit_rate(), Some(1080.0 / 2200.0));
        // Too little expected to compare a measured rate with.
        let short = Load {
            placed: l.sent - (MIN_EXPECTED_BLOCKS - 1),
            ..l
        };
        assert_eq!(short.expected_hit_rate(), None);
        assert_eq!(Load::default().expected_hit_rate(), None);
        // Halved together: the share stays.
        w.heartbeat(&s, 1 + PLACED_HALF_LIFE_MS);
        w2.heartbeat(&s, 1 + PLACED_HALF_LIFE_MS);
        let l = snapshot(&s, 2 + PLACED_HALF_LIFE_MS, 1_000_000)[&10];
        assert_eq!((l.sent, l.placed), (1100, 560));
    }

    #[test]
    fn two_vms_starting_on_an_empty_store_get_different_slots() {
        // Before: both read the absent counter, both wrote 1 unconditionally
        // and both took slot 0, overwriting each other's counts.
        struct Interleaved<'a> {
            inner: &'a MemStore,
            rival: std::cell::RefCell<Option<LoadBoard>>,
        }
        impl Store for Interleaved<'_> {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
                self.inner.get(key)
            }
            fn set(
                &self,
                key: &str,
                value: &[u8],
                cas: Option<u32>,
            ) -> Result<(), crate::store::StoreError> {
                // The rival starts and claims between our read of the
                // empty store and our first write.
                if let Some(mut b) = self.rival.borrow_mut().take() {
                    b.start(self.inner, 20, started(1, 0, false), 0);
                    assert_eq!(b.slot(), Some(0));
                }
                self.inner.set(key, value, cas)
            }
        }
        let s = MemStore::new();
        let racing = Interleaved {
            inner: &s,
            rival: std::cell::RefCell::new(Some(LoadBoard::new(2, 1000))),
        };
        let mut a = LoadBoard::new(1, 1000);
        a.start(&racing, 10, started(1, 0, false), 0);
        a.heartbeat(&s, 1);
        assert_eq!(a.slot(), Some(1));
        // The rival never had to move: its counts were never overwritten.
        let snap = snapshot(&s, 2, 1000);
        assert_eq!((snap[&10].requests, snap[&20].requests), (1, 1));
    }

    #[test]
    fn a_session_moved_through_another_vm_leaves_the_replica_it_left() {
        let s = MemStore::new();
        let mut w1 = LoadBoard::new(1, 1_000_000);
        let mut w2 = LoadBoard::new(2, 1_000_000);
        // w1 placed two sessions on 10; w2 sees one of them move to 20.
        w1.start(&s, 10, started(5, 30, true), 0);
        w1.start(&s, 10, started(5, 30, true), 0);
        w2.withdraw_branch(10);
        w2.start(&s, 20, started(5, 30, true), 0);
        let snap = snapshot(&s, 1, 1_000_000);
        assert_eq!((snap[&10].branches, snap[&20].branches), (1, 1));
        assert_eq!(snap[&10].withdrawn, 0);
        // The other one moves through w1 itself: its own count drops.
        w1.withdraw_branch(10);
        w1.start(&s, 30, started(5, 30, true), 1);
        let snap = snapshot(&s, 2, 1_000_000);
        assert_eq!(snap[&10].branches, 0);
        assert_eq!(w1.local(10).withdrawn, 0);
        // A withdrawal decays like the placements it cancels, and never
        // takes the sum below zero.
        w2.withdraw_branch(10);
        w2.heartbeat(&s, 3);
        assert_eq!(snapshot(&s, 4, 1_000_000)[&10].branches, 0);
        w2.heartbeat(&s, 3 + 2 * PLACED_HALF_LIFE_MS);
        assert_eq!(w2.local(10), Load::default());
    }

    #[test]
    fn finish_without_start_never_underflows() {
        let s = MemStore::new();
        let mut w = LoadBoard::new(1, 1000);
        w.finish(&s, 10, 5, 0);
        assert_eq!(w.local(10), Load::default());
    }

    #[test]
    fn corrupt_slots_are_ignored() {
        let s = MemStore::new();
        s.set(SLOTS_KEY, &encode_count(2), None).unwrap();
        s.set(&slot_key(0), &[VERSION, 1, 2, 3], None).unwrap();
        s.set(&slot_key(1), b"garbage", None).unwrap();
        assert!(snapshot(&s, 0, 1000).is_empty());
        let good = encode(&Slot {
            owner: 1,
            heartbeat_ms: 2,
            loads: vec![(
                3,
                Load {
                    requests: 4,
                    work: 5,
                    placed: 6,
                    branches: 7,
                    sent: 8,
                    withdrawn: 9,
                },
            )],
        });
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_none());
        }
        assert!(decode(&good).is_some());
        // The version-2 slot layout and the bare u32 counter of before
        // read as absent.
        let mut v2 = vec![2];
        v2.extend_from_slice(&good[store::HEADER_BYTES..]);
        assert!(decode(&v2).is_none());
        assert_eq!(decode_count(&3u32.to_le_bytes()), 0);
        assert_eq!(decode_count(&encode_count(3)), 3);
        assert_eq!(decode_count(&encode_count(MAX_SLOTS + 5)), MAX_SLOTS);
    }

    /// A VM dies with a request in flight, then the wall clock steps back
    /// an hour: 10 s later its counts are gone and its slot is free, as
    /// without the step.
    #[test]
    fn a_dead_vms_counts_expire_after_a_clock_step_back() {
        let s = MemStore::new();
        let t0 = 10_000_000;
        let mut dead = LoadBoard::new(1, 2000);
        dead.start(&s, 10, started(500, 0, false), t0);
        let now = t0 - 3_600_000 + 10_000;
        let mut next = LoadBoard::new(2, 2000);
        next.start(&s, 11, started(1, 0, false), now);
        assert_eq!(next.slot(), dead.slot());
        let snap = snapshot(&s, now, 2000);
        assert_eq!(snap.get(&10), None);
        assert_eq!(snap.get(&11).map(|l| l.work), Some(1));
    }

    /// The wall clock steps back an hour: recent placements still decay
    /// with their half-life (before: not at all until the clock was back
    /// where the last halving left it, an hour later, so every placement
    /// of that hour counted as recent).
    #[test]
    fn placements_decay_after_a_clock_step_back() {
        let s = MemStore::new();
        let t0 = 10_000_000;
        let mut w = LoadBoard::new(1, 2000);
        w.start(&s, 10, started(5, 64, true), t0);
        w.finish(&s, 10, 5, t0);
        let back = t0 - 3_600_000;
        let mut now = back;
        while now < back + 20 * PLACED_HALF_LIFE_MS {
            now += 1000;
            w.heartbeat(&s, now);
        }
        assert_eq!(w.local(10), Load::default());
        assert!(snapshot(&s, now, 2000).is_empty());
    }

    /// Replicas come and go (every rollout of a discovered pool brings new
    /// addresses): a slot that has counted more of them than a reader
    /// accepts still reads, with the request in flight in it.
    #[test]
    fn a_slot_that_saw_many_replicas_still_reads() {
        let s = MemStore::new();
        let mut w = LoadBoard::new(1, 1_000_000);
        let n = MAX_LOADS as u64 + 1;
        for id in 0..n {
            w.start(&s, 1000 + id, started(1, 64, true), 1);
            w.finish(&s, 1000 + id, 1, 1);
        }
        w.start(&s, 7, started(100, 0, false), 2);
        let snap = snapshot(&s, 3, 1_000_000);
        assert_eq!(snap.get(&7).map(|l| (l.requests, l.work)), Some((1, 100)));
        assert_eq!(snap.len(), MAX_LOADS);
    }
}
