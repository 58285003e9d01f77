//! The replica a client's session-affinity token names.

use super::pressure::{least_scraped, scraped};
use super::{Candidate, ScoreParams};

/// The replica a session's affinity token names (another instance may
/// have issued it, so this one may not know the session's prompt): it
/// wins while within the load bound (work in flight is the bound's
/// business) and its scraped queue, KV and LoRA pressure exceed the
/// least by less than holding the whole prompt saves. So a dying
/// replica's queue turns its sessions away, as it turns away hits.
pub(super) fn token_holder(
    cands: &[Candidate],
    keeps: &[bool],
    blocks: u32,
    p: &ScoreParams,
) -> Option<usize> {
    let a = (0..cands.len()).find(|&i| cands[i].affinity && keeps[i])?;
    let w = &p.weights;
    let saved = w.prefix * f64::from(blocks);
    (scraped(&cands[a], w) - least_scraped(cands, keeps, w) <= saved).then_some(a)
}
