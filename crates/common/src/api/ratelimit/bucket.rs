//! The static limit: a token bucket (client-go's `--kube-api-qps` / `--kube-api-burst`), also the
//! ceiling rate beside the adaptive window.

use std::time::Duration;

use tokio::time::Instant;

/// Token-bucket arithmetic, free of clocks so it can be tested exactly.
#[derive(Debug, Clone)]
pub struct Bucket {
    qps: f64,
    burst: f64,
    /// Tokens at `at`; negative while requests are waiting on reserved tokens.
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub fn new(qps: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            qps,
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if now > self.at {
            let refill = (now - self.at).as_secs_f64() * self.qps;
            self.tokens = (self.tokens + refill).min(self.burst);
            self.at = now;
        }
    }

    /// Takes one token and says how long the caller must wait before using it.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        self.refill(now);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }

    pub fn qps(&self) -> f64 {
        self.qps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_is_free_then_requests_are_spaced_by_one_over_qps() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10.0, 3, t0);
        for _ in 0..3 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        let d = b.reserve(t0);
        assert!((d.as_secs_f64() - 0.1).abs() < 1e-9, "{d:?}");
        let d = b.reserve(t0);
        assert!((d.as_secs_f64() - 0.2).abs() < 1e-9, "{d:?}");
    }

    #[test]
    fn refill_never_exceeds_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::new(100.0, 2, t0);
        let later = t0 + Duration::from_secs(60);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert!(b.reserve(later) > Duration::ZERO);
    }

    proptest::proptest! {
        /// Over any arrival pattern, n requests are never all admitted sooner than the rate allows.
        #[test]
        fn admitted_rate_is_bounded(qps in 1.0f64..200.0, burst in 1u32..50, gaps in proptest::collection::vec(0u64..50, 1..200)) {
            let t0 = Instant::now();
            let mut b = Bucket::new(qps, burst, t0);
            let mut now = t0;
            let mut last_admit = t0;
            for g in &gaps {
                now += Duration::from_millis(*g);
                let admit = now + b.reserve(now);
                proptest::prop_assert!(admit >= last_admit);
                last_admit = admit;
            }
            let n = gaps.len() as f64;
            let span = (last_admit - t0).as_secs_f64();
            proptest::prop_assert!(n <= f64::from(burst) + span * qps + 1e-6);
        }
    }
}
