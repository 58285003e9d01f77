//! Session affinity in a cookie, for clients that keep cookies but were
//! never written to echo a header: an OpenAI SDK client (httpx keeps a
//! cookie jar per client), a browser.
//!
//! One client's jar is often shared by several sessions (one SDK client
//! for many agent runs), so the cookie can't simply name "the" replica: a
//! session would follow whichever session answered last. It holds the
//! last `affinity.cookie_sessions` sessions instead, each as the replica
//! that served it and an anchor: the length in bytes and hash of the
//! prompt it served, all of it (its partial last block too: a short first
//! question after a system prompt many conversations share lies there,
//! and an anchor of whole blocks alone was that system prompt, which
//! every new conversation continued). A request follows the entry
//! whose anchor its own prompt starts with, the deepest if several do:
//! the previous turn of its own conversation, which no other
//! conversation's prompt starts with. The filter hashes the request's
//! prompt at the entries' lengths as it hashes it anyway
//! (`prefix::Hasher::probing`).
//!
//! A shared jar loses entries: two sessions' turns in flight at once each
//! get a cookie made from the jar their request carried, and the client
//! keeps the last. A session loses only its newest entry that way, and
//! its previous turn's still matches; but a session's first entry can be
//! lost whole. So `clients_echo` (new sessions placed by this instance's
//! load, found again only by their token) suits one jar per session; with
//! a shared jar, new sessions are better placed where every instance
//! agrees, and the cookie keeps them from moving.
//!
//! Each entry has its own issue time (its session's last turn), so an
//! idle session's entry expires after `max_age_s` however busy the jar's
//! other sessions keep the cookie.
//!
//! Value: lowercase hex of the entries (replica id 8 bytes, anchor bytes
//! 4, anchor hash 8, issue time 4; newest first), then the first 16 bytes
//! of HMAC-SHA256(key, "prefix-router/affinity-cookie/v1" | the entries):
//! 32 characters, and 48 an entry (1-64 entries: 80-3,104, under the
//! 4 KiB a cookie may hold).

use super::{fresh, open, seal, u32_at, u64_at, unhex, AffinityError, MAC_BYTES};
use crate::endpoint::ReplicaId;
use crate::headers::{self, Pairs};
use crate::prefix::Probe;

const DOMAIN: &[u8] = b"prefix-router/affinity-cookie/v2";
/// Most sessions one cookie can hold (`affinity.cookie_sessions` is at
/// most this): 3,104 characters.
pub const MAX_SESSIONS: usize = 64;
const ENTRY_BYTES: usize = 8 + 4 + 8 + 4;

/// A session in the cookie: the replica that served its last turn, and
/// that turn's prompt (`bytes` long, hashing to `hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub replica: ReplicaId,
    pub bytes: u32,
    pub hash: u64,
    /// When its turn was answered (seconds since the epoch, mod 2^32).
    pub issued: u32,
}

impl Entry {
    /// The same prompt (whatever replica or time).
    fn same_anchor(&self, o: &Entry) -> bool {
        (self.bytes, self.hash) == (o.bytes, o.hash)
    }
}

/// The sessions a client's cookie holds, newest first (at most
/// `MAX_SESSIONS`). A jar shared by more sessions at once than it keeps
/// keeps the latest; the others' turns are routed without it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Jar {
    entries: Vec<Entry>,
}

impl Jar {
    /// The prompt lengths to probe a request's prompt at.
    pub fn probes(&self) -> Vec<u32> {
        self.entries.iter().map(|e| e.bytes).collect()
    }

    /// The replica of the session this prompt continues: the entry whose
    /// anchor a probe of the prompt matches, the deepest if several do.
    pub fn replica_for(&self, probed: &[Probe]) -> Option<ReplicaId> {
        self.continued(probed)
            .max_by_key(|e| e.bytes)
            .map(|e| e.replica)
    }

    /// Drop the entries this prompt continues: its own turn replaces them
    /// (its anchor is deeper), and a conversation keeps one entry.
    pub fn forget_continued(&mut self, probed: &[Probe]) {
        let gone: Vec<Entry> = self.continued(probed).copied().collect();
        self.entries.retain(|e| !gone.contains(e));
    }

