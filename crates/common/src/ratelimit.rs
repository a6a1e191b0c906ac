//! Client-side limits for API requests.
//!
//! - **static**: a token bucket (`Bucket`, the shape of client-go's `--kube-api-qps` /
//!   `--kube-api-burst`), so stowage and kube-controller-manager can be compared at equal limits,
//!   and for operators who want a hard cap;
//! - **adaptive**: a bucket at a high ceiling plus a window on requests in flight (`Window`) that
//!   the apiserver's answers move. API Priority and Fairness grants each priority level a number
//!   of *seats* (requests executing at once) and answers 429 (with `Retry-After`) when the
//!   level's seats and queues are full; so the window is what adapts, not a rate. A 429 halves it,
//!   once per generation (only a request sent since the last cut can tell that the halved window
//!   is still too wide); it grows by a tenth (at least one) a second while requests wait for it
//!   and no hold is on. Watches are not counted: APF frees their seat once they are set up.
//!   Latency is not a signal: APF queueing and a shared machine raise it for reasons this client
//!   cannot fix, and cutting on it would leave capacity unused.
//!
//! Like golang.org/x/time/rate's `Wait`, a request that finds the bucket empty *reserves* a future
//! token and sleeps until it is due; reservations queue in arrival order.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
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

    pub fn qps(&self) -> f64 {
        self.qps
    }
}

/// The adaptive window's arithmetic: multiplicative decrease once per generation, growth while
/// there is demand. Pure: the instants are arguments.
#[derive(Debug, Clone)]
pub struct Window {
    size: f64,
    min: f64,
    max: f64,
    /// Bumped by every cut; a request remembers the generation it was sent in.
    generation: u64,
    /// No growth before this: a second after a cut, or the server's `Retry-After`.
    hold_until: Instant,
    last_growth: Instant,
    /// A request had to wait for a slot since the last growth step: a wider window would be used.
    wanted_more: bool,
    in_flight: usize,
}

const MIN_HOLD: Duration = Duration::from_secs(1);
const GROWTH_STEP: Duration = Duration::from_secs(1);

impl Window {
    pub fn new(limits: Adaptive, now: Instant) -> Self {
        Self {
            size: limits.start.clamp(limits.min, limits.max),
            min: limits.min.max(1.0),
            max: limits.max,
            generation: 0,
            hold_until: now,
            last_growth: now,
            wanted_more: false,
            in_flight: 0,
        }
    }

    /// Requests allowed in flight now.
    pub fn limit(&self) -> usize {
        self.size.floor().max(1.0) as usize
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Takes a slot if one is free, returning its generation.
    pub fn try_acquire(&mut self) -> Option<u64> {
        if self.in_flight < self.limit() {
            self.in_flight += 1;
            Some(self.generation)
        } else {
            self.wanted_more = true;
            None
        }
    }

    pub fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The server answered 429 to a request sent in generation `sent_in`. Returns whether the
    /// window was cut: answers to requests sent before the last cut are already accounted for.
    pub fn throttled(&mut self, now: Instant, retry_after: Option<Duration>, sent_in: u64) -> bool {
        let hold = retry_after.unwrap_or_default().max(MIN_HOLD);
        self.hold_until = self.hold_until.max(now + hold);
        if sent_in != self.generation {
            return false;
        }
        self.generation += 1;
        let cut = (self.size / 2.0).max(self.min);
        let changed = cut < self.size;
        self.size = cut;
        changed
    }

    /// Grows the window when a growth step is due, demand was there and no hold is on. Returns
    /// whether it changed.
    pub fn tick(&mut self, now: Instant) -> bool {
        if now < self.hold_until || now < self.last_growth + GROWTH_STEP {
            return false;
        }
        self.last_growth = now;
        if !std::mem::take(&mut self.wanted_more) {
            return false;
        }
        let grown = (self.size * 1.1).max(self.size + 1.0).min(self.max);
        let changed = grown > self.size;
        self.size = grown;
        changed
    }
}

/// Bounds of the adaptive window, in requests in flight (watches not counted), and the ceiling
/// rate of the bucket beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    pub start: f64,
    pub min: f64,
    pub max: f64,
    pub max_qps: f32,
}

/// What a client's requests are held to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Unlimited,
    Static { qps: f32, burst: u32 },
    Adaptive(Adaptive),
}

impl Limit {
    /// The rate the in-flight windows of the controllers are sized for: the static rate, the
    /// adaptive ceiling, or 0 (no limit).
    pub fn nominal_qps(&self) -> f32 {
        match self {
            Limit::Unlimited => 0.0,
            Limit::Static { qps, .. } => *qps,
            Limit::Adaptive(a) => a.max_qps,
        }
    }
}

