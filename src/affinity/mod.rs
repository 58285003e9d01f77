//! Session affinity that survives a hop between gateway instances: a
//! response carries the replica that served it in a token the client
//! can't forge (HMAC-SHA256 with a key every instance is configured with),
//! and any instance honours it on the next turn while that replica is
//! eligible and not overloaded. Forged, expired or foreign tokens are
//! refused (and counted by the caller), never followed.
//!
//! Token (in a header the client echoes on purpose): 56 lowercase hex
//! characters: the replica id (8 bytes) and the issue time in seconds (4
//! bytes), encrypted, then the first 16 bytes of
//! HMAC-SHA256(key, "prefix-router/affinity/v2" | id | time). The cookie
//! (`cookie`), for clients that keep cookies instead, remembers several
//! sessions, each by its last prompt.
//!
//! Every sealed value (token, cookie, response id) is encrypted as well as
//! signed (`seal`): a replica id is an unkeyed hash of the replica's
//! `ip:port`, so in the clear it told a client the internal address behind
//! it (a /16 and a few ports tried in well under a second), and a cookie
//! entry's prompt hash let its holder check a guessed prompt.

pub mod cookie;
pub mod response;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

use crate::endpoint::ReplicaId;

const DOMAIN: &[u8] = b"prefix-router/affinity/v2";
const MAC_BYTES: usize = 16;
/// Where the encryption's keystream is derived (`xor_pad`).
const PAD_DOMAIN: &[u8] = b"prefix-router/pad/v1";
const TOKEN_BYTES: usize = 8 + 4 + MAC_BYTES;
/// How far ahead another gateway instance's clock may be (see `verify`).
const MAX_CLOCK_SKEW_S: i64 = 60;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AffinityError {
    #[error("affinity token is not the right number of hex characters")]
    Malformed,
    #[error("affinity token's MAC does not verify (forged, or another key)")]
    Forged,
    #[error("affinity token is older than its maximum age")]
    Expired,
}

fn mac(key: &[u8], domain: &[u8], payload: &[u8]) -> Option<Hmac<Sha256>> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).ok()?;
    m.update(domain);
    m.update(payload);
    Some(m)
}

/// `payload`, encrypted, followed by the first `MAC_BYTES` of its MAC, in
/// lowercase hex. The MAC is over the plain payload and doubles as the
/// nonce of the encryption (as in SIV): the same payload seals alike, and
/// a payload differs whenever what it says does (each holds an issue time).
fn seal(key: &[u8], domain: &[u8], payload: &[u8]) -> String {
    let mut tag = [0u8; MAC_BYTES];
    if let Some(m) = mac(key, domain, payload) {
        tag.copy_from_slice(&m.finalize().into_bytes()[..MAC_BYTES]);
    }
    let mut sealed = payload.to_vec();
    xor_pad(key, domain, &tag, &mut sealed);
    sealed.extend_from_slice(&tag);
    hex(&sealed)
}

/// The payload of a sealed value, if its MAC verifies.
fn open(key: &[u8], domain: &[u8], raw: &[u8]) -> Result<Vec<u8>, AffinityError> {
    let (sealed, tag) = raw
        .split_at_checked(raw.len().wrapping_sub(MAC_BYTES))
        .ok_or(AffinityError::Malformed)?;
    let mut payload = sealed.to_vec();
    xor_pad(key, domain, tag, &mut payload);
    verified(key, domain, payload, tag)
}

/// `payload` if `tag` is its MAC.
fn verified(
    key: &[u8],
    domain: &[u8],
    payload: Vec<u8>,
    tag: &[u8],
) -> Result<Vec<u8>, AffinityError> {
    let m = mac(key, domain, &payload).ok_or(AffinityError::Forged)?;
    m.verify_truncated_left(tag)
        .map_err(|_| AffinityError::Forged)?;
    Ok(payload)
}

/// XOR `buf` with a keystream only the key's holders compute: HMAC-SHA256
/// in counter mode under a key derived from (key, domain, tag). sha2 and
/// hmac are here for the MAC already; a cookie of 16 sessions takes 13
/// blocks.
fn xor_pad(key: &[u8], domain: &[u8], tag: &[u8], buf: &mut [u8]) {
    let Ok(mut derive) = Hmac::<Sha256>::new_from_slice(key) else {
        return;
    };
    derive.update(PAD_DOMAIN);
    derive.update(domain);
    derive.update(tag);
    let Ok(stream) = Hmac::<Sha256>::new_from_slice(&derive.finalize().into_bytes()) else {
        return;
    };
    for (i, chunk) in buf.chunks_mut(32).enumerate() {
        let mut block = stream.clone();
        block.update(&(i as u32).to_be_bytes());
        let pad = block.finalize().into_bytes();
        chunk.iter_mut().zip(pad.iter()).for_each(|(b, p)| *b ^= p);
    }
}

/// Lowercase hex, as one string (a cookie holds up to 1,552 bytes).
fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
    out
}

