//! Replica discovery from Envoy's own admin `/clusters?format=json`: the
//! hosts Envoy knows for the pool cluster (from EDS in a mesh, DNS, or a
//! static list), with Envoy's health view of each. This is how the filter
//! follows an Istio/EDS-managed pool without a list of its own.
//!
//! The result is published in shared data by the scraper VM; every worker
//! rebuilds its endpoint list when the published set changes.

use std::collections::HashSet;

use serde::Deserialize;
use thiserror::Error;

use crate::config::MAX_ENDPOINTS;
use crate::endpoint::Endpoint;
use crate::store::{self, shared_key, Store, Writer};

const KEY: &str = shared_key!("discovered");
/// The published set's (unversioned before).
pub(crate) const VERSION: u8 = 1;

#[derive(Debug, Error)]
pub enum DiscoveryError {
    #[error("admin /clusters answer is not the expected JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cluster `{0}` is not in Envoy's admin /clusters answer")]
    NoCluster(String),
}

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    #[serde(default)]
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<Address>,
    #[serde(default)]
    health_status: Health,
}

#[derive(Deserialize)]
struct Address {
    socket_address: Option<SocketAddress>,
}

#[derive(Deserialize)]
struct SocketAddress {
    #[serde(default)]
    address: String,
    #[serde(default)]
    port_value: u32,
}

#[derive(Deserialize, Default)]
struct Health {
    #[serde(default)]
    eds_health_status: Option<String>,
    #[serde(default)]
    failed_active_health_check: bool,
    #[serde(default)]
    failed_outlier_check: bool,
    #[serde(default)]
    pending_dynamic_removal: bool,
    #[serde(default)]
    excluded_via_immediate_hc_fail: bool,
}

impl Health {
    /// Envoy would send traffic there: not failed by health checks or
    /// outlier detection, not draining or marked unhealthy by EDS.
    fn usable(&self) -> bool {
        let eds_ok = match self.eds_health_status.as_deref() {
            None | Some("HEALTHY") | Some("UNKNOWN") | Some("DEGRADED") => true,
            Some(_) => false,
        };
        eds_ok && self.listed() && !self.failed_active_health_check && !self.failed_outlier_check
    }

    /// Still in the pool, whatever its health: not leaving it.
    fn listed(&self) -> bool {
        self.eds_health_status.as_deref() != Some("DRAINING")
            && !self.pending_dynamic_removal
            && !self.excluded_via_immediate_hc_fail
    }
}

/// The usable hosts of `cluster`, deduplicated, at most `MAX_ENDPOINTS`.
/// Hosts that aren't plain IP sockets (pipes, internal listeners) are
/// skipped: the destination header can only name `ip:port`.
///
/// Under half of the pool usable, every host still in it is listed, as
/// Envoy's panic mode (at its default threshold, 50%) routes to them all:
/// when every host fails its health checks, the check is as likely wrong
/// (a changed `/health` path, a slow one during a model reload) as the
/// pool down, and an empty list answered every request with a 503; with
/// one of four usable, it took everything.
pub fn parse_clusters(json: &[u8], cluster: &str) -> Result<Vec<Endpoint>, DiscoveryError> {
    let all: Clusters = serde_json::from_slice(json)?;
    let c = all
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| DiscoveryError::NoCluster(cluster.to_string()))?;
    let h = hosts(c.host_statuses);
    Ok(match h.usable_n * 2 < h.listed_n {
        true => h.listed,
        false => h.usable,
    })
}

/// A pool's hosts as endpoints: the usable ones and every one still
/// listed, each list at most `MAX_ENDPOINTS`, and how many there are of
/// each in the whole pool.
struct Hosts {
    usable: Vec<Endpoint>,
    listed: Vec<Endpoint>,
    /// Counted past the cap: with one list of both, a pool whose first
    /// 1,024 hosts failed their health checks had no usable host, and
    /// panic mode listed only failing ones.
    usable_n: usize,
    listed_n: usize,
}

fn hosts(statuses: Vec<HostStatus>) -> Hosts {
    let mut seen = HashSet::new();
    let mut h = Hosts {
        usable: Vec::new(),
        listed: Vec::new(),
        usable_n: 0,
        listed_n: 0,
    };
    for status in statuses {
        if !status.health_status.listed() {
            continue;
        }
        let Some(ep) = status.address.and_then(endpoint) else {
            continue;
        };
        if !seen.insert(ep.id()) {
            continue;
        }
        h.listed_n += 1;
        if status.health_status.usable() {
            h.usable_n += 1;
            if h.usable.len() < MAX_ENDPOINTS {
                h.usable.push(ep.clone());
            }
        }
        if h.listed.len() < MAX_ENDPOINTS {
            h.listed.push(ep);
        }
    }
    h
}

