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
//!
//! The two arithmetics are pure and live in `bucket.rs` and `window.rs`; this file is the tower
//! layer that applies them to requests and reports them in the client metrics.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
use tokio::time::Instant;
use tower::{Layer, Service};

mod bucket;
mod window;

pub use bucket::Bucket;
pub use window::{Adaptive, Window};

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
        crate::api::clientmetrics::concurrency_limit_set(&self.host, w.limit() as f64);
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
        crate::api::clientmetrics::limit_set(host, limiter.as_ref().map_or(0.0, |l| l.bucket.qps()));
        crate::api::clientmetrics::limit_cuts_start(host);
        crate::api::clientmetrics::concurrency_limit_set(
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
            crate::api::clientmetrics::limiter_waited(
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
                    crate::api::clientmetrics::limit_cut(&shared.host);
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
    use super::window::tests::LIMITS;
    use super::*;

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
}
