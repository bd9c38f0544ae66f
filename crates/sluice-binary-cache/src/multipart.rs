//! S3 multipart uploads of big NARs (Nix's `multipart-upload`, `multipart-chunk-size` and
//! `multipart-threshold`, `src/libstore/s3-binary-cache-store.cc` in Nix 2.35, which uploads
//! with `CreateMultipartUpload`, `UploadPart` and `CompleteMultipartUpload` and aborts on
//! failure): the compressed NAR is sent from its temporary file one part at a time, each part a
//! signed request of its own (its sha256 in `x-amz-content-sha256`, its MD5 in `Content-MD5`)
//! retried as any HTTP request; an upload that fails is aborted (`AbortMultipartUpload`), so
//! the bucket keeps no parts. Memory: one part.

use super::http::{Answer, HttpTransport, Request};
use super::upload::PreparedNar;
use super::{CacheError, Upload};

/// S3's smallest part (but the last), largest part, and most parts of one upload (Nix's
/// `AWS_MIN_PART_SIZE`, `AWS_MAX_PART_SIZE`, `AWS_MAX_PART_COUNT`).
const MIN_PART: u64 = 5 << 20;
const MAX_PART: u64 = 5 << 30;
const MAX_PARTS: u64 = 10_000;

/// The part size for `file_size` bytes: `chunk_size` (`multipart-chunk-size`) within S3's
/// limits, raised as Nix does when the file would need more than [`MAX_PARTS`] parts.
fn part_size(chunk_size: u64, file_size: u64) -> u64 {
    chunk_size.clamp(MIN_PART, MAX_PART).max(file_size.div_ceil(MAX_PARTS))
}

/// Uploads `nar` to `rel` in parts of `chunk_size` bytes (see [`part_size`]; the last may be
/// shorter); `headers` go with the `CreateMultipartUpload` request, as S3 takes an object's
/// metadata there.
pub async fn upload(
    http: &HttpTransport,
    rel: &str,
    nar: &PreparedNar,
    chunk_size: u64,
    mime: &str,
    headers: &[(&'static str, String)],
) -> Result<(), CacheError> {
    let empty = Upload::Bytes(bytes::Bytes::new());
    let created =
        http.send(&format!("{rel}?uploads"), Request { method: &reqwest::Method::POST, body: Some((&empty, mime)), headers }).await?;
    let upload_id = element(http, rel, created.as_ref(), "UploadId")?;
    let id = utf8_percent_encode(&upload_id);
    let result = upload_parts(http, rel, &id, nar, part_size(chunk_size, nar.file_size)).await;
    let result = match result {
        Ok(parts) => complete(http, rel, &id, &parts).await,
        Err(e) => Err(e),
    };
    if result.is_err() {
        let abort = Request { method: &reqwest::Method::DELETE, body: None, headers: &[] };
        if let Err(e) = http.send(&format!("{rel}?uploadId={id}"), abort).await {
            tracing::warn!("aborting the multipart upload of {}: {e}", http.resolve(rel));
        }
    }
    result
}

/// Sends every part; their ETags in order.
async fn upload_parts(http: &HttpTransport, rel: &str, id: &str, nar: &PreparedNar, part_size: u64) -> Result<Vec<String>, CacheError> {
    let io = |source| CacheError::Io { url: http.resolve(rel), source };
    let mut etags = Vec::new();
    for (index, offset) in (0..nar.file_size).step_by(part_size as usize).enumerate() {
        let len = part_size.min(nar.file_size - offset);
        let body = Upload::Bytes(nar.compressed.part(offset, len as usize).map_err(io)?);
        let target = format!("{rel}?partNumber={}&uploadId={id}", index + 1);
        let answer = http
            .send(&target, Request { method: &reqwest::Method::PUT, body: Some((&body, "application/octet-stream")), headers: &[] })
            .await?;
        let etag = answer.as_ref().and_then(|a| a.headers.get(reqwest::header::ETAG)?.to_str().ok().map(str::to_string));
        etags.push(etag.ok_or_else(|| refused(http, &target, "the answer to UploadPart has no ETag"))?);
    }
    Ok(etags)
}

/// `CompleteMultipartUpload` with the parts' ETags; S3 may answer 200 with an `<Error>`.
async fn complete(http: &HttpTransport, rel: &str, id: &str, etags: &[String]) -> Result<(), CacheError> {
    let mut xml = String::from("<CompleteMultipartUpload>");
    for (i, etag) in etags.iter().enumerate() {
        xml.push_str(&format!("<Part><PartNumber>{}</PartNumber><ETag>{etag}</ETag></Part>", i + 1));
    }
    xml.push_str("</CompleteMultipartUpload>");
    let body = Upload::Bytes(xml.into());
    let target = format!("{rel}?uploadId={id}");
    let answer =
        http.send(&target, Request { method: &reqwest::Method::POST, body: Some((&body, "application/xml")), headers: &[] }).await?;
    let answer = answer.ok_or_else(|| CacheError::Refused { url: http.resolve(&target) })?;
    if String::from_utf8_lossy(&answer.body).contains("<Error>") {
        return Err(refused(http, &target, &format!("CompleteMultipartUpload failed: {}", String::from_utf8_lossy(&answer.body))));
    }
    Ok(())
}

/// The text of the first `<name>` element of an answer's XML body.
fn element(http: &HttpTransport, rel: &str, answer: Option<&Answer>, name: &str) -> Result<String, CacheError> {
    let answer = answer.ok_or_else(|| CacheError::Refused { url: http.resolve(rel) })?;
    let text = String::from_utf8_lossy(&answer.body);
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let start = text.find(&open).map(|i| i + open.len());
    let value = start.and_then(|s| Some(text[s..s + text[s..].find(&close)?].to_string()));
    value.filter(|v| !v.is_empty()).ok_or_else(|| refused(http, rel, &format!("the answer to CreateMultipartUpload has no {name}")))
}

/// An upload id as a query value: S3's ids are URL-safe in practice, but any other byte is
/// percent-encoded.
fn utf8_percent_encode(id: &str) -> String {
    id.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

fn refused(http: &HttpTransport, rel: &str, what: &str) -> CacheError {
    CacheError::Io { url: http.resolve(rel), source: std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string()) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn part_sizes_keep_to_s3_limits() {
        assert_eq!(super::part_size(1 << 20, 12 << 20), 5 << 20);
        assert_eq!(super::part_size(8 << 20, 12 << 20), 8 << 20);
        assert_eq!(super::part_size(5 << 20, 100 << 30), (100u64 << 30).div_ceil(10_000));
        assert_eq!(super::part_size(u64::MAX, 1 << 30), 5 << 30);
    }
}
