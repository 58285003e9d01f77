//! Session affinity that survives a hop between gateway instances: a
//! response carries the replica that served it in a token the client
//! can't forge (HMAC-SHA256 with a key every instance is configured with),
//! and any instance honours it on the next turn while that replica is
//! eligible and not overloaded. Forged, expired or foreign tokens are
//! refused (and counted by the caller), never followed.
//!
//! Token (in a header the client echoes on purpose): 56 lowercase hex
//! characters: the replica id (8 bytes), the issue time in seconds (4
//! bytes), then the first 16 bytes of
//! HMAC-SHA256(key, "prefix-router/affinity/v1" | id | time). The cookie
//! (`cookie`), for clients that keep cookies instead, remembers several
//! sessions, each by its last prompt.

pub mod cookie;
pub mod response;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

use crate::endpoint::ReplicaId;

const DOMAIN: &[u8] = b"prefix-router/affinity/v1";
const MAC_BYTES: usize = 16;
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

/// `payload` followed by its first `MAC_BYTES` of MAC, in lowercase hex.
fn seal(key: &[u8], domain: &[u8], payload: &[u8]) -> String {
    let mut tag = [0u8; MAC_BYTES];
    if let Some(m) = mac(key, domain, payload) {
        tag.copy_from_slice(&m.finalize().into_bytes()[..MAC_BYTES]);
    }
    // One string, not one per byte: a cookie holds up to 1,552 bytes.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * (payload.len() + tag.len()));
    for &b in payload.iter().chain(&tag) {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
    out
}

/// The payload of a sealed value, if its MAC verifies.
fn open(key: &[u8], domain: &[u8], raw: &[u8]) -> Result<Vec<u8>, AffinityError> {
    let (payload, tag) = raw
        .split_at_checked(raw.len().wrapping_sub(MAC_BYTES))
        .ok_or(AffinityError::Malformed)?;
    let m = mac(key, domain, payload).ok_or(AffinityError::Forged)?;
    m.verify_truncated_left(tag)
        .map_err(|_| AffinityError::Forged)?;
    Ok(payload.to_vec())
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
