//! `s3://BUCKET` binary caches (Nix's `S3BinaryCacheStore`, `src/libstore/s3-binary-cache-store.cc`;
//! parameters as Nix 2.35 reads them, see [`S3Params`]): the [`http`](super::http) transport
//! on the bucket's URL with every request signed with AWS SigV4 (`aws-sigv4`), the body's
//! sha256 in `x-amz-content-sha256` and, on uploads, its MD5 in `Content-MD5`. The bucket's URL
//! is `ENDPOINT/BUCKET` in path style (the default with a custom `endpoint`, as Nix's
//! `addressing-style=auto`) and `BUCKET.ENDPOINT` in virtual-hosted style (the default on AWS,
//! `s3.REGION.amazonaws.com`). A 403 or 404 means absence only when S3's error code says so
//! ([`is_absence`]): Nix's `S3Helper::getObject` and `fileExists` take `NoSuchKey` and
//! `AccessDenied` (a missing key without `ListBucket`) for absence and fail on every other
//! error (`SignatureDoesNotMatch`, `InvalidAccessKeyId`, `NoSuchBucket`, …).
//!
//! Credentials, as the AWS SDK's default chain that Nix uses: with `profile=`, that profile of
//! the shared credentials file (`$AWS_SHARED_CREDENTIALS_FILE`, default `~/.aws/credentials`);
//! otherwise `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`) from the
//! environment, then the profile `$AWS_PROFILE` (default `default`) of that file, then the
//! EC2 instance metadata service (`imds.rs`, unless `AWS_EC2_METADATA_DISABLED`
//! is `true`; these carry an expiry, and are found again five minutes before it). Without any,
//! requests go unsigned (a public bucket).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{sign, PayloadChecksumKind, SignableBody, SignableRequest, SigningSettings};

use super::http::{HttpTransport, RequestSigner};
use super::multipart;
use super::{CacheError, Upload};
use crate::url::S3Params;

/// An S3 bucket: where it is and how requests to it are signed.
#[derive(Debug)]
pub struct S3 {
    params: S3Params,
}

impl S3 {
    /// The bucket of `params`.
    pub fn new(params: &S3Params) -> Self {
        S3 { params: params.clone() }
    }

    /// The bucket's URL (no trailing slash), path or virtual-hosted style.
    pub(crate) fn bucket_url(&self) -> String {
        let p = &self.params;
        let endpoint = p.endpoint.clone().unwrap_or_else(|| format!("s3.{}.amazonaws.com", p.region));
        let (scheme, host) = match endpoint.split_once("://") {
            Some((scheme, host)) => (scheme.to_string(), host.trim_end_matches('/').to_string()),
            None => (p.scheme.clone(), endpoint.trim_end_matches('/').to_string()),
        };
        match p.path_style {
            true => format!("{scheme}://{host}/{}", p.bucket),
            false => format!("{scheme}://{}.{host}", p.bucket),
        }
    }

    /// The request signer (SigV4 with the credentials found now, or none: unsigned).
    pub fn signer(&self, client: &super::http::Client) -> Arc<dyn RequestSigner> {
        Arc::new(SigV4 {
            region: self.params.region.clone(),
            profile: self.params.profile.clone(),
            client: client.clone(),
            credentials: tokio::sync::Mutex::new(None),
        })
    }