    fn continued<'a>(&'a self, probed: &'a [Probe]) -> impl Iterator<Item = &'a Entry> {
        self.entries.iter().filter(|e| {
            probed
                .iter()
                .any(|p| p.bytes == e.bytes && p.hash == e.hash)
        })
    }

    /// This jar with `e` first (in place of an entry for the same
    /// prompt), and at most `keep` entries in all (the oldest go).
    pub fn with(&self, e: Entry, keep: usize) -> Jar {
        let keep = keep.clamp(1, MAX_SESSIONS);
        let mut entries = Vec::with_capacity(keep);
        entries.push(e);
        let rest = self.entries.iter().filter(|o| !o.same_anchor(&e));
        entries.extend(rest.take(keep - 1).copied());
        Jar { entries }
    }

    /// The cookie value.
    pub fn seal(&self, key: &[u8]) -> String {
        let mut payload = Vec::with_capacity(self.entries.len() * ENTRY_BYTES);
        for e in &self.entries {
            payload.extend_from_slice(&e.replica.to_be_bytes());
            payload.extend_from_slice(&e.bytes.to_be_bytes());
            payload.extend_from_slice(&e.hash.to_be_bytes());
            payload.extend_from_slice(&e.issued.to_be_bytes());
        }
        seal(key, DOMAIN, &payload)
    }

    /// The sessions a cookie value holds that are still fresh, if it is
    /// ours (`Expired` when none is). Bounded work on any input: a value
    /// longer than the most entries isn't decoded.
    pub fn open(
        key: &[u8],
        value: &[u8],
        now_s: u64,
        max_age_s: u64,
    ) -> Result<Jar, AffinityError> {
        let least = ENTRY_BYTES + MAC_BYTES;
        let most = MAX_SESSIONS * ENTRY_BYTES + MAC_BYTES;
        let raw = unhex(value.trim_ascii(), least..=most)?;
        if !raw
            .len()
            .saturating_sub(MAC_BYTES)
            .is_multiple_of(ENTRY_BYTES)
        {
            return Err(AffinityError::Malformed);
        }
        let payload = open(key, DOMAIN, &raw)?;
        let entries: Vec<Entry> = payload
            .chunks_exact(ENTRY_BYTES)
            .map(|e| Entry {
                replica: u64_at(&e[..8]),
                bytes: u32_at(&e[8..12]),
                hash: u64_at(&e[12..20]),
                issued: u32_at(&e[20..]),
            })
            .filter(|e| fresh(e.issued, now_s, max_age_s).is_ok())
            .collect();
        if entries.is_empty() {
            return Err(AffinityError::Expired);
        }
        Ok(Jar { entries })
    }
}

/// The value of cookie `name` in the request's `cookie` headers (HTTP/2
/// may send several), if present.
pub fn find<'a>(req: &'a Pairs, name: &str) -> Option<&'a [u8]> {
    cookies(req)
        .find(|(n, _)| *n == name.as_bytes())
        .map(|(_, v)| v)
}

/// The request's cookies without `name`, joined into one `cookie` value
/// (as bytes: another cookie's needn't be UTF-8, and stays as it is);
/// `None` when `name` isn't there.
pub fn without(req: &Pairs, name: &str) -> Option<Vec<u8>> {
    find(req, name)?;
    let kept: Vec<&[u8]> = cookies_raw(req)
        .filter(|pair| split(pair).0 != name.as_bytes())
        .collect();
    Some(kept.join(&b"; "[..]))
}

/// The `set-cookie` value for a sealed jar. `Secure` when the client came
/// over TLS (a cookie marked so is never sent over plain HTTP, so it
/// can't be set for clients that use plain HTTP).
pub fn set_cookie(name: &str, value: &str, max_age_s: u64, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{name}={value}; Max-Age={max_age_s}; Path=/; HttpOnly; SameSite=Lax{secure}")
}

