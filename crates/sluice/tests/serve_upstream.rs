//! `sluice serve` of a binary cache as it is stored, and `sluice serve --upstream` as a
//! pull-through cache: real nginx upstreams (one slow behind latency-proxy, one with a corrupt
//! NAR, one whose narinfos no trusted key signed, one dead), a `file://` or s3s-fs cache as
//! `--store`, real Nix 2.8 and 2.26 substituting through it, a burst of clients asking for one
//! NAR, and a front killed while it fetches a NAR.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::serve::{nix_trusting, signing_key, source_store, subset, Server};

/// The 25-path subset pushed from a store filled from the corpus into `file://tmp/NAME` with
/// xz, each narinfo keeping the corpus's signature; the cache's directory.
fn xz_cache(tmp: &Path, name: &str) -> PathBuf {
    let (root, _) = subset();
    let src = tmp.join("src");
    if !src.exists() {
        source_store(tmp, &root);
    }
    let dir = tmp.join(name);
    let to = format!("file://{}?compression=xz", dir.display());
    check(&sluice(tmp, &["copy", "--from", src.to_str().unwrap(), "--to", &to, &root]), "sluice copy --to file://");
    dir
}

/// The narinfo of store path `path` in the cache directory `dir`, as fields.
fn narinfo_field(dir: &Path, path: &str, field: &str) -> String {
    let text = std::fs::read_to_string(dir.join(format!("{}.narinfo", &path["/nix/store/".len()..][..32]))).unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{field}: "))).unwrap_or_else(|| panic!("no {field} in {text}")).to_string()
}

/// `curl -s URL`: (whether it succeeded, body).
fn curl(url: &str) -> (bool, Vec<u8>) {
    let o = Command::new("curl").args(["-sf", "--max-time", "60", url]).output().unwrap();
    (o.status.success(), o.stdout)
}

/// The value of `/metrics`' line `name{upstream="URL"}`.
fn upstream_metric(server: &Server, name: &str, upstream: &str) -> u64 {
    let (_, text) = curl(&format!("{}/metrics", server.url));
    let text = String::from_utf8(text).unwrap();
    let prefix = format!("sluice_serve_upstream_{name}{{upstream=\"{upstream}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.parse().unwrap())
}

/// Files of the cache directory `dir` (relative), `nix-cache-info`, hidden files and the
/// directory of sluice's push and gc fence (`sluice/`, which a push into the cache leaves)
/// left out.
fn cache_files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for sub in ["", "nar"] {
        for e in std::fs::read_dir(dir.join(sub)).into_iter().flatten() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            if !["nix-cache-info", "nar", "sluice"].contains(&name.as_str()) && !name.starts_with('.') {
                out.insert(if sub.is_empty() { name } else { format!("{sub}/{name}") });
            }
        }
    }
    out
}

/// A `file://` cache of xz NARs is served as stored (issue 39): narinfos byte for byte (URL,
/// Compression, FileHash, FileSize kept), NAR files as they are (xz, not decompressed), the
/// server's key added to the signatures; real Nix 2.8 substitutes from it and verifies it.
/// Before, the narinfo said `Compression: none` and the NAR was sent decompressed.
#[test]
fn a_binary_cache_is_served_as_it_is_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let cache = xz_cache(tmp, "cache");
    let plain = Server::start_url(tmp, &format!("file://{}", cache.display()), &[]);
    let hash = &root["/nix/store/".len()..][..32];
    let stored = std::fs::read(cache.join(format!("{hash}.narinfo"))).unwrap();
    assert_eq!(curl(&format!("{}/{hash}.narinfo", plain.url)), (true, stored));
    let url = narinfo_field(&cache, &root, "URL");
    assert!(url.ends_with(".nar.xz"), "{url}");
    assert_eq!(curl(&format!("{}/{url}", plain.url)), (true, std::fs::read(cache.join(&url)).unwrap()));
    // With its length, as nginx serves it (it was chunked, without one).
    let head = Command::new("curl").args(["-sf", "-D", "-", "-o", "/dev/null", &format!("{}/{url}", plain.url)]).output().unwrap();
    let len = std::fs::metadata(cache.join(&url)).unwrap().len();
    assert!(String::from_utf8_lossy(&head.stdout).to_lowercase().contains(&format!("content-length: {len}\r\n")), "{head:?}");
    assert!(!curl(&format!("{}/nar/{}.nar", plain.url, "0".repeat(52))).0);

    let (secret, public) = signing_key(tmp);
    let signed = Server::start_url(tmp, &format!("file://{}", cache.display()), &["--secret-key", secret.to_str().unwrap()]);
    let (_, text) = curl(&format!("{}/{hash}.narinfo", signed.url));
    let text = String::from_utf8(text).unwrap();
    for field in ["URL", "Compression", "FileHash", "FileSize", "NarHash"] {
        assert!(text.contains(&format!("{field}: {}\n", narinfo_field(&cache, &root, field))), "{field} in {text}");
    }
    assert!(text.contains(&format!("Sig: {}\n", narinfo_field(&cache, &root, "Sig"))), "{text}");
    assert!(text.contains("Sig: sluice-serve-test-1:"), "{text}");

    let store = tmp.join("nix-copy");
    let o = nix_trusting(tmp, &public, "nix", &["copy", "--from", &signed.url, "--to", store.to_str().unwrap(), &root]);
    check(&o, "nix copy --from sluice serve file://");
    assert_nix_verifies(tmp, &store);
    let listed = nix_trusting(tmp, &public, "nix", &["path-info", "--store", store.to_str().unwrap(), "-r", &root]);
    assert_eq!(String::from_utf8(listed.stdout).unwrap().lines().map(str::to_string).collect::<BTreeSet<_>>(), paths);
}

