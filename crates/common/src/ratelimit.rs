//! Client-side rate limit for API requests: a token bucket of `qps` tokens a second holding at most
//! `burst`, the same shape as client-go's `--kube-api-qps` / `--kube-api-burst`, so stowage and
//! kube-controller-manager can be compared at equal limits.
//!
//! Like golang.org/x/time/rate's `Wait`, a request that finds the bucket empty *reserves* a future
//! token and sleeps until it is due; reservations queue in arrival order.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tower::{Layer, Service};

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

    /// Takes one token and says how long the caller must wait before using it.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        if now > self.at {
            let refill = (now - self.at).as_secs_f64() * self.qps;
            self.tokens = (self.tokens + refill).min(self.burst);
            self.at = now;
        }
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

/// A shared limiter; `qps <= 0` means unlimited. Each request's wait is recorded in
/// `rest_client_rate_limiter_duration_seconds` under `host`.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    bucket: Option<Arc<Mutex<Bucket>>>,
    host: Arc<str>,
}

impl RateLimitLayer {
    pub fn new(qps: f32, burst: u32) -> Self {
        Self::for_host(qps, burst, "")
    }

    pub fn for_host(qps: f32, burst: u32, host: &str) -> Self {
        let bucket =
            (qps > 0.0).then(|| Arc::new(Mutex::new(Bucket::new(f64::from(qps), burst, Instant::now()))));
        Self {
            bucket,
            host: host.into(),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            bucket: self.bucket.clone(),
            host: self.host.clone(),
            wait: None,
            waited: Duration::ZERO,
            permitted: false,
        }
    }
}

/// The service: `poll_ready` waits for a token, then for the inner service.
pub struct RateLimit<S> {
    inner: S,
    bucket: Option<Arc<Mutex<Bucket>>>,
    host: Arc<str>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The wait the permitted request was given (recorded once the request, and with it its
    /// verb, is known).
    waited: Duration,
    permitted: bool,
}

impl<S, B> Service<http::Request<B>> for RateLimit<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.permitted {
            if let Some(bucket) = &self.bucket {
                if self.wait.is_none() {
                    let now = Instant::now();
                    // A poisoned lock only means another request panicked mid-arithmetic; the
                    // numbers are still usable.
                    let delay = bucket.lock().unwrap_or_else(|p| p.into_inner()).reserve(now);
                    self.waited = delay;
                    self.wait = Some(Box::pin(tokio::time::sleep_until(now + delay)));
                }
                if let Some(wait) = self.wait.as_mut()
                    && wait.as_mut().poll(cx).is_pending()
                {
                    return Poll::Pending;
                }
                self.wait = None;
            }
            self.permitted = true;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        self.permitted = false;
        if self.bucket.is_some() {
            crate::clientmetrics::limiter_waited(
                req.method().as_str(),
                &self.host,
                self.waited.as_secs_f64(),
            );
        }
        self.inner.call(req)
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
