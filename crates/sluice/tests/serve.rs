//! `sluice serve` against real clients: a chroot store filled by `sluice copy` from the corpus,
//! served to real Nix 2.8 and Nix 2.26 (`nix copy --from`, `nix-store -r` with it as a
//! substituter, signatures verified with the server's public key, `nix path-info -r --json`
//! equal to the same over nginx serving a cache pushed from the same store), to sluice with and
//! without the batch endpoint, in front of an S3 bucket (s3s-fs) as of a local store, in front of
//! an HTTP cache that answers in two writes (narinfos asked in turn wait for no delayed ACK), and to
//! hostile clients (traversal, huge headers, thousands of idle connections, a client that
//! stops reading, h2c connections that only answer PINGs or flood them, a request body trickled
//! a byte at a time, HTTP/2 streams never read, keep-alive clients holding every slot) beside a
//! slow reader that keeps up.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// The 25-path subset's root and its paths.
pub(crate) fn subset() -> (String, BTreeSet<String>) {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let paths = std::fs::read_to_string(corpus().join("truth/subset-paths.txt")).unwrap().lines().map(str::to_string).collect();
    (summary["subsetRoot"].as_str().unwrap().to_string(), paths)
}

/// A chroot store under `tmp/src` holding the closure of `root`, copied by sluice from the corpus.
pub(crate) fn source_store(tmp: &Path, root: &str) -> PathBuf {
    let src = tmp.join("src");
    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(
        &sluice(tmp, &["copy", "--from", &from, "--to", src.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), root]),
        "filling the source store",
    );
    src
}

/// `sluice serve ARGS` of a store holding the 25-path subset (under `tmp`), and the subset's paths.
fn serve_subset(tmp: &Path, args: &[&str]) -> (Server, BTreeSet<String>) {
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    (Server::start(tmp, &src, args), paths)
}

/// A new signing key under `tmp`: (secret key file, public key).
pub(crate) fn signing_key(tmp: &Path) -> (PathBuf, String) {
    let secret = sluice(tmp, &["key", "generate", "sluice-serve-test-1"]);
    check(&secret, "key generate");
    let file = tmp.join("secret.key");
    std::fs::write(&file, &secret.stdout).unwrap();
    let public = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["key", "generate", "--public"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .unwrap();
    check(&public, "key generate --public");
    (file, String::from_utf8(public.stdout).unwrap().trim().to_string())
}

/// A running `sluice serve`; killed on drop.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) url: String,
    addr: String,
}

impl Server {
    /// Starts `sluice serve --store STORE --listen 127.0.0.1:0 ARGS` and waits for its address.
    pub(crate) fn start(tmp: &Path, store: &Path, args: &[&str]) -> Server {
        Server::start_url(tmp, store.to_str().unwrap(), args)
    }

