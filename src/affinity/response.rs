//! Stored Responses API responses, named after the replica that holds
//! them (`affinity.response_ids`).
//!
//! A Responses API request with `store` (the default) leaves the response
//! in the model server's memory: vLLM and SGLang keep it in a dict of
//! their own process. A follow-up that names it (`previous_response_id`,
//! or `GET /v1/responses/{id}`) works only on that replica: anywhere else
//! the server answers that no such response exists. Several gateway
//! instances can't share a table of where each response went, so the id
//! itself says: the filter sets the request's `request_id` (an extra
//! parameter both servers take and use as the response's id) to
//! `resp_` and 72 lowercase hex characters: the replica id (8 bytes),
//! the issue time (4) and a nonce unique to this VM's request (8),
//! encrypted (`super::seal`), then 16 bytes of
//! HMAC-SHA256(key, "prefix-router/response/v2" | those). Any instance
//! with the key reads the replica back; a client can't name a replica of
//! its choosing (the MAC), only one an id it was given names, and can't
//! tell which address that is.

use super::{open, seal, u64_at, unhex, verified, AffinityError, MAC_BYTES};
use crate::endpoint::ReplicaId;

const DOMAIN: &[u8] = b"prefix-router/response/v2";
/// The ids of builds before the encryption: the same fields in the clear.
/// Still read, since a stored response outlives a rollout (its
/// conversation's next turn must still find it); no longer minted.
const DOMAIN_V1: &[u8] = b"prefix-router/response/v1";
/// How the servers' own ids start; kept, so clients see the usual shape.
const PREFIX: &[u8] = b"resp_";
const PAYLOAD_BYTES: usize = 8 + 4 + 8;
const ID_BYTES: usize = PAYLOAD_BYTES + MAC_BYTES;

/// The id for a response `replica` will hold, issued at `now_s`; `nonce`
/// must differ between this VM's requests (the server stores by id).
pub fn mint(key: &[u8], replica: ReplicaId, now_s: u64, nonce: u64) -> String {
    let mut payload = [0u8; PAYLOAD_BYTES];
    payload[..8].copy_from_slice(&replica.to_be_bytes());
    payload[8..12].copy_from_slice(&(now_s as u32).to_be_bytes());
    payload[12..].copy_from_slice(&nonce.to_be_bytes());
    let mut id = String::from("resp_");
    id.push_str(&seal(key, DOMAIN, &payload));
    id
}

/// The replica a response id names, if this filter (with `key`) minted
/// it. No expiry: a stored response lives as long as its server keeps
/// it, and an id only ever names where it was stored. Bounded work on any
/// input: only a value of exactly an id's length is decoded.
pub fn replica_of(key: &[u8], id: &[u8]) -> Result<ReplicaId, AffinityError> {
    let hex = id.strip_prefix(PREFIX).ok_or(AffinityError::Malformed)?;
    let raw = unhex(hex, ID_BYTES..=ID_BYTES)?;
    let payload = open(key, DOMAIN, &raw).or_else(|e| {
        let (plain, tag) = raw.split_at_checked(PAYLOAD_BYTES).ok_or(e)?;
        verified(key, DOMAIN_V1, plain.to_vec(), tag)
    })?;
    Ok(u64_at(&payload))
}

/// How `body` (a JSON object) gets `"request_id":"<id>"` as its first
/// member: its first `drop` bytes (any whitespace and the `{`) give way
/// to `head`. `None` when it isn't an object. Envoy edits a buffered body
/// at its start (or end) without a copy of the rest, so renaming a
/// 256 KiB body moves a hundred bytes, not the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub drop: usize,
    pub head: Vec<u8>,
}

