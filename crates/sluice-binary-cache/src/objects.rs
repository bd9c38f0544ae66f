//! A cache's files as objects, for the commands that look after a cache (`sluice store
//! verify`, `gc`, `sign`): the size of one ([`BinaryCache::object_size`]), every one with its
//! size and age ([`BinaryCache::list_objects`]: a `file://` directory or an S3 bucket, by
//! `ListObjectsV2`; a plain HTTP cache cannot be listed), and removing one
//! ([`BinaryCache::delete_object`]). Nix has no such operations on a binary cache.

use std::time::SystemTime;

use super::http::{Answer, Request};
use super::{BinaryCache, CacheError, Transport};

/// A file of a cache: its name relative to the cache (`<hash>.narinfo`, `nar/<hash>.nar.xz`),
/// its size and when it was last written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub name: String,
    pub size: u64,
    pub modified: SystemTime,
}

/// Keys asked of S3 per `ListObjectsV2` page (its most).
const LIST_PAGE: u32 = 1000;

impl BinaryCache {
    /// The size in bytes of the cache file `rel` (`HEAD`'s `Content-Length` over HTTP and S3);
    /// `None` when it does not exist. An answer without a length is an error naming the URL.
    pub async fn object_size(&self, rel: &str) -> Result<Option<u64>, CacheError> {
        match &self.transport {
            Transport::File(t) => {
                let path = t.dir().join(rel);
                match std::fs::metadata(&path) {
                    Ok(meta) => Ok(Some(meta.len())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(source) => Err(CacheError::Io { url: path.display().to_string(), source }),
                }
            }
            Transport::Http { http, .. } => {
                let head = Request { method: &reqwest::Method::HEAD, body: None, headers: &[] };
                let Some(Answer { headers, .. }) = http.send(rel, head).await? else { return Ok(None) };
                let length = headers.get(reqwest::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
                length.map(Some).ok_or_else(|| invalid(http.resolve(rel), "HEAD answered without a Content-Length".into()))
            }
        }
    }

    /// Every file of the cache: the files of a `file://` directory and of its `nar`
    /// directory, or every key of an S3 bucket. Fails for a plain HTTP cache, which has no
    /// way to list its files.
    pub async fn list_objects(&self) -> Result<Vec<Object>, CacheError> {
        match &self.transport {
            Transport::File(t) => {
                let mut objects = list_dir(t.dir(), "")?;
                let nar = t.dir().join("nar");
                if nar.is_dir() {
                    objects.extend(list_dir(&nar, "nar/")?);
                }
                Ok(objects)
            }
            Transport::Http { s3: Some(_), .. } => self.list_bucket("").await,
            Transport::Http { s3: None, .. } => {
                Err(invalid(self.url.clone(), "an HTTP binary cache cannot be listed; name the paths".into()))
            }
        }
    }

    /// The files whose names start with `prefix`, a directory of the cache (`sluice/gc/`):
    /// that directory's files for `file://` (none when it does not exist), the keys under that
    /// prefix of an S3 bucket. Fails for a plain HTTP cache.
    pub async fn list_under(&self, prefix: &str) -> Result<Vec<Object>, CacheError> {
        match &self.transport {
            Transport::File(t) => match t.dir().join(prefix).is_dir() {
                true => list_dir(&t.dir().join(prefix), prefix),
                false => Ok(Vec::new()),
            },
            Transport::Http { s3: Some(_), .. } => self.list_bucket(prefix).await,
            Transport::Http { s3: None, .. } => {
                Err(invalid(self.url.clone(), "an HTTP binary cache cannot be listed; name the paths".into()))
            }
        }
    }

    /// Whether the cache's files can be listed (`file://` and S3, not plain HTTP).
    pub fn can_list(&self) -> bool {
        !matches!(self.transport, Transport::Http { s3: None, .. })
    }

    /// Creates or replaces the small cache file `rel` with `bytes` (its directories made first
    /// in a `file://` cache).
    pub async fn put_object(&self, rel: &str, bytes: Vec<u8>) -> Result<(), CacheError> {
        if let (Transport::File(t), Some((dir, _))) = (&self.transport, rel.rsplit_once('/')) {
            let dir = t.dir().join(dir);
            std::fs::create_dir_all(&dir).map_err(|source| CacheError::Io { url: dir.display().to_string(), source })?;
        }
        self.upsert_file(rel, super::Upload::Bytes(bytes.into()), "application/octet-stream").await
    }

    /// The keys of the S3 bucket that start with `prefix`, a `ListObjectsV2` page at a time.
    async fn list_bucket(&self, prefix: &str) -> Result<Vec<Object>, CacheError> {
        let Transport::Http { http, .. } = &self.transport else { return Ok(Vec::new()) };
        let mut objects = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = reqwest::Url::parse("http://list/").map_err(|e| invalid(self.url.clone(), e.to_string()))?;
            query.query_pairs_mut().append_pair("list-type", "2").append_pair("max-keys", &LIST_PAGE.to_string());
            if !prefix.is_empty() {
                query.query_pairs_mut().append_pair("prefix", prefix);
            }
            if let Some(token) = &token {
                query.query_pairs_mut().append_pair("continuation-token", token);
            }
            let rel = format!("?{}", query.query().unwrap_or_default());
            let answer = http.send(&rel, Request::GET).await?.ok_or_else(|| invalid(http.resolve(&rel), "no such bucket".into()))?;
            let xml = String::from_utf8(answer.body).map_err(|_| invalid(http.resolve(&rel), "listing is not UTF-8".into()))?;
            let page = parse_list_page(&xml).map_err(|what| invalid(http.resolve(&rel), what))?;
            objects.extend(page.objects);
            match page.next {
                Some(next) => token = Some(next),
                None => return Ok(objects),
            }
        }
    }

    /// The raw narinfo text `<hash_part>.narinfo`; `None` when the cache has none.
    pub async fn narinfo_text_of_hash(&self, hash_part: &str) -> Result<Option<String>, CacheError> {
        self.narinfo_text_of(hash_part).await
    }

    /// Removes the cache file `rel`; one that is already gone is no error.
    pub async fn delete_object(&self, rel: &str) -> Result<(), CacheError> {
        match &self.transport {
            Transport::File(t) => {
                let path = t.dir().join(rel);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        Err(CacheError::Io { url: path.display().to_string(), source: e })
                    }
                    _ => Ok(()),
                }
            }
            Transport::Http { http, .. } => {
                http.send(rel, Request { method: &reqwest::Method::DELETE, body: None, headers: &[] }).await.map(drop)
            }
        }
    }
}