    /// [`Server::start`] for the store at `url`.
    pub(crate) fn start_url(tmp: &Path, url: &str, args: &[&str]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp, "");
        Server::started(cmd.args(["serve", "--store", url, "--listen", "127.0.0.1:0"]).args(args).stderr(Stdio::piped()).spawn().unwrap())
    }

    /// [`Server::start_url`] with its standard error (its log) going to the file `log`.
    pub(crate) fn start_logging(tmp: &Path, url: &str, args: &[&str], log: &Path) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp, "");
        cmd.args(["serve", "--store", url, "--listen", "127.0.0.1:0"]).args(args);
        let child = cmd.stderr(std::fs::File::create(log).unwrap()).spawn().unwrap();
        let start = Instant::now();
        let url = loop {
            let text = std::fs::read_to_string(log).unwrap();
            if let Some(line) = text.lines().find(|l| l.starts_with("serving ")) {
                break line.rsplit(' ').next().unwrap().to_owned();
            }
            assert!(start.elapsed() < Duration::from_secs(20), "{text}");
            std::thread::sleep(Duration::from_millis(20));
        };
        Server { child, addr: url.split("://").nth(1).unwrap().to_owned(), url }
    }

    /// [`Server::start`] by `systemd-socket-activate` listening on a free loopback port, which
    /// starts `sluice serve` with that socket passed at the first connection (made here).
    fn start_activated(tmp: &Path, store: &Path, args: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut cmd = Command::new("systemd-socket-activate");
        isolate(&mut cmd, tmp, "");
        cmd.args(["-l", &format!("127.0.0.1:{port}"), env!("CARGO_BIN_EXE_sluice"), "serve", "--store", store.to_str().unwrap()]);
        let child = cmd.args(["--listen", "127.0.0.1:0"]).args(args).stderr(Stdio::piped()).spawn().unwrap();
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "systemd-socket-activate did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let server = Server::started(child);
        assert_eq!(server.url, format!("http://127.0.0.1:{port}"), "sluice serve does not serve the socket systemd passed");
        server
    }

    /// The server `child` once it said where it serves (lines before, `systemd-socket-activate`'s,
    /// are skipped).
    fn started(mut child: Child) -> Server {
        let mut line = String::new();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        while stderr.read_line(&mut line).unwrap() > 0 && !line.starts_with("serving ") {
            line.clear();
        }
        let url = line.trim().rsplit(' ').next().unwrap_or_else(|| panic!("no address in {line:?}")).to_string();
        assert!(url.starts_with("http"), "sluice serve said {line:?}");
        let addr = url.split("://").nth(1).unwrap().to_string();
        Server { child, url, addr }
    }

    /// Sends `request` raw and returns the whole answer (the connection is closed by the request).
    fn raw(&self, request: &[u8]) -> String {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The status line's code of `GET target`, the target sent as is.
    fn status_of(&self, target: &str) -> u16 {
        let answer = self.raw(format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
        answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("no status in {answer:?}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `prog ARGS` (real Nix 2.8) isolated under `tmp`, trusting only `public`.
pub(crate) fn nix_trusting(tmp: &Path, public: &str, prog: &str, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(prog);
    isolate(&mut cmd, tmp, &format!("trusted-public-keys = {public}\nrequire-sigs = true"));
    cmd.args(args).output().unwrap()
}

/// `nix path-info -r --json` of `root` in the cache at `url`, each entry without the fields
/// that name the cache's own files (`url`, `compression`, `downloadHash`, `downloadSize`).
fn cache_path_info(tmp: &Path, url: &str, root: &str) -> Vec<serde_json::Value> {
    let mut infos = nix_path_info(tmp, url, root);
    for i in &mut infos {
        let o = i.as_object_mut().unwrap();
        for k in ["url", "compression", "downloadHash", "downloadSize"] {
            o.remove(k);
        }
    }
    infos.sort_by_key(|i| i["path"].as_str().unwrap().to_string());
    infos
}

/// Real Nix 2.8, trusting only `public`, substitutes the closure of `root` (exactly `paths`)
/// from the cache at `url`: `nix copy --from` (then `nix store verify` with one signature by
/// `public` needed) and `nix-store -r` with it as the substituter, each into a fresh chroot store.
fn assert_nix_2_8_substitutes(tmp: &Path, url: &str, public: &str, root: &str, paths: &BTreeSet<String>) {
    let (a, b) = (tmp.join("nix-copy"), tmp.join("nix-substitute"));
    check(&nix_trusting(tmp, public, "nix", &["copy", "--from", url, "--to", a.to_str().unwrap(), root]), "nix copy --from sluice serve");
    check(
        &nix_trusting(tmp, public, "nix", &["store", "verify", "--store", a.to_str().unwrap(), "-r", "--sigs-needed", "1", root]),
        "nix store verify with the server's key",
    );
    assert_nix_verifies(tmp, &a);
    check(
        &nix_trusting(tmp, public, "nix-store", &["--store", b.to_str().unwrap(), "-r", root, "--option", "substituters", url]),
        "nix-store -r with sluice serve as substituter",
    );
    for store in [&a, &b] {
        let listed = nix_trusting(tmp, public, "nix", &["path-info", "--store", store.to_str().unwrap(), "-r", root]);
        let got: BTreeSet<String> = String::from_utf8(listed.stdout).unwrap().lines().map(str::to_string).collect();
        assert_eq!(&got, paths, "paths in {}", store.display());
    }
}

#[test]
fn real_nix_2_8_substitutes_from_sluice_serve_as_from_nginx() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    let (secret, public) = signing_key(tmp);
    let server = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap()]);

    assert_nix_2_8_substitutes(tmp, &server.url, &public, &root, &paths);

    // The same store pushed into a cache with the same key and served by nginx: the same
    // path infos, signatures included.
    let pushed = tmp.join("pushed");
    let to = format!("file://{}?secret-key={}", pushed.display(), secret.display());
    check(&sluice(tmp, &["copy", "--from", src.to_str().unwrap(), "--to", &to, &root]), "sluice copy --to file://");
    let nginx = CacheServer::start(&pushed, &tmp.join("nginx"), &[]);
    let served = cache_path_info(tmp, &server.url, &root);
    assert_eq!(served.len(), paths.len());
    assert_eq!(served, cache_path_info(tmp, &nginx.url, &root));

    // The narinfo's URL and Compression are what is served: the NAR hashes to NarHash.
    let hash = &root["/nix/store/".len()..][..32];
    let narinfo = server.raw(format!("GET /{hash}.narinfo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    assert!(narinfo.contains("Compression: none\n"), "{narinfo}");
    let url = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap();
    let nar = Command::new("curl").args(["-sf", &format!("{}/{url}", server.url)]).output().unwrap();
    check(&nar, "curl the NAR");
    let real = src.join(root.trim_start_matches('/'));
    let expected = nix(tmp, "nix-store", &["--dump", real.to_str().unwrap()]);
    assert_eq!(nar.stdout, expected.stdout);
    let range = Command::new("curl").args(["-sf", "-r", "8-23", &format!("{}/{url}", server.url)]).output().unwrap();
    assert_eq!(range.stdout, expected.stdout[8..24]);
}

/// Socket activation: `systemd-socket-activate` listens on a port and starts `sluice serve`
/// with that socket passed (`LISTEN_FDS`, `LISTEN_PID`) at the first connection: it serves
/// there, not on `--listen`, and real Nix 2.8 substitutes the subset from it (it bound
/// `--listen` and left the passed socket unanswered).
#[test]
fn a_socket_activated_server_serves_the_socket_systemd_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    let (secret, public) = signing_key(tmp);
    let server = Server::start_activated(tmp, &src, &["--secret-key", secret.to_str().unwrap()]);
    let info = Command::new("curl").args(["-sf", "--max-time", "20", &format!("{}/nix-cache-info", server.url)]).output().unwrap();
    check(&info, "curl nix-cache-info");
    assert!(String::from_utf8_lossy(&info.stdout).contains("StoreDir: /nix/store\n"));
    assert_nix_2_8_substitutes(tmp, &server.url, &public, &root, &paths);
}

#[test]
fn real_nix_2_8_substitutes_from_sluice_serve_in_front_of_an_s3_bucket() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    let (secret, public) = signing_key(tmp);
    std::fs::create_dir_all(tmp.join("s3/bucket")).unwrap();
    let s3 = S3Server::start(&tmp.join("s3"), true);
    // The credentials of the default profile, for `sluice copy` and `sluice serve` alike.
    std::fs::create_dir_all(tmp.join("home/.aws")).unwrap();
    std::fs::write(tmp.join("home/.aws/credentials"), "[default]\naws_access_key_id = AKTEST\naws_secret_access_key = SKTEST\n").unwrap();
    let bucket = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", s3.port);
    check(&sluice(tmp, &["copy", "--from", src.to_str().unwrap(), "--to", &bucket, &root]), "sluice copy --to s3://");
    let server = Server::start_url(tmp, &bucket, &["--secret-key", secret.to_str().unwrap()]);

    assert_nix_2_8_substitutes(tmp, &server.url, &public, &root, &paths);
}

/// Narinfos asked one after the other through `sluice serve` in front of an HTTP cache that
/// writes an answer's headers and its body in two writes with Nagle's algorithm on (Python's
/// `http.server` keeping connections alive, put_server.py, serving cache-xz; s3s-fs does the
/// same when its file read ends after hyper flushed the headers), as a Nix client asks them:
/// each is one request on the server's kept-alive upstream connection. The body left only once
/// the server's socket had acknowledged the headers, which Linux delays by 40 ms on such a
/// connection: each narinfo found took 40 ms or more of the server's time.
#[test]
fn narinfos_through_serve_in_front_of_a_cache_answering_in_two_writes_do_not_wait_for_delayed_acks() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let cache = PutServer::start(&corpus().join("cache-xz"), tmp, "[]", 5, true);
    let server = Server::start_url(tmp, &cache.url, &[]);
    // The subset's narinfos (found) and as many that the cache does not have.
    let (_, paths) = subset();
    let found = paths.iter().map(|p| (p.trim_start_matches("/nix/store/")[..32].to_string(), true));
    let hashes: Vec<(String, bool)> = found.chain((0..paths.len()).map(|i| (format!("{i:032}"), false))).collect();
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for (hash, present) in &hashes {
        conn.write_all(format!("GET /{hash}.narinfo HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
        let answer = answer_on(&mut conn).unwrap_or_else(|| panic!("no answer for {hash}.narinfo"));
        let status = if *present { "HTTP/1.1 200" } else { "HTTP/1.1 404" };
        assert!(answer.starts_with(status), "{hash}.narinfo: {answer}");
    }
    let metrics = server.raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let value = |name: &str| -> f64 {
        let prefix = format!("sluice_serve_request_duration_seconds_{name}{{endpoint=\"narinfo\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {prefix} in {metrics}")).parse().unwrap()
    };
    assert_eq!(value("count") as usize, hashes.len());
    let ms = value("sum") * 1000.0 / hashes.len() as f64;
    assert!(ms < 10.0, "{ms:.1} ms of the server's time per narinfo");
}

#[test]
fn real_nix_2_26_substitutes_from_sluice_serve() {
    let o = Command::new(shared().join("bin/setup-nix-modern")).current_dir("/tmp").output().unwrap();
    check(&o, "setup-nix-modern");
    // nix-modern sees the host's /tmp only.
    let tmp = tempfile::Builder::new().tempdir_in("/tmp").unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    let (secret, public) = signing_key(tmp);
    let server = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap()]);
    let modern = |args: &[&str]| {
        let mut cmd = Command::new(shared().join("bin/nix-modern"));
        isolate(&mut cmd, tmp, &format!("trusted-public-keys = {public}\nrequire-sigs = true"));
        let o = cmd.current_dir(tmp).args(args).output().unwrap();
        check(&o, &format!("nix-modern {args:?}"));
        String::from_utf8(o.stdout).unwrap()
    };
    let (a, b) = (tmp.join("modern-copy"), tmp.join("modern-substitute"));
    modern(&["nix", "copy", "--from", &server.url, "--to", a.to_str().unwrap(), &root]);
    modern(&["nix", "store", "verify", "--store", a.to_str().unwrap(), "-r", "--sigs-needed", "1", &root]);
    modern(&["nix-store", "--store", b.to_str().unwrap(), "-r", &root, "--option", "substituters", &server.url]);
    for store in [&a, &b] {
        let got: BTreeSet<String> =
            modern(&["nix", "path-info", "--store", store.to_str().unwrap(), "-r", &root]).lines().map(str::to_string).collect();
        assert_eq!(got, paths);
    }
    let info: serde_json::Value =
        serde_json::from_str(&modern(&["nix", "path-info", "--store", &server.url, "-r", "--json", &root])).unwrap();
    assert_eq!(info.as_object().map_or_else(|| info.as_array().unwrap().len(), |o| o.len()), paths.len());
}