    /// Uploads `rel` with `storage-class` if one is set: in parts (see [`multipart`]) when
    /// `multipart-upload` is on and `upload` is a NAR of at least `multipart-threshold` bytes,
    /// in one `PUT` otherwise.
    pub async fn put(&self, http: &HttpTransport, rel: &str, upload: &Upload, mime: &str) -> Result<(), CacheError> {
        let headers: Vec<(&'static str, String)> = self.params.storage_class.iter().map(|c| ("x-amz-storage-class", c.clone())).collect();
        match upload {
            Upload::Nar(nar) if self.params.multipart_upload && nar.file_size >= self.params.multipart_threshold => {
                multipart::upload(http, rel, nar, self.params.multipart_chunk_size, mime, &headers).await
            }
            _ => http.put(rel, upload, mime, &headers).await,
        }
    }
}

/// The code and message of an S3 error answer (`<Error><Code>…</Code><Message>…</Message>`);
/// `None` when `body` has no code (the answer to a `HEAD` has no body). The message is empty
/// when there is none.
pub(crate) fn error_of(body: &str) -> Option<(String, String)> {
    let element = |name: &str| {
        let start = body.find(&format!("<{name}>"))? + name.len() + 2;
        let end = start + body[start..].find(&format!("</{name}>"))?;
        Some(unescape(body[start..end].trim()))
    };
    Some((element("Code").filter(|c| !c.is_empty())?, element("Message").unwrap_or_default()))
}

/// `text` with XML's five predefined entities replaced.
fn unescape(text: &str) -> String {
    [("&lt;", "<"), ("&gt;", ">"), ("&quot;", "\""), ("&apos;", "'"), ("&amp;", "&")]
        .iter()
        .fold(text.to_string(), |t, (from, to)| t.replace(from, to))
}

/// Whether S3's error `code` on a download or an existence check means the key is absent:
/// `NoSuchKey`, or `AccessDenied`, which S3 answers for a missing key when the credentials
/// may not list the bucket (as Nix's `s3-binary-cache-store.cc` takes them).
pub(crate) fn is_absence(code: &str) -> bool {
    matches!(code, "NoSuchKey" | "AccessDenied")
}

/// SigV4 request signing for service `s3`.
#[derive(Debug)]
struct SigV4 {
    region: String,
    /// The URL's `profile=`.
    profile: Option<String>,
    /// For the instance metadata service.
    client: super::http::Client,
    /// The default chain's credentials, found at the first request and again when they are
    /// about to expire ([`Found`]; `None` until the first request).
    credentials: tokio::sync::Mutex<Option<Found>>,
}

/// Credentials found, and when to look for them again.
#[derive(Debug)]
struct Found {
    /// `None`: requests go unsigned.
    credentials: Option<Credentials>,
    /// [`REFRESH_BEFORE`] their expiry (the instance metadata service's carry one); `None`:
    /// never (the environment's and a profile's do not expire here).
    refresh_at: Option<SystemTime>,
}

/// Expiring credentials are found again this long before they expire: the instance metadata
/// service has new ones at least five minutes before the old ones expire (AWS's "Retrieve
/// security credentials from instance metadata"), and a push may outlive a role's credentials
/// (about 6 hours).
const REFRESH_BEFORE: Duration = Duration::from_secs(5 * 60);

/// When finding expiring credentials again fails, the old ones are kept (while they last) and
/// the search is retried after this long, not at every request.
const REFRESH_RETRY: Duration = Duration::from_secs(30);

impl Found {
    fn new(credentials: Option<Credentials>) -> Found {
        let refresh_at = credentials.as_ref().and_then(|c| c.expiry()).map(|at| at.checked_sub(REFRESH_BEFORE).unwrap_or(at));
        Found { credentials, refresh_at }
    }
}

impl SigV4 {
    /// The credentials to sign with now: found at the first call, found again once
    /// [`Found::refresh_at`] has passed (a failed search keeps the old ones, retried after
    /// [`REFRESH_RETRY`]).
    async fn current(&self) -> Option<Credentials> {
        self.current_by(|| find_credentials(self.profile.as_deref(), &self.client)).await
    }

    /// [`SigV4::current`] with `find` as the default chain.
    async fn current_by<F: std::future::Future<Output = Option<Credentials>>>(&self, find: impl Fn() -> F) -> Option<Credentials> {
        let mut held = self.credentials.lock().await;
        let now = SystemTime::now();
        match &mut *held {
            None => *held = Some(Found::new(find().await)),
            Some(found) if found.refresh_at.is_some_and(|at| at <= now) => match find().await {
                Some(fresh) => *found = Found::new(Some(fresh)),
                None => {
                    tracing::warn!(
                        "S3 credentials expire at {:?} and could not be found again; retrying in {} s",
                        found.credentials.as_ref().and_then(|c| c.expiry()),
                        REFRESH_RETRY.as_secs()
                    );
                    found.refresh_at = Some(now + REFRESH_RETRY);
                }
            },
            Some(_) => {}
        }
        held.as_ref().and_then(|found| found.credentials.clone())
    }
}

impl RequestSigner for SigV4 {
    fn sign<'a>(
        &'a self,
        request: &'a mut reqwest::Request,
        payload_sha256: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            match self.current().await {
                Some(credentials) => sign_v4(&credentials, &self.region, request, payload_sha256),
                None => Ok(()),
            }
        })
    }
}