/// A socket address of the admin page as an endpoint (`None`: a pipe, a
/// port out of range, an address that doesn't parse).
fn endpoint(a: Address) -> Option<Endpoint> {
    let sa = a.socket_address?;
    if sa.port_value == 0 || sa.port_value > u16::MAX as u32 {
        return None;
    }
    let text = if sa.address.contains(':') {
        format!("[{}]:{}", sa.address, sa.port_value)
    } else {
        format!("{}:{}", sa.address, sa.port_value)
    };
    text.parse().ok()
}

/// The admin path that lists only `cluster`: `filter` (an RE2 match on
/// the cluster name, Envoy >= 1.38) keeps the page a few KB on a mesh
/// gateway whose full page lists thousands of clusters (about 2 KB each:
/// 10 MB at 5,000, over the read limit). Older Envoys ignore the parameter
/// and send the full page, which `parse_clusters` filters.
pub fn admin_path(cluster: &str) -> String {
    let mut re = String::with_capacity(cluster.len() * 2 + 2);
    re.push('^');
    for c in cluster.chars() {
        if c.is_ascii_punctuation() && c != '_' && c != '-' {
            re.push('\\');
        }
        re.push(c);
    }
    re.push('$');
    let mut path = String::from("/clusters?format=json&filter=");
    for b in re.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            path.push(b as char);
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    path
}

/// Publish the discovered set (written by the scraper VM).
pub fn publish<S: Store + ?Sized>(store: &S, eps: &[Endpoint]) {
    // Unconditional: one writer (the lease holder); a stale racing write
    // is corrected on the next interval.
    let _ = store.set(KEY, &encode(eps), None);
}

/// The published set and its CAS token (a cheap change detector), or
/// `None` if nothing was published yet. Malformed → `None`.
pub fn load<S: Store + ?Sized>(store: &S) -> Option<(Vec<Endpoint>, u32)> {
    let (value, cas) = store.get(KEY);
    Some((decode(&value?)?, cas.unwrap_or(0)))
}

fn encode(eps: &[Endpoint]) -> Vec<u8> {
    let mut w = Writer::new(VERSION, 4 + eps.len() * 24);
    w.count(eps.len());
    for e in eps {
        w.str(e.as_str());
    }
    w.finish()
}

fn decode(buf: &[u8]) -> Option<Vec<Endpoint>> {
    store::decode(VERSION, buf, |r| {
        let n = r.count(MAX_ENDPOINTS)?;
        (0..n).map(|_| r.str()?.parse().ok()).collect()
    })
}

