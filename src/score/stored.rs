//! Where a stored response is, and where it is looked for: the replica
//! it is named after, then that replica's successors.

use super::gateways::rendezvous_order;
use super::{to_front, Candidate};
use crate::endpoint::ReplicaId;

/// The order a response named after `home` is stored in, and looked for
/// in: `home` (when it is a candidate), then every other candidate by its
/// rendezvous weight for `home`. Envoy tries the destination header's
/// addresses in order (`max_fallbacks` of them after the first), so a
/// create whose home refused it, or answered 503, is stored on the first
/// successor that took it, under the home's name; a follow-up, from any
/// instance, lists the same successors and retries on 404 down them.
///
/// The successors depend on the home alone, not on the response: a
/// follow-up stored on a successor is itself named after the home (it was
/// sent there first), and its own follow-up must find it on the same
/// successor. A home that is down sends all its new sessions to its
/// first successor until the filter stops picking it (one scrape
/// interval, or Envoy's outlier detection); ordering by the ranking
/// instead, as before, spread them, and left every one stored where no
/// follow-up looked.
pub(super) fn looked_in(cands: &[Candidate], home: ReplicaId) -> Vec<usize> {
    let mut order = rendezvous_order(cands, home);
    if let Some(h) = cands.iter().position(|c| c.id == home) {
        to_front(&mut order, h);
    }
    order
}
