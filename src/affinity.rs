//! Session affinity that survives a hop between gateway instances: a
//! response carries the replica that served it in a token the client
//! can't forge (HMAC-SHA256 with a key every instance is configured with),
//! and any instance honours it on the next turn while that replica is
//! eligible and not overloaded. Forged, expired or foreign tokens are
//! refused (and counted by the caller), never followed.
//!
//! Token: 56 lowercase hex characters: the replica id (8 bytes), the
//! issue time in seconds (4 bytes), then the first 16 bytes of
//! HMAC-SHA256(key, "prefix-router/affinity/v1" | id | time).

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
    #[error("affinity token is not {0} hex characters", TOKEN_BYTES * 2)]
    Malformed,
    #[error("affinity token's MAC does not verify (forged, or another key)")]
    Forged,
    #[error("affinity token is older than its maximum age")]
    Expired,
}

fn mac(key: &[u8], payload: &[u8]) -> Option<Hmac<Sha256>> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).ok()?;
    m.update(DOMAIN);
    m.update(payload);
    Some(m)
}

/// The token for `replica`, issued at `now_s` (seconds since the epoch).
pub fn mint(key: &[u8], replica: ReplicaId, now_s: u64) -> String {
    let mut raw = [0u8; TOKEN_BYTES];
    raw[..8].copy_from_slice(&replica.to_be_bytes());
    raw[8..12].copy_from_slice(&(now_s as u32).to_be_bytes());
    if let Some(m) = mac(key, &raw[..12]) {
        let tag = m.finalize().into_bytes();
        raw[12..].copy_from_slice(&tag[..MAC_BYTES]);
    }
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

/// The replica a token names, if it is ours and fresh. Bounded work on any
/// input: only a value of exactly the token's length is decoded.
pub fn verify(
    key: &[u8],
    token: &[u8],
    now_s: u64,
    max_age_s: u64,
) -> Result<ReplicaId, AffinityError> {
    let raw = unhex(token.trim_ascii()).ok_or(AffinityError::Malformed)?;
    let m = mac(key, &raw[..12]).ok_or(AffinityError::Forged)?;
    m.verify_truncated_left(&raw[12..])
        .map_err(|_| AffinityError::Forged)?;
    let mut id = [0u8; 8];
    id.copy_from_slice(&raw[..8]);
    let mut t = [0u8; 4];
    t.copy_from_slice(&raw[8..12]);
    // Issue times wrap with u32 seconds (in 2106): compare modulo 2^32,
    // as a signed age. Gateway pods' clocks differ a little: a token from
    // an instance a second ahead read as 2^32 - 1 seconds old, so a session
    // hopping instances lost its replica. Up to `MAX_CLOCK_SKEW_S` of
    // negative age is accepted, and counts as zero.
    let age = i64::from((now_s as u32).wrapping_sub(u32::from_be_bytes(t)) as i32);
    if age < -MAX_CLOCK_SKEW_S || age.max(0) as u64 > max_age_s {
        return Err(AffinityError::Expired);
    }
    Ok(u64::from_be_bytes(id))
}

fn unhex(s: &[u8]) -> Option<[u8; TOKEN_BYTES]> {
    if s.len() != TOKEN_BYTES * 2 {
        return None;
    }
    let mut out = [0u8; TOKEN_BYTES];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(out)
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