pub fn request_id_head(body: &[u8], id: &str) -> Option<Head> {
    // A UTF-8 byte order mark first: the servers' parser skips it, and so
    // does ours (`request::body::read`), so such a body is routed as one
    // to name; the mark goes with the brace. Not skipped, no such body was
    // named, and its follow-ups found their response nowhere.
    let bom = if body.starts_with(b"\xEF\xBB\xBF") {
        3
    } else {
        0
    };
    let start = bom
        + body
            .get(bom..)?
            .iter()
            .position(|b| !b.is_ascii_whitespace())?;
    let rest = body.get(start..)?.strip_prefix(b"{")?;
    let empty = rest.trim_ascii_start().starts_with(b"}");
    let mut head = Vec::with_capacity(id.len() + 20);
    head.extend_from_slice(b"{\"request_id\":\"");
    head.extend_from_slice(id.as_bytes());
    head.extend_from_slice(if empty { b"\"" } else { b"\"," });
    Some(Head {
        drop: start + 1,
        head,
    })
}

impl Head {
    /// The body with it: what the upstream gets.
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.head.clone();
        out.extend_from_slice(body.get(self.drop..).unwrap_or_default());
        out
    }

    /// The renamed body's length.
    pub fn len_with(&self, body_len: usize) -> usize {
        body_len.saturating_sub(self.drop) + self.head.len()
    }
}

/// The path creates a response: it is one of the Responses API paths
/// among `bases` (those ending in `/responses`), query aside. Other
/// inference paths take `input` too (embeddings, pooling).
pub fn creates(path: &str, bases: &[String]) -> bool {
    let path = path.split('?').next().unwrap_or("");
    bases.iter().any(|b| b.ends_with("/responses") && b == path)
}

