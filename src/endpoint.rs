//! A replica address, as written into the destination header.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use serde::Deserialize;
use thiserror::Error;

/// A replica's stable identity inside shared-data records: xxh3-64 of the
/// canonical `ip:port` text. Records carry ids rather than strings so
/// they stay small and fixed-width; config loading rejects a colliding set.
pub type ReplicaId = u64;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("`{value}` is not an `ip:port` address (IPv6 as `[addr]:port`)")]
pub struct BadEndpoint {
    pub value: String,
}

/// A validated replica address. The only way to build one is by parsing, so
/// the header value written for it is always a canonical socket address
/// (in a configuration too: it deserializes from its text).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct Endpoint {
    addr: SocketAddr,
    text: String,
    id: ReplicaId,
}

impl Endpoint {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Canonical `ip:port` / `[v6]:port`, exactly what Envoy's
    /// original_dst and override_host policies parse.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// A stat-name-safe label (`127_0_0_1_8000`): Envoy splits stat names on
    /// dots, so the address's own dots and colons can't appear in one.
    pub fn stat_label(&self) -> String {
        self.text
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
            .trim_matches('_')
            .to_string()
    }
}

impl FromStr for Endpoint {
    type Err = BadEndpoint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        let addr: SocketAddr = trimmed.parse().map_err(|_| BadEndpoint {
            value: s.to_string(),
        })?;
        // A scope id (`%2`) or flow label isn't `[v6]:port`: its text would
        // share a stat label with another address's (`%` and `:` both map
        // to `_`).
        let scoped = matches!(addr, SocketAddr::V6(v6) if v6.scope_id() != 0 || v6.flowinfo() != 0);
        if addr.port() == 0 || scoped {
            return Err(BadEndpoint {
                value: s.to_string(),
            });
        }
        let text = addr.to_string();
        let id = replica_id(&text);
        Ok(Endpoint { addr, text, id })
    }
}

impl TryFrom<String> for Endpoint {
    type Error = BadEndpoint;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

pub fn replica_id(canonical: &str) -> ReplicaId {
    xxhash_rust::xxh3::xxh3_64(canonical.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ipv4_and_ipv6() {
        let v4: Endpoint = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(v4.as_str(), "10.0.0.1:8000");
        let v6: Endpoint = "[::1]:9000".parse().unwrap();
        assert_eq!(v6.as_str(), "[::1]:9000");
        assert_eq!(v6.stat_label(), "1__9000");
        assert_eq!(v4.stat_label(), "10_0_0_1_8000");
    }

    #[test]
    fn canonicalises_ipv6_spelling() {
        let a: Endpoint = "[0:0:0:0:0:0:0:1]:9000".parse().unwrap();
        let b: Endpoint = "[::1]:9000".parse().unwrap();
        assert_eq!(a, b);
        assert_eq!(a.id(), b.id());
    }

    #[test]
    fn rejects_names_missing_ports_and_port_zero() {
        for bad in [
            "",
            "localhost:8000",
            "10.0.0.1",
            "10.0.0.1:0",
            "::1:80",
            "10.0.0.1:99999",
            "10.0.0.1:80,10.0.0.2:80",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad} accepted");
        }
    }

    /// A scoped IPv6 address (`%2`: an interface index) parsed, and its
    /// stat label took `%` as a separator like `:`: `[fe80::1%2]:80` and
    /// `[fe80::1:2]:80`, two replicas, shared every per-replica stat.
    /// The header only carries `ip:port` / `[v6]:port` (README), so a
    /// scope id or flow label is refused like any other non-address.
    #[test]
    fn scoped_ipv6_is_refused_so_stat_labels_stay_distinct() {
        let plain: Endpoint = "[fe80::1:2]:80".parse().unwrap();
        assert_eq!(plain.stat_label(), "fe80__1_2__80");
        assert!("[fe80::1%2]:80".parse::<Endpoint>().is_err());
    }

    #[test]
    fn id_is_a_stable_golden_value() {
        // xxh3-64 of the canonical text; same on wasm32 and x86_64.
        assert_eq!(replica_id("10.0.0.1:8000"), 12762026736958320935);
    }
}