/// Signs `request` for service `s3` in `region` with SigV4 (`x-amz-content-sha256` set to
/// `payload_sha256`).
fn sign_v4(credentials: &Credentials, region: &str, request: &mut reqwest::Request, payload_sha256: &str) -> Result<(), String> {
    let identity = credentials.clone().into();
    let mut settings = SigningSettings::default();
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("s3")
        .time(SystemTime::now())
        .settings(settings)
        .build()
        .map_err(|e| e.to_string())?
        .into();
    let headers: Vec<(String, String)> =
        request.headers().iter().filter_map(|(n, v)| Some((n.as_str().to_string(), v.to_str().ok()?.to_string()))).collect();
    let signable = SignableRequest::new(
        request.method().as_str(),
        request.url().as_str(),
        headers.iter().map(|(n, v)| (n.as_str(), v.as_str())),
        SignableBody::Precomputed(payload_sha256.to_string()),
    )
    .map_err(|e| e.to_string())?;
    let (instructions, _) = sign(signable, &params).map_err(|e| e.to_string())?.into_parts();
    for (name, value) in instructions.headers() {
        let value = reqwest::header::HeaderValue::from_str(value).map_err(|e| format!("header {name}: {e}"))?;
        request.headers_mut().insert(reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| e.to_string())?, value);
    }
    Ok(())
}

/// The credentials of the default chain (see the module doc); `None` when there are none.
async fn find_credentials(profile: Option<&str>, client: &super::http::Client) -> Option<Credentials> {
    let env = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    if profile.is_none() {
        if let (Some(id), Some(secret)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
            return Some(Credentials::new(id, secret, env("AWS_SESSION_TOKEN"), None, "environment"));
        }
    }
    if let Some(found) = profile_credentials(profile) {
        return Some(found);
    }
    if profile.is_some() {
        return None;
    }
    let endpoint = super::imds::endpoint(env("AWS_EC2_METADATA_DISABLED").as_deref(), env("AWS_EC2_METADATA_SERVICE_ENDPOINT").as_deref())?;
    super::imds::credentials(client, &endpoint)
        .await
        .map_err(|why| tracing::debug!("no credentials from the instance metadata service: {why}; S3 requests go unsigned"))
        .ok()
}

/// The credentials of `profile` (default `$AWS_PROFILE`, else `default`) in the shared
/// credentials file (`$AWS_SHARED_CREDENTIALS_FILE`, default `~/.aws/credentials`).
fn profile_credentials(profile: Option<&str>) -> Option<Credentials> {
    let env = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    let file = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(std::path::PathBuf::from)
        .or_else(|| Some(std::path::PathBuf::from(env("HOME")?).join(".aws/credentials")))?;
    let named = profile.map(str::to_string).or_else(|| env("AWS_PROFILE")).unwrap_or_else(|| "default".into());
    let text = std::fs::read_to_string(&file).ok()?;
    let found = profile_keys(&text, &named);
    if found.is_none() && profile.is_some() {
        tracing::warn!("{}: no credentials for profile {named:?}; S3 requests go unsigned", file.display());
    }
    found.map(|(id, secret, token)| Credentials::new(id, secret, token, None, "profile"))
}

