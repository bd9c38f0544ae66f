//! `sluice copy --from LOCAL --to CACHE`: pushing a chroot store (filled by sluice from the
//! corpus) into `file://`, HTTP (PUT) and S3 caches, read back by real Nix 2.8 (`nix copy
//! --from`, `nix-store -r` with the cache as substituter, `nix store verify` against the key
//! sluice signed with). S3 runs against s3s-fs (`cargo install s3s-fs --version 0.14.1
//! --features binary`, which `.ci/run` does), started by the tests with and without
//! credentials.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::*;

/// The 25-path subset's root and its paths.
pub(crate) fn subset() -> (String, BTreeSet<String>) {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let paths = std::fs::read_to_string(corpus().join("truth/subset-paths.txt")).unwrap().lines().map(str::to_string).collect();
    (summary["subsetRoot"].as_str().unwrap().to_string(), paths)
}

/// A chroot store under `tmp/src` holding the closure of `root`, copied by sluice from `cache`.
pub(crate) fn source_store(tmp: &Path, cache: &str, root: &str) -> PathBuf {
    let src = tmp.join("src");
    let from = format!("file://{}", corpus().join(cache).display());
    check(
        &sluice(tmp, &["copy", "--from", &from, "--to", src.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), root]),
        "filling the source store",
    );
    src
}

/// A new signing key under `tmp`: (secret key file, public key).
fn signing_key(tmp: &Path) -> (PathBuf, String) {
    let secret = sluice(tmp, &["key", "generate", "sluice-push-test-1"]);
    check(&secret, "key generate");
    let file = tmp.join("secret.key");
    std::fs::write(&file, &secret.stdout).unwrap();
    let mut public = Command::new(env!("CARGO_BIN_EXE_sluice"));
    let public = public.args(["key", "generate", "--public"]).stdin(std::fs::File::open(&file).unwrap()).output().unwrap();
    check(&public, "key generate --public");
    (file, String::from_utf8(public.stdout).unwrap().trim().to_string())
}

/// Real Nix reads the cache at `url`: `nix copy --from` into a fresh chroot store with only
/// `public` trusted, `nix store verify` of its signatures, and `nix-store -r` with the cache as
/// a substituter into another; both stores then hold exactly `paths`.
fn assert_nix_reads(tmp: &Path, url: &str, public: &str, root: &str, paths: &BTreeSet<String>) {
    let (a, b) = (tmp.join("nix-copy"), tmp.join("nix-substitute"));
    let keys = format!("trusted-public-keys = {public}\nrequire-sigs = true");
    let run = |prog: &str, args: &[&str]| {
        let mut cmd = Command::new(prog);
        isolate(&mut cmd, tmp, &keys);
        cmd.args(args).output().unwrap()
    };
    check(&run("nix", &["copy", "--from", url, "--to", a.to_str().unwrap(), root]), "nix copy --from the pushed cache");
    check(
        &run("nix", &["store", "verify", "--store", a.to_str().unwrap(), "-r", "--sigs-needed", "1", root]),
        "nix store verify --sigs-needed 1",
    );
    assert_nix_verifies(tmp, &a);
    check(
        &run("nix-store", &["--store", b.to_str().unwrap(), "-r", root, "--option", "substituters", url]),
        "nix-store -r with the pushed cache as substituter",
    );
    for store in [&a, &b] {
        let listed = run("nix", &["path-info", "--store", store.to_str().unwrap(), "-r", root]);
        check(&listed, "nix path-info -r");
        let got: BTreeSet<String> = String::from_utf8(listed.stdout).unwrap().lines().map(str::to_string).collect();
        assert_eq!(&got, paths, "paths in {}", store.display());
    }
}

/// The narinfos of a `file://` cache directory, by hash part, with their `References:`.
fn narinfos(dir: &Path) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for entry in entries {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(hash) = name.strip_suffix(".narinfo") else { continue };
        let text = std::fs::read_to_string(dir.join(&name)).unwrap();
        let refs = text
            .lines()
            .find_map(|l| l.strip_prefix("References:"))
            .unwrap_or("")
            .split_whitespace()
            .map(|r| r[..32].to_string())
            .collect();
        out.push((hash.to_string(), refs));
    }
    out
}

