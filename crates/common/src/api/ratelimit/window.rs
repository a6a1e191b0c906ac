//! The adaptive limit: a window on requests in flight that the apiserver's 429s narrow and
//! waiting demand widens (the rules are in the parent module's documentation).

use std::time::Duration;

use tokio::time::Instant;

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
    pub(super) hold_until: Instant,
    last_growth: Instant,
    /// A request had to wait for a slot since the last growth step: a wider window would be used.
    wanted_more: bool,
    pub(super) in_flight: usize,
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::api::ratelimit) const LIMITS: Adaptive = Adaptive {
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
    }
}