fn invalid(url: String, what: String) -> CacheError {
    CacheError::Io { url, source: std::io::Error::new(std::io::ErrorKind::InvalidData, what) }
}

/// The regular files of `dir`, named `prefix` + their name.
fn list_dir(dir: &std::path::Path, prefix: &str) -> Result<Vec<Object>, CacheError> {
    let io = |source| CacheError::Io { url: dir.display().to_string(), source };
    let mut objects = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let meta = match entry.metadata() {
            Ok(meta) => meta,
            // Removed since the directory was read.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(e)),
        };
        if meta.is_file() {
            let modified = meta.modified().map_err(io)?;
            objects.push(Object { name: format!("{prefix}{}", entry.file_name().to_string_lossy()), size: meta.len(), modified });
        }
    }
    Ok(objects)
}

/// One page of a `ListObjectsV2` answer.
struct ListPage {
    objects: Vec<Object>,
    /// The continuation token of the next page, if the listing is truncated.
    next: Option<String>,
}

/// Parses a `ListObjectsV2` answer (`ListBucketResult`: `Contents` with `Key`, `Size`,
/// `LastModified`; `IsTruncated`, `NextContinuationToken`).
fn parse_list_page(xml: &str) -> Result<ListPage, String> {
    let mut objects = Vec::new();
    for contents in elements(xml, "Contents") {
        let field = |name: &str| elements(contents, name).next().ok_or_else(|| format!("a <Contents> without <{name}>"));
        let name = unescape(field("Key")?);
        let size = field("Size")?.trim().parse().map_err(|e| format!("<Size> of {name}: {e}"))?;
        let stamp = field("LastModified")?.trim();
        let modified = aws_smithy_types::DateTime::from_str(stamp, aws_smithy_types::date_time::Format::DateTime)
            .ok()
            .and_then(|t| SystemTime::try_from(t).ok())
            .ok_or_else(|| format!("<LastModified> of {name}: not a date: {stamp}"))?;
        objects.push(Object { name, size, modified });
    }
    let truncated = elements(xml, "IsTruncated").next().is_some_and(|v| v.trim() == "true");
    let next = match truncated {
        true => Some(unescape(elements(xml, "NextContinuationToken").next().ok_or("truncated, without <NextContinuationToken>")?)),
        false => None,
    };
    Ok(ListPage { objects, next })
}

/// The contents of every `<name>…</name>` element of `xml`, in order (no nesting of the same
/// name, as in S3's listings).
fn elements<'x>(xml: &'x str, name: &str) -> impl Iterator<Item = &'x str> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let mut rest = xml;
    std::iter::from_fn(move || {
        let start = rest.find(&open)? + open.len();
        let len = rest[start..].find(&close)?;
        let inner = &rest[start..start + len];
        rest = &rest[start + len + close.len()..];
        Some(inner)
    })
}

/// XML's five escapes undone.
fn unescape(text: &str) -> String {
    text.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::parse_list_page;

    #[test]
    fn a_listing_page_gives_keys_sizes_dates_and_the_next_token() {
        let xml = "<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>true</IsTruncated>\
            <Contents><Key>nar/a&amp;b.nar.xz</Key><LastModified>2026-12-07T02:00:00.000Z</LastModified><Size>42</Size></Contents>\
            <Contents><Key>x.narinfo</Key><LastModified>2026-12-07T02:00:01Z</LastModified><Size>7</Size></Contents>\
            <NextContinuationToken>tok/1</NextContinuationToken></ListBucketResult>";
        let page = parse_list_page(xml).unwrap();
        let names: Vec<_> = page.objects.iter().map(|o| (o.name.as_str(), o.size)).collect();
        assert_eq!(names, [("nar/a&b.nar.xz", 42), ("x.narinfo", 7)]);
        let secs = page.objects[1].modified.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(secs, 1_796_608_801);
        assert_eq!(page.next.as_deref(), Some("tok/1"));
    }
}
