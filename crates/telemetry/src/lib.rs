//! What every valet part reports the same way: OpenTelemetry instruments exported
//! through a Prometheus registry of their own (so parts in one process, as in tests,
//! never share counts), rendered as exposition text for `/metrics`.

#![forbid(unsafe_code)]

use std::fmt;

use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::metrics::SdkMeterProvider;

/// Bucket bounds (seconds) for latency histograms: fine below a second, out to a minute.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 30.0, 60.0,
];

/// A meter with its own Prometheus registry.
pub struct Registry {
    registry: prometheus::Registry,
    provider: SdkMeterProvider,
    meter: Meter,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Registry {
    /// A fresh registry whose instruments belong to the meter `name`.
    pub fn new(name: &'static str) -> Self {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .expect("a fresh registry accepts the exporter");
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let meter = provider.meter(name);
        Self {
            registry,
            provider,
            meter,
        }
    }

    /// The meter to create instruments with.
    pub fn meter(&self) -> &Meter {
        &self.meter
    }

    /// The Prometheus registry itself, for the few hot-path instruments kept as plain
    /// Prometheus collectors (label values resolved once, no attribute hashing).
    pub fn prometheus(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// Every metric as Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let _ = &self.provider;
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# error encoding metrics: {e}\n"))
    }

    /// The value of one series of [`Self::render`]'s output: see [`sample_of`].
    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample_of(&self.render(), name, labels)
    }
}

/// Reads a sample out of Prometheus text: the series called `name` whose labels include
/// `labels`, summed over the other labels; 0 when absent.
pub fn sample_of(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (series_name, series_labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
            None => (series, ""),
        };
        if series_name != name {
            continue;
        }
        let pairs: Vec<(&str, &str)> = series_labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        if labels.iter().all(|want| pairs.contains(want)) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_samples() {
        let r = Registry::new("test");
        let c = r.meter().u64_counter("valet.test.things").build();
        c.add(2, &[opentelemetry::KeyValue::new("kind", "a")]);
        c.add(3, &[opentelemetry::KeyValue::new("kind", "b")]);
        assert_eq!(r.sample("valet_test_things_total", &[("kind", "a")]), 2.0);
        assert_eq!(r.sample("valet_test_things_total", &[]), 5.0);
        assert_eq!(r.sample("absent", &[]), 0.0);
    }
}