/// The response id in a path under a Responses API path (`bases`, each
/// ending in `/responses`): `/v1/responses/{id}`, its `/cancel` or
/// `/input_items`, with any query string.
pub fn id_in_path<'a>(path: &'a str, bases: &[String]) -> Option<&'a str> {
    let path = path.split('?').next()?;
    bases
        .iter()
        .filter(|b| b.ends_with("/responses"))
        .find_map(|b| path.strip_prefix(b.as_str())?.strip_prefix('/'))
        .and_then(|tail| tail.split('/').next())
        .filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn an_id_names_its_replica_for_any_instance_with_the_key() {
        let id = mint(KEY, 0xdead_beef_0000_0001, 1_000_000, 42);
        assert_eq!(id.len(), 5 + 72);
        assert!(id.starts_with("resp_"));
        assert_eq!(replica_of(KEY, id.as_bytes()), Ok(0xdead_beef_0000_0001));
        // Another request's id for the same replica differs.
        assert_ne!(id, mint(KEY, 0xdead_beef_0000_0001, 1_000_000, 43));
    }

    #[test]
    fn an_id_shows_nothing_of_its_replica_and_old_ids_still_resolve() {
        let replica = 0xdead_beef_0000_0001_u64;
        let id = mint(KEY, replica, 1_000_000, 42);
        assert!(!id.contains(&format!("{replica:016x}")), "{id}");
        // An id minted by a build before the encryption: the fields in
        // the clear, signed under the old domain. Its conversation's next
        // turn still finds the replica after a rollout.
        let mut plain = Vec::new();
        plain.extend_from_slice(&replica.to_be_bytes());
        plain.extend_from_slice(&1_000_000_u32.to_be_bytes());
        plain.extend_from_slice(&42_u64.to_be_bytes());
        let mut tag = [0u8; MAC_BYTES];
        let m = super::super::mac(KEY, DOMAIN_V1, &plain).unwrap();
        tag.copy_from_slice(&hmac::Mac::finalize(m).into_bytes()[..MAC_BYTES]);
        plain.extend_from_slice(&tag);
        let old = format!("resp_{}", super::super::hex(&plain));
        assert!(old.contains(&format!("{replica:016x}")));
        assert_eq!(replica_of(KEY, old.as_bytes()), Ok(replica));
        // Not under another key, nor with a bit flipped.
        let mut forged = old.clone().into_bytes();
        forged[5 + 15] = if forged[5 + 15] == b'1' { b'2' } else { b'1' };
        assert_eq!(replica_of(KEY, &forged), Err(AffinityError::Forged));
    }

    #[test]
    fn forged_foreign_and_server_made_ids_name_nothing() {
        let id = mint(KEY, 7, 1_000_000, 1);
        let mut forged = id.clone().into_bytes();
        // The replica id's last hex digit.
        forged[5 + 15] = if forged[5 + 15] == b'7' { b'8' } else { b'7' };
        assert_eq!(replica_of(KEY, &forged), Err(AffinityError::Forged));
        let foreign = mint(b"another key, also 32 bytes long!", 7, 1_000_000, 1);
        assert_eq!(
            replica_of(KEY, foreign.as_bytes()),
            Err(AffinityError::Forged)
        );
        // What vLLM makes when the filter didn't name the response.
        let server = b"resp_8b6f2a0c9d4e4f6a9c1b2d3e4f5a6b7c";
        for junk in [&server[..], b"", b"resp_", &id.as_bytes()[1..], b"resp_zz"] {
            assert_eq!(replica_of(KEY, junk), Err(AffinityError::Malformed));
        }
    }

    #[test]
    fn the_request_id_goes_first_in_the_body() {
        let body = br#"  {"model":"m","input":"hi"}"#;
        let h = request_id_head(body, "resp_1").unwrap();
        // The two spaces and the brace give way: nothing else is copied.
        assert_eq!(h.drop, 3);
        let out = h.apply(body);
        assert_eq!(out, br#"{"request_id":"resp_1","model":"m","input":"hi"}"#);
        assert_eq!(h.len_with(body.len()), out.len());
        let empty = request_id_head(b"{ }", "resp_1").unwrap();
        assert_eq!(empty.apply(b"{ }"), br#"{"request_id":"resp_1" }"#);
        assert_eq!(request_id_head(b"[1]", "resp_1"), None);
        assert_eq!(request_id_head(b"   ", "resp_1"), None);
    }

    #[test]
    fn a_body_with_a_byte_order_mark_is_named_too() {
        // Parsed and routed like any other (`request::body::read`), so it
        // is named like any other: the mark goes with the brace.
        let body = b"\xEF\xBB\xBF {\"model\":\"m\",\"input\":\"hi\"}";
        let h = request_id_head(body, "resp_1").unwrap();
        assert_eq!(h.drop, 5);
        let out = h.apply(body);
        assert_eq!(out, br#"{"request_id":"resp_1","model":"m","input":"hi"}"#);
        assert_eq!(h.len_with(body.len()), out.len());
        // Only at the very start, as the servers' parser skips it.
        assert_eq!(request_id_head(b" \xEF\xBB\xBF{}", "resp_1"), None);
    }

    #[test]
    fn ids_are_read_from_paths_under_a_responses_path() {
        let bases = [
            "/v1/chat/completions".to_string(),
            "/v1/responses".to_string(),
        ];
        assert_eq!(id_in_path("/v1/responses/resp_ab", &bases), Some("resp_ab"));
        assert_eq!(
            id_in_path("/v1/responses/resp_ab/cancel", &bases),
            Some("resp_ab")
        );
        assert_eq!(
            id_in_path("/v1/responses/resp_ab?stream=true", &bases),
            Some("resp_ab")
        );
        assert_eq!(id_in_path("/v1/responses", &bases), None);
        assert_eq!(id_in_path("/v1/responses/", &bases), None);
        assert_eq!(id_in_path("/v1/responsesX/a", &bases), None);
        assert_eq!(id_in_path("/v1/chat/completions/a", &bases), None);
        assert!(creates("/v1/responses", &bases));
        assert!(creates("/v1/responses?x=1", &bases));
        assert!(!creates("/v1/responses/resp_ab", &bases));
        assert!(!creates("/v1/chat/completions", &bases));
        assert!(!creates("/v1/embeddings", &["/v1/embeddings".to_string()]));
    }
}