#[test]
fn subset_into_file_cache_xz_with_listing_is_read_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    let cache = tmp.path().join("cache");
    let to = format!("file://{}?compression=xz&write-nar-listing=true&secret-key={}", cache.display(), secret.display());
    check(&sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &to, &root]), "push");
    assert_eq!(std::fs::read_to_string(cache.join("nix-cache-info")).unwrap(), "StoreDir: /nix/store\n");
    let infos = narinfos(&cache);
    assert_eq!(infos.len(), 25);
    let nars: Vec<_> = std::fs::read_dir(cache.join("nar")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(nars.len(), 25);
    assert!(nars.iter().all(|n| n.ends_with(".nar.xz")), "{nars:?}");
    // The listing Nix writes, {"version":1,"root":…} with narOffsets, of every path: what real
    // Nix lists from the NAR in the cache.
    for path in &paths {
        let ls: serde_json::Value = serde_json::from_slice(&std::fs::read(cache.join(format!("{}.ls", &path[11..43]))).unwrap()).unwrap();
        assert_eq!(ls["version"], 1);
        let nix_ls = nix(tmp.path(), "nix", &["store", "ls", "--json", "-R", "--store", &format!("file://{}", cache.display()), path]);
        check(&nix_ls, "nix store ls");
        assert_eq!(ls["root"], serde_json::from_slice::<serde_json::Value>(&nix_ls.stdout).unwrap(), "{path}");
    }
    assert_nix_reads(tmp.path(), &format!("file://{}", cache.display()), &public, &root, &paths);
    // A second push finds everything there and writes nothing.
    let again = sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &to, &root]);
    check(&again, "second push");
    assert!(stderr(&again).contains("copied 0 paths") && stderr(&again).contains("25 already there"), "{}", stderr(&again));
}

#[test]
fn full_corpus_into_file_cache_zstd_is_read_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let paths: BTreeSet<String> =
        std::fs::read_to_string(corpus().join("truth/closure-paths.txt")).unwrap().lines().map(str::to_string).collect();
    let src = source_store(tmp.path(), "cache-zstd", TOP);
    let (secret, public) = signing_key(tmp.path());
    let cache = tmp.path().join("cache");
    let to = format!("file://{}?secret-key={}", cache.display(), secret.display());
    check(&sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &to, TOP]), "push");
    assert_eq!(narinfos(&cache).len(), 1056);
    assert!(std::fs::read_to_string(cache.join(format!("{}.narinfo", &TOP[11..43]))).unwrap().contains("Compression: zstd\n"));
    assert_nix_reads(tmp.path(), &format!("file://{}", cache.display()), &public, TOP, &paths);
}

#[test]
fn killed_push_leaves_no_narinfo_with_an_incomplete_closure() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source_store(tmp.path(), "cache-zstd", TOP);
    let cache = tmp.path().join("cache");
    let to = format!("file://{}?compression=xz&compression-level=9", cache.display());
    for delay_ms in [150, 400] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let mut child = cmd.args(["copy", "--from", src.to_str().unwrap(), "--to", &to, TOP]).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let infos = narinfos(&cache);
        assert!(infos.len() < 1056, "the push finished before it was killed ({delay_ms} ms)");
        let have: BTreeSet<&str> = infos.iter().map(|(h, _)| h.as_str()).collect();
        for (hash, refs) in &infos {
            for r in refs {
                assert!(have.contains(r.as_str()), "{hash}.narinfo was written before the narinfo of its reference {r}");
            }
        }
    }
}

#[test]
fn subset_by_http_put_is_read_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    std::fs::create_dir_all(tmp.path().join("s3/bucket")).unwrap();
    let server = S3Server::start(&tmp.path().join("s3"), false);
    let url = format!("http://127.0.0.1:{}/bucket", server.port);
    check(
        &sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &format!("{url}?secret-key={}", secret.display()), &root]),
        "push by PUT",
    );
    assert_eq!(narinfos(&tmp.path().join("s3/bucket")).len(), 25);
    assert_nix_reads(tmp.path(), &url, &public, &root, &paths);
}

