//! `/metrics`: Prometheus text exposition (format 0.0.4) of requests by endpoint and status,
//! response body bytes by endpoint, and request durations (from the request's arrival to the
//! end of its response body) by endpoint, as a histogram in seconds.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// Upper bounds (seconds) of the duration histogram's buckets (`+Inf` follows).
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0];

#[derive(Default)]
struct Endpoint {
    /// Responses by status code.
    requests: BTreeMap<u16, u64>,
    bytes: u64,
    /// Count of durations at most `BUCKETS[i]` (not cumulative; summed when printed).
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// The server's counters, shared by all connections.
#[derive(Default)]
pub struct Metrics {
    endpoints: Mutex<BTreeMap<&'static str, Endpoint>>,
}

impl Metrics {
    fn record(&self, endpoint: &'static str, status: u16, bytes: u64, seconds: f64) {
        let mut all = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        let e = all.entry(endpoint).or_default();
        *e.requests.entry(status).or_default() += 1;
        e.bytes += bytes;
        e.count += 1;
        e.sum += seconds;
        if let Some(i) = BUCKETS.iter().position(|b| seconds <= *b) {
            e.buckets[i] += 1;
        }
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let all = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        out.push_str(
            "# HELP sluice_serve_requests_total Requests answered, by endpoint and status.\n# TYPE sluice_serve_requests_total counter\n",
        );
        for (name, e) in all.iter() {
            for (status, n) in &e.requests {
                let _ = writeln!(out, "sluice_serve_requests_total{{endpoint=\"{name}\",status=\"{status}\"}} {n}");
            }
        }
        out.push_str("# HELP sluice_serve_response_bytes_total Response body bytes sent, by endpoint.\n# TYPE sluice_serve_response_bytes_total counter\n");
        for (name, e) in all.iter() {
            let _ = writeln!(out, "sluice_serve_response_bytes_total{{endpoint=\"{name}\"}} {}", e.bytes);
        }
        out.push_str("# HELP sluice_serve_request_duration_seconds From a request's arrival to the end of its response body.\n# TYPE sluice_serve_request_duration_seconds histogram\n");
        for (name, e) in all.iter() {
            let mut cumulative = 0;
            for (bound, n) in BUCKETS.iter().zip(e.buckets) {
                cumulative += n;
                let _ = writeln!(out, "sluice_serve_request_duration_seconds_bucket{{endpoint=\"{name}\",le=\"{bound}\"}} {cumulative}");
            }
            let _ = writeln!(out, "sluice_serve_request_duration_seconds_bucket{{endpoint=\"{name}\",le=\"+Inf\"}} {}", e.count);
            let _ = writeln!(out, "sluice_serve_request_duration_seconds_sum{{endpoint=\"{name}\"}} {}", e.sum);
            let _ = writeln!(out, "sluice_serve_request_duration_seconds_count{{endpoint=\"{name}\"}} {}", e.count);
        }
        out
    }
}

/// A response body that counts its bytes and, when it is dropped (sent in full, or abandoned
/// by the client), records the request in [`Metrics`] and writes its access log line (at
/// `info`, `sluice serve -v`): the client, the request line, the status, the body's bytes
/// and the time from the request's arrival.
pub struct Metered<B> {
    inner: B,
    metrics: Arc<Metrics>,
    endpoint: &'static str,
    status: u16,
    started: Instant,
    bytes: u64,
    /// `CLIENT "METHOD TARGET VERSION"`.
    request: String,
}

impl<B> Metered<B> {
    pub fn new(inner: B, metrics: Arc<Metrics>, endpoint: &'static str, status: u16, started: Instant, request: String) -> Self {
        Metered { inner, metrics, endpoint, status, started, bytes: 0, request }
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        let secs = self.started.elapsed().as_secs_f64();
        self.metrics.record(self.endpoint, self.status, self.bytes, secs);
        tracing::info!(target: "sluice_serve::access", "{} {} {} bytes in {:.1} ms", self.request, self.status, self.bytes, secs * 1000.0);
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Metered<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
