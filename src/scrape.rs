//! What a metrics (or admin) callout's answer means, before any of it is
//! read: every way a callout can end — no response at all (connect error,
//! timeout, a reset mid-body, a body that stalled), a status other than
//! 200, an answer over the size limit — is a failed scrape with a reason,
//! never something to trust or to trap on.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CalloutError {
    /// Envoy gives no response headers when the call failed before or
    /// during the response (reset mid-body, timeout, connect error).
    #[error("no response (connect error, timeout or reset)")]
    NoResponse,
    #[error("status {0}")]
    Status(String),
    #[error("answer of {size} bytes is over the {limit}-byte limit")]
    TooLarge { size: usize, limit: usize },
    #[error("the response body could not be read")]
    Unreadable,
}

/// Check a callout's `:status` (raw bytes, as the host gave them; `None`
/// when absent) and announced body size against `limit`.
pub fn check(status: Option<&[u8]>, body_size: usize, limit: usize) -> Result<(), CalloutError> {
    match status {
        None => Err(CalloutError::NoResponse),
        Some(b"200") if body_size > limit => Err(CalloutError::TooLarge {
            size: body_size,
            limit,
        }),
        Some(b"200") => Ok(()),
        Some(other) => Err(CalloutError::Status(
            String::from_utf8_lossy(&other[..other.len().min(16)]).into_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_but_a_bounded_200_is_a_failure() {
        assert_eq!(check(Some(b"200"), 10, 100), Ok(()));
        assert_eq!(check(Some(b"200"), 100, 100), Ok(()));
        assert_eq!(check(None, 0, 100), Err(CalloutError::NoResponse));
        assert_eq!(
            check(Some(b"500"), 3, 100),
            Err(CalloutError::Status("500".into()))
        );
        assert_eq!(
            check(Some(b"200"), 101, 100),
            Err(CalloutError::TooLarge {
                size: 101,
                limit: 100
            })
        );
        // A hostile status line: bounded, lossy, still a failure.
        let junk = [0xffu8; 64];
        let e = check(Some(&junk), 0, 100).unwrap_err().to_string();
        assert!(e.starts_with("status ") && e.len() < 80, "{e}");
    }
}
