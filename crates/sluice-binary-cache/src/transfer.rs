//! Watching a streamed download: how many bytes arrived, how many were announced, whether the
//! body ended or broke. After a NAR fails to unpack, [`TransferProbe::broken`] tells whether
//! the transfer itself was cut short (so a new attempt may succeed) and by how much.

use std::io::Read;
use std::sync::{Arc, Mutex};

#[derive(Debug)]
struct Transfer {
    url: String,
    received: u64,
    expected: Option<u64>,
    ended: bool,
    error: Option<String>,
}

/// Shared view of one download; the default probe (local files) never reports a break.
#[derive(Debug, Clone, Default)]
pub struct TransferProbe {
    inner: Option<Arc<Mutex<Transfer>>>,
}

impl TransferProbe {
    /// Wraps `reader`, the body of `url` announced as `expected` bytes (`None`: no
    /// `Content-Length`), in a reader that reports to the returned probe.
    pub fn watch<R: Read>(url: &str, expected: Option<u64>, reader: R) -> (ProbedReader<R>, TransferProbe) {
        let t = Arc::new(Mutex::new(Transfer { url: url.to_string(), received: 0, expected, ended: false, error: None }));
        (ProbedReader { inner: reader, state: t.clone() }, TransferProbe { inner: Some(t) })
    }

    /// Why the transfer broke in a way a new attempt may fix (an I/O error or timeout, fewer
    /// bytes than announced, or a body without length that ended before the consumer was
    /// satisfied); `None` when it did not. Meant to be asked after the consumer failed.
    pub fn broken(&self) -> Option<String> {
        let t = self.inner.as_ref()?.lock().unwrap_or_else(|p| p.into_inner());
        let (url, got) = (&t.url, t.received);
        let short = t.expected.filter(|n| got < *n).map(|n| format!("{url}: download truncated: received {got} of {n} bytes"));
        match (&t.error, short) {
            (Some(e), Some(s)) => Some(format!("{s} ({e})")),
            (Some(e), None) => Some(format!("{url}: download failed after {got} bytes: {e}")),
            (None, Some(s)) if t.ended => Some(s),
            (None, _) if t.ended && t.expected.is_none() => {
                Some(format!("{url}: download truncated: the body ended after {got} bytes (no Content-Length) before the NAR was complete"))
            }
            _ => None,
        }
    }
}

/// A reader that records its progress in a [`TransferProbe`].
pub struct ProbedReader<R> {
    inner: R,
    state: Arc<Mutex<Transfer>>,
}

impl<R: Read> Read for ProbedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let result = self.inner.read(buf);
        let mut t = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &result {
            Ok(0) if !buf.is_empty() => t.ended = true,
            Ok(n) => t.received += *n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => t.error = Some(e.to_string()),
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_bodies_are_reported() {
        let (mut r, probe) = TransferProbe::watch("http://c/nar/x", Some(10), &b"12345"[..]);
        assert_eq!(probe.broken(), None);
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        assert_eq!(probe.broken().unwrap(), "http://c/nar/x: download truncated: received 5 of 10 bytes");
        let (mut r, probe) = TransferProbe::watch("u", None, &b"12345"[..]);
        let mut two = [0u8; 2];
        r.read_exact(&mut two).unwrap();
        assert_eq!(probe.broken(), None, "not at the end yet");
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        assert!(probe.broken().unwrap().contains("ended after 5 bytes"));
        let (mut r, probe) = TransferProbe::watch("u", Some(5), &b"12345"[..]);
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        assert_eq!(probe.broken(), None, "complete");
        assert_eq!(TransferProbe::default().broken(), None);
    }
}