/// `sluice missing --json` of `root` from `url` into an empty store, with a fresh disk cache.
fn sluice_missing(tmp: &Path, url: &str, public: &str, root: &str, home: &str) -> serde_json::Value {
    let sub = tmp.join(home);
    std::fs::create_dir_all(&sub).unwrap();
    let o = sluice(
        &sub,
        &[
            "missing",
            "--json",
            "--store",
            tmp.join("empty").to_str().unwrap(),
            "--substituters",
            url,
            "--trusted-public-keys",
            public,
            root,
        ],
    );
    check(&o, "sluice missing");
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn sluice_gets_the_same_closure_with_and_without_the_batch_endpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let top = TOP.to_string();
    let src = source_store(tmp, &top);
    let (secret, public) = signing_key(tmp);
    let batch = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap()]);
    let plain = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap(), "--no-batch"]);
    let info = |s: &Server| s.raw(b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert!(info(&batch).contains("SluiceBatch: 1"));
    assert!(!info(&plain).contains("SluiceBatch"));
    let metric = |s: &Server, endpoint: &str| -> u64 {
        let text = s.raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let prefix = format!("sluice_serve_requests_total{{endpoint=\"{endpoint}\",status=\"200\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |n| n.parse().unwrap())
    };
    let with = sluice_missing(tmp, &batch.url, &public, &top, "with");
    let without = sluice_missing(tmp, &plain.url, &public, &top, "without");
    assert_eq!(with, without);
    assert_eq!(metric(&batch, "batch-closure"), 1);
    // With the batch: only the root's narinfo travels alongside nix-cache-info.
    assert!(metric(&batch, "narinfo") <= 1, "{} narinfo requests", metric(&batch, "narinfo"));
    assert_eq!(metric(&plain, "narinfo"), 1056);
    // The batch's answers are in the disk cache: a second run asks nothing more.
    let again = sluice_missing(tmp, &batch.url, &public, &top, "with");
    assert_eq!(again, with);
    assert_eq!(metric(&batch, "batch-closure"), 1);
    assert!(metric(&batch, "narinfo") <= 1);

    // Every line of a batch answer is byte for byte the per-path narinfo.
    let hashes = "433r6hrfzj8vvazpcnl77q6m3lm3vw3g\n00000000000000000000000000000000\n";
    let answer =
        Command::new("curl").args(["-sf", "--data-binary", hashes, &format!("{}/_sluice/v1/narinfos", batch.url)]).output().unwrap();
    check(&answer, "POST narinfos");
    let lines: Vec<serde_json::Value> =
        String::from_utf8(answer.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[1]["narinfo"].is_null());
    let single = Command::new("curl").args(["-sf", &format!("{}/433r6hrfzj8vvazpcnl77q6m3lm3vw3g.narinfo", batch.url)]).output().unwrap();
    assert_eq!(lines[0]["narinfo"].as_str().unwrap().as_bytes(), single.stdout);
}

/// A cold `sluice missing` (no `nix-cache-info` in the disk cache) sends its batch request
/// alongside `nix-cache-info`, not once its answer said `SluiceBatch`: through latency-proxy
/// over plain HTTP that is TCP and one request, 2 RTT, where it took 3. A cache that turns out
/// not to advertise the batch has its answer ignored (the same closure, per narinfo).
#[test]
fn a_cold_closure_query_sends_the_batch_with_nix_cache_info() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, &root);
    let (secret, public) = signing_key(tmp);
    let batch = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap()]);
    let plain = Server::start(tmp, &src, &["--secret-key", secret.to_str().unwrap(), "--no-batch"]);
    let port = |s: &Server| s.addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let rtt = Duration::from_millis(1000);
    let proxy = LatencyProxy::start(port(&batch), rtt.as_millis() as u32);
    let started = Instant::now();
    let got = sluice_missing(tmp, &format!("http://127.0.0.1:{}", proxy.port), &public, &root, "cold");
    let took = started.elapsed();
    let missing: BTreeSet<String> = got["willSubstitute"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect();
    assert_eq!(missing, paths);
    assert!(took >= 2 * rtt && took < rtt * 13 / 5, "the cold closure query took {took:?} at RTT {rtt:?} (2 RTT expected)");
    let requests = batch.raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert!(requests.contains("sluice_serve_requests_total{endpoint=\"batch-closure\",status=\"200\"} 1\n"), "{requests}");
    assert_eq!(sluice_missing(tmp, &plain.url, &public, &root, "plain"), got);
}