/// The upstreams of [`real_nix_substitutes_through_a_pull_through_cache`].
struct Upstreams {
    good: CacheServer,
    corrupt: CacheServer,
    untrusted: CacheServer,
    dead: String,
    /// The path whose NAR the corrupt upstream corrupts, and that NAR's file.
    broken: (String, String),
}

/// Four upstreams of the subset: `good` (priority 50, nginx behind latency-proxy at RTT
/// 40 ms), `corrupt` (priority 20: the root only, its NAR file with a byte changed), `untrusted` (priority
/// 10: no signature), `dead` (priority 5: nothing listens).
fn upstreams(tmp: &Path) -> Upstreams {
    let good = xz_cache(tmp, "good");
    let (root, _) = subset();
    // The corrupt upstream has only the root: its narinfo, and its NAR with a byte changed.
    let corrupt = tmp.join("corrupt");
    let broken_file = narinfo_field(&good, &root, "URL");
    std::fs::create_dir_all(corrupt.join("nar")).unwrap();
    let narinfo = format!("{}.narinfo", &root["/nix/store/".len()..][..32]);
    for f in ["nix-cache-info", &narinfo] {
        std::fs::copy(good.join(f), corrupt.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(good.join(&broken_file)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(corrupt.join(&broken_file), bytes).unwrap();
    let untrusted = tmp.join("untrusted");
    copy_dir(&good, &untrusted);
    for e in std::fs::read_dir(&untrusted).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "narinfo") {
            let text = std::fs::read_to_string(&p).unwrap();
            std::fs::write(&p, text.lines().filter(|l| !l.starts_with("Sig: ")).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
        }
    }
    Upstreams {
        good: CacheServer::start(&good, &tmp.join("nginx-good"), &["--rtt-ms", "40"]),
        corrupt: CacheServer::start(&corrupt, &tmp.join("nginx-corrupt"), &[]),
        untrusted: CacheServer::start(&untrusted, &tmp.join("nginx-untrusted"), &[]),
        dead: format!("http://127.0.0.1:{}", closed_port()),
        broken: (root, broken_file),
    }
}

impl Upstreams {
    /// `--upstream` flags for all four, with their priorities.
    fn flags(&self) -> Vec<String> {
        [
            format!("{}?priority=5", self.dead),
            format!("{}?priority=10", self.untrusted.url),
            format!("{}?priority=20", self.corrupt.url),
            self.good.url.clone(),
        ]
        .into_iter()
        .flat_map(|u| ["--upstream".to_string(), u])
        .collect()
    }
}

/// `sluice serve --store CACHE --upstream …` trusting the corpus's key, signing with `secret`.
fn pull_through(tmp: &Path, cache: &str, ups: &Upstreams, secret: &Path) -> Server {
    let key = corpus_key();
    let mut args = vec!["--option", "trusted-public-keys", &key, "--secret-key", secret.to_str().unwrap()];
    let flags = ups.flags();
    args.extend(flags.iter().map(String::as_str));
    Server::start_url(tmp, cache, &args)
}

/// Real Nix 2.26 (`nix-modern`) copies `root` from `url` into a new store under `tmp`,
/// trusting only `public`.
fn nix_2_26_copies(tmp: &Path, public: &str, url: &str, root: &str) {
    let to = tmp.join("nix-2.26");
    let mut cmd = Command::new(shared().join("bin/nix-modern"));
    isolate(&mut cmd, tmp, &format!("trusted-public-keys = {public}\nrequire-sigs = true"));
    let o = cmd.current_dir(tmp).args(["nix", "copy", "--from", url, "--to", to.to_str().unwrap(), root]).output().unwrap();
    check(&o, "nix-modern nix copy --from the pull-through cache");
}

/// A pull-through cache in front of four upstreams (see [`upstreams`]): the untrusted one's
/// narinfos are passed over, the dead one is skipped at once (no request waits for it), the
/// corrupt NAR is never served whole, never kept, and counted, and the path then comes from
/// the good upstream. Real Nix 2.8 copies the closure through it (signatures by the server's
/// key), each NAR fetched from the good upstream once; Nix 2.26 then copies it again from
/// what was kept, with no upstream request; the kept cache is what nginx would serve.
#[test]
fn real_nix_substitutes_through_a_pull_through_cache() {
    let o = Command::new(shared().join("bin/setup-nix-modern")).current_dir("/tmp").output().unwrap();
    check(&o, "setup-nix-modern");
    let tmp = tempfile::Builder::new().tempdir_in("/tmp").unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let ups = upstreams(tmp);
    let (secret, public) = signing_key(tmp);
    let kept = tmp.join("kept");
    let server = pull_through(tmp, &format!("file://{}", kept.display()), &ups, &secret);

    // The corrupt upstream's NAR: the client never gets it whole; it is not kept, counted,
    // and not served again.
    let (broken_path, broken_file) = &ups.broken;
    let hash = &broken_path["/nix/store/".len()..][..32];
    let (ok, narinfo) = curl(&format!("{}/{hash}.narinfo", server.url));
    let narinfo = String::from_utf8(narinfo).unwrap();
    assert!(ok && narinfo.contains(&format!("URL: {broken_file}?hash={hash}\n")), "{narinfo}");
    assert!(narinfo.contains("Sig: sluice-serve-test-1:") && narinfo.contains("Sig: corpus-"), "{narinfo}");
    let (ok, body) = curl(&format!("{}/{broken_file}?hash={hash}", server.url));
    assert!(!ok, "the corrupt NAR was served whole ({} bytes)", body.len());
    assert_eq!(upstream_metric(&server, "nar_failures_total", &ups.corrupt.url), 1);
    assert!(upstream_metric(&server, "narinfo_refused_total", &ups.untrusted.url) >= 1);
    assert!(upstream_metric(&server, "failures_total", &ups.dead) >= 1);
    assert_eq!(cache_files(&kept), BTreeSet::new());

    // Nix 2.8 copies the closure: every path from the good upstream, once.
    let started = Instant::now();
    let a = tmp.join("nix-2.8");
    let o = nix_trusting(tmp, &public, "nix", &["copy", "--from", &server.url, "--to", a.to_str().unwrap(), &root]);
    check(&o, "nix copy --from the pull-through cache");
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
    assert_nix_verifies(tmp, &a);
    check(
        &nix_trusting(tmp, &public, "nix", &["store", "verify", "--store", a.to_str().unwrap(), "-r", "--sigs-needed", "1", &root]),
        "verify",
    );
    assert_eq!(ups.good.requests(".nar.xz"), paths.len());
    assert_eq!(ups.corrupt.requests(".nar.xz"), 1);
    assert_eq!(ups.untrusted.requests(".nar.xz"), 0);
    assert_eq!(upstream_metric(&server, "nars_total", &ups.good.url), paths.len() as u64);

    // Everything is kept as nginx would serve it, each narinfo after its NAR.
    let good = tmp.join("good");
    assert_eq!(cache_files(&kept), cache_files(&good));
    for p in &paths {
        assert_eq!(narinfo_field(&kept, p, "URL"), narinfo_field(&good, p, "URL"));
        let file = narinfo_field(&kept, p, "URL");
        assert_eq!(std::fs::read(kept.join(&file)).unwrap(), std::fs::read(good.join(&file)).unwrap());
    }

    // Nix 2.26 copies it again, from what was kept: no upstream request.
    let narinfos_asked = ups.good.requests(".narinfo");
    nix_2_26_copies(tmp, &public, &server.url, &root);
    assert_eq!(ups.good.requests(".nar.xz"), paths.len());
    assert_eq!(ups.good.requests(".narinfo"), narinfos_asked);
}

/// Clients asking for one NAR at the same moment get it from one upstream request, each
/// byte for byte.
#[test]
fn a_burst_of_clients_fetches_one_nar_once() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let good = xz_cache(tmp, "good");
    let nginx = CacheServer::start(&good, &tmp.join("nginx"), &["--rtt-ms", "100"]);
    let key = corpus_key();
    let kept = tmp.join("kept");
    let server =
        Server::start_url(tmp, &format!("file://{}", kept.display()), &["--option", "trusted-public-keys", &key, "--upstream", &nginx.url]);
    let (_, paths) = subset();
    let biggest = paths.iter().max_by_key(|p| narinfo_field(&good, p, "FileSize").parse::<u64>().unwrap()).unwrap();
    let hash = &biggest["/nix/store/".len()..][..32];
    let (ok, narinfo) = curl(&format!("{}/{hash}.narinfo", server.url));
    assert!(ok);
    let url = String::from_utf8(narinfo).unwrap().lines().find_map(|l| l.strip_prefix("URL: ").map(str::to_string)).unwrap();
    let expected = std::fs::read(good.join(narinfo_field(&good, biggest, "URL"))).unwrap();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn({
                let url = format!("{}/{url}", server.url);
                move || curl(&url)
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), (true, expected.clone()));
    }
    assert_eq!(nginx.requests(".nar.xz"), 1);
}

