//! Fault injection: per-replica modes switched at run time by
//! `POST /admin/fault`, plus an evenly spread failure rate.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Normal service.
    Ok,
    /// Inference waits `delay_ms` (real time) before reaching the engine.
    Slow,
    /// Everything but `/admin/fault` is answered 503 at once.
    Down,
    /// Everything but `/admin/fault` is accepted and never answered, until
    /// the mode changes.
    Hang,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub mode: Mode,
    #[serde(default)]
    pub delay_ms: u64,
}

impl Fault {
    /// Real-time delay to add before an inference request's first token.
    pub fn delay_ms(&self) -> u64 {
        if self.mode == Mode::Slow {
            self.delay_ms
        } else {
            0
        }
    }
}

/// Fails exactly `rate` of requests, spread evenly (request n fails when
/// floor((n+1)·rate) > floor(n·rate)), so tests see deterministic counts.
pub struct FailRate {
    rate: f64,
    seen: AtomicU64,
}

impl FailRate {
    pub fn new(rate: f64) -> Self {
        Self {
            rate,
            seen: AtomicU64::new(0),
        }
    }

    pub fn should_fail(&self) -> bool {
        if self.rate <= 0.0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Relaxed) as f64;
        ((n + 1.0) * self.rate).floor() > (n * self.rate).floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_rate_is_exact_over_a_window() {
        let f = FailRate::new(0.25);
        let fails = (0..100).filter(|_| f.should_fail()).count();
        assert_eq!(fails, 25);
        let never = FailRate::new(0.0);
        assert!((0..10).all(|_| !never.should_fail()));
        let always = FailRate::new(1.0);
        assert!((0..10).all(|_| always.should_fail()));
    }

    #[test]
    fn fault_json_shape() {
        let f: Fault = serde_json::from_str(r#"{"mode":"slow","delay_ms":250}"#).unwrap();
        assert_eq!(f.delay_ms(), 250);
        let f: Fault = serde_json::from_str(r#"{"mode":"hang"}"#).unwrap();
        assert_eq!((f.mode, f.delay_ms()), (Mode::Hang, 0));
        assert!(serde_json::from_str::<Fault>(r#"{"mode":"sideways"}"#).is_err());
    }
}