/// `aws_access_key_id`, `aws_secret_access_key` and `aws_session_token` of `[profile]` in an
/// INI credentials file.
fn profile_keys(text: &str, profile: &str) -> Option<(String, String, Option<String>)> {
    let (mut in_profile, mut id, mut secret, mut token) = (false, None, None, None);
    for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#') && !l.starts_with(';')) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            in_profile = name.trim() == profile;
        } else if let (true, Some((key, value))) = (in_profile, line.split_once('=')) {
            let value = Some(value.trim().to_string());
            match key.trim() {
                "aws_access_key_id" => id = value,
                "aws_secret_access_key" => secret = value,
                "aws_session_token" => token = value,
                _ => {}
            }
        }
    }
    Some((id?, secret?, token))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credentials that carry an expiry are found again [`REFRESH_BEFORE`] it, those that do
    /// not never; a failed search keeps the old ones and is not retried at every request.
    #[tokio::test]
    async fn expiring_credentials_are_found_again_before_they_expire() {
        let signer =
            SigV4 { region: "r".into(), profile: None, client: crate::client::Client::plain(), credentials: tokio::sync::Mutex::new(None) };
        let searches = std::sync::atomic::AtomicUsize::new(0);
        let expiring = |left: Duration, id: &str| Credentials::new(id, "s", None, Some(SystemTime::now() + left), "test");
        let search = |answer: Option<Credentials>| {
            let searches = &searches;
            move || {
                let answer = answer.clone();
                async move {
                    searches.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    answer
                }
            }
        };
        let id = |c: Option<Credentials>| c.map(|c| c.access_key_id().to_string());
        // Four minutes left: due at once, so the next request finds them again.
        assert_eq!(id(signer.current_by(search(Some(expiring(Duration::from_secs(240), "A")))).await).as_deref(), Some("A"));
        assert_eq!(id(signer.current_by(search(Some(expiring(Duration::from_secs(3600), "B")))).await).as_deref(), Some("B"));
        assert_eq!(searches.load(std::sync::atomic::Ordering::SeqCst), 2);
        // An hour left: kept.
        assert_eq!(id(signer.current_by(search(Some(expiring(Duration::from_secs(3600), "C")))).await).as_deref(), Some("B"));
        assert_eq!(searches.load(std::sync::atomic::Ordering::SeqCst), 2);
        // Due again, and the search fails: the old ones are kept, and not asked for again
        // within REFRESH_RETRY.
        signer.credentials.lock().await.as_mut().unwrap().refresh_at = Some(SystemTime::now());
        assert_eq!(id(signer.current_by(search(None)).await).as_deref(), Some("B"));
        assert_eq!(id(signer.current_by(search(None)).await).as_deref(), Some("B"));
        assert_eq!(searches.load(std::sync::atomic::Ordering::SeqCst), 3);
        // Credentials without an expiry (the environment's, a profile's) are never searched again.
        let plain =
            SigV4 { region: "r".into(), profile: None, client: crate::client::Client::plain(), credentials: tokio::sync::Mutex::new(None) };
        for _ in 0..3 {
            assert_eq!(id(plain.current_by(search(Some(Credentials::new("P", "s", None, None, "test")))).await).as_deref(), Some("P"));
        }
        assert_eq!(searches.load(std::sync::atomic::Ordering::SeqCst), 4);
    }

    #[test]
    fn error_codes() {
        let wrong_key = r#"<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the signature you provided. Check your key &amp; signing method.</Message><AWSAccessKeyId>AK</AWSAccessKeyId></Error>"#;
        assert_eq!(
            error_of(wrong_key),
            Some((
                "SignatureDoesNotMatch".into(),
                "The request signature we calculated does not match the signature you provided. Check your key & signing method.".into()
            ))
        );
        let no_bucket =
            "<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message><BucketName>b</BucketName></Error>";
        assert_eq!(error_of(no_bucket).map(|(c, _)| is_absence(&c)), Some(false));
        assert_eq!(error_of("<Error><Code>NoSuchKey</Code></Error>"), Some(("NoSuchKey".into(), String::new())));
        assert!(is_absence("NoSuchKey") && is_absence("AccessDenied") && !is_absence("InvalidAccessKeyId"));
        assert_eq!(error_of(""), None);
        assert_eq!(error_of("<Error><Code></Code></Error>"), None);
    }

    #[test]
    fn credentials_file_profiles() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key = S\n\n[ci]\n# comment\naws_access_key_id=B\naws_secret_access_key=T\naws_session_token=X\n";
        assert_eq!(profile_keys(text, "default"), Some(("A".into(), "S".into(), None)));
        assert_eq!(profile_keys(text, "ci"), Some(("B".into(), "T".into(), Some("X".into()))));
        assert_eq!(profile_keys(text, "other"), None);
    }

    #[test]
    fn bucket_urls() {
        // `s3://b?endpoint=127.0.0.1:9000&scheme=http`.
        let mut p = S3Params {
            bucket: "b".into(),
            region: "us-east-1".into(),
            endpoint: Some("127.0.0.1:9000".into()),
            profile: None,
            scheme: "http".into(),
            path_style: true,
            multipart_upload: false,
            multipart_chunk_size: 5 << 20,
            multipart_threshold: 100 << 20,
            storage_class: None,
        };
        assert_eq!(S3::new(&p).bucket_url(), "http://127.0.0.1:9000/b");
        (p.endpoint, p.path_style, p.region, p.scheme) = (None, false, "eu-west-1".into(), "https".into());
        assert_eq!(S3::new(&p).bucket_url(), "https://b.s3.eu-west-1.amazonaws.com");
    }
}
