//! The retry backoff of a failed operation on one key, as upstream's exponentialbackoff for volume
//! operations: 500 ms after the first failure, doubling, at most 2 min 2 s; a success starts over.
//!
//! Hand-written rather than `backon`: the pure decision cores keep it as plain data (a failure
//! count) inside state that is cloned and compared, with time an argument; `backon`'s backoffs
//! are stateful iterators built for retrying one future in place.

use std::time::Duration;

/// Wait after the first failure.
pub const INITIAL: Duration = Duration::from_millis(500);
/// Longest wait (upstream's 2m2s).
pub const MAX: Duration = Duration::from_secs(122);

/// Failures in a row of one key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    pub const fn new() -> Self {
        Self { failures: 0 }
    }

    /// Records a failure; returns how long to wait before the next try.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        delay(self.failures)
    }

    /// Forgets the failures: the next failure waits `INITIAL` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The wait the last failure earned; `None` after a success.
    pub fn current(&self) -> Option<Duration> {
        (self.failures > 0).then(|| delay(self.failures))
    }
}

/// The wait after `failures` failures in a row (`INITIAL` for 0 or 1).
pub fn delay(failures: u32) -> Duration {
    exponential(INITIAL, MAX, failures)
}

/// The wait after `failures` failures in a row when waits start at `first` and double up to
/// `max` (`first` for 0 or 1): the one doubling rule, also for the work queue's and the binder's
/// own bounds.
pub fn exponential(first: Duration, max: Duration, failures: u32) -> Duration {
    // 2^31 is the largest power of two a u32 holds; the product saturates long before.
    let exp = failures.saturating_sub(1).min(31);
    first.saturating_mul(1u32 << exp).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn upstreams_sequence() {
        let mut b = Backoff::new();
        let got: Vec<u64> = (0..10).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(
            got,
            [
                500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 122_000, 122_000
            ]
        );
        b.reset();
        assert_eq!(b.current(), None);
        assert_eq!(b.failed(), INITIAL);
    }

    proptest! {
        #[test]
        fn doubles_up_to_the_cap_and_never_beyond(n in 1u32..=u32::MAX) {
            let d = delay(n);
            prop_assert!(d >= INITIAL && d <= MAX);
            let next = delay(n.saturating_add(1));
            prop_assert!(next >= d, "never shorter after one more failure");
            prop_assert!(next == (d * 2).min(MAX) || n == u32::MAX);
        }

        #[test]
        fn any_bounds_double_from_first_to_max(
            first_ms in 1u64..10_000,
            max_ms in 1u64..1_000_000,
            n in 1u32..=u32::MAX,
        ) {
            let (first, max) = (Duration::from_millis(first_ms), Duration::from_millis(max_ms));
            let d = exponential(first, max, n);
            prop_assert_eq!(exponential(first, max, 1), first.min(max));
            prop_assert!(d <= max);
            let next = exponential(first, max, n.saturating_add(1));
            prop_assert!(next == (d * 2).min(max) || n == u32::MAX);
        }

        #[test]
        fn a_success_starts_over(fails in 0usize..64) {
            let mut b = Backoff::new();
            for _ in 0..fails {
                b.failed();
            }
            prop_assert_eq!(b.failures() as usize, fails);
            prop_assert_eq!(b.current().is_some(), fails > 0);
            b.reset();
            prop_assert_eq!(b.failed(), INITIAL);
        }
    }
}
