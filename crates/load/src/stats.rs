//! Summaries: counts by status and latency percentiles.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::record::Record;

/// Latency percentiles of a set of requests (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latencies {
    pub count: usize,
    pub min: Duration,
    pub median: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub mean: Duration,
}

impl Latencies {
    /// Percentiles of `samples`; `None` when empty.
    pub fn of(mut samples: Vec<Duration>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort();
        let n = samples.len();
        let rank = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        let total: Duration = samples.iter().sum();
        Some(Self {
            count: n,
            min: samples[0],
            median: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: samples[n - 1],
            mean: total / u32::try_from(n).unwrap_or(u32::MAX),
        })
    }
}

impl fmt::Display for Latencies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |d: Duration| format!("{:.3}s", d.as_secs_f64());
        write!(
            f,
            "n={} min {} median {} p90 {} p99 {} max {}",
            self.count,
            s(self.min),
            s(self.median),
            s(self.p90),
            s(self.p99),
            s(self.max)
        )
    }
}

/// What a set of records adds up to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub total: usize,
    pub by_status: BTreeMap<u16, usize>,
    /// Over every request.
    pub all: Option<Latencies>,
    /// Over the requests that got an HTTP answer (not a transport error, status 0).
    pub answered: Option<Latencies>,
    /// Over the 200s.
    pub ok: Option<Latencies>,
}

impl Summary {
    pub fn of<'a>(records: impl IntoIterator<Item = &'a Record>) -> Self {
        let mut by_status = BTreeMap::new();
        let mut all = Vec::new();
        let mut ok = Vec::new();
        let mut answered = Vec::new();
        for r in records {
            *by_status.entry(r.status).or_insert(0) += 1;
            all.push(r.latency());
            if r.status != 0 {
                answered.push(r.latency());
            }
            if r.status == 200 {
                ok.push(r.latency());
            }
        }
        Self {
            total: all.len(),
            by_status,
            all: Latencies::of(all),
            answered: Latencies::of(answered),
            ok: Latencies::of(ok),
        }
    }

    pub fn count(&self, status: u16) -> usize {
        self.by_status.get(&status).copied().unwrap_or(0)
    }

    /// The seed's results block: totals, 200, 503, other, and served latency.
    pub fn seed_block(&self) -> String {
        let other = self.total - self.count(200) - self.count(503);
        let latency = match &self.ok {
            Some(l) => format!(
                "avg {:.3}s, slowest {:.6}s",
                l.mean.as_secs_f64(),
                l.max.as_secs_f64()
            ),
            None => "none served".to_owned(),
        };
        format!(
            "==> results\n    total requests : {}\n    200 OK         : {}\n    503 unavailable: {}\n    other          : {}\n    200 latency    : {}\n",
            self.total,
            self.count(200),
            self.count(503),
            other,
            latency
        )
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let statuses: Vec<String> = self
            .by_status
            .iter()
            .map(|(s, n)| {
                format!(
                    "{}: {n}",
                    if *s == 0 {
                        "error".to_owned()
                    } else {
                        s.to_string()
                    }
                )
            })
            .collect();
        write!(f, "{} requests ({})", self.total, statuses.join(", "))?;
        // A refused connection answers in microseconds: it is no latency of the
        // system's, so the figure is of the answers only.
        if let Some(l) = &self.answered {
            write!(f, "; latency of the answers {l}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let l = Latencies::of((1..=100).map(ms).collect()).unwrap();
        assert_eq!(
            (l.min, l.median, l.p90, l.p99, l.max),
            (ms(1), ms(50), ms(90), ms(99), ms(100))
        );
        assert_eq!(l.mean, Duration::from_micros(50_500));
        let one = Latencies::of(vec![ms(7)]).unwrap();
        assert_eq!((one.median, one.p99, one.max), (ms(7), ms(7), ms(7)));
        assert!(Latencies::of(Vec::new()).is_none());
        let l = Latencies::of(vec![ms(30), ms(10), ms(20)]).unwrap();
        assert_eq!(l.median, ms(20));
    }

    #[test]
    fn summary_counts_and_seed_block() {
        let rec = |status, latency_ms| Record {
            label: "l".into(),
            actor: "demo/p1".into(),
            start: ms(0),
            end: ms(latency_ms),
            status,
            body: String::new(),
        };
        let records = [rec(200, 100), rec(200, 300), rec(503, 5000), rec(0, 1)];
        let s = Summary::of(&records);
        assert_eq!(s.total, 4);
        assert_eq!((s.count(200), s.count(503), s.count(0)), (2, 1, 1));
        assert_eq!(s.ok.unwrap().max, ms(300));
        assert_eq!(
            s.seed_block(),
            "==> results\n    total requests : 4\n    200 OK         : 2\n    503 unavailable: 1\n    other          : 1\n    200 latency    : avg 0.200s, slowest 0.300000s\n"
        );
    }
}
