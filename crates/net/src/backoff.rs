//! The one backoff of every retry loop.

use std::ops::Range;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Exponential waits between tries: `first`, then each wait `factor` times the one
/// before, at most `cap`, each stretched by a random fraction of itself drawn from the
/// jitter range (so that many clients that failed together do not all try again at the
/// same instant). Growth saturates (at [`Duration::MAX`] without a cap) rather than
/// panicking.
///
/// ```
/// # use std::time::Duration;
/// # use valet_net::Backoff;
/// let mut b = Backoff::new(Duration::from_millis(500)).cap(Duration::from_secs(5));
/// let waits: Vec<_> = (0..6).map(|_| b.next_delay()).collect();
/// assert_eq!(waits.last(), Some(&Duration::from_secs(5)));
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    next: Duration,
    factor: f64,
    cap: Duration,
    jitter: Range<f64>,
}

impl Backoff {
    /// Waits from `first`, doubling, with no cap and no jitter.
    pub fn new(first: Duration) -> Self {
        Self {
            first,
            next: first,
            factor: 2.0,
            cap: Duration::MAX,
            jitter: 0.0..0.0,
        }
    }

    /// Each wait `factor` times the one before (1.0: a constant wait).
    #[must_use]
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = factor;
        self
    }

    /// No wait longer than `cap` (before its jitter).
    #[must_use]
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self.next = self.next.min(cap);
        self
    }

    /// Each wait stretched by a fraction of itself drawn uniformly from `range`:
    /// `0.0..0.1` lengthens it by up to a tenth, `-0.5..0.0` shortens it by up to half.
    #[must_use]
    pub fn jitter(mut self, range: Range<f64>) -> Self {
        self.jitter = range;
        self
    }

    /// The next wait, with its jitter drawn.
    pub fn next_delay(&mut self) -> Duration {
        let u = if self.jitter.is_empty() {
            0.0
        } else {
            rand::random::<f64>()
        };
        self.next_delay_with(u)
    }

    /// The next wait for a given uniform draw `u` in `[0, 1)`.
    pub fn next_delay_with(&mut self, u: f64) -> Duration {
        let base = self.next;
        self.next = scale(base, self.factor).min(self.cap);
        let stretch = self.jitter.start + (self.jitter.end - self.jitter.start) * u;
        if stretch >= 0.0 {
            base.saturating_add(scale(base, stretch))
        } else {
            base.saturating_sub(scale(base, -stretch))
        }
    }

    /// The next wait before its jitter, without taking it (for a log line).
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Starts over from the first wait (after a try that succeeded).
    pub fn reset(&mut self) {
        self.next = self.first.min(self.cap);
    }

    /// Waits the next wait; `false` (at once) when `stop` is cancelled first.
    pub async fn wait(&mut self, stop: &CancellationToken) -> bool {
        let wait = self.next_delay();
        tokio::select! {
            () = tokio::time::sleep(wait) => true,
            () = stop.cancelled() => false,
        }
    }
}

fn scale(d: Duration, f: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() * f).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    #[test]
    fn doubles_up_to_its_cap_and_starts_over() {
        let mut b = Backoff::new(Duration::from_millis(500)).cap(Duration::from_secs(5));
        let waits: Vec<f64> = (0..7).map(|_| ms(b.next_delay())).collect();
        assert_eq!(
            waits,
            [500.0, 1000.0, 2000.0, 4000.0, 5000.0, 5000.0, 5000.0]
        );
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(500));
    }

    #[test]
    fn a_factor_and_a_stretch() {
        let mut b = Backoff::new(Duration::from_millis(100))
            .factor(1.1)
            .jitter(0.0..0.1);
        let waits: Vec<f64> = (0..5).map(|_| ms(b.next_delay_with(0.0))).collect();
        for (got, want) in waits.iter().zip([100.0, 110.0, 121.0, 133.1, 146.41]) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        let mut b = Backoff::new(Duration::from_millis(100)).jitter(0.0..0.1);
        let d = b.next_delay_with(0.999_999);
        assert!(d < Duration::from_millis(110) && d > Duration::from_micros(109_999));
    }

    #[test]
    fn jitter_stays_in_its_range_and_is_drawn() {
        let mut b = Backoff::new(Duration::from_millis(100))
            .factor(1.0)
            .jitter(-0.5..0.0);
        let mut shortened = false;
        for _ in 0..60 {
            let d = ms(b.next_delay());
            assert!((50.0..=100.0).contains(&d), "{d}");
            shortened |= d < 99.0;
        }
        assert!(shortened, "jitter is drawn");
    }

    #[test]
    fn growth_saturates_without_a_cap() {
        let mut b = Backoff::new(Duration::from_millis(100));
        let mut last = Duration::ZERO;
        for _ in 0..40 {
            let d = b.next_delay_with(0.0);
            assert!(d > last, "{d:?} after {last:?}");
            last = d;
        }
        for _ in 0..2000 {
            b.next_delay_with(0.5);
        }
        assert_eq!(b.next_delay(), Duration::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_its_time_or_at_the_stop() {
        let stop = CancellationToken::new();
        let mut b = Backoff::new(Duration::from_secs(1));
        let start = tokio::time::Instant::now();
        assert!(b.wait(&stop).await);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        let waiting = tokio::spawn({
            let stop = stop.clone();
            async move { b.wait(&stop).await }
        });
        tokio::task::yield_now().await;
        stop.cancel();
        assert!(!waiting.await.unwrap());
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(1),
            "the stop ends it at once"
        );
    }
}
