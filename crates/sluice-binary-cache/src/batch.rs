//! The client of `sluice serve`'s batch closure endpoint (`POST _sluice/v1/closure`, see
//! `sluice_serve::batch`): the narinfos of a whole closure in one request, read line by line as
//! they arrive ([`BatchLines`]), so that the closure engine starts on the first level while
//! the server still walks the last.

use bytes::Bytes;
use sluice_nix::store_path::StorePath;

use super::http::{self, Body, MAX_SMALL_FILE};
use super::{BinaryCache, CacheError, Transport, Upload};

/// Where the endpoint lives, relative to the cache.
const ENDPOINT: &str = "_sluice/v1/closure";

impl BinaryCache {
    /// The narinfos of the closures of `roots` in one request to the batch endpoint, read as
    /// they arrive; `Ok(None)` when the cache is not reached over HTTP. Each line is what
    /// `<hash part>.narinfo` would have answered. Fails naming the URL when the cache has no
    /// such endpoint or the request fails.
    pub async fn batch_closure(&self, roots: &[StorePath]) -> Result<Option<BatchLines>, CacheError> {
        self.health.check(&self.url)?;
        let answer = self.send_batch_closure(roots).await;
        let Some((url, body)) = self.health.observe(&self.url, answer)? else { return Ok(None) };
        match body {
            Some(body) => Ok(Some(BatchLines::new(body))),
            None => Err(batch_error(&url, "the cache advertises SluiceBatch but has no batch endpoint".into())),
        }
    }

    /// [`BinaryCache::batch_closure`] asked before the cache's `nix-cache-info` has said whether
    /// it offers the batch (so that a cold closure query spends no round trip on
    /// `nix-cache-info` alone): only of a plain HTTP(S) cache, with no effect on the cache's
    /// health, and `None` on any failure (a cache that is not `sluice serve` answers 404 or
    /// 405). Its answer is to be used only once `nix-cache-info` advertises `SluiceBatch`.
    pub async fn batch_closure_unasked(&self, roots: &[StorePath]) -> Option<BatchLines> {
        if !matches!(self.transport, Transport::Http { s3: None, .. }) {
            return None;
        }
        match self.send_batch_closure(roots).await {
            Ok(Some((_, Some(body)))) => Some(BatchLines::new(body)),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!("{e}");
                None
            }
        }
    }

    /// Sends the closure request of `roots`: the endpoint's URL and the answer's body (`None`
    /// for 404, 403 or 410), `None` when the cache is not reached over HTTP.
    async fn send_batch_closure(&self, roots: &[StorePath]) -> Result<Option<(String, Option<Body>)>, CacheError> {
        let Transport::Http { http, .. } = &self.transport else { return Ok(None) };
        let body = Upload::Bytes(roots.iter().map(|p| format!("{}\n", p.hash_part())).collect::<String>().into());
        let request = http::Request { method: &reqwest::Method::POST, body: Some((&body, "text/plain")), headers: &[] };
        let answer = http.send_streaming(ENDPOINT, request).await?;
        Ok(Some((http.resolve(ENDPOINT), answer)))
    }
}

/// An error of the batch endpoint at `url`: its answer is not what it should be.
fn batch_error(url: &str, what: String) -> CacheError {
    CacheError::Io { url: url.to_string(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, what) }
}

/// The lines of a batch answer, NDJSON `{"hash": "<hash part>", "narinfo": "<text>" | null}`,
/// parsed as they arrive.
pub struct BatchLines {
    body: Body,
    lines: Lines,
    /// Lines parsed so far (for errors).
    parsed: usize,
}

impl BatchLines {
    fn new(body: Body) -> Self {
        BatchLines { body, lines: Lines::default(), parsed: 0 }
    }

    /// The next line as (hash part, narinfo text or `None`), `None` at the end of the answer.
    /// Fails naming the URL and the line when a line is not such JSON or is over
    /// [`MAX_SMALL_FILE`] bytes, or when the transfer fails.
    pub async fn next(&mut self) -> Result<Option<(String, Option<String>)>, CacheError> {
        loop {
            if let Some(line) = self.lines.next_line() {
                self.parsed += 1;
                return parse_line(line).map(Some).map_err(|e| batch_error(self.body.url(), format!("line {}: {e}", self.parsed)));
            }
            if self.lines.ended {
                return Ok(None);
            }
            if self.lines.pending() > MAX_SMALL_FILE {
                let what = format!("line {} is over {MAX_SMALL_FILE} bytes", self.parsed + 1);
                return Err(batch_error(self.body.url(), what));
            }
            match self.body.chunk().await? {
                Some(chunk) => self.lines.push(chunk),
                None => self.lines.ended = true,
            }
        }
    }
}

fn parse_line(line: &[u8]) -> Result<(String, Option<String>), serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct Line {
        hash: String,
        narinfo: Option<String>,
    }
    let Line { hash, narinfo } = serde_json::from_slice(line)?;
    Ok((hash, narinfo))
}

/// Splits chunks of bytes into lines (ended by `\n`; the last may end with the input).
#[derive(Default)]
struct Lines {
    buf: Vec<u8>,
    /// Where the first line not yet taken starts in `buf`.
    start: usize,
    /// Whether the input has ended (what is left is the last line).
    ended: bool,
}

impl Lines {
    fn push(&mut self, chunk: Bytes) {
        self.buf.drain(..self.start);
        self.start = 0;
        self.buf.extend_from_slice(&chunk);
    }

    /// Bytes not yet taken.
    fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next whole line, without its `\n`.
    fn next_line(&mut self) -> Option<&[u8]> {
        let (from, rest) = (self.start, &self.buf[self.start..]);
        let len = match rest.iter().position(|&b| b == b'\n') {
            Some(at) => at,
            None if self.ended && !rest.is_empty() => rest.len(),
            None => return None,
        };
        self.start = (from + len + 1).min(self.buf.len());
        Some(&self.buf[from..from + len])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&str]) -> Vec<String> {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for chunk in chunks {
            lines.push(Bytes::copy_from_slice(chunk.as_bytes()));
            while let Some(line) = lines.next_line() {
                out.push(String::from_utf8(line.to_vec()).unwrap());
            }
        }
        lines.ended = true;
        while let Some(line) = lines.next_line() {
            out.push(String::from_utf8(line.to_vec()).unwrap());
        }
        out
    }

    #[test]
    fn lines_are_whole_across_chunks() {
        assert_eq!(split(&["{\"a\"", ":1}\n{\"b\":2}\n{", "\"c\":3}\n"]), ["{\"a\":1}", "{\"b\":2}", "{\"c\":3}"]);
        assert_eq!(split(&["one\ntw", "o"]), ["one", "two"]);
        assert_eq!(split(&["one\n", "", "\n"]), ["one", ""]);
        assert!(split(&[]).is_empty());
    }

    #[test]
    fn a_line_is_parsed_or_refused_naming_what_is_wrong() {
        let line = br#"{"hash":"0c7ry3w8ggj1mgwwxmrkjbpsg7sm25s9","narinfo":"StorePath: x\n"}"#;
        assert_eq!(parse_line(line).unwrap(), ("0c7ry3w8ggj1mgwwxmrkjbpsg7sm25s9".into(), Some("StorePath: x\n".into())));
        assert_eq!(parse_line(br#"{"hash":"h","narinfo":null}"#).unwrap(), ("h".into(), None));
        let e = parse_line(br#"{"hash":"h"#).unwrap_err().to_string();
        assert!(e.contains("EOF"), "{e}");
    }
}
