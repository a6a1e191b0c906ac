//! Client-side rate limit for API requests.
//!
//! Two shapes share one token bucket (`Bucket`, the shape of client-go's `--kube-api-qps` /
//! `--kube-api-burst`):
//! - **static**: a fixed rate and burst, so stowage and kube-controller-manager can be compared at
//!   equal limits, and for operators who want a hard cap;
//! - **adaptive** (`Aimd`): starts high and lets the apiserver set the pace. API Priority and
//!   Fairness answers 429 (with `Retry-After`) when this client's priority level is full; each
//!   such episode halves the rate, and the rate grows by a tenth a second while requests are
//!   waiting for it and no 429 came. Latency is not a signal: APF queueing and a shared machine
//!   raise it for reasons this client cannot fix, and cutting on it would leave capacity unused.
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

    /// Changes the rate from `now` on: tokens earned so far count at the old rate, and reserved
    /// tokens not yet due are repaid at the new one.
    pub fn set_rate(&mut self, qps: f64, burst: u32, now: Instant) {
        self.refill(now);
        self.qps = qps;
        self.burst = f64::from(burst.max(1));
        self.tokens = self.tokens.min(self.burst);
    }

    pub fn qps(&self) -> f64 {
        self.qps
    }
}

/// The adaptive rate: additive-increase (a tenth a second, while there is demand), multiplicative
/// decrease (half, once per throttling episode). Pure arithmetic over the instants it is given.
#[derive(Debug, Clone)]
pub struct Aimd {
    rate: f64,
    min: f64,
    max: f64,
    last_cut: Option<Instant>,
    /// No growth before this: a second after a cut, or the server's `Retry-After`.
    hold_until: Instant,
    last_growth: Instant,
    /// A request had to wait for a token since the last growth step: more rate would be used.
    wanted_more: bool,
}

/// 429s within this of a cut answer requests sent at the old rate: one episode, one cut.
const CUT_EPISODE: Duration = Duration::from_secs(1);
const GROWTH_STEP: Duration = Duration::from_secs(1);

impl Aimd {
    pub fn new(limits: Adaptive, now: Instant) -> Self {
        Self {
            rate: limits.start.clamp(limits.min, limits.max),
            min: limits.min,
            max: limits.max,
            last_cut: None,
            hold_until: now,
            last_growth: now,
            wanted_more: false,
        }
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// The burst that goes with a rate: a tenth of a second's worth, so a freshly raised rate is
    /// not spent in one spike that APF would reject, and at least 10 for start-up lists.
    pub fn burst(rate: f64) -> u32 {
        (rate / 10.0).ceil().max(10.0) as u32
    }

    /// The server said 429. Returns whether the rate was cut (once per episode).
    pub fn throttled(&mut self, now: Instant, retry_after: Option<Duration>) -> bool {
        let hold = retry_after.unwrap_or_default().max(CUT_EPISODE);
        self.hold_until = self.hold_until.max(now + hold);
        if self.last_cut.is_some_and(|t| now < t + CUT_EPISODE) {
            return false;
        }
        self.last_cut = Some(now);
        let cut = (self.rate / 2.0).max(self.min);
        let changed = cut < self.rate;
        self.rate = cut;
        changed
    }

    /// A request waited for a token.
    pub fn waited(&mut self) {
        self.wanted_more = true;
    }

    /// Grows the rate when a growth step is due, demand was there and no hold is on. Returns
    /// whether it changed.
    pub fn tick(&mut self, now: Instant) -> bool {
        if now < self.hold_until || now < self.last_growth + GROWTH_STEP {
            return false;
        }
        self.last_growth = now;
        if !std::mem::take(&mut self.wanted_more) {
            return false;
        }
        let grown = (self.rate * 1.1).max(self.rate + 1.0).min(self.max);
        let changed = grown > self.rate;
        self.rate = grown;
        changed
    }
}

/// Bounds of the adaptive rate, in requests per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    pub start: f64,
    pub min: f64,
    pub max: f64,
}

/// What a client's requests are held to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Unlimited,
    Static { qps: f32, burst: u32 },
    Adaptive(Adaptive),
}

impl Limit {
    /// The rate the in-flight windows are sized for: the static rate, the adaptive ceiling, or
    /// 0 (no limit).
    pub fn nominal_qps(&self) -> f32 {
        match self {
            Limit::Unlimited => 0.0,
            Limit::Static { qps, .. } => *qps,
            Limit::Adaptive(a) => a.max as f32,
        }
    }
}