#[derive(Debug)]
struct Limiter {
    bucket: Bucket,
    window: Option<Window>,
}

/// What a limiter shares between the service and its requests' answers.
#[derive(Debug)]
struct Shared {
    limiter: Mutex<Limiter>,
    /// Woken when a slot frees or the window grows.
    slots: Arc<Notify>,
    host: Arc<str>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Limiter> {
        // A poisoned lock only means another request panicked mid-arithmetic; the numbers are
        // still usable.
        self.limiter.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn window_gauge(&self, w: &Window) {
        crate::clientmetrics::concurrency_limit_set(&self.host, w.limit() as f64);
    }
}

/// A slot in the window, held by one request until its answer comes (or it is dropped).
struct Slot {
    shared: Arc<Shared>,
    generation: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(w) = self.shared.lock().window.as_mut() {
            w.release();
        }
        self.shared.slots.notify_waiters();
    }
}

/// A shared limiter. Each request's wait is recorded in
/// `rest_client_rate_limiter_duration_seconds` under `host`.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    shared: Option<Arc<Shared>>,
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
        Self { shared: None }
    }

    pub fn for_host(limit: Limit, host: &str) -> Self {
        let now = Instant::now();
        let limiter = match limit {
            Limit::Unlimited => None,
            Limit::Static { qps, .. } if qps <= 0.0 => None,
            Limit::Static { qps, burst } => Some(Limiter {
                bucket: Bucket::new(f64::from(qps), burst, now),
                window: None,
            }),
            Limit::Adaptive(a) => {
                let qps = f64::from(a.max_qps);
                // A tenth of a second's worth at once, at least 10 for start-up lists.
                let burst = (qps / 10.0).ceil().max(10.0) as u32;
                Some(Limiter {
                    bucket: Bucket::new(qps, burst, now),
                    window: Some(Window::new(a, now)),
                })
            }
        };
        crate::clientmetrics::limit_set(host, limiter.as_ref().map_or(0.0, |l| l.bucket.qps()));
        crate::clientmetrics::limit_cuts_start(host);
        crate::clientmetrics::concurrency_limit_set(
            host,
            limiter
                .as_ref()
                .and_then(|l| l.window.as_ref())
                .map_or(0.0, |w| w.limit() as f64),
        );
        Self {
            shared: limiter.map(|l| {
                Arc::new(Shared {
                    limiter: Mutex::new(l),
                    slots: Arc::new(Notify::new()),
                    host: host.into(),
                })
            }),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            shared: self.shared.clone(),
            slot_wait: None,
            slot: None,
            wait: None,
            since: None,
            waited: Duration::ZERO,
            reserved: false,
            permitted: false,
        }
    }
}

/// The service: `poll_ready` waits for a slot in the window (adaptive), then for a token, then
/// for the inner service; an adaptive limiter also reads each response's status.
pub struct RateLimit<S> {
    inner: S,
    shared: Option<Arc<Shared>>,
    /// Registered for a wake-up while the window is full.
    slot_wait: Option<Pin<Box<OwnedNotified>>>,
    slot: Option<Slot>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    /// When the request being readied started waiting.
    since: Option<Instant>,
    /// The wait the permitted request was given (recorded once the request, and with it its
    /// method, is known).
    waited: Duration,
    /// A token was reserved for the request being readied (its wait may be zero).
    reserved: bool,
    permitted: bool,
}

impl<S> RateLimit<S> {
    /// Takes a slot of the window when there is one; `Pending` (woken by a release or growth)
    /// when it is full.
    fn poll_slot(&mut self, cx: &mut Context<'_>, shared: &Arc<Shared>) -> Poll<()> {
        while self.slot.is_none() {
            // Registered before looking, so a release between the look and the wait is not lost.
            let mut wake = self
                .slot_wait
                .take()
                .unwrap_or_else(|| Box::pin(shared.slots.clone().notified_owned()));
            wake.as_mut().enable();
            {
                let mut l = shared.lock();
                let Some(w) = l.window.as_mut() else {
                    return Poll::Ready(());
                };
                if w.tick(Instant::now()) {
                    shared.window_gauge(w);
                }
                if let Some(generation) = w.try_acquire() {
                    self.slot = Some(Slot {
                        shared: shared.clone(),
                        generation,
                    });
                    break;
                }
            }
            match wake.as_mut().poll(cx) {
                Poll::Ready(()) => continue,
                Poll::Pending => {
                    self.slot_wait = Some(wake);
                    return Poll::Pending;
                }
            }
        }
        self.slot_wait = None;
        Poll::Ready(())
    }
}