#[test]
fn subset_into_s3_with_credentials_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    std::fs::create_dir_all(tmp.path().join("s3/bucket")).unwrap();
    let server = S3Server::start(&tmp.path().join("s3"), true);
    let s3 = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", server.port);
    let push = |env: &[(&str, &str)], url: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        cmd.envs(env.iter().copied()).args(["copy", "--from", src.to_str().unwrap(), "--to", url, &root]).output().unwrap()
    };
    // Unsigned requests are refused by the server, and the error names the URL.
    let refused = push(&[], &s3);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains(&format!("http://127.0.0.1:{}/bucket/nix-cache-info: the server refused the upload", server.port)),
        "{}",
        stderr(&refused)
    );
    // Credentials from the environment.
    check(
        &push(
            &[("AWS_ACCESS_KEY_ID", "AKTEST"), ("AWS_SECRET_ACCESS_KEY", "SKTEST")],
            &format!("{s3}&secret-key={}&compression=xz", secret.display()),
        ),
        "push to S3",
    );
    assert_eq!(narinfos(&tmp.path().join("s3/bucket")).len(), 25);
    // Credentials from an instance metadata service (IMDSv2, a fake one on loopback).
    let (imds, asked) = fake_imds(r#"{"AccessKeyId":"AKTEST","SecretAccessKey":"SKTEST","Token":null}"#);
    let mut info = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut info, tmp.path(), "");
    let info = info
        .envs([("AWS_EC2_METADATA_DISABLED", "false"), ("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.as_str())])
        .args(["path-info", "--store", &s3, &root])
        .output()
        .unwrap();
    check(&info, "path-info of S3 with credentials from the instance metadata service");
    assert_eq!(String::from_utf8_lossy(&info.stdout).trim(), root);
    assert_eq!(
        asked.join().unwrap(),
        [
            "PUT /latest/api/token",
            "GET /latest/meta-data/iam/security-credentials/",
            "GET /latest/meta-data/iam/security-credentials/ci-role"
        ]
    );
    // Read back through the substitution pipeline, with credentials from a profile.
    let aws = tmp.path().join("home/.aws");
    std::fs::create_dir_all(&aws).unwrap();
    std::fs::write(aws.join("credentials"), "[default]\naws_access_key_id = WRONG\naws_secret_access_key = WRONG\n[ci]\naws_access_key_id = AKTEST\naws_secret_access_key = SKTEST\n").unwrap();
    let dst = tmp.path().join("back");
    let back = sluice(
        tmp.path(),
        &["copy", "--from", &format!("{s3}&profile=ci"), "--to", dst.to_str().unwrap(), "--trusted-public-keys", &public, &root],
    );
    check(&back, "copy from S3");
    assert_nix_verifies(tmp.path(), &dst);
    let listed = nix(tmp.path(), "nix", &["path-info", "--store", dst.to_str().unwrap(), "-r", &root]);
    assert_eq!(String::from_utf8(listed.stdout).unwrap().lines().map(str::to_string).collect::<BTreeSet<_>>(), paths);
}

/// A fake EC2 instance metadata service on loopback answering IMDSv2's three requests (a
/// token, the role `ci-role`, then `credentials`): its endpoint, and the request lines it got.
fn fake_imds(credentials: &'static str) -> (String, std::thread::JoinHandle<Vec<String>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let served = std::thread::spawn(move || {
        let mut asked = Vec::new();
        for body in ["token-1", "ci-role\n", credentials] {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = vec![0; 4096];
            let n = conn.read(&mut buf).unwrap();
            let request = String::from_utf8_lossy(&buf[..n]).into_owned();
            assert!(asked.is_empty() || request.to_ascii_lowercase().contains("x-aws-ec2-metadata-token: token-1\r\n"), "{request}");
            asked.push(request.split(" HTTP/").next().unwrap().to_string());
            write!(conn, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        }
        asked
    });
    (endpoint, served)
}

/// A chroot store under `tmp/src` holding one 12 MB file that does not compress (three S3
/// parts of at most 5 MiB): (the store, the path, its NAR by `nix-store --dump`).
fn incompressible_path(tmp: &Path) -> (PathBuf, String, Vec<u8>) {
    let file = tmp.join("parts");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..12_000_000 / 8)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect();
    std::fs::write(&file, &data).unwrap();
    let src = tmp.join("src");
    let added = nix(tmp, "nix-store", &["--store", src.to_str().unwrap(), "--add", file.to_str().unwrap()]);
    check(&added, "nix-store --add");
    let path = String::from_utf8(added.stdout).unwrap().trim().to_string();
    let real = src.join(path.trim_start_matches('/'));
    let dumped = nix(tmp, "nix-store", &["--dump", real.to_str().unwrap()]);
    check(&dumped, "nix-store --dump");
    (src, path, dumped.stdout)
}

/// `sluice copy` of `path` from `src` to the S3 URL `s3`, with s3s-fs's test credentials and
/// `conf` as the configuration.
fn push_to_s3(tmp: &Path, src: &Path, s3: &str, path: &str, conf: &str) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, conf);
    cmd.envs([("AWS_ACCESS_KEY_ID", "AKTEST"), ("AWS_SECRET_ACCESS_KEY", "SKTEST")]);
    cmd.args(["copy", "--from", src.to_str().unwrap(), "--to", s3, path]).output().unwrap()
}