/// The subset's xz cache (`good`) served by the scripted server with `rule` (a JSON object)
/// applied to the root's NAR file: the cache's directory, the root, its NAR file (`URL`) and
/// the server.
fn root_nar_scripted(tmp: &Path, mut rule: serde_json::Value) -> (PathBuf, String, String, Scripted) {
    let good = xz_cache(tmp, "good");
    let (root, _) = subset();
    let file = narinfo_field(&good, &root, "URL");
    rule["path"] = format!("/{file}").into();
    let rules = tmp.join("rules.json");
    std::fs::write(&rules, serde_json::json!([rule]).to_string()).unwrap();
    let upstream = Scripted::start(&good, Some(&rules), 0, &tmp.join("upstream.log"));
    (good, root, file, upstream)
}

/// Two fronts over one s3s-fs bucket: a front killed while it fetches a NAR publishes
/// nothing (no narinfo, no NAR file in the bucket); the other front serves the path (asked
/// by the NAR URL the first one gave, whose `?hash=` names the path), keeps it, and then a
/// new front serves it from the bucket with no upstream request.
#[test]
fn fronts_over_one_bucket_and_a_front_killed_mid_nar() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (good, root, file, upstream) = root_nar_scripted(tmp, serde_json::json!({ "delay": 3, "fail_times": 1 }));
    std::fs::create_dir_all(tmp.join("s3/bucket")).unwrap();
    let s3 = S3Server::start(&tmp.join("s3"), true);
    std::fs::create_dir_all(tmp.join("home/.aws")).unwrap();
    std::fs::write(tmp.join("home/.aws/credentials"), "[default]\naws_access_key_id = AKTEST\naws_secret_access_key = SKTEST\n").unwrap();
    let bucket = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", s3.port);
    let key = corpus_key();
    let args = ["--option", "trusted-public-keys", &key, "--upstream", &upstream.url];
    let mut a = Server::start_url(tmp, &bucket, &args);
    let b = Server::start_url(tmp, &bucket, &args);

    let hash = &root["/nix/store/".len()..][..32];
    let (ok, narinfo) = curl(&format!("{}/{hash}.narinfo", a.url));
    assert!(ok);
    let url = String::from_utf8(narinfo).unwrap().lines().find_map(|l| l.strip_prefix("URL: ").map(str::to_string)).unwrap();
    let nar = format!("{}/{url}", a.url);
    let waiting = std::thread::spawn(move || curl(&nar));
    // The upstream holds the NAR for 3 s (and logs the request only once it answers).
    std::thread::sleep(Duration::from_secs(1));
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert!(!waiting.join().unwrap().0);
    let objects = || cache_files(&tmp.join("s3/bucket"));
    assert_eq!(objects(), BTreeSet::new(), "the killed front published something");

    assert_eq!(curl(&format!("{}/{url}", b.url)), (true, std::fs::read(good.join(&file)).unwrap()));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(objects(), BTreeSet::from([format!("{hash}.narinfo"), file.clone()]));
    let c = Server::start_url(tmp, &bucket, &args);
    let before = upstream.requests(|_| true).len();
    assert_eq!(curl(&format!("{}/{file}", c.url)), (true, std::fs::read(good.join(&file)).unwrap()));
    let (ok, kept) = curl(&format!("{}/{hash}.narinfo", c.url));
    assert!(ok && String::from_utf8(kept).unwrap().contains(&format!("URL: {file}\n")));
    assert_eq!(upstream.requests(|_| true).len(), before);
}