/// Whether a token issued at `issued` (seconds, u32) is still good at
/// `now_s`.
fn fresh(issued: u32, now_s: u64, max_age_s: u64) -> Result<(), AffinityError> {
    // Issue times wrap with u32 seconds (in 2106): compare modulo 2^32,
    // as a signed age. Gateway pods' clocks differ a little: a token from
    // an instance a second ahead read as 2^32 - 1 seconds old, so a session
    // hopping instances lost its replica. Up to `MAX_CLOCK_SKEW_S` of
    // negative age is accepted, and counts as zero.
    let age = i64::from((now_s as u32).wrapping_sub(issued) as i32);
    if age < -MAX_CLOCK_SKEW_S || age.max(0) as u64 > max_age_s {
        return Err(AffinityError::Expired);
    }
    Ok(())
}

/// The token for `replica`, issued at `now_s` (seconds since the epoch).
pub fn mint(key: &[u8], replica: ReplicaId, now_s: u64) -> String {
    let mut payload = [0u8; TOKEN_BYTES - MAC_BYTES];
    payload[..8].copy_from_slice(&replica.to_be_bytes());
    payload[8..].copy_from_slice(&(now_s as u32).to_be_bytes());
    seal(key, DOMAIN, &payload)
}

/// The replica a token names, if it is ours and fresh. Bounded work on any
/// input: only a value of exactly the token's length is decoded.
pub fn verify(
    key: &[u8],
    token: &[u8],
    now_s: u64,
    max_age_s: u64,
) -> Result<ReplicaId, AffinityError> {
    let raw = unhex(token.trim_ascii(), TOKEN_BYTES..=TOKEN_BYTES)?;
    let payload = open(key, DOMAIN, &raw)?;
    let (id, t) = payload.split_at(8);
    fresh(u32_at(t), now_s, max_age_s)?;
    Ok(u64_at(id))
}

fn u64_at(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.iter_mut().zip(b).for_each(|(o, i)| *o = *i);
    u64::from_be_bytes(a)
}

fn u32_at(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.iter_mut().zip(b).for_each(|(o, i)| *o = *i);
    u32::from_be_bytes(a)
}

/// The bytes of a hex string whose decoded length is in `len` (checked
/// before anything is decoded).
fn unhex(s: &[u8], len: std::ops::RangeInclusive<usize>) -> Result<Vec<u8>, AffinityError> {
    if !s.len().is_multiple_of(2) || !len.contains(&(s.len() / 2)) {
        return Err(AffinityError::Malformed);
    }
    s.chunks_exact(2)
        .map(|pair| {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            Some((hi * 16 + lo) as u8)
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or(AffinityError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn a_token_names_its_replica_for_any_instance_with_the_key() {
        let t = mint(KEY, 0xdead_beef_0000_0001, 1_000_000);
        assert_eq!(t.len(), 56);
        assert_eq!(
            verify(KEY, t.as_bytes(), 1_000_100, 3600),
            Ok(0xdead_beef_0000_0001)
        );
    }

    /// A replica id is an unkeyed xxh3 of the replica's `ip:port`: in the
    /// clear, a token told a client the internal address behind it (a /16
    /// and a few ports guessed in well under a second). Nor does any part
    /// of the value repeat between two tokens for the same replica.
    #[test]
    fn a_token_does_not_disclose_its_replicas_address() {
        let addr = "10.0.0.37:8000";
        let id = crate::endpoint::replica_id(addr);
        let t = mint(KEY, id, 1_000_000);
        let found = (0..=255)
            .map(|i| format!("10.0.0.{i}:8000"))
            .find(|g| t.contains(&format!("{:016x}", crate::endpoint::replica_id(g))));
        assert_eq!(found, None, "the token names its replica's address");
        let later = mint(KEY, id, 1_000_001);
        assert_ne!(t[..16], later[..16], "the same replica, the same bytes");
        assert_eq!(verify(KEY, t.as_bytes(), 1_000_001, 60), Ok(id));
    }

    #[test]
    fn forged_foreign_expired_and_garbage_tokens_are_refused() {
        let t = mint(KEY, 7, 1_000_000);
        // Another replica id with the old MAC.
        let mut forged = t.clone().into_bytes();
        forged[15] = if forged[15] == b'7' { b'8' } else { b'7' };
        assert_eq!(
            verify(KEY, &forged, 1_000_000, 3600),
            Err(AffinityError::Forged)
        );
        // A token from a gateway with another key.
        let foreign = mint(b"another key, also 32 bytes long!", 7, 1_000_000);
        assert_eq!(
            verify(KEY, foreign.as_bytes(), 1_000_000, 3600),
            Err(AffinityError::Forged)
        );
        assert_eq!(
            verify(KEY, t.as_bytes(), 1_003_601, 3600),
            Err(AffinityError::Expired)
        );
        // Minted by an instance whose clock is ahead: a little is skew,
        // more is no token this instance could have been sent.
        assert_eq!(verify(KEY, t.as_bytes(), 999_999, 3600), Ok(7));
        assert_eq!(verify(KEY, t.as_bytes(), 999_940, 3600), Ok(7));
        assert_eq!(
            verify(KEY, t.as_bytes(), 999_939, 3600),
            Err(AffinityError::Expired)
        );
        for junk in [&b""[..], b"zz", &[0xff; 56], &t.as_bytes()[..55], b"0x1234"] {
            assert_eq!(
                verify(KEY, junk, 1_000_000, 3600),
                Err(AffinityError::Malformed)
            );
        }
    }
}