/// Fuzzing support: arbitrary admin JSON never panics; accepted hosts are
/// valid, distinct and bounded; the published form round-trips.
#[cfg(any(test, fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub fn check_admin_json(data: &[u8]) {
    if let Ok(eps) = parse_clusters(data, "pool") {
        assert!(eps.len() <= MAX_ENDPOINTS);
        let s = crate::store::MemStore::new();
        publish(&s, &eps);
        assert_eq!(load(&s).map(|l| l.0), Some(eps));
    }
    for record in [data, &store::seal(VERSION, data)] {
        if let Some(eps) = decode(record) {
            assert!(eps.len() <= MAX_ENDPOINTS);
            assert_eq!(decode(&encode(&eps)), Some(eps));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_query_names_exactly_one_cluster() {
        assert_eq!(
            admin_path("pool"),
            "/clusters?format=json&filter=%5Epool%24"
        );
        // An Istio name: every metacharacter escaped, then URL-encoded.
        assert_eq!(
            admin_path("outbound|8000||vllm.default.svc"),
            "/clusters?format=json&filter=%5Eoutbound%5C%7C8000%5C%7C%5C%7Cvllm%5C.default%5C.svc%24"
        );
    }

    use crate::store::MemStore;

    const ADMIN: &str = r#"{"cluster_statuses":[
      {"name":"other","host_statuses":[{"address":{"socket_address":{"address":"10.9.9.9","port_value":1}}}]},
      {"name":"pool","observability_name":"pool","host_statuses":[
        {"address":{"socket_address":{"address":"10.0.0.1","port_value":8000}},"stats":[{"name":"rq_total","value":"3"}],"health_status":{"eds_health_status":"HEALTHY"},"weight":1,"locality":{}},
        {"address":{"socket_address":{"address":"10.0.0.2","port_value":8000}},"health_status":{"eds_health_status":"HEALTHY","failed_active_health_check":true}},
        {"address":{"socket_address":{"address":"10.0.0.3","port_value":8000}},"health_status":{"eds_health_status":"DRAINING"}},
        {"address":{"socket_address":{"address":"fd00::4","port_value":8000}},"health_status":{"eds_health_status":"HEALTHY"}},
        {"address":{"socket_address":{"address":"10.0.0.1","port_value":8000}},"health_status":{}},
        {"address":{"pipe":{"path":"/tmp/x"}},"health_status":{}},
        {"address":{"socket_address":{"address":"10.0.0.5","port_value":8000}},"health_status":{"failed_outlier_check":true}}
      ]}]}"#;

    #[test]
    fn usable_hosts_of_the_named_cluster() {
        let eps = parse_clusters(ADMIN.as_bytes(), "pool").unwrap();
        let names: Vec<&str> = eps.iter().map(|e| e.as_str()).collect();
        assert_eq!(names, vec!["10.0.0.1:8000", "[fd00::4]:8000"]);
    }

    #[test]
    fn under_half_usable_lists_every_host_still_in_the_pool() {
        let page = |flags: &[&str]| {
            let hosts: Vec<String> = flags
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    format!(
                        r#"{{"address":{{"socket_address":{{"address":"10.0.0.{i}","port_value":80}}}},"health_status":{{{f}}}}}"#
                    )
                })
                .collect();
            let json = format!(
                r#"{{"cluster_statuses":[{{"name":"pool","host_statuses":[{}]}}]}}"#,
                hosts.join(",")
            );
            let eps = parse_clusters(json.as_bytes(), "pool").unwrap();
            eps.iter().map(|e| e.to_string()).collect::<Vec<_>>()
        };
        let hc = r#""failed_active_health_check":true"#;
        let gone = r#""eds_health_status":"DRAINING""#;
        // Every host failing its health check: all of them, not none.
        assert_eq!(page(&[hc, hc]), ["10.0.0.0:80", "10.0.0.1:80"]);
        // One of four usable: all four; two of four: those two.
        assert_eq!(page(&["", hc, hc, hc]).len(), 4);
        assert_eq!(page(&["", "", hc, hc]), ["10.0.0.0:80", "10.0.0.1:80"]);
        // A host leaving the pool is never listed.
        assert_eq!(page(&[hc, gone]), ["10.0.0.0:80"]);
        assert!(page(&[gone, gone]).is_empty());
    }

    #[test]
    fn a_pool_over_the_cap_is_judged_whole() {
        // 1,024 failing hosts listed first, then 1,100 healthy ones:
        // more than half usable, so the healthy ones (capped), not panic
        // mode over the failing ones.
        let host = |net: u8, i: usize, flags: &str| {
            format!(
                r#"{{"address":{{"socket_address":{{"address":"10.{net}.{}.{}","port_value":80}}}},"health_status":{{{flags}}}}}"#,
                i / 256,
                i % 256
            )
        };
        let hc = r#""failed_active_health_check":true"#;
        let mut hosts: Vec<String> = (0..MAX_ENDPOINTS).map(|i| host(1, i, hc)).collect();
        hosts.extend((0..1100).map(|i| host(2, i, "")));
        let json = format!(
            r#"{{"cluster_statuses":[{{"name":"pool","host_statuses":[{}]}}]}}"#,
            hosts.join(",")
        );
        let eps = parse_clusters(json.as_bytes(), "pool").unwrap();
        assert_eq!(eps.len(), MAX_ENDPOINTS);
        assert!(eps.iter().all(|e| e.as_str().starts_with("10.2.")));
    }

    #[test]
    fn missing_cluster_and_garbage_are_errors() {
        assert!(matches!(
            parse_clusters(ADMIN.as_bytes(), "nope"),
            Err(DiscoveryError::NoCluster(_))
        ));
        assert!(parse_clusters(b"<html>", "pool").is_err());
        assert!(parse_clusters(b"{\"cluster_statuses\":5}", "pool").is_err());
        assert!(parse_clusters(b"{}", "pool").is_err());
    }

    #[test]
    fn published_set_round_trips_and_changes_its_token() {
        let s = MemStore::new();
        assert!(load(&s).is_none());
        let eps = parse_clusters(ADMIN.as_bytes(), "pool").unwrap();
        publish(&s, &eps);
        let (got, t1) = load(&s).unwrap();
        assert_eq!(got, eps);
        publish(&s, &eps[..1]);
        let (got, t2) = load(&s).unwrap();
        assert_eq!(got.len(), 1);
        assert_ne!(t1, t2);
        let good = encode(&eps);
        for cut in 0..good.len() {
            s.set(KEY, &good[..cut], None).unwrap();
            assert!(load(&s).is_none());
        }
        // The unversioned layout of before, and an address that doesn't
        // parse: absent.
        let mut old = vec![1, 0, 0, 0, 11];
        old.extend_from_slice(b"10.0.0.1:80");
        s.set(KEY, &old, None).unwrap();
        assert!(load(&s).is_none());
        let mut w = Writer::new(VERSION, 0);
        w.count(1).str("x:80");
        s.set(KEY, &w.finish(), None).unwrap();
        assert!(load(&s).is_none());
    }
}