/// A watch holds its connection open for minutes; APF does not count it against the level's
/// seats once it is established, and neither does the window.
fn is_watch<B>(req: &http::Request<B>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

impl<S, B, RB> Service<http::Request<B>> for RateLimit<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answered<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.permitted
            && let Some(shared) = self.shared.clone()
        {
            let since = *self.since.get_or_insert_with(Instant::now);
            std::task::ready!(self.poll_slot(cx, &shared));
            if self.wait.is_none() && !self.reserved {
                self.reserved = true;
                let now = Instant::now();
                let delay = shared.lock().bucket.reserve(now);
                // No timer for a token that is free now (most requests, below the ceiling).
                if !delay.is_zero() {
                    self.wait = Some(Box::pin(tokio::time::sleep_until(now + delay)));
                }
            }
            if let Some(w) = self.wait.as_mut() {
                std::task::ready!(w.as_mut().poll(cx));
                self.wait = None;
            }
            // The whole wait: for a slot in the window, then for a token.
            self.waited = since.elapsed();
            self.since = None;
        }
        self.permitted = true;
        self.reserved = false;
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        self.permitted = false;
        let mut slot = self.slot.take();
        if let Some(shared) = &self.shared {
            crate::clientmetrics::limiter_waited(
                req.method().as_str(),
                &shared.host,
                self.waited.as_secs_f64(),
            );
            if is_watch(&req) {
                slot = None;
            }
        }
        Answered {
            inner: Box::pin(self.inner.call(req)),
            slot,
        }
    }
}

/// A request's response: frees its slot and, on a 429, narrows the window.
pub struct Answered<F> {
    inner: Pin<Box<F>>,
    slot: Option<Slot>,
}