#[test]
fn hostile_requests_are_refused_and_do_not_take_the_server_down() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, _) = subset();
    let src = source_store(tmp, &root);
    // A temporary tree as an interrupted unpacking leaves it, and a file outside the store.
    std::fs::create_dir_all(src.join("nix/store/00000000000000000000000000000000-sluice-unpacking")).unwrap();
    std::fs::write(tmp.join("secret.txt"), "secret").unwrap();
    // A path being added: its tree is in the store directory, it is not registered (valid).
    let adding = "7h3v0kq3mzrbj4ymkzp5ba4gy3xqz1qj";
    std::fs::create_dir_all(src.join(format!("nix/store/{adding}-being-added"))).unwrap();
    std::fs::create_dir_all(src.join("nix/store/.links")).unwrap();
    let server = Server::start(tmp, &src, &["--idle-timeout", "2"]);
    for target in [
        &format!("/{adding}.narinfo")[..],
        &format!("/{adding}.ls"),
        &format!("/nar/{adding}-{}.nar", "0".repeat(52)),
        "/.links",
        "/nar/.links",
        "/%2elinks",
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/nar/..%2f..%2fsecret.txt",
        "/nar/%2e%2e/%2e%2e/secret.txt",
        "/00000000000000000000000000000000.narinfo",
        "/00000000000000000000000000000000.ls",
        "/00000000000000000000000000000000-sluice-unpacking",
        "/nar/00000000000000000000000000000000-0000000000000000000000000000000000000000000000000000.nar",
        "/log/../../secret.txt",
        "/nix/store",
    ] {
        assert_eq!(server.status_of(target), 404, "{target}");
    }
    // Malformed requests: a 4xx answer each, and the server goes on.
    for request in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /nix-cache-info HTTP/9.9\r\n\r\n",
        b"GET nix-cache-info HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /nix-cache-info HTTP/1.1\r\nBad Header\r\n\r\n",
        b"\x00\x01\x02\xff\r\n\r\n",
    ] {
        let answer = server.raw(request);
        let code = answer.split(' ').nth(1).unwrap_or("");
        assert!(code.starts_with('4'), "{:?}: {answer:?}", String::from_utf8_lossy(request));
    }
    // A header line over 8 KiB: 431, as nginx refuses one (with 400); far over: 431 too.
    for size in [9 * 1024, 64 * 1024] {
        let request = format!("GET /nix-cache-info HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n", "a".repeat(size));
        let answer = server.raw(request.as_bytes());
        assert!(answer.starts_with("HTTP/1.1 431"), "{size}: {}", answer.lines().next().unwrap_or(""));
    }
    // Thousands of idle connections, and one that asked for a NAR and stopped reading.
    let hash = &root["/nix/store/".len()..][..32];
    let narinfo = server.raw(format!("GET /{hash}.narinfo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    let url = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap().to_string();
    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    for _ in 0..64 {
        stalled.write_all(format!("GET /{url} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
    }
    let idle: Vec<TcpStream> = (0..2000).map(|_| TcpStream::connect(&server.addr).unwrap()).collect();
    let started = Instant::now();
    assert_eq!(server.status_of(&format!("/{hash}.narinfo")), 200);
    assert!(started.elapsed() < Duration::from_secs(2), "answered in {:?} beside 2000 idle connections", started.elapsed());
    // The idle ones are closed after the idle timeout.
    std::thread::sleep(Duration::from_secs(4));
    let mut closed = 0;
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        if matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 2000);
    drop(stalled);
    assert_eq!(server.status_of("/nix-cache-info"), 200);
}

/// A self-signed certificate for 127.0.0.1 and its key under `tmp`, as `openssl req -x509`
/// makes one by default: a CA certificate (`basicConstraints CA:TRUE`).
fn self_signed(tmp: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (tmp.join("cert.pem"), tmp.join("key.pem"));
    let o = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key.to_str().unwrap(), "-out", cert.to_str().unwrap()])
        .output()
        .unwrap();
    check(&o, "openssl req");
    (cert, key)
}

/// `sluice serve` over HTTPS with a self-signed certificate ([`self_signed`]), signing with
/// a key of its own, serving the corpus subset's closure from a store under `tmp`.
struct Tls {
    server: Server,
    cert: PathBuf,
    /// The public key of the server's signing key.
    public: String,
    /// The store served.
    src: PathBuf,
    root: String,
    paths: BTreeSet<String>,
}

impl Tls {
    fn start(tmp: &Path) -> Tls {
        let (root, paths) = subset();
        let src = source_store(tmp, &root);
        let (cert, key) = self_signed(tmp);
        let (secret, public) = signing_key(tmp);
        let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap(), "--secret-key", secret.to_str().unwrap()];
        let server = Server::start(tmp, &src, &args);
        Tls { server, cert, public, src, root, paths }
    }
}

/// A server whose certificate is self-signed by `openssl req -x509` (a CA certificate, which
/// webpki refuses as a server's: `CaUsedAsEndEntity`) is reached as curl, Nix 2.8 (whose
/// `ssl-cert-file` is `NIX_SSL_CERT_FILE`: it reads `--option ssl-cert-file` too late) and Nix
/// 2.26 reach it with that certificate as `ssl-cert-file`; without it, the error says in one
/// line to name the certificate in `ssl-cert-file`.
#[test]
fn a_self_signed_certificate_in_ssl_cert_file_is_accepted_as_by_curl_and_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let Tls { server, cert, public, root, paths, .. } = Tls::start(tmp);
    let curl =
        Command::new("curl").args(["-sf", "--cacert", cert.to_str().unwrap(), &format!("{}/nix-cache-info", server.url)]).output().unwrap();
    check(&curl, "curl --cacert");
    let mut real = Command::new("nix");
    isolate(&mut real, tmp, &format!("trusted-public-keys = {public}"));
    let real = real.env("NIX_SSL_CERT_FILE", &cert).args(["path-info", "--store", &server.url, &root]).output().unwrap();
    check(&real, "Nix 2.8 with NIX_SSL_CERT_FILE");
    let cert_file = ["--option", "ssl-cert-file", cert.to_str().unwrap()];
    check(
        &nix_modern(tmp, &[&["nix", "path-info", "--store", &server.url, &root][..], &cert_file].concat()),
        "Nix 2.26 with ssl-cert-file",
    );
    let own = sluice(tmp, &[&["path-info", "--store", &server.url, "-r", &root][..], &cert_file].concat());
    check(&own, "sluice with ssl-cert-file");
    assert_eq!(String::from_utf8_lossy(&own.stdout).lines().map(str::to_owned).collect::<BTreeSet<_>>(), paths);
    let unknown = sluice(tmp, &["path-info", "--store", &server.url, &root]);
    assert_eq!(unknown.status.code(), Some(1));
    let errors: Vec<String> = stderr(&unknown).lines().filter(|l| l.starts_with("error:")).map(str::to_owned).collect();
    assert_eq!(errors.len(), 1, "{}", stderr(&unknown));
    assert!(
        errors[0].ends_with("CaUsedAsEndEntity)); if you trust the server's certificate (or its CA's), name it in ssl-cert-file (--option ssl-cert-file FILE)"),
        "{}",
        errors[0]
    );
}

#[test]
fn https_serves_http2_by_alpn() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, _) = subset();
    let src = source_store(tmp, &root);
    let (cert, key) = self_signed(tmp);
    let server = Server::start(tmp, &src, &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    assert!(server.url.starts_with("https://"));
    for (flag, version) in [("--http2", "2"), ("--http1.1", "1.1")] {
        let o = Command::new("curl")
            .args([
                "-sf",
                "--cacert",
                cert.to_str().unwrap(),
                flag,
                "-o",
                "/dev/null",
                "-w",
                "%{http_version}",
                &format!("{}/nix-cache-info", server.url),
            ])
            .output()
            .unwrap();
        check(&o, "curl over TLS");
        assert_eq!(String::from_utf8_lossy(&o.stdout), version);
    }
    // h2c with prior knowledge on a plain port.
    let plain = Server::start(tmp, &src, &[]);
    let o = Command::new("curl")
        .args(["-sf", "--http2-prior-knowledge", "-o", "/dev/null", "-w", "%{http_version}", &format!("{}/nix-cache-info", plain.url)])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), "2");
}

/// The answers read from a connection whose requests were `heads` (whether each was a HEAD):
/// each answer's head and body (its `Content-Length` bytes; none answering a HEAD).
fn split_answers(mut bytes: &[u8], heads: &[bool]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for head_only in heads {
        let end = bytes.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no answer head in {} bytes", bytes.len())) + 4;
        let head = String::from_utf8_lossy(&bytes[..end]).to_lowercase();
        let len = head.lines().find_map(|l| l.strip_prefix("content-length: ")).map_or(0, |v| v.trim().parse().unwrap());
        let body = if *head_only { 0 } else { len };
        out.push((head, bytes[end..end + body].to_vec()));
        bytes = &bytes[end + body..];
    }
    assert!(bytes.is_empty(), "{} bytes after the last answer", bytes.len());
    out
}