/// The batch endpoint answers the closure of a path only an upstream has, in one request
/// (the upstream asked level by level, each level at once); nothing is kept before its NAR.
#[test]
fn the_batch_endpoint_answers_a_closure_only_upstream() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let good = xz_cache(tmp, "good");
    let nginx = CacheServer::start(&good, &tmp.join("nginx"), &[]);
    let key = corpus_key();
    let kept = tmp.join("kept");
    let server =
        Server::start_url(tmp, &format!("file://{}", kept.display()), &["--option", "trusted-public-keys", &key, "--upstream", &nginx.url]);
    let (root, paths) = subset();
    let o = Command::new("curl")
        .args(["-sf", "--data-binary", &root["/nix/store/".len()..][..32], &format!("{}/_sluice/v1/closure", server.url)])
        .output()
        .unwrap();
    check(&o, "POST _sluice/v1/closure");
    let mut got = BTreeSet::new();
    for line in String::from_utf8(o.stdout).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = v["narinfo"].as_str().unwrap_or_else(|| panic!("no narinfo in {line}"));
        got.insert(text.lines().find_map(|l| l.strip_prefix("StorePath: ")).unwrap().to_string());
    }
    assert_eq!(got, paths);
    assert_eq!(nginx.requests(".narinfo"), paths.len());
    assert_eq!(cache_files(&kept), BTreeSet::new());
}