impl<F, RB, E> Future for Answered<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = std::task::ready!(self.inner.as_mut().poll(cx));
        if let Some(slot) = self.slot.take() {
            if let Ok(resp) = &out
                && resp.status() == http::StatusCode::TOO_MANY_REQUESTS
            {
                let shared = &slot.shared;
                let mut l = shared.lock();
                if let Some(w) = l.window.as_mut()
                    && w.throttled(Instant::now(), retry_after(resp), slot.generation)
                {
                    shared.window_gauge(w);
                    crate::clientmetrics::limit_cut(&shared.host);
                }
            }
            drop(slot);
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
        start: 32.0,
        min: 1.0,
        max: 512.0,
        max_qps: 2000.0,
    };

    #[test]
    fn a_429_halves_the_window_once_per_generation() {
        let t0 = Instant::now();
        let mut w = Window::new(LIMITS, t0);
        let sent: Vec<u64> = (0..32).map(|_| w.try_acquire().unwrap()).collect();
        assert_eq!(w.try_acquire(), None, "full at 32");
        // Every request of the first generation is answered 429: one cut, not 32.
        assert!(w.throttled(t0, None, sent[0]));
        for g in &sent[1..] {
            assert!(!w.throttled(t0, None, *g));
        }
        assert_eq!(w.limit(), 16);
        // A request sent after the cut that is refused too cuts again.
        sent.iter().for_each(|_| w.release());
        let g = w.try_acquire().unwrap();
        assert!(w.throttled(t0, None, g));
        assert_eq!(w.limit(), 8);
        for _ in 0..10 {
            let g = w.generation();
            w.throttled(t0, None, g);
        }
        assert_eq!(w.limit(), 1, "never below one in flight");
    }

    #[test]
    fn the_window_grows_only_while_requests_wait_and_no_hold_is_on() {
        let t0 = Instant::now();
        let mut w = Window::new(LIMITS, t0);
        let s = |n: u64| t0 + Duration::from_secs(n);
        assert!(!w.tick(s(1)), "no demand, no growth");
        (0..32).for_each(|_| assert!(w.try_acquire().is_some()));
        assert_eq!(w.try_acquire(), None, "a request waits: demand");
        assert!(!w.tick(s(1) + Duration::from_millis(500)), "one step a second");
        assert!(w.tick(s(2)));
        assert_eq!(w.limit(), 35, "a tenth more");
        // A 429 with Retry-After: 5 holds growth for five seconds, demand or not.
        let g = w.generation();
        w.throttled(s(3), Some(Duration::from_secs(5)), g);
        assert_eq!(w.limit(), 17);
        for n in 4..8 {
            assert_eq!(w.try_acquire(), None);
            assert!(!w.tick(s(n)), "held at {n}s");
        }
        assert_eq!(w.try_acquire(), None);
        assert!(w.tick(s(8)));
        assert_eq!(w.limit(), 19, "a tenth of 17.5 more");
        for n in 9..200 {
            while w.try_acquire().is_some() {}
            w.tick(s(n));
        }
        assert_eq!(w.limit(), 512, "capped at the ceiling");
        // Small windows grow by one a step (a tenth of 2 would never reach the next integer).
        let mut small = Window::new(Adaptive { start: 2.0, ..LIMITS }, t0);
        while small.try_acquire().is_some() {}
        assert!(small.tick(s(1)));
        assert_eq!(small.limit(), 3);
    }

    fn answering(
        status: Arc<Mutex<http::StatusCode>>,
    ) -> impl Service<
        http::Request<()>,
        Response = http::Response<()>,
        Error = std::convert::Infallible,
        Future = impl Future<Output = Result<http::Response<()>, std::convert::Infallible>>,
    > + Clone {
        tower::service_fn(move |_req: http::Request<()>| {
            let code = *status.lock().unwrap();
            async move {
                let mut resp = http::Response::new(());
                *resp.status_mut() = code;
                resp.headers_mut()
                    .insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("3"));
                Ok(resp)
            }
        })
    }

    fn window_of(layer: &RateLimitLayer) -> Window {
        layer.shared.as_ref().unwrap().lock().window.clone().unwrap()
    }

    #[tokio::test]
    async fn a_429_through_the_layer_narrows_the_window_a_200_does_not() {
        use tower::ServiceExt;
        let status = Arc::new(Mutex::new(http::StatusCode::OK));
        let layer = RateLimitLayer::for_host(Limit::Adaptive(LIMITS), "test-host");
        let mut svc = layer.layer(answering(status.clone()));
        svc.ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await
            .unwrap();
        assert_eq!(window_of(&layer).limit(), 32);
        assert_eq!(
            window_of(&layer).in_flight,
            0,
            "the slot is freed with the answer"
        );
        *status.lock().unwrap() = http::StatusCode::TOO_MANY_REQUESTS;
        svc.ready()
            .await
            .unwrap()
            .call(http::Request::new(()))
            .await
            .unwrap();
        let w = window_of(&layer);
        assert_eq!(w.limit(), 16, "halved on 429");
        assert!(w.hold_until >= Instant::now() + Duration::from_secs(3) - Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_full_window_holds_the_next_request_until_a_slot_frees_and_watches_take_none() {
        use tower::ServiceExt;
        let layer =
            RateLimitLayer::for_host(Limit::Adaptive(Adaptive { start: 1.0, ..LIMITS }), "test-host-2");
        let mut svc = layer.layer(answering(Arc::new(Mutex::new(http::StatusCode::OK))));
        // A watch passes and leaves the one slot free.
        let watch = http::Request::builder()
            .uri("/api/v1/pods?watch=true&resourceVersion=1")
            .body(())
            .unwrap();
        let w = svc.ready().await.unwrap().call(watch);
        assert_eq!(window_of(&layer).in_flight, 0);
        let first = svc.ready().await.unwrap().call(http::Request::new(()));
        assert_eq!(window_of(&layer).in_flight, 1);
        // The window is full: the next request is not ready until the first is answered.
        let held = tokio::time::timeout(Duration::from_millis(200), svc.ready()).await;
        assert!(held.is_err(), "a second request got a slot of a window of one");
        assert_eq!(window_of(&layer).in_flight, 1);
        first.await.unwrap();
        w.await.unwrap();
        assert_eq!(window_of(&layer).in_flight, 0);
        // Woken by the release, the waiting request gets the slot.
        tokio::time::timeout(Duration::from_secs(10), svc.ready())
            .await
            .expect("ready once the slot was freed")
            .unwrap();
        assert_eq!(window_of(&layer).in_flight, 1);
    }

    proptest::proptest! {
        /// Whatever the server answers and whenever, the window stays within its bounds and never
        /// lets more requests in flight than its limit.
        #[test]
        fn the_window_stays_within_its_bounds(events in proptest::collection::vec((0u64..3000, 0u8..4), 1..300)) {
            let t0 = Instant::now();
            let mut w = Window::new(LIMITS, t0);
            let mut now = t0;
            let mut held: Vec<u64> = Vec::new();
            for (gap, what) in events {
                now += Duration::from_millis(gap);
                match what {
                    0 => if let Some(g) = held.pop() { w.throttled(now, None, g); w.release(); },
                    1 => if let Some(g) = w.try_acquire() { held.push(g) },
                    2 => if held.pop().is_some() { w.release() },
                    _ => { w.tick(now); }
                }
                proptest::prop_assert!(w.size >= LIMITS.min && w.size <= LIMITS.max);
                proptest::prop_assert!(held.len() <= LIMITS.max as usize);
                proptest::prop_assert_eq!(w.in_flight, held.len());
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