/// NAR files of a binary cache served as stored go out over plain HTTP/1.1 with `sendfile`
/// (issue 40): a file larger than what one body frame stands for (8 MiB) and a small one,
/// asked for around a HEAD and another request, all pipelined on one keep-alive connection,
/// come whole and in order, each with its length. Over HTTPS (HTTP/1.1 and HTTP/2) and h2c,
/// where the files are read instead, the same bytes.
#[test]
fn stored_nar_files_come_whole_and_in_order_pipelined_and_over_https() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let cache = tmp.join("cache");
    std::fs::create_dir_all(cache.join("nar")).unwrap();
    std::fs::write(cache.join("nix-cache-info"), "StoreDir: /nix/store\n").unwrap();
    let big: Vec<u8> = (0..20 * 1024 * 1024 + 12345u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let small = b"a small NAR file\n".repeat(64);
    let (big_name, small_name) = (format!("nar/{}.nar", "1".repeat(52)), format!("nar/{}.nar.xz", "2".repeat(52)));
    std::fs::write(cache.join(&big_name), &big).unwrap();
    std::fs::write(cache.join(&small_name), &small).unwrap();
    let url = format!("file://{}", cache.display());

    let server = Server::start_url(tmp, &url, &[]);
    let ask = |method: &str, target: &str| format!("{method} /{target} HTTP/1.1\r\nHost: x\r\n\r\n");
    let close = format!("GET /{big_name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let requests = [ask("GET", &big_name), ask("HEAD", &big_name), ask("GET", "nix-cache-info"), ask("GET", &small_name), close].concat();
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    conn.write_all(requests.as_bytes()).unwrap();
    let mut got = Vec::new();
    conn.read_to_end(&mut got).unwrap();
    let answers = split_answers(&got, &[false, true, false, false, false]);
    for (i, want) in [(0, &big[..]), (3, &small[..]), (4, &big[..])] {
        let (head, body) = &answers[i];
        assert!(head.starts_with("http/1.1 200 ") && head.contains(&format!("content-length: {}\r\n", want.len())), "{i}: {head}");
        assert!(body == want, "answer {i}: {} bytes, not the file's {}", body.len(), want.len());
    }
    assert!(answers[1].0.starts_with("http/1.1 200 ") && answers[1].0.contains(&format!("content-length: {}\r\n", big.len())));
    assert!(answers[2].1.starts_with(b"StoreDir: /nix/store\n"), "{:?}", answers[2]);

    let (cert, key) = self_signed(tmp);
    let tls = Server::start_url(tmp, &url, &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    let cacert = ["--cacert", cert.to_str().unwrap()];
    let over = |flag| [&cacert[..], &[flag][..]].concat();
    // Both files on one connection over TLS; with h2c one each (curl 7.88 fails a second
    // request on an h2c connection, against this server as before this change).
    let h2c = vec!["--http2-prior-knowledge"];
    let names = [&big_name, &small_name];
    for (base, flags, urls) in [
        (&tls.url, over("--http1.1"), &names[..]),
        (&tls.url, over("--http2"), &names[..]),
        (&server.url, h2c.clone(), &names[..1]),
        (&server.url, h2c, &names[1..]),
    ] {
        let o = Command::new("curl").arg("-sf").args(&flags).args(urls.iter().map(|n| format!("{base}/{n}"))).output().unwrap();
        check(&o, "curl");
        let want: Vec<u8> = urls.iter().flat_map(|n| std::fs::read(cache.join(n)).unwrap()).collect();
        assert!(o.stdout == want, "{base} {flags:?} {urls:?}: {} bytes, not {}", o.stdout.len(), want.len());
    }
}

/// HEAD answers have no body over HTTP/2 either, whatever their status: Nix 2.8 (libcurl on
/// GnuTLS, HTTP/2 by ALPN) asks a narinfo by HEAD (`fileExists`) and gets its 404 over TLS
/// (it failed with "Stream error in the HTTP/2 framing layer": the 404's text came as DATA,
/// which nghttp2 answers with RST_STREAM PROTOCOL_ERROR); curl's HEAD over HTTP/2 and
/// HTTP/1.1 gets 404 and 405 with no error; on h2c, the frames are one HEADERS with
/// END_STREAM and no DATA.
#[test]
fn head_answers_have_no_body_over_http2_so_nix_2_8_gets_its_404_over_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let Tls { server, cert, public, src, .. } = Tls::start(tmp);
    let missing = "/nix/store/00000000000000000000000000000000-missing";
    let mut real = Command::new("nix");
    isolate(&mut real, tmp, &format!("trusted-public-keys = {public}\ndownload-attempts = 1"));
    let real = real.env("NIX_SSL_CERT_FILE", &cert).args(["path-info", "--store", &server.url, missing]).output().unwrap();
    assert_eq!(real.status.code(), Some(1), "{}", stderr(&real));
    assert_eq!(stderr(&real).trim().lines().last(), Some(format!("error: path '{missing}' is not valid").as_str()), "{}", stderr(&real));
    for (target, code) in [("00000000000000000000000000000000.narinfo", "404"), ("nope", "404"), ("_sluice/v1/closure", "405")] {
        for flag in ["--http2", "--http1.1"] {
            let url = format!("{}/{target}", server.url);
            let o = Command::new("curl")
                .args(["-s", "-I", "--cacert", cert.to_str().unwrap(), flag, "-o", "/dev/null", "-w", "%{http_code}", &url])
                .output()
                .unwrap();
            check(&o, &format!("curl -I {flag} {url}"));
            assert_eq!(String::from_utf8_lossy(&o.stdout), code, "{flag} {url}");
        }
    }
    let plain = Server::start(tmp, &src, &[]);
    let mut h2 = H2::connect(plain.url.trim_start_matches("http://"), 65535);
    h2.head(1, "/00000000000000000000000000000000.narinfo");
    let started = Instant::now();
    let mut frames = Vec::new();
    while !frames.iter().any(|f: &Frame| f.2 == 1 && f.1 & END_STREAM_OR_ACK != 0) && started.elapsed() < Duration::from_secs(10) {
        frames.extend(h2.frames());
        std::thread::sleep(Duration::from_millis(10));
    }
    let on_stream: Vec<(u8, u8)> = frames.iter().filter(|f| f.2 == 1).map(|f| (f.0, f.1 & END_STREAM_OR_ACK)).collect();
    assert_eq!(on_stream, [(HEADERS, END_STREAM_OR_ACK)]);
}

/// The body of an HTTP/1.1 answer read whole by [`Server::raw`].
fn body_of(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, body)| body)
}

