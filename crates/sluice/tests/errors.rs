//! Errors people can act on: a `--from` that cannot be used is one hard error that
//! says why, as real Nix 2.8 refuses it too; failures that share a cause are one line with the
//! count, what the paths carry and the fix.

use std::path::Path;

use crate::common::*;

/// The `error:` lines of `sluice`'s standard error.
fn error_lines(o: &std::process::Output) -> Vec<String> {
    stderr(o).lines().filter(|l| l.starts_with("error: ")).map(str::to_owned).collect()
}

/// `sluice copy --from URL` and `nix copy --from URL` of the corpus's top path into fresh
/// stores under `tmp`: both must fail; returns sluice's output.
fn copy_from_both(tmp: &Path, url: &str, extra: &[&str]) -> (std::process::Output, std::process::Output) {
    let ours = tmp.join("ours");
    let theirs = tmp.join("theirs");
    let mut args = vec!["copy", "--from", url, "--to", ours.to_str().unwrap()];
    args.extend(extra);
    args.push(TOP);
    let o = sluice(tmp, &args);
    assert_eq!(o.status.code(), Some(1), "sluice copy --from {url}: {}", stderr(&o));
    let mut args = vec!["copy", "--from", url, "--to", theirs.to_str().unwrap(), "--option", "download-attempts", "1"];
    args.extend(extra);
    args.push(TOP);
    let n = nix(tmp, "nix", &args);
    assert!(!n.status.success(), "nix copy --from {url} must fail too: {}", stderr(&n));
    (o, n)
}

/// An HTTP server without `nix-cache-info` is not a binary cache: Nix's one line, byte for byte.
#[test]
fn from_not_a_binary_cache_is_nixs_one_error() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let server = Scripted::start(&empty, None, 0, &tmp.path().join("log"));
    let (o, n) = copy_from_both(tmp.path(), &server.url, &[]);
    assert_eq!(stderr(&o), format!("error: '{}' does not appear to be a binary cache\n", server.url));
    assert_eq!(stderr(&o), stderr(&n), "as Nix 2.8 says it");
}

/// `path-info --store` of an HTTP server without `nix-cache-info` (it answers a PUT that would
/// create one with 501): Nix 2.8's one line, byte for byte, and its status.
#[test]
fn path_info_of_not_a_binary_cache_is_nixs_one_error() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let server = Scripted::start(&empty, None, 0, &tmp.path().join("log"));
    let o = sluice(tmp.path(), &["path-info", "--store", &server.url, TOP]);
    let n = nix(tmp.path(), "nix", &["path-info", "--store", &server.url, TOP]);
    assert_eq!(stderr(&o), format!("error: '{}' does not appear to be a binary cache\n", server.url));
    assert_eq!(stderr(&o), stderr(&n), "as Nix 2.8 says it");
    assert_eq!(o.status.code(), n.status.code());
}

/// Unreachable, a certificate nobody trusts, 401: one error naming the URL and the cause,
/// before anything is copied (today: "no substituter has this path" for each path), naming
/// the URL once (reqwest's message repeated it).
#[test]
fn from_unreachable_tls_or_401_is_one_error_saying_so() {
    let tmp = tempfile::tempdir().unwrap();
    let closed = format!("http://127.0.0.1:{}", closed_port());
    let tls = CacheServer::start(&corpus().join("cache-zstd"), &tmp.path().join("nginx"), &["--tls"]);
    let rules = tmp.path().join("rules-401.json");
    std::fs::write(&rules, r#"[{"path": "/nix-cache-info", "status": 401, "body": "token expired"}]"#).unwrap();
    let unauthorised = Scripted::start(&corpus().join("cache-zstd"), Some(&rules), 0, &tmp.path().join("log"));
    for (url, cause) in [
        (closed.as_str(), "Connection refused"),
        (tls.url.as_str(), "certificate"),
        (unauthorised.url.as_str(), "HTTP status 401 (token expired)"),
    ] {
        let case = tmp.path().join(cause.split(' ').next().unwrap());
        std::fs::create_dir(&case).unwrap();
        let (o, _) = copy_from_both(&case, url, &["--option", "download-attempts", "1"]);
        let lines: Vec<String> = stderr(&o).lines().map(str::to_owned).collect();
        assert_eq!(lines.len(), 1, "one line for {url}: {lines:?}");
        assert!(lines[0].starts_with(&format!("error: {url}/nix-cache-info: ")) && lines[0].contains(cause), "{url}: {lines:?}");
        assert_eq!(lines[0].matches(url).count(), 1, "the URL once: {lines:?}");
    }
}

/// An `ssl-cert-file` that cannot be read is the error of the cache that needs the HTTP
/// client, naming the cache and the file; a copy from `file://` builds no client, so the
/// setting is not read (Nix reads it only for its HTTP transfers too).
#[test]
fn an_unreadable_ssl_cert_file_fails_only_a_cache_over_https() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-ca.pem");
    let missing = missing.to_str().unwrap();
    let closed = format!("https://127.0.0.1:{}", closed_port());
    let o = sluice(
        tmp.path(),
        &["copy", "--from", &closed, "--to", tmp.path().join("https").to_str().unwrap(), "--option", "ssl-cert-file", missing, TOP],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(error_lines(&o), [format!("error: {closed}: ssl-cert-file {missing}: No such file or directory (os error 2)")]);
    let leaf = corpus_path("bash-5.2-p15");
    let file = format!("file://{}", corpus().join("cache-zstd").display());
    let o = copy_with(tmp.path(), &tmp.path().join("file"), &file, &corpus_key(), &[("ssl-cert-file", missing)], &[&leaf]);
    check(&o, "a copy from file:// with an unreadable ssl-cert-file");
}

/// 1046 paths signed by a key nobody trusts: one line with the count, the key the narinfos
/// carry, the trusted one and the fix; the 10 content-addressed paths need no signature and
/// are copied. Real Nix 2.8 refuses the closure too.
#[test]
fn untrusted_key_failures_are_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let key = corpus_key();
    let other = format!("other-1:{}", key.split_once(':').unwrap().1);
    let cache = format!("file://{}", corpus().join("cache-zstd").display());
    let (o, n) = copy_from_both(tmp.path(), &cache, &["--trusted-public-keys", &other]);
    let lines = error_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(
            "error: 1046 paths lack a signature by a trusted key: they are signed by corpus-nixos-1-1 but trusted-public-keys has other-1; \
             if you trust that key, add it to trusted-public-keys (/nix/store/"
        ) && lines[0].ends_with(", and 1043 more)"),
        "{lines:?}"
    );
    assert!(stderr(&n).contains("lacks a valid signature"), "{}", stderr(&n));
}