#[derive(Debug)]
struct Limiter {
    bucket: Bucket,
    aimd: Option<Aimd>,
}

impl Limiter {
    fn retune(&mut self, now: Instant, host: &str) {
        if let Some(a) = &self.aimd {
            self.bucket.set_rate(a.rate(), Aimd::burst(a.rate()), now);
            crate::clientmetrics::limit_set(host, a.rate());
        }
    }
}

/// A shared limiter. Each request's wait is recorded in
/// `rest_client_rate_limiter_duration_seconds` under `host`.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    limiter: Option<Arc<Mutex<Limiter>>>,
    adaptive: bool,
    host: Arc<str>,
}

impl RateLimitLayer {
    /// A static bucket; `qps <= 0` means unlimited.
    pub fn new(qps: f32, burst: u32) -> Self {
        let limit = if qps > 0.0 {
            Limit::Static { qps, burst }
        } else {
            Limit::Unlimited
        };
        Self::for_host(limit, "")
    }

    /// No limit and no gauge: for a client whose traffic must never wait (leader election).
    pub fn unlimited() -> Self {
        Self {
            limiter: None,
            adaptive: false,
            host: "".into(),
        }
    }

    pub fn for_host(limit: Limit, host: &str) -> Self {
        let now = Instant::now();
        let limiter = match limit {
            Limit::Unlimited => None,
            Limit::Static { qps, .. } if qps <= 0.0 => None,
            Limit::Static { qps, burst } => Some(Limiter {
                bucket: Bucket::new(f64::from(qps), burst, now),
                aimd: None,
            }),
            Limit::Adaptive(a) => {
                let aimd = Aimd::new(a, now);
                Some(Limiter {
                    bucket: Bucket::new(aimd.rate(), Aimd::burst(aimd.rate()), now),
                    aimd: Some(aimd),
                })
            }
        };
        crate::clientmetrics::limit_set(host, limiter.as_ref().map_or(0.0, |l| l.bucket.qps()));
        Self {
            adaptive: matches!(limit, Limit::Adaptive(_)),
            limiter: limiter.map(|l| Arc::new(Mutex::new(l))),
            host: host.into(),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            limiter: self.limiter.clone(),
            adaptive: self.adaptive,
            host: self.host.clone(),
            wait: None,
            waited: Duration::ZERO,
            permitted: false,
        }
    }
}

/// The service: `poll_ready` waits for a token, then for the inner service; an adaptive
/// limiter also reads each response's status.
pub struct RateLimit<S> {
    inner: S,
    limiter: Option<Arc<Mutex<Limiter>>>,
    adaptive: bool,
    host: Arc<str>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The wait the permitted request was given (recorded once the request, and with it its
    /// verb, is known).
    waited: Duration,
    permitted: bool,
}

/// A poisoned lock only means another request panicked mid-arithmetic; the numbers are still
/// usable.
fn lock(l: &Mutex<Limiter>) -> std::sync::MutexGuard<'_, Limiter> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S, B, RB> Service<http::Request<B>> for RateLimit<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answered<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.permitted {
            if let Some(limiter) = &self.limiter {
                if self.wait.is_none() {
                    let now = Instant::now();
                    let mut l = lock(limiter);
                    if l.aimd.as_mut().is_some_and(|a| a.tick(now)) {
                        l.retune(now, &self.host);
                    }
                    let delay = l.bucket.reserve(now);
                    if !delay.is_zero()
                        && let Some(a) = l.aimd.as_mut()
                    {
                        a.waited();
                    }
                    drop(l);
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
        if self.limiter.is_some() {
            crate::clientmetrics::limiter_waited(
                req.method().as_str(),
                &self.host,
                self.waited.as_secs_f64(),
            );
        }
        Answered {
            inner: Box::pin(self.inner.call(req)),
            adaptive: self.limiter.clone().filter(|_| self.adaptive),
            host: self.host.clone(),
        }
    }
}

/// A request's response, read by an adaptive limiter for 429s.
pub struct Answered<F> {
    inner: Pin<Box<F>>,
    adaptive: Option<Arc<Mutex<Limiter>>>,
    host: Arc<str>,
}

impl<F, RB, E> Future for Answered<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = std::task::ready!(self.inner.as_mut().poll(cx));
        if let (Some(limiter), Ok(resp)) = (&self.adaptive, &out)
            && resp.status() == http::StatusCode::TOO_MANY_REQUESTS
        {
            let now = Instant::now();
            let mut l = lock(limiter);
            if l.aimd
                .as_mut()
                .is_some_and(|a| a.throttled(now, retry_after(resp)))
            {
                l.retune(now, &self.host);
                crate::clientmetrics::limit_cut(&self.host);
            }
        }
        Poll::Ready(out)
    }
}