/// Whether the client reached the gateway over TLS.
pub fn over_tls(req: &Pairs) -> bool {
    ["x-forwarded-proto", ":scheme"]
        .iter()
        .any(|h| headers::get(req, h).is_some_and(|v| v.eq_ignore_ascii_case(b"https")))
}

fn cookies_raw(req: &Pairs) -> impl Iterator<Item = &[u8]> {
    req.iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(b"cookie"))
        .flat_map(|(_, v)| v.split(|&b| b == b';'))
        .map(<[u8]>::trim_ascii)
        .filter(|pair| !pair.is_empty())
}

fn cookies(req: &Pairs) -> impl Iterator<Item = (&[u8], &[u8])> {
    cookies_raw(req).map(split)
}

/// `name=value` (a value may be quoted); a pair without `=` is all name.
fn split(pair: &[u8]) -> (&[u8], &[u8]) {
    let (n, v) = match pair.iter().position(|&b| b == b'=') {
        Some(i) => (&pair[..i], &pair[i + 1..]),
        None => (pair, &b""[..]),
    };
    let v = v
        .strip_prefix(b"\"")
        .and_then(|v| v.strip_suffix(b"\""))
        .unwrap_or(v);
    (n.trim_ascii(), v.trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn entry(i: u64) -> Entry {
        Entry {
            replica: 100 + i,
            bytes: 10 * i as u32 + 1,
            hash: 0xabc0 + i,
            issued: 1_000_000,
        }
    }

    fn probe(e: Entry) -> Probe {
        Probe {
            bytes: e.bytes,
            hash: e.hash,
        }
    }

    #[test]
    fn a_jar_round_trips_through_its_cookie_value() {
        let jar = Jar::default().with(entry(1), 8).with(entry(2), 8);
        let v = jar.seal(KEY);
        assert_eq!(v.len(), 2 * (2 * 24 + 16));
        assert_eq!(Jar::open(KEY, v.as_bytes(), 1_000_100, 3600), Ok(jar));
    }

    #[test]
    fn an_idle_sessions_entry_expires_however_busy_the_jar() {
        // Session 1 went quiet at 1,000,000; session 2 kept the cookie
        // in use (each of its turns sets the cookie again).
        let busy = Entry {
            issued: 1_003_000,
            ..entry(2)
        };
        let v = Jar::default().with(entry(1), 8).with(busy, 8).seal(KEY);
        let opened = Jar::open(KEY, v.as_bytes(), 1_003_601, 3600).unwrap();
        assert_eq!(opened, Jar::default().with(busy, 8));
        assert_eq!(
            Jar::open(KEY, v.as_bytes(), 1_006_601, 3600),
            Err(AffinityError::Expired)
        );
        // A turn of the same prompt again (served elsewhere): one entry.
        let moved = Entry {
            replica: 7,
            issued: 1_003_500,
            ..busy
        };
        assert_eq!(opened.with(moved, 8), Jar::default().with(moved, 8));
    }

    #[test]
    fn forged_foreign_expired_and_garbage_values_are_refused() {
        let v = Jar::default().with(entry(1), 8).seal(KEY);
        let mut forged = v.clone().into_bytes();
        forged[20] = if forged[20] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            Jar::open(KEY, &forged, 1_000_000, 3600),
            Err(AffinityError::Forged)
        );
        let foreign = Jar::default()
            .with(entry(1), 8)
            .seal(b"another key, also 32 bytes long!");
        assert_eq!(
            Jar::open(KEY, foreign.as_bytes(), 1_000_000, 3600),
            Err(AffinityError::Forged)
        );
        assert_eq!(
            Jar::open(KEY, v.as_bytes(), 1_003_601, 3600),
            Err(AffinityError::Expired)
        );
        let too_many = "0".repeat(2 * (65 * 24 + 16));
        let ragged = "0".repeat(2 * (24 + 16) + 2);
        let header_token = super::super::mint(KEY, 7, 1_000_000);
        for junk in [
            &b""[..],
            b"zz",
            &v.as_bytes()[..79],
            too_many.as_bytes(),
            ragged.as_bytes(),
            header_token.as_bytes(),
        ] {
            assert_eq!(
                Jar::open(KEY, junk, 1_000_000, 3600),
                Err(AffinityError::Malformed),
                "{}",
                String::from_utf8_lossy(junk)
            );
        }
    }

    #[test]
    fn a_prompt_follows_the_deepest_session_it_continues() {
        let (a, b, c) = (entry(1), entry(2), entry(3));
        let jar = Jar::default().with(a, 8).with(b, 8).with(c, 8);
        assert_eq!(jar.probes(), vec![31, 21, 11]);
        // Continues a and b (b is a's later turn, or a fork of it): b.
        assert_eq!(jar.replica_for(&[probe(a), probe(b)]), Some(b.replica));
        // Same lengths, other content: another conversation.
        let other = Probe {
            bytes: b.bytes,
            hash: 1,
        };
        assert_eq!(jar.replica_for(&[other]), None);
        assert_eq!(jar.replica_for(&[]), None);
        // Its own turn replaces the entries it continues.
        let mut rest = jar.clone();
        rest.forget_continued(&[probe(a), probe(b)]);
        assert_eq!(rest, Jar::default().with(c, 8));
    }

    #[test]
    fn a_jar_keeps_the_newest_sessions() {
        let mut jar = Jar::default();
        for i in 0..20 {
            jar = jar.with(entry(i), 8);
        }
        let want: Vec<u32> = (12..20).rev().map(|i| entry(i).bytes).collect();
        assert_eq!(jar.probes(), want);
        // The same entry again moves to the front, not in twice.
        let again = jar.with(entry(15), 8);
        assert_eq!(again.probes()[0], entry(15).bytes);
        assert_eq!(again.probes().len(), 8);
        // A smaller limit (the operator lowered it) cuts at the next turn;
        // the most a cookie holds opens.
        assert_eq!(jar.with(entry(30), 3).probes().len(), 3);
        let mut full = Jar::default();
        for i in 0..100 {
            full = full.with(entry(i), 1000);
        }
        assert_eq!(full.probes().len(), MAX_SESSIONS);
        let v = full.seal(KEY);
        assert_eq!(v.len(), 3_104);
        assert_eq!(
            Jar::open(KEY, v.as_bytes(), 1_000_000, 60).map(|j| j.probes().len()),
            Ok(64)
        );
    }

    fn req(cookies: &[&str]) -> Pairs {
        let mut p: Pairs = vec![(b":path".to_vec(), b"/v1/chat/completions".to_vec())];
        p.extend(
            cookies
                .iter()
                .map(|c| (b"Cookie".to_vec(), c.as_bytes().to_vec())),
        );
        p
    }

    #[test]
    fn the_cookie_is_found_in_any_cookie_header_and_stripped_alone() {
        let r = req(&["a=1; pr=\"tok\"", "b=2;c"]);
        assert_eq!(find(&r, "pr"), Some(&b"tok"[..]));
        assert_eq!(find(&r, "c"), Some(&b""[..]));
        assert_eq!(find(&r, "p"), None);
        assert_eq!(without(&r, "pr").as_deref(), Some(&b"a=1; b=2; c"[..]));
        assert_eq!(without(&req(&["pr=x"]), "pr").as_deref(), Some(&b""[..]));
        assert_eq!(without(&r, "zz"), None);
        // Another cookie's bytes aren't text: ours goes, it stays as it is.
        let mut odd = req(&["pr=x"]);
        odd.push((b"cookie".to_vec(), vec![b'k', b'=', 0xff]));
        assert_eq!(without(&odd, "pr").as_deref(), Some(&b"k=\xff"[..]));
    }

    #[test]
    fn set_cookie_is_secure_only_over_tls() {
        let tls = req(&[]);
        assert!(!over_tls(&tls));
        let mut tls = tls;
        tls.push((b"x-forwarded-proto".to_vec(), b"HTTPS".to_vec()));
        assert!(over_tls(&tls));
        assert_eq!(
            set_cookie("pr", "ab", 60, false),
            "pr=ab; Max-Age=60; Path=/; HttpOnly; SameSite=Lax"
        );
        assert!(set_cookie("pr", "ab", 60, true).ends_with("; Secure"));
    }
}