/// Store path names as Nix 2.26 takes them (`checkName`, `StorePath::StorePath` in `path.cc`):
/// `.`, `..` and a first dash-separated component of either are refused, naming the rule (an
/// illegal character by itself and where it is, as Nix 2.26 names it);
/// `.foo` and `...` are names (Nix 2.8 took all six); 211 characters at most; the hash part in
/// nixbase32; an empty name refused. Each asked of an empty store by `path-info` and by real
/// Nix 2.26's `nix-store --check-validity` (through `nix-modern`). Kept: a base name whose 33rd
/// character is not `-`, which Nix 2.26 takes (it does not look at that character).
#[test]
fn store_path_names_are_nix_2_26s() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let hash = "0za6hhg5kdh6vk2ds8m40snyz7aar7a1";
    let (max, over) = (format!("{hash}-{}", "a".repeat(211)), format!("{hash}-{}", "a".repeat(212)));
    let dot = "has an invalid name: the first dash-separated component must not be '.";
    let cases: Vec<(String, bool, Option<&str>)> = vec![
        (format!("{hash}-."), true, Some(dot)),
        (format!("{hash}-.."), true, Some(dot)),
        (format!("{hash}-.-x"), true, Some(dot)),
        (format!("{hash}-..-x"), true, Some(dot)),
        (format!("{hash}-.foo"), false, None),
        (format!("{hash}-..."), false, None),
        (format!("{hash}-"), true, Some("is too short")),
        (max, false, None),
        (over, true, Some("name longer than 211 characters")),
        (format!("{hash}-a!b"), true, Some("has an invalid name: illegal character '!' at byte 1 of the name")),
        (format!("{hash}-gcc-é"), true, Some("has an invalid name: illegal character 'é' at byte 4 of the name")),
        (format!("{hash}-a\tb"), true, Some("has an invalid name: illegal character '\\t' at byte 1 of the name")),
        ("0za6hhg5kdh6vk2ds8m40snyz7aar7ae-x".into(), true, Some("invalid hash part")),
        (format!("{hash}_x"), false, Some("no '-' after the hash part (Nix 2.26 does not check it")),
    ];
    for (base, nix_refuses, refusal) in cases {
        let path = format!("/nix/store/{base}");
        let o = sluice(tmp.path(), &["path-info", "--store", store.to_str().unwrap(), &path]);
        assert!(!o.status.success());
        let ours = stderr(&o);
        let n = nix_modern(tmp.path(), &["nix-store", "--store", store.to_str().unwrap(), "--check-validity", &path]);
        let theirs = stderr(&n);
        assert!(!n.status.success());
        assert_eq!(!theirs.contains(&format!("path '{path}' is not valid")), nix_refuses, "Nix 2.26 on {base:?}: {theirs}");
        match refusal {
            Some(why) => assert!(ours.contains(why), "{base:?}: {ours}"),
            None => assert_eq!(ours, format!("error: path '{path}' is not valid\n"), "{base:?}"),
        }
    }
}