/// A NAR over `multipart-threshold` goes to S3 in parts (`multipart-upload=true`): the object
/// S3 keeps is the NAR byte for byte, its ETag is that of a three-part upload, and real Nix
/// reads the cache through `http://…/bucket`.
#[test]
fn big_nar_into_s3_by_multipart_upload_is_read_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, path, dumped) = incompressible_path(tmp.path());
    let (secret, public) = signing_key(tmp.path());
    std::fs::create_dir_all(tmp.path().join("s3/bucket")).unwrap();
    let server = S3Server::start(&tmp.path().join("s3"), true);
    let s3 = format!(
        "s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1&compression=none&multipart-upload=true&multipart-threshold=5M&multipart-chunk-size=5M&secret-key={}",
        server.port,
        secret.display()
    );
    check(&push_to_s3(tmp.path(), &src, &s3, &path, ""), "multipart push to S3");
    drop(server);

    let server = S3Server::start(&tmp.path().join("s3"), false);
    let url = format!("http://127.0.0.1:{}/bucket", server.port);
    let narinfo = std::fs::read_to_string(tmp.path().join("s3/bucket").join(format!("{}.narinfo", &path[11..43]))).unwrap();
    let nar_url = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap();
    let object =
        Command::new("curl").args(["-sfD", tmp.path().join("headers").to_str().unwrap(), &format!("{url}/{nar_url}")]).output().unwrap();
    assert!(object.status.success());
    assert!(object.stdout == dumped, "the object is not the NAR ({} bytes against {})", object.stdout.len(), dumped.len());
    let headers = std::fs::read_to_string(tmp.path().join("headers")).unwrap().to_ascii_lowercase();
    let etag = headers.lines().find_map(|l| l.strip_prefix("etag: ")).unwrap().trim().trim_matches('"').to_string();
    assert!(etag.ends_with("-3"), "ETag {etag} is not that of a three-part upload");
    assert_nix_reads(tmp.path(), &url, &public, &path, &BTreeSet::from([path.clone()]));
}

/// A TCP front before a server that forwards HTTP/1.1 requests (framed by `Content-Length`)
/// and their answers, but closes a connection, unanswered and unforwarded, when a request line
/// contains `kill`; it records every request line it read.
struct KillingFront {
    port: u16,
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl KillingFront {
    fn start(upstream: u16, kill: &'static str) -> KillingFront {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || Self::forward(client, upstream, kill, &log));
            }
        });
        KillingFront { port, seen }
    }

    /// Forwards one client connection's requests until it ends or a request is killed.
    fn forward(client: std::net::TcpStream, upstream: u16, kill: &str, log: &std::sync::Mutex<Vec<String>>) -> std::io::Result<()> {
        use std::io::{BufRead, Read, Write};
        let mut server = std::net::TcpStream::connect(("127.0.0.1", upstream))?;
        let (mut answers, mut to_client) = (server.try_clone()?, client.try_clone()?);
        std::thread::spawn(move || std::io::copy(&mut answers, &mut to_client));
        let mut requests = std::io::BufReader::new(&client);
        loop {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                if requests.read_until(b'\n', &mut head)? == 0 {
                    return Ok(());
                }
            }
            let text = String::from_utf8_lossy(&head).into_owned();
            let line = text.lines().next().unwrap_or("").to_string();
            log.lock().unwrap().push(line.clone());
            if line.contains(kill) {
                let _ = server.shutdown(std::net::Shutdown::Both);
                return client.shutdown(std::net::Shutdown::Both);
            }
            let length = text
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<u64>().unwrap()))
                .unwrap_or(0);
            server.write_all(&head)?;
            std::io::copy(&mut (&mut requests).take(length), &mut server)?;
        }
    }

    /// The request lines seen whose target contains `what`.
    fn seen(&self, what: &str) -> Vec<String> {
        self.seen.lock().unwrap().iter().filter(|l| l.contains(what)).cloned().collect()
    }
}