#[test]
fn a_path_deleted_is_404_right_after_being_served_and_ranges_are_the_nar_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, _) = subset();
    let src = source_store(tmp, &root);
    let server = Server::start(tmp, &src, &[]);
    let hash = &root["/nix/store/".len()..][..32];
    let get = |target: &str| server.raw(format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    let narinfo = get(&format!("/{hash}.narinfo"));
    assert!(narinfo.starts_with("HTTP/1.1 200"), "{narinfo}");
    // Asked again: the same text (now from the server's cache of rendered narinfos).
    assert_eq!(body_of(&get(&format!("/{hash}.narinfo"))), body_of(&narinfo));
    let field = |name: &str| body_of(&narinfo).lines().find_map(|l| l.strip_prefix(name)).unwrap().to_string();
    let (url, size): (String, usize) = (field("URL: "), field("NarSize: ").parse().unwrap());

    // The whole NAR is NarSize bytes; a byte range is those bytes of it.
    let curl = |extra: &[&str]| Command::new("curl").args(["-sf"]).args(extra).arg(format!("{}/{url}", server.url)).output().unwrap();
    let whole = curl(&[]);
    check(&whole, "curl the NAR");
    assert_eq!(whole.stdout.len(), size);
    assert_eq!(&whole.stdout[..13], b"\x0d\0\0\0\0\0\0\0nix-a", "a NAR");
    let (first, last) = (size / 3, 2 * size / 3);
    let part = curl(&["-r", &format!("{first}-{last}")]);
    check(&part, "curl a range of the NAR");
    assert_eq!(part.stdout, whole.stdout[first..=last]);

    // Deleted by real Nix 2.8 (nothing refers to the root): 404 at once, narinfo and NAR.
    let mut cmd = Command::new("nix");
    isolate(&mut cmd, tmp, "");
    let deleted = cmd.args(["--store", &format!("local?root={}", src.display()), "store", "delete", &root]).output().unwrap();
    check(&deleted, "nix store delete");
    assert_eq!(server.status_of(&format!("/{hash}.narinfo")), 404);
    assert_eq!(server.status_of(&format!("/{url}")), 404);
}