/// `Retry-After` in seconds (what APF sends); an HTTP date is ignored.
fn retry_after<RB>(resp: &http::Response<RB>) -> Option<Duration> {
    let v = resp.headers().get(http::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
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

    const LIMITS: Adaptive = Adaptive {
        start: 400.0,
        min: 10.0,
        max: 1000.0,
    };

    #[test]
    fn a_throttling_episode_halves_the_rate_once() {
        let t0 = Instant::now();
        let mut a = Aimd::new(LIMITS, t0);
        assert!(a.throttled(t0, None));
        assert_eq!(a.rate(), 200.0);
        // The other in-flight requests' 429s belong to the same episode.
        for ms in [1, 100, 999] {
            assert!(!a.throttled(t0 + Duration::from_millis(ms), None));
        }
        assert_eq!(a.rate(), 200.0);
        assert!(a.throttled(t0 + Duration::from_millis(1000), None));
        assert_eq!(a.rate(), 100.0);
        for s in 2..20 {
            a.throttled(t0 + Duration::from_secs(s), None);
        }
        assert_eq!(a.rate(), 10.0, "never below the floor");
    }

    #[test]
    fn the_rate_grows_a_tenth_a_second_only_while_requests_wait_and_no_hold_is_on() {
        let t0 = Instant::now();
        let mut a = Aimd::new(LIMITS, t0);
        let s = |n: u64| t0 + Duration::from_secs(n);
        assert!(!a.tick(s(1)), "no demand, no growth");
        a.waited();
        assert!(!a.tick(s(1) + Duration::from_millis(500)), "one step a second");
        assert!(a.tick(s(2)));
        assert!((a.rate() - 440.0).abs() < 1e-9, "{}", a.rate());
        // A 429 with Retry-After: 5 holds growth for five seconds, demand or not.
        a.throttled(s(3), Some(Duration::from_secs(5)));
        assert!((a.rate() - 220.0).abs() < 1e-9, "{}", a.rate());
        for n in 4..8 {
            a.waited();
            assert!(!a.tick(s(n)), "held at {n}s");
        }
        a.waited();
        assert!(a.tick(s(8)));
        for n in 9..200 {
            a.waited();
            a.tick(s(n));
        }
        assert_eq!(a.rate(), 1000.0, "capped at the ceiling");
    }

    #[tokio::test]
    async fn a_429_through_the_layer_cuts_the_rate_a_200_does_not() {
        use tower::ServiceExt;
        let status = Arc::new(Mutex::new(http::StatusCode::OK));
        let answer = status.clone();
        let inner = tower::service_fn(move |_req: http::Request<()>| {
            let code = *answer.lock().unwrap();
            async move {
                let mut resp = http::Response::new(());
                *resp.status_mut() = code;
                resp.headers_mut()
                    .insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("3"));
                Ok::<_, std::convert::Infallible>(resp)
            }
        });
        let layer = RateLimitLayer::for_host(Limit::Adaptive(LIMITS), "test-host");
        let mut svc = layer.layer(inner);
        let rate = |l: &RateLimitLayer| lock(l.limiter.as_ref().unwrap()).bucket.qps();
        svc.ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await
            .unwrap();
        assert_eq!(rate(&layer), 400.0);
        *status.lock().unwrap() = http::StatusCode::TOO_MANY_REQUESTS;
        svc.ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await
            .unwrap();
        assert_eq!(rate(&layer), 200.0, "halved on 429");
        let hold = lock(layer.limiter.as_ref().unwrap())
            .aimd
            .clone()
            .unwrap()
            .hold_until;
        assert!(hold >= Instant::now() + Duration::from_secs(3) - Duration::from_millis(1));
    }

    proptest::proptest! {
        /// Whatever the server answers and whenever, the adaptive rate stays within its bounds.
        #[test]
        fn the_adaptive_rate_stays_within_its_bounds(events in proptest::collection::vec((0u64..3000, 0u8..3), 1..300)) {
            let t0 = Instant::now();
            let mut a = Aimd::new(LIMITS, t0);
            let mut now = t0;
            for (gap, what) in events {
                now += Duration::from_millis(gap);
                match what {
                    0 => { a.throttled(now, None); }
                    1 => a.waited(),
                    _ => { a.tick(now); }
                }
                proptest::prop_assert!(a.rate() >= LIMITS.min && a.rate() <= LIMITS.max);
            }
        }

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