/// A multipart upload whose second part fails on every attempt is aborted
/// (`AbortMultipartUpload`, as Nix 2.35 does): the push fails naming the part's URL, the
/// upload is never completed, and s3s-fs keeps nothing of it (no part files, no upload
/// record, no object, no narinfo).
#[test]
fn failed_multipart_upload_is_aborted_and_leaves_no_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, path, _) = incompressible_path(tmp.path());
    let root = tmp.path().join("s3");
    std::fs::create_dir_all(root.join("bucket")).unwrap();
    let server = S3Server::start(&root, true);
    let front = KillingFront::start(server.port, "partNumber=2&");
    let s3 = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1&compression=none&multipart-upload=true&multipart-threshold=5M&multipart-chunk-size=5M", front.port);
    let failed = push_to_s3(tmp.path(), &src, &s3, &path, "download-attempts = 2");
    assert!(!failed.status.success(), "the push succeeded through a front that kills part 2");
    assert!(
        stderr(&failed).contains(&format!("http://127.0.0.1:{}/bucket/nar/", front.port))
            && stderr(&failed).contains("partNumber=2&uploadId="),
        "{}",
        stderr(&failed)
    );

    assert_eq!(front.seen("?uploads").len(), 1, "{:?}", front.seen(""));
    assert_eq!(front.seen("partNumber=1&").len(), 1);
    assert_eq!(front.seen("partNumber=2&").len(), 2, "part 2 is tried download-attempts times");
    let aborts = front.seen("DELETE /bucket/nar/");
    assert_eq!(aborts.len(), 1, "{:?}", front.seen(""));
    assert!(aborts[0].contains("?uploadId="), "{aborts:?}");
    assert!(front.seen("POST /bucket/nar/").iter().all(|l| l.contains("?uploads")), "the upload was completed: {:?}", front.seen(""));
    // s3s-fs keeps an upload's record, parts and metadata in its directory (`.upload-ID.json`,
    // `.upload_id-ID.part-N`, `….upload-ID.metadata.json`), and files being written as `.tmp.*`.
    let left: Vec<String> = walk(&root).into_iter().filter(|n| n.contains("upload") || n.starts_with(".tmp.")).collect();
    assert!(left.is_empty(), "s3s-fs keeps {left:?}");
    let bucket: Vec<String> = walk(&root.join("bucket"));
    assert_eq!(bucket, ["nix-cache-info"], "the bucket holds more than nix-cache-info");
}

/// The files under `dir`, relative to it, sorted.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            match p.is_dir() {
                true => stack.push(p),
                false => out.push(p.strip_prefix(dir).unwrap().display().to_string()),
            }
        }
    }
    out.sort();
    out
}

/// The subset's top path and closure, a source store under `tmp` holding them, and an empty
/// binary cache directory `tmp/cache` (its `nix-cache-info` only).
fn subset_and_empty_cache(tmp: &Path) -> (String, BTreeSet<String>, PathBuf, PathBuf) {
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let cache = tmp.join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::fs::write(cache.join("nix-cache-info"), "StoreDir: /nix/store\n").unwrap();
    (root, paths, src, cache)
}

/// A `file://` cache's narinfos are read anew by each run, as Nix reads a local binary
/// cache's (only its HTTP and S3 stores use the narinfo disk cache): a copy that found the
/// cache empty does not keep failing for an hour after the closure is pushed into it.
#[test]
fn a_file_cache_is_read_anew_after_a_push_into_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths, src, cache) = subset_and_empty_cache(tmp.path());
    let url = format!("file://{}", cache.display());
    let copy_back = |to: &str| {
        sluice(
            tmp.path(),
            &["copy", "--from", &url, "--to", tmp.path().join(to).to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root],
        )
    };
    let o = copy_back("before");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no substituter has this path"), "{}", stderr(&o));
    check(&sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &url, &root]), "push into the cache");
    check(&copy_back("after"), "copy from the cache after the push");
    assert_eq!(nix_path_info(tmp.path(), tmp.path().join("after").to_str().unwrap(), &root).len(), paths.len());
}

/// A cache that refuses every upload (nginx, which takes no PUT) fails the push with one line
/// per cause, not one per path: the count, a few paths, the cache and its answer. Regression:
/// a push of N paths printed N errors, all the same but for the path (Nix stops at the first).
#[test]
fn refused_uploads_are_one_error_line() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, _, src, cache) = subset_and_empty_cache(tmp.path());
    let server = CacheServer::start(&cache, &tmp.path().join("srv"), &[]);
    let o = sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", &server.url, &root]);
    assert!(!o.status.success(), "the push fails");
    let err = stderr(&o);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    // The refused uploads; the paths whose reference failed first, if any, are a second line.
    assert!((1..=2).contains(&errors.len()), "one line per cause:\n{err}");
    let refused = format!("paths could not be copied because {} failed: ", server.url);
    assert!(errors[0].contains(&refused) && errors[0].contains("the server refused the upload") && errors[0].contains("more)"), "{err}");
    let counted: usize = errors.iter().map(|l| l["error: ".len()..].split(' ').next().unwrap().parse::<usize>().unwrap_or(1)).sum();
    assert_eq!(counted, 25, "every path of the closure is counted once:\n{err}");
    assert!(err.contains("copied 0 paths"), "{err}");
}
