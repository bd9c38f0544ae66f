//! S3 credentials from the EC2 instance metadata service, IMDSv2: the last source of the AWS
//! SDK's default credentials chain, which Nix uses when no `profile=` is given
//! (`s3-binary-cache-store.cc`). A session token first (`PUT /latest/api/token` with
//! `X-aws-ec2-metadata-token-ttl-seconds`), then, with it, the instance's role
//! (`GET /latest/meta-data/iam/security-credentials/`) and that role's credentials (JSON with
//! `AccessKeyId`, `SecretAccessKey`, `Token`, and `Expiration`, which the credentials carry so
//! that the signer finds them again before they expire). As the SDKs do, the service is not asked when
//! `AWS_EC2_METADATA_DISABLED` is `true`, and it is asked at
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT` (default `http://169.254.169.254`). Each request must
//! be answered within [`TIMEOUT`], so a machine without the service loses at most that, once,
//! at the first request to the bucket. The requests go through the caches' HTTP client (no
//! proxy), on connections closed after each answer.

use std::time::Duration;

use aws_credential_types::Credentials;

/// The longest wait for one request's whole answer.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(1);

/// Seconds the session token is asked to live (the SDKs' 6 hours).
const TOKEN_TTL: u32 = 21600;

/// The longest answer read, in bytes (the credentials' JSON is about 1 KiB).
const MAX_ANSWER: usize = 1 << 20;

/// The service's endpoint from the environment (`AWS_EC2_METADATA_DISABLED`,
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT`), `None` when it is disabled.
pub fn endpoint(disabled: Option<&str>, endpoint: Option<&str>) -> Option<String> {
    if disabled.is_some_and(|d| d.trim().eq_ignore_ascii_case("true")) {
        return None;
    }
    Some(endpoint.filter(|e| !e.is_empty()).unwrap_or("http://169.254.169.254").trim_end_matches('/').to_string())
}

/// The instance role's credentials from the service at `endpoint` (`http://HOST[:PORT]`),
/// asked through `client`; why not, when it cannot be asked or answers otherwise.
pub async fn credentials(client: &super::http::Client, endpoint: &str) -> Result<Credentials, String> {
    if !endpoint.starts_with("http://") {
        return Err(format!("{endpoint}: the instance metadata endpoint must be http://"));
    }
    let token = request(
        client,
        reqwest::Method::PUT,
        &format!("{endpoint}/latest/api/token"),
        ("x-aws-ec2-metadata-token-ttl-seconds", TOKEN_TTL.to_string()),
    )
    .await?;
    let token = ("x-aws-ec2-metadata-token", token.trim().to_string());
    let roles_url = format!("{endpoint}/latest/meta-data/iam/security-credentials/");
    let roles = request(client, reqwest::Method::GET, &roles_url, token.clone()).await?;
    let role = roles.lines().next().map(str::trim).filter(|r| !r.is_empty()).ok_or("the instance has no IAM role")?;
    let json = request(client, reqwest::Method::GET, &format!("{roles_url}{role}"), token).await?;
    let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| format!("the credentials of role {role}: {e}"))?;
    let field = |name: &str| value.get(name).and_then(|v| v.as_str()).map(str::to_string);
    let expiry = field("Expiration")
        .map(|e| expiry(&e).map_err(|why| format!("the credentials of role {role}: Expiration {e:?}: {why}")))
        .transpose()?;
    match (field("AccessKeyId"), field("SecretAccessKey")) {
        (Some(id), Some(secret)) => Ok(Credentials::new(id, secret, field("Token"), expiry, "instance metadata")),
        _ => Err(format!("the credentials of role {role} lack AccessKeyId or SecretAccessKey")),
    }
}

/// The time an RFC 3339 `Expiration` (`2026-12-02T22:00:00Z`) stands for.
fn expiry(text: &str) -> Result<std::time::SystemTime, String> {
    let at = aws_smithy_types::DateTime::from_str(text, aws_smithy_types::date_time::Format::DateTime).map_err(|e| e.to_string())?;
    std::time::SystemTime::try_from(at).map_err(|e| e.to_string())
}

