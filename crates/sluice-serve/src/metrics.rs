//! `/metrics`: Prometheus text exposition (format 0.0.4) of requests by endpoint and status,
//! response body bytes by endpoint, and request durations (from the request's arrival to the
//! end of its response body) by endpoint, as a histogram in seconds; for a pull-through cache,
//! per upstream, its narinfo answers, their latency, its failures and its NARs
//! ([`UpstreamCounts`]).

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

/// What one upstream of a pull-through cache did ([`crate::upstream`]).
#[derive(Default)]
pub struct UpstreamCounts {
    /// Narinfos it had (and the trusted keys accepted).
    pub hits: u64,
    /// Narinfos it did not have.
    pub misses: u64,
    /// Narinfos it had that no trusted key signed, or whose NAR is over the largest taken.
    pub refused: u64,
    /// Requests that failed or timed out (a narinfo request's skips it for a while), and NAR
    /// fetches that did not get the file whole (fetched again later).
    pub failures: u64,
    /// NARs fetched and checked.
    pub nars: u64,
    /// NARs that failed their check (never served).
    pub nar_failures: u64,
    /// Seconds the answered narinfo requests took, and their number.
    pub latency_sum: f64,
    pub latency_count: u64,
}

impl UpstreamCounts {
    /// A narinfo it had, answered in `took`.
    pub fn hit(&mut self, took: std::time::Duration) {
        self.hits += 1;
        self.answered(took);
    }

    /// A narinfo it did not have, answered in `took`.
    pub fn miss(&mut self, took: std::time::Duration) {
        self.misses += 1;
        self.answered(took);
    }

    fn answered(&mut self, took: std::time::Duration) {
        self.latency_sum += took.as_secs_f64();
        self.latency_count += 1;
    }
}

/// The server's counters, shared by all connections.
#[derive(Default)]
pub struct Metrics {
    endpoints: Mutex<BTreeMap<&'static str, Endpoint>>,
    upstreams: Mutex<BTreeMap<String, UpstreamCounts>>,
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

    /// Counts something upstream `url` did.
    pub fn upstream(&self, url: &str, count: impl FnOnce(&mut UpstreamCounts)) {
        count(self.upstreams.lock().unwrap_or_else(|p| p.into_inner()).entry(url.to_string()).or_default());
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = self.render_endpoints();
        self.render_upstreams(&mut out);
        out
    }

    fn render_upstreams(&self, out: &mut String) {
        let all = self.upstreams.lock().unwrap_or_else(|p| p.into_inner());
        if all.is_empty() {
            return;
        }
        type Counter = (&'static str, &'static str, fn(&UpstreamCounts) -> u64);
        let counters: [Counter; 6] = [
            ("narinfo_hits_total", "Narinfos an upstream had and the trusted keys accepted.", |c| c.hits),
            ("narinfo_misses_total", "Narinfos an upstream did not have.", |c| c.misses),
            ("narinfo_refused_total", "Narinfos an upstream had that no trusted key signed, or whose NAR is too large.", |c| c.refused),
            ("failures_total", "Requests to an upstream that failed or timed out, NAR fetches that broke.", |c| c.failures),
            ("nars_total", "NARs fetched from an upstream and checked.", |c| c.nars),
            ("nar_failures_total", "NARs from an upstream that failed their check.", |c| c.nar_failures),
        ];
        for (name, help, get) in counters {
            let _ = writeln!(out, "# HELP sluice_serve_upstream_{name} {help}\n# TYPE sluice_serve_upstream_{name} counter");
            for (url, c) in all.iter() {
                let _ = writeln!(out, "sluice_serve_upstream_{name}{{upstream=\"{url}\"}} {}", get(c));
            }
        }
        out.push_str("# HELP sluice_serve_upstream_narinfo_seconds Time an upstream took to answer a narinfo request.\n# TYPE sluice_serve_upstream_narinfo_seconds summary\n");
        for (url, c) in all.iter() {
            let _ = writeln!(out, "sluice_serve_upstream_narinfo_seconds_sum{{upstream=\"{url}\"}} {}", c.latency_sum);
            let _ = writeln!(out, "sluice_serve_upstream_narinfo_seconds_count{{upstream=\"{url}\"}} {}", c.latency_count);
        }
    }

    fn render_endpoints(&self) -> String {
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

/// What the access log says of a request: `CLIENT "METHOD TARGET VERSION"`, written out only
/// when the line is logged.
pub struct RequestLine {
    pub client: Option<std::net::SocketAddr>,
    pub method: hyper::Method,
    pub target: hyper::Uri,
    pub version: hyper::Version,
}

impl std::fmt::Display for RequestLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.client {
            Some(client) => write!(f, "{client}")?,
            None => f.write_str("-")?,
        }
        write!(f, " \"{} {} {:?}\"", self.method, self.target, self.version)
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
    request: RequestLine,
}

impl<B> Metered<B> {
    pub fn new(inner: B, metrics: Arc<Metrics>, endpoint: &'static str, status: u16, started: Instant, request: RequestLine) -> Self {
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