/// An upstream whose NAR file goes on past the `FileSize` its narinfo gives (a body that never
/// ends) is cut off there: the client's request fails at once instead of waiting while the
/// front spools the endless body, and nothing is kept.
#[test]
fn an_upstream_whose_nar_never_ends_is_cut_off() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let good = xz_cache(tmp, "good");
    let (root, _) = subset();
    let file = narinfo_field(&good, &root, "URL");
    let endless = serde_json::json!([{ "path": format!("/{file}"), "endless": true }]);
    let upstream = PutServer::start(&good, tmp, &endless.to_string(), 16, false);
    let key = corpus_key();
    let kept = tmp.join("kept");
    let server = Server::start_url(
        tmp,
        &format!("file://{}", kept.display()),
        &["--option", "trusted-public-keys", &key, "--upstream", &upstream.url],
    );
    let hash = &root["/nix/store/".len()..][..32];
    assert!(curl(&format!("{}/{hash}.narinfo", server.url)).0);
    let asked = Instant::now();
    let (ok, _) = curl(&format!("{}/{file}", server.url));
    assert!(!ok, "an endless NAR was served whole");
    assert!(asked.elapsed() < Duration::from_secs(30), "the request failed only after {:?}", asked.elapsed());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cache_files(&kept), BTreeSet::new());
}