/// One request with one extra header; the body of a 200 answer (at most [`MAX_ANSWER`]
/// bytes), or why not, naming the request.
async fn request(
    client: &super::http::Client,
    method: reqwest::Method,
    url: &str,
    (name, value): (&'static str, String),
) -> Result<String, String> {
    let fail = |e: &dyn std::fmt::Display| format!("{method} {url}: {e}");
    let mut sent = reqwest::Request::new(method.clone(), reqwest::Url::parse(url).map_err(|e| fail(&e))?);
    let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| fail(&e))?;
    sent.headers_mut().insert(name, reqwest::header::HeaderValue::from_str(&value).map_err(|e| fail(&e))?);
    sent.headers_mut().insert(reqwest::header::CONNECTION, reqwest::header::HeaderValue::from_static("close"));
    let answered = async {
        let mut answer = client.execute(sent).await.map_err(|e| fail(&crate::causes::causes(&e)))?;
        if answer.status() != reqwest::StatusCode::OK {
            return Err(fail(&format!("status {}", answer.status().as_u16())));
        }
        let mut body = Vec::new();
        while let Some(chunk) = answer.chunk().await.map_err(|e| fail(&e))? {
            if body.len() + chunk.len() > MAX_ANSWER {
                return Err(fail(&format!("an answer of more than {MAX_ANSWER} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        String::from_utf8(body).map_err(|e| fail(&e))
    };
    tokio::time::timeout(TIMEOUT, answered).await.map_err(|_| fail(&format!("no whole answer within {} ms", TIMEOUT.as_millis())))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A fake service on loopback: answers `answers.len()` requests in turn, each with the
    /// given status and body; returns its endpoint and the requests it got.
    fn fake(answers: Vec<(u16, &'static str)>) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let served = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for (status, body) in answers {
                let (mut conn, _) = listener.accept().unwrap();
                let mut buf = vec![0; 4096];
                let n = conn.read(&mut buf).unwrap();
                seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                write!(conn, "HTTP/1.1 {status} X\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
            }
            seen
        });
        (endpoint, served)
    }

    /// A client as the caches'.
    fn client() -> crate::http::Client {
        crate::client::Client::plain()
    }

    /// IMDSv2's three requests, the token passed on; the role's credentials come back.
    #[tokio::test]
    async fn role_credentials_with_a_session_token() {
        let creds = r#"{"Code":"Success","AccessKeyId":"ASIAFAKE","SecretAccessKey":"secret","Token":"session","Expiration":"2026-12-02T22:00:00Z"}"#;
        let (endpoint, served) = fake(vec![(200, "tok-123"), (200, "the-role\n"), (200, creds)]);
        let got = credentials(&client(), &endpoint).await.unwrap();
        assert_eq!((got.access_key_id(), got.secret_access_key(), got.session_token()), ("ASIAFAKE", "secret", Some("session")));
        // 2026-12-02T22:00:00Z
        assert_eq!(got.expiry(), Some(std::time::UNIX_EPOCH + Duration::from_secs(1_796_248_800)));
        let seen = served.join().unwrap();
        assert!(
            seen[0].starts_with("PUT /latest/api/token HTTP/1.1\r\n")
                && seen[0].contains("x-aws-ec2-metadata-token-ttl-seconds: 21600\r\n"),
            "{}",
            seen[0]
        );
        assert!(
            seen[1].starts_with("GET /latest/meta-data/iam/security-credentials/ HTTP/1.1\r\n")
                && seen[1].contains("x-aws-ec2-metadata-token: tok-123\r\n"),
            "{}",
            seen[1]
        );
        assert!(seen[2].starts_with("GET /latest/meta-data/iam/security-credentials/the-role HTTP/1.1\r\n"), "{}", seen[2]);
    }

    /// A refused token (a service that only speaks IMDSv1 answers 403 here) is an error
    /// naming the request; nothing further is asked.
    #[tokio::test]
    async fn refused_token_is_an_error() {
        let (endpoint, served) = fake(vec![(403, "")]);
        let err = credentials(&client(), &endpoint).await.unwrap_err();
        assert!(err.contains("PUT http://127.0.0.1:") && err.contains("/latest/api/token: status 403"), "{err}");
        assert_eq!(served.join().unwrap().len(), 1);
    }

    /// The environment as the SDKs read it.
    #[test]
    fn endpoint_from_the_environment() {
        assert_eq!(endpoint(None, None).as_deref(), Some("http://169.254.169.254"));
        assert_eq!(endpoint(Some("false"), Some("http://[fd00:ec2::254]/")).as_deref(), Some("http://[fd00:ec2::254]"));
        assert_eq!(endpoint(Some("TRUE"), None), None);
        assert_eq!(endpoint(Some("true"), Some("http://127.0.0.1:1")), None);
    }
}