/// The target and size of glibc's NAR, the subset's largest (about 300 KB), served by `server`.
fn glibc_nar(server: &Server, paths: &BTreeSet<String>) -> (String, usize) {
    let glibc = paths.iter().find(|p| p.ends_with("-glibc-2.37-8")).unwrap();
    let narinfo = server
        .raw(format!("GET /{}.narinfo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &glibc["/nix/store/".len()..][..32]).as_bytes());
    let field = |name: &str| body_of(&narinfo).lines().find_map(|l| l.strip_prefix(name)).unwrap().to_string();
    (format!("/{}", field("URL: ")), field("NarSize: ").parse().unwrap())
}

/// A raw HTTP/2 client (h2c with prior knowledge) for what curl does not do: a connection that
/// only pings, streams never read, a download whose window opens slowly. Its socket does not
/// block: [`H2::frames`] returns what has arrived.
struct H2 {
    s: TcpStream,
    buf: Vec<u8>,
    /// Frames not yet taken by the socket.
    out: Vec<u8>,
    /// Whether the server has closed the connection.
    closed: bool,
    /// Whether the server's PINGs are acknowledged.
    acks_pings: bool,
}

/// A frame as received: type, flags, stream and payload.
type Frame = (u8, u8, u32, Vec<u8>);

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const WINDOW_UPDATE: u8 = 8;
/// The END_STREAM flag (of DATA and HEADERS); ACK of SETTINGS and PING.
const END_STREAM_OR_ACK: u8 = 1;

impl H2 {
    /// Connects and sends the preface and SETTINGS with `window` as the initial window of
    /// each stream.
    fn connect(addr: &str, window: u32) -> H2 {
        let mut c = H2 { s: TcpStream::connect(addr).unwrap(), buf: Vec::new(), out: Vec::new(), closed: false, acks_pings: true };
        c.s.set_nonblocking(true).unwrap();
        c.out.extend(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        let mut initial_window = vec![0, 4];
        initial_window.extend(window.to_be_bytes());
        c.send(SETTINGS, 0, 0, &initial_window);
        c
    }

    /// Queues a frame and sends what the socket takes.
    fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        self.out.extend(&u32::try_from(payload.len()).unwrap().to_be_bytes()[1..]);
        self.out.extend([kind, flags]);
        self.out.extend(stream.to_be_bytes());
        self.out.extend(payload);
        self.flush();
    }

    fn flush(&mut self) {
        while !self.out.is_empty() {
            match self.s.write(&self.out) {
                Ok(n) if n > 0 => drop(self.out.drain(..n)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                _ => {
                    self.closed = true;
                    return;
                }
            }
        }
    }

    /// Sends `n` PINGs, if the socket took the last ones.
    fn flood(&mut self, n: usize) {
        self.flush();
        if self.out.is_empty() {
            for _ in 0..n {
                self.send(PING, 0, 0, b"flooding");
            }
        }
    }

    /// Opens stream `stream` with `GET target` (HPACK: `:method GET` and `:scheme http`
    /// indexed, `:path` and `:authority` literal).
    fn get(&mut self, stream: u32, target: &str) {
        self.request(stream, &[0x82], target);
    }

    /// Opens stream `stream` with `HEAD target` (`:method` literal with its name indexed).
    fn head(&mut self, stream: u32, target: &str) {
        self.request(stream, &[0x02, 4, b'H', b'E', b'A', b'D'], target);
    }

    /// Opens stream `stream` with the request of HPACK `method` for `target`.
    fn request(&mut self, stream: u32, method: &[u8], target: &str) {
        let mut block = method.to_vec();
        block.extend([0x86, 0x04, u8::try_from(target.len()).unwrap()]);
        assert!(target.len() < 127);
        block.extend(target.as_bytes());
        block.extend([0x01, 1, b'x']);
        self.send(HEADERS, 0x4 | END_STREAM_OR_ACK, stream, &block);
    }

    /// Opens `window` more bytes for stream `stream` and for the connection.
    fn open_window(&mut self, stream: u32, window: u32) {
        for s in [0, stream] {
            self.send(WINDOW_UPDATE, 0, s, &window.to_be_bytes());
        }
    }

    /// Waits until the server has served each of `conns` (its SETTINGS came).
    fn await_served(conns: &mut [H2]) {
        let mut served = vec![false; conns.len()];
        let started = Instant::now();
        while served.contains(&false) && started.elapsed() < Duration::from_secs(10) {
            for (c, served) in conns.iter_mut().zip(&mut served) {
                *served |= c.frames().iter().any(|f| f.0 == SETTINGS);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!served.contains(&false), "{} connections not served", served.iter().filter(|s| !**s).count());
    }

    /// The frames that have arrived, the server's SETTINGS (and PINGs if `acks_pings`)
    /// acknowledged; sets
    /// `closed` once the server has closed the connection.
    fn frames(&mut self) -> Vec<Frame> {
        let mut chunk = [0u8; 16384];
        loop {
            match self.s.read(&mut chunk) {
                Ok(0) => self.closed = true,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => self.closed = true,
            }
            break;
        }
        let mut frames = Vec::new();
        while self.buf.len() >= 9 {
            let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
            if self.buf.len() < 9 + len {
                break;
            }
            let frame: Vec<u8> = self.buf.drain(..9 + len).collect();
            let (kind, flags, stream) = (frame[3], frame[4], u32::from_be_bytes(frame[5..9].try_into().unwrap()) & 0x7fff_ffff);
            match (kind, flags & END_STREAM_OR_ACK) {
                (SETTINGS, 0) => self.send(SETTINGS, END_STREAM_OR_ACK, 0, &[]),
                (PING, 0) if self.acks_pings => self.send(PING, END_STREAM_OR_ACK, 0, &frame[9..]),
                _ => {}
            }
            frames.push((kind, flags, stream, frame[9..].to_vec()));
        }
        frames
    }
}

#[test]
fn h2c_connections_that_only_ping_are_closed_when_idle_and_lock_no_client_out() {
    let tmp = tempfile::tempdir().unwrap();
    // As many connections as the server takes: a client coming next has an idle one shed.
    let (server, _) = serve_subset(tmp.path(), &["--idle-timeout", "2", "--max-connections", "200"]);
    let mut pingers: Vec<H2> = (0..200).map(|_| H2::connect(&server.addr, 65535)).collect();
    // Each one served (the server's SETTINGS came) before the real client connects.
    H2::await_served(&mut pingers);

    // The pingers answer the server's PINGs and ping every 0.5 s, while a real client asks.
    let started = Instant::now();
    let (answer, answered_in, closed_in) = std::thread::scope(|scope| {
        let real = scope.spawn(|| {
            let answer = server.raw(b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            (answer, started.elapsed())
        });
        let mut closed_in = None;
        for tick in 0.. {
            for p in pingers.iter_mut().filter(|p| !p.closed) {
                p.frames();
                if tick % 5 == 0 {
                    p.send(PING, 0, 0, b"sluice!!");
                }
            }
            if closed_in.is_none() && pingers.iter().all(|p| p.closed) {
                closed_in = Some(started.elapsed());
            }
            if real.is_finished() && closed_in.is_some() || started.elapsed() > Duration::from_secs(12) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let (answer, answered_in) = real.join().unwrap();
        (answer, answered_in, closed_in)
    });
    let open = pingers.iter().filter(|p| !p.closed).count();
    assert!(answer.starts_with("HTTP/1.1 200"), "the real client got {answer:?} after {answered_in:?}, beside {open} pinging connections");
    assert!(answered_in < Duration::from_secs(5), "answered in {answered_in:?}");
    let closed_in = closed_in.unwrap_or_else(|| panic!("{open} of 200 pinging connections still open after 12 s"));
    assert!(closed_in < Duration::from_secs(5), "closed in {closed_in:?}");
}

#[test]
fn a_request_body_trickled_a_byte_at_a_time_is_ended() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, _) = serve_subset(tmp.path(), &["--idle-timeout", "3"]);
    // A keep-alive connection after its request, idle meanwhile.
    let mut kept = TcpStream::connect(&server.addr).unwrap();
    kept.write_all(b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"POST /_sluice/v1/narinfos HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    // A byte every 2 s: each within the idle timeout, the body never within it.
    let started = Instant::now();
    let ended = loop {
        if started.elapsed() > Duration::from_secs(15) {
            break None;
        }
        if s.write_all(b" ").is_err() {
            break Some(started.elapsed());
        }
        match s.read(&mut [0u8; 512]) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            _ => break Some(started.elapsed()),
        }
    };
    let ended = ended.expect("the trickled request still going after 15 s");
    assert!(ended >= Duration::from_secs(3) && ended < Duration::from_secs(7), "ended after {ended:?}");
    let mut answer = String::new();
    kept.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    assert!(kept.read_to_string(&mut answer).is_ok(), "the keep-alive connection still open: {answer:?}");
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("StoreDir: /nix/store"), "{answer}");
    assert_eq!(server.status_of("/nix-cache-info"), 200);
}

#[test]
fn h2_a_slow_download_goes_on_while_streams_never_read_are_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, paths) = serve_subset(tmp.path(), &["--idle-timeout", "3"]);
    let (url, size) = glibc_nar(&server, &paths);

    // A window opened at 40 KiB/s (past 16 KiB), over twice the 64 KiB per 3 s needed; and as
    // many streams as allowed, never read.
    let mut slow = H2::connect(&server.addr, 16384);
    slow.get(1, &url);
    let mut stuck = H2::connect(&server.addr, 0);
    for stream in 0..64 {
        stuck.get(2 * stream + 1, &url);
    }
    let started = Instant::now();
    let (mut status, mut received, mut done, mut stuck_closed, mut opened) = (None, 0, None, None, 0);
    while (done.is_none() || stuck_closed.is_none()) && started.elapsed() < Duration::from_secs(30) && !slow.closed {
        for (kind, flags, stream, payload) in slow.frames() {
            match (kind, stream) {
                (HEADERS, 1) => status = Some(payload[0]),
                (DATA, 1) => received += payload.len(),
                _ => {}
            }
            if stream == 1 && flags & END_STREAM_OR_ACK != 0 {
                done = Some(started.elapsed());
            }
        }
        let due = (started.elapsed().as_secs_f64() * 40960.0) as u32;
        if done.is_none() && due > opened {
            slow.open_window(1, due - opened);
            opened = due;
        }
        stuck.frames();
        if stuck.closed && stuck_closed.is_none() {
            stuck_closed = Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    // :status 200, as HPACK's static entry 8.
    assert_eq!(status, Some(0x88));
    assert_eq!(received, size, "NAR bytes received after {:?} (closed: {})", started.elapsed(), slow.closed);
    let done = done.expect("the download never ended");
    assert!(done > Duration::from_secs(6), "downloaded in {done:?}, not slowly");
    let stuck_closed = stuck_closed.expect("64 streams never read still open after 30 s");
    assert!(stuck_closed < Duration::from_secs(7), "closed after {stuck_closed:?}");
    assert_eq!(server.status_of("/nix-cache-info"), 200);
}

#[test]
fn h2c_ping_floods_hold_no_connection_past_its_grace_and_no_request_waiting_on_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, paths) = serve_subset(tmp.path(), &["--idle-timeout", "2", "--max-connections", "4"]);
    let (url, _) = glibc_nar(&server, &paths);
    // Every slot taken: the first connection waits on a NAR it never reads, the others have
    // no request; none answers the server's PINGs (the GOAWAY's among them).
    let mut flooders: Vec<H2> = (0..4).map(|i| H2::connect(&server.addr, if i == 0 { 0 } else { 65535 })).collect();
    flooders[0].get(1, &url);
    for f in &mut flooders {
        f.acks_pings = false;
    }
    H2::await_served(&mut flooders);

    // 40 PINGs every 10 ms (68 KB/s of ACKs, twice 64 KiB per idle period), the ACKs read,
    // while a real client asks.
    let started = Instant::now();
    let (answer, answered_in, closed_in) = std::thread::scope(|scope| {
        let real = scope.spawn(|| {
            let answer = server.raw(b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            (answer, started.elapsed())
        });
        let mut closed_in = vec![None; flooders.len()];
        while closed_in.contains(&None) && started.elapsed() < Duration::from_secs(12) {
            for (f, closed_in) in flooders.iter_mut().zip(&mut closed_in).filter(|(f, _)| !f.closed) {
                f.frames();
                f.flood(40);
                if f.closed {
                    *closed_in = Some(started.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let (answer, answered_in) = real.join().unwrap();
        (answer, answered_in, closed_in)
    });
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "the real client got {answer:?} after {answered_in:?}; flooders closed after {closed_in:?}"
    );
    assert!(answered_in < Duration::from_millis(4500), "answered in {answered_in:?}");
    let closed_in: Vec<Duration> =
        closed_in.iter().map(|c| c.unwrap_or_else(|| panic!("flooders still open after 12 s: closed after {closed_in:?}"))).collect();
    // The stuck request ends one idle period after it began to wait; the others are closed
    // at the latest one idle period after being told to.
    assert!(closed_in[0] < Duration::from_millis(3500), "the stuck request ended after {:?}", closed_in[0]);
    assert!(closed_in.iter().all(|c| *c < Duration::from_millis(5000)), "closed after {closed_in:?}");
}

/// Reads one HTTP/1.1 answer with a `Content-Length` from `s`; `None` if the connection
/// closes or times out first.
fn answer_on(s: &mut TcpStream) -> Option<String> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head.lines().find_map(|l| l.strip_prefix("content-length: "))?.parse().ok()?;
            if body.len() >= length {
                return Some(text);
            }
        }
        match s.read(&mut chunk) {
            Ok(n) if n > 0 => got.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

#[test]
fn keep_alive_clients_holding_every_slot_are_shed_for_a_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, _) = serve_subset(tmp.path(), &["--idle-timeout", "4", "--max-connections", "6"]);
    let request = b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\n\r\n";
    let connect = || {
        let s = TcpStream::connect(&server.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        s
    };
    let mut kept: Vec<TcpStream> = (0..6).map(|_| connect()).collect();
    for s in &mut kept {
        s.write_all(request).unwrap();
        assert!(answer_on(s).is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    }
    // Three times: every keep-alive client asks again (connecting again if it was shed), so
    // that they hold every slot, then a new client asks; 2 s (half the idle timeout) apart.
    let (mut shed, mut waits) = (0, Vec::new());
    for round in 0..4 {
        for s in &mut kept {
            if s.write_all(request).is_err() || answer_on(s).is_none() {
                shed += 1;
                *s = connect();
                s.write_all(request).unwrap();
                assert!(answer_on(s).is_some_and(|a| a.starts_with("HTTP/1.1 200")), "connecting again after being shed");
            }
        }
        if round == 3 {
            break;
        }
        let asked = Instant::now();
        let answer = server.raw(b"GET /nix-cache-info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        waits.push((answer, asked.elapsed()));
        std::thread::sleep(Duration::from_secs(2));
    }
    for (answer, waited) in &waits {
        assert!(answer.starts_with("HTTP/1.1 200"), "a new client got {answer:?} after {waited:?}");
        assert!(*waited < Duration::from_millis(1500), "a new client waited {waited:?}");
    }
    // One idle keep-alive connection closed for each new client.
    assert_eq!(shed, 3);
}

/// `--listen` without a port says what it expects, with an example (it said only "invalid
/// socket address").
#[test]
fn listen_without_a_port_says_what_it_expects() {
    let tmp = tempfile::tempdir().unwrap();
    for addr in ["127.0.0.1", "::1", "[::1]"] {
        let o = sluice(tmp.path(), &["serve", "--store", tmp.path().join("store").to_str().unwrap(), "--listen", addr]);
        assert_eq!(o.status.code(), Some(1));
        assert_eq!(stderr(&o), format!("error: --listen {addr}: expected HOST:PORT, e.g. 127.0.0.1:5000 or [::]:5000\n"));
    }
}

/// `sluice serve --store` of a store or a `file://` cache that does not exist fails, naming
/// it, and makes nothing (it made an empty store and served it).
#[test]
fn serving_a_store_that_does_not_exist_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no/such/dir");
    for url in [missing.display().to_string(), format!("local?root={}", missing.display()), format!("file://{}", missing.display())] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let o = cmd.args(["serve", "--store", &url, "--listen", "127.0.0.1:0"]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{url}: {}", stderr(&o));
        assert!(stderr(&o).starts_with(&format!("error: {url}: no store to serve: {}", missing.display())), "{}", stderr(&o));
        assert!(!tmp.path().join("no").exists(), "{url}: something was made");
    }
}

/// `sluice serve -v` writes an access log line per request: the client, the request line,
/// the status, the bytes sent and the time; without `-v`, none.
#[test]
fn an_access_log_line_per_request_at_verbose() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, _) = subset();
    let src = source_store(tmp, &root);
    for (flags, logged) in [(&["-v"][..], true), (&[], false)] {
        let log = tmp.join(format!("serve{}.log", flags.len()));
        let server = Server::start_logging(tmp, src.to_str().unwrap(), flags, &log);
        let hash = &root["/nix/store/".len()..][..32];
        for target in ["/nix-cache-info".to_owned(), format!("/{hash}.narinfo"), "/00000000000000000000000000000000.narinfo".to_owned()] {
            let o = Command::new("curl").args(["-s", "-o", "/dev/null", &format!("{}{target}", server.url)]).output().unwrap();
            check(&o, "curl");
        }
        drop(server);
        let text = std::fs::read_to_string(&log).unwrap();
        let access: Vec<&str> = text.lines().filter(|l| l.contains("\" 200 ") || l.contains("\" 404 ")).collect();
        if !logged {
            assert!(access.is_empty(), "{text}");
            continue;
        }
        assert_eq!(access.len(), 3, "{text}");
        assert!(access[0].starts_with("INFO 127.0.0.1:") && access[0].contains(" \"GET /nix-cache-info HTTP/1.1\" 200 "), "{}", access[0]);
        assert!(access[1].contains(&format!(" \"GET /{hash}.narinfo HTTP/1.1\" 200 ")), "{}", access[1]);
        assert!(access[2].contains(" \"GET /00000000000000000000000000000000.narinfo HTTP/1.1\" 404 "), "{}", access[2]);
        assert!(access.iter().all(|l| l.contains(" bytes in ") && l.ends_with(" ms")), "{access:?}");
    }
}

/// A `file://` cache's narinfo is served as the file is now: after it is replaced (as a push
/// replaces it, by a rename) the new text, after it is deleted 404, though the server keeps
/// what it served last.
#[test]
fn a_stored_narinfo_replaced_or_deleted_is_served_as_it_is_now() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let cache = tmp.join("cache");
    copy_dir(&corpus().join("cache-subset-none"), &cache);
    let server = Server::start_url(tmp, &format!("file://{}", cache.display()), &[]);
    let name = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| n.ends_with(".narinfo"))
        .unwrap();
    let file = cache.join(&name);
    let get = || server.raw(format!("GET /{name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    let before = std::fs::read_to_string(&file).unwrap();
    for _ in 0..2 {
        assert_eq!(body_of(&get()), before);
    }
    // The same size with one byte of a signature changed, then another signature line: a new
    // file renamed over the old one each time, as a push writes it.
    let sig = before.lines().find(|l| l.starts_with("Sig: ")).unwrap();
    let flipped = format!("{}{}==", &sig[..sig.len() - 3], if sig.ends_with("A==") { 'Q' } else { 'A' });
    for text in [before.replacen(sig, &flipped, 1), format!("{before}Sig: other:{}==\n", "A".repeat(86))] {
        assert_ne!(text, before);
        let new = cache.join(".new.narinfo");
        std::fs::write(&new, &text).unwrap();
        std::fs::rename(&new, &file).unwrap();
        assert_eq!(body_of(&get()), text);
    }
    std::fs::remove_file(&file).unwrap();
    assert_eq!(server.status_of(&format!("/{name}")), 404);
}