/// A narinfo whose `NarSize` is over `--upstream-max-nar-size` is passed over, with a warning
/// naming the path and the upstream, and counted as refused; one under it is served. Before,
/// any size was taken (and its NAR spooled whole).
#[test]
fn an_upstream_nar_over_the_largest_taken_is_passed_over() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let good = xz_cache(tmp, "good");
    let nginx = CacheServer::start(&good, &tmp.join("nginx"), &[]);
    let (_, paths) = subset();
    let size = |p: &String| narinfo_field(&good, p, "NarSize").parse::<u64>().unwrap();
    let biggest = paths.iter().max_by_key(|p| size(p)).unwrap();
    let smaller = paths.iter().find(|p| size(p) < size(biggest)).unwrap();
    let (key, limit) = (corpus_key(), (size(biggest) - 1).to_string());
    let log = tmp.join("serve.log");
    let args = ["--option", "trusted-public-keys", &key, "--upstream", &nginx.url, "--upstream-max-nar-size", &limit];
    let server = Server::start_logging(tmp, &format!("file://{}", tmp.join("kept").display()), &args, &log);
    let narinfo = |p: &str| curl(&format!("{}/{}.narinfo", server.url, &p["/nix/store/".len()..][..32])).0;
    assert!(!narinfo(biggest));
    assert!(narinfo(smaller));
    let warning = format!(
        "upstream {}: {biggest}: its NAR is {} bytes (NarSize {}, FileSize {}), more than the {limit} bytes of --upstream-max-nar-size; passed over",
        nginx.url,
        size(biggest),
        size(biggest),
        narinfo_field(&good, biggest, "FileSize")
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(&warning), "{text}");
    assert_eq!(upstream_metric(&server, "narinfo_refused_total", &nginx.url), 1);
    assert_eq!(nginx.requests(".nar.xz"), 0);
}

/// A NAR the upstream did not give (a 404, once) is fetched again on a request after the
/// back-off (2 s), then served and kept; meanwhile neither it nor its narinfo is served, nor
/// is it asked for again, and it counts as a failure, not as a NAR that failed its check.
/// Before, it was never fetched again until the server restarted.
#[test]
fn a_nar_not_fetched_is_fetched_again_after_a_back_off() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (good, root, file, upstream) = root_nar_scripted(tmp, serde_json::json!({ "status": 404, "fail_times": 1 }));
    let key = corpus_key();
    let kept = tmp.join("kept");
    let args = ["--option", "trusted-public-keys", &key, "--upstream", &upstream.url];
    let server = Server::start_url(tmp, &format!("file://{}", kept.display()), &args);
    let hash = &root["/nix/store/".len()..][..32];
    let narinfo = format!("{}/{hash}.narinfo", server.url);
    let (ok, text) = curl(&narinfo);
    assert!(ok);
    let url = String::from_utf8(text).unwrap().lines().find_map(|l| l.strip_prefix("URL: ").map(str::to_string)).unwrap();
    let nar = format!("{}/{url}", server.url);
    let fetches = || upstream.requests(|p| p == format!("/{file}")).len();
    assert!(!curl(&nar).0);
    let failed = Instant::now();
    assert!(!curl(&nar).0);
    assert!(!curl(&narinfo).0);
    assert!(failed.elapsed() < Duration::from_millis(1500), "the back-off may have ended: took {:?}", failed.elapsed());
    assert_eq!(fetches(), 1);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(curl(&narinfo).0);
    assert_eq!(curl(&nar), (true, std::fs::read(good.join(&file)).unwrap()));
    assert_eq!(fetches(), 2);
    assert_eq!(upstream_metric(&server, "failures_total", &upstream.url), 1);
    assert_eq!(upstream_metric(&server, "nar_failures_total", &upstream.url), 0);
    assert_eq!(upstream_metric(&server, "nars_total", &upstream.url), 1);
    let want = BTreeSet::from([format!("{hash}.narinfo"), file.clone()]);
    let started = Instant::now();
    while cache_files(&kept) != want {
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", cache_files(&kept));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The temporary files of NARs being fetched into a `file://` cache (`.sluice-upload-*`, in
/// its directory).
fn uploads(dir: &Path) -> BTreeSet<String> {
    let names = std::fs::read_dir(dir).into_iter().flatten().map(|e| e.unwrap().file_name().to_string_lossy().into_owned());
    names.filter(|n| n.starts_with(".sluice-upload-")).collect()
}

/// Two fronts over one `file://` cache fetch a NAR each from a slow upstream; one is killed
/// (`kill -9`) mid-NAR and leaves its temporary file. A front started later removes it and
/// not the live front's, whose NAR is then kept whole. Before, the dead front's file stayed
/// for good.
#[test]
fn a_later_front_removes_what_a_killed_one_left_and_no_live_upload() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let good = xz_cache(tmp, "good");
    let (root, paths) = subset();
    let other = paths.iter().find(|p| **p != root).unwrap().clone();
    let (dead_file, live_file) = (narinfo_field(&good, &root, "URL"), narinfo_field(&good, &other, "URL"));
    let rules = tmp.join("rules.json");
    let slow = serde_json::json!([
        { "path": format!("/{dead_file}"), "delay": 60, "fail_times": 1 },
        { "path": format!("/{live_file}"), "delay": 15, "fail_times": 1 },
    ]);
    std::fs::write(&rules, slow.to_string()).unwrap();
    let upstream = Scripted::start(&good, Some(&rules), 0, &tmp.join("upstream.log"));
    let kept = tmp.join("kept");
    let store = format!("file://{}", kept.display());
    let key = corpus_key();
    let args = ["--option", "trusted-public-keys", &key, "--upstream", &upstream.url];
    let mut dead = Server::start_url(tmp, &store, &args);
    let live = Server::start_url(tmp, &store, &args);
    let fetching = |server: &Server, path: &str| {
        let (ok, narinfo) = curl(&format!("{}/{}.narinfo", server.url, &path["/nix/store/".len()..][..32]));
        assert!(ok);
        let url = String::from_utf8(narinfo).unwrap().lines().find_map(|l| l.strip_prefix("URL: ").map(str::to_string)).unwrap();
        let nar = format!("{}/{url}", server.url);
        std::thread::spawn(move || curl(&nar))
    };
    let _abandoned = fetching(&dead, &root);
    let waiting = fetching(&live, &other);
    let started = Instant::now();
    while uploads(&kept).len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", uploads(&kept));
        std::thread::sleep(Duration::from_millis(50));
    }
    let both = uploads(&kept);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();

    let _later = Server::start_url(tmp, &store, &args);
    let left = uploads(&kept);
    assert_eq!(left.len(), 1, "the killed front's temporary file is still there: {left:?}");
    assert!(left.is_subset(&both), "{left:?} {both:?}");
    assert_eq!(waiting.join().unwrap(), (true, std::fs::read(good.join(&live_file)).unwrap()));
    let hash = &other["/nix/store/".len()..][..32];
    let want = BTreeSet::from([format!("{hash}.narinfo"), live_file.clone()]);
    let started = Instant::now();
    while cache_files(&kept) != want || !uploads(&kept).is_empty() {
        assert!(started.elapsed() < Duration::from_secs(20), "{:?} {:?}", cache_files(&kept), uploads(&kept));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::read(kept.join(&live_file)).unwrap(), std::fs::read(good.join(&live_file)).unwrap());
}

/// A local store as the pull-through cache: real Nix 2.8 copies the closure through it, each
/// NAR fetched once from the upstream (nginx), and the paths are then valid in that store
/// (added once their references were, each checked by `nix-store --verify`); real Nix 2.26
/// copies them again from it, with no upstream request. Before, `--upstream` refused a local
/// store.
#[test]
fn a_local_store_is_a_pull_through_cache() {
    let o = Command::new(shared().join("bin/setup-nix-modern")).current_dir("/tmp").output().unwrap();
    check(&o, "setup-nix-modern");
    let tmp = tempfile::Builder::new().tempdir_in("/tmp").unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let good = xz_cache(tmp, "good");
    let nginx = CacheServer::start(&good, &tmp.join("nginx"), &[]);
    let (secret, public) = signing_key(tmp);
    let kept = tmp.join("kept");
    let key = corpus_key();
    let store = format!("local?root={}", kept.display());
    let args = ["--option", "trusted-public-keys", &key, "--upstream", &nginx.url, "--secret-key", secret.to_str().unwrap()];
    let server = Server::start_url(tmp, &store, &args);

    let a = tmp.join("nix-2.8");
    let o = nix_trusting(tmp, &public, "nix", &["copy", "--from", &server.url, "--to", a.to_str().unwrap(), &root]);
    check(&o, "nix copy --from the pull-through local store");
    assert_nix_verifies(tmp, &a);
    assert_eq!(nginx.requests(".nar.xz"), paths.len());
    let started = Instant::now();
    while registered_paths(&kept) != paths {
        assert!(started.elapsed() < Duration::from_secs(30), "kept {:?} of {:?}", registered_paths(&kept), paths);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_nix_verifies(tmp, &kept);

    let narinfos_asked = nginx.requests(".narinfo");
    nix_2_26_copies(tmp, &public, &server.url, &root);
    assert_eq!(nginx.requests(".nar.xz"), paths.len());
    assert_eq!(nginx.requests(".narinfo"), narinfos_asked);
}
