//! narinfo and `nix-cache-info` content, end to end through `sluice copy` (cases 01, 02):
//! optional FileHash/FileSize, required fields named in errors, hash encodings, line format,
//! fallback to the next cache after a corrupt narinfo, a narinfo for another path, an HTML
//! page served with 200 (for narinfos, or for every URL), the forms of `URL`, and broken
//! `nix-cache-info` files.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::common::*;

const C01: &str = "01-narinfo-compressed-without-filehash";
const C02: &str = "02-narinfo-field-validation";
const OK: &str = "/nix/store/j2yfr439465w3qg0kz6c1h1x6x5hf4zp-ok-baseline";

/// A writable copy of case 02's cache under `tmp` (at `tmp/sub`).
fn cache_copy(tmp: &Path, sub: &str) -> PathBuf {
    let dir = tmp.join(sub);
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    copy_dir(&case_dir(C02).join("cache"), &dir);
    dir
}

fn narinfo_file(cache: &Path, path: &str) -> PathBuf {
    cache.join(format!("{}.narinfo", &path["/nix/store/".len()..][..32]))
}

fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

#[test]
fn compressed_without_filehash_is_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let url = file_url(&case_dir(C01).join("cache"));
    let paths = ["/nix/store/s6h0lhk28lyfid0044hvxdjibflfgvfz-pkg-xz", "/nix/store/8w9n7zvscigkn8iz190bcd8ajlx7qnwi-pkg-zstd"];
    check(&copy_with(tmp.path(), &root, &url, &case_key(C01), &[], &paths), "copy of case 01");
    for p in paths {
        let out = root.join(&p[1..]);
        let hello = std::fs::metadata(out.join("bin/hello")).unwrap();
        assert_eq!((hello.len(), hello.permissions().mode() & 0o777), (21, 0o555));
        assert_eq!(std::fs::metadata(out.join("share/doc.txt")).unwrap().len(), 950);
        let info = nix_path_info(tmp.path(), root.to_str().unwrap(), p);
        // sha256:15bz31488rh4v6mi43l6pf8n6mdzcljlcpv3s1y5gy1yc910gcc8, as Nix 2.8 prints it.
        assert_eq!(info[0]["narHash"], "sha256-iLEHQmI++Fd80GNfRiVlv1VjkbuGDhKr2QRmhEgYf5U=");
        assert_eq!(info[0]["narSize"], 1808);
    }
    assert_nix_verifies(tmp.path(), &root);
}

#[test]
fn field_rules_of_case_02() {
    let url = file_url(&case_dir(C02).join("cache"));
    let accept = ["ok-baseline", "unknown-fields", "narhash-base16", "narhash-sri", "deriver-unknown", "compression-absent"];
    let reject = [
        ("narsize-zero", "NarSize"),
        ("narsize-missing", "NarSize"),
        ("narsize-negative", "NarSize"),
        ("narhash-missing", "NarHash"),
        ("narhash-bad-b32", "NarHash"),
        ("url-missing", "URL"),
        ("storepath-missing", "StorePath"),
        ("references-twice", "References"),
        ("no-final-newline", "\\n"),
        ("crlf", "\\r"),
    ];
    let rows = case_paths(C02);
    assert_eq!(rows.len(), accept.len() + reject.len());
    for (variant, path) in rows {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let o = copy_with(tmp.path(), &root, &url, &case_key(C02), &[], &[&path]);
        if accept.contains(&variant.as_str()) {
            check(&o, &variant);
            let info = nix_path_info(tmp.path(), root.to_str().unwrap(), &path);
            // sha256:0b3v1wdsz9144w0dq1r0ys0bw55ycjn9l2x4njymrj59zfhkg5rm, as Nix 2.8 prints it.
            assert_eq!(info[0]["narHash"], "sha256-NZc3ofupyFy9tKQLmqxkvhS+gPYgB9wAJySkrxsPeyw=", "{variant}: hash normalised");
            assert!(info[0]["deriver"].is_null(), "{variant}: no deriver");
        } else {
            let field = reject.iter().find(|(v, _)| *v == variant).unwrap_or_else(|| panic!("unknown variant {variant}")).1;
            assert_eq!(o.status.code(), Some(1), "{variant} must be refused");
            let err = stderr(&o);
            let line = err.lines().find(|l| l.starts_with("error:") && l.contains(&path)).unwrap_or_else(|| panic!("{variant}: {err}"));
            assert!(line.contains(field) && line.contains(&url), "{variant}: names {field} and the URL: {line}");
            assert_absent(tmp.path(), &root, &path);
        }
    }
}

#[test]
fn corrupt_narinfo_falls_back_to_the_next_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let good = cache_copy(tmp.path(), "good");
    let path = "/nix/store/2gdfjrc61r0ayxndbzqw5yd1jbdpfi0m-narsize-zero";
    let file = narinfo_file(&good, path);
    let fixed = std::fs::read_to_string(&file).unwrap().replace("NarSize: 0\n", "NarSize: 136\n");
    std::fs::write(&file, fixed).unwrap();
    let bad = file_url(&case_dir(C02).join("cache"));
    let root = tmp.path().join("root");
    // The fixed narinfo's signature no longer matches (NarSize is signed): trust by hash only.
    let o = copy_with(tmp.path(), &root, &format!("{bad} {}", file_url(&good)), &case_key(C02), &[("require-sigs", "false")], &[path]);
    check(&o, "fallback after a corrupt narinfo");
    let err = stderr(&o);
    assert!(
        err.lines().any(|l| l.to_lowercase().contains("warn") && l.contains(&bad) && l.contains("NarSize")),
        "the corrupt narinfo is logged: {err}"
    );
    assert_nix_verifies(tmp.path(), &root);
}

#[test]
fn narinfo_for_another_path_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = cache_copy(tmp.path(), "c");
    let other = "/nix/store/8lkcxl53llk5fi2gsvl23y2i1zmr8zjr-unknown-fields";
    std::fs::copy(narinfo_file(&cache, other), narinfo_file(&cache, OK)).unwrap();
    let root = tmp.path().join("root");
    let o = copy_with(tmp.path(), &root, &file_url(&cache), &case_key(C02), &[], &[OK]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains(&format!("narinfo is for {other}, not the requested {OK}")), "{err}");
    assert_absent(tmp.path(), &root, OK);
}

/// A hostile cache's narinfos and `nix-cache-info` (found by a hostile review). A narinfo with
/// 300,000 distinct `Sig:` lines is read in linear time and its path copied with every one
/// (each line was looked for among those before it: 100,000 took 22 s in a release build).
/// A value of 32 MiB (a `Deriver`, a `StoreDir`) is quoted cut in the refusal, with its length
/// (the whole value was in the message, 52 MB of standard error for a 50 MiB `Deriver`).
#[test]
fn a_hostile_caches_long_fields_cost_linear_time_and_short_messages() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = cache_copy(tmp.path(), "c");
    let narinfo = std::fs::read_to_string(narinfo_file(&cache, OK)).unwrap();
    let sigs: String = (0..300_000).map(|i| format!("Sig: hostile-{i}:x\n")).collect();
    std::fs::write(narinfo_file(&cache, OK), format!("{narinfo}{sigs}")).unwrap();
    let root = tmp.path().join("root");
    let url = file_url(&cache);
    let key = case_key(C02);
    let copy = ["copy", "--substituters", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &key, OK];
    check(&sluice_after(tmp.path(), "ulimit -t 30", &copy), "copy of a path with 300,000 signatures within 30 s of CPU");
    let info = nix_path_info(tmp.path(), root.to_str().unwrap(), OK);
    assert_eq!(info[0]["signatures"].as_array().map(Vec::len), Some(300_001));

    let long = "a".repeat(32 << 20);
    let hostile = [
        ("narinfo", format!("{narinfo}Deriver: {long}\n"), "narinfo field Deriver: store path \"aaaa"),
        ("nix-cache-info", format!("StoreDir: /{long}\n"), "cache is for store directory \"/aaaa"),
    ];
    for (file, content, refusal) in hostile {
        let cache = cache_copy(tmp.path(), file);
        let target = if file == "narinfo" { narinfo_file(&cache, OK) } else { cache.join(file) };
        std::fs::write(target, content).unwrap();
        let root = tmp.path().join(format!("root-{file}"));
        let o = copy_with(tmp.path(), &root, &file_url(&cache), &key, &[], &[OK]);
        assert_eq!(o.status.code(), Some(1), "{file}");
        let err = stderr(&o);
        assert!(err.len() < 4096, "{file}: {} bytes of standard error", err.len());
        assert!(
            err.contains(refusal) && err.contains(&format!("\"… ({} bytes in all)", long.len() + usize::from(file != "narinfo"))),
            "{err}"
        );
        assert_absent(tmp.path(), &root, OK);
    }
}

/// A portal that answers `200` and an HTML page for `pattern` (a regex on the request path).
fn portal(tmp: &Path, pattern: &str) -> Scripted {
    let rules = tmp.join("rules.json");
    let page = "<!DOCTYPE html>\n<html><body>Welcome to our captive portal</body></html>\n";
    std::fs::write(&rules, serde_json::json!([{ "path": pattern, "body": page }]).to_string()).unwrap();
    Scripted::start(&case_dir(C02).join("cache"), Some(&rules), 0, &tmp.join("log"))
}

/// A cache whose narinfos became HTML pages (its `nix-cache-info` still real, as the disk
/// cache remembers it): the page is named as such, and the cache is given up on for the run
/// after the first one (asked first, `?priority=10`), the next cache serving the paths.
#[test]
fn html_page_with_200_is_not_a_narinfo() {
    let tmp = tempfile::tempdir().unwrap();
    let portal = portal(tmp.path(), "/[0-9a-z]{32}\\.narinfo");
    let root = tmp.path().join("root");
    let alone = copy_with(tmp.path(), &root, &portal.url, &case_key(C02), &[], &[OK]);
    assert_eq!(alone.status.code(), Some(1));
    let err = stderr(&alone);
    let page = "the body is not a narinfo but an HTML page ('<!DOCTYPE html> <html><body>Welcome to our captive portal</b…'): a parked domain or a captive portal answers every URL with one";
    assert!(err.contains(&format!("{}/{}.narinfo: invalid narinfo: {page}", portal.url, &OK[11..43])), "{err}");
    assert_absent(tmp.path(), &root, OK);
    let other = "/nix/store/8lkcxl53llk5fi2gsvl23y2i1zmr8zjr-unknown-fields";
    let subs = format!("{}?priority=10 {}", portal.url, file_url(&case_dir(C02).join("cache")));
    let o = copy_with(tmp.path(), &root, &subs, &case_key(C02), &[], &[OK, other]);
    check(&o, "fallback after an HTML narinfo");
    let err = stderr(&o);
    let warned = format!("substituter {} is not used for the rest of this run: ", portal.url);
    assert_eq!(err.lines().filter(|l| l.contains(&warned) && l.contains(page)).count(), 1, "one warning: {err}");
    assert!(portal.requests(|p| p.starts_with("/nar/")).is_empty(), "the portal's page was never used as a narinfo");
}

/// A parked domain or captive portal answers every URL, `nix-cache-info` too, with `200` and
/// an HTML page: the cache is left out at once with a warning naming it, and the next cache
/// serves the path; alone, the run fails saying why. Real Nix 2.8 reads the page as a
/// `nix-cache-info` without fields, then fails the run on the first narinfo ("NAR info file
/// … is corrupt"), the next cache unasked.
#[test]
fn a_parked_domain_is_left_out_and_the_next_cache_serves() {
    let tmp = tempfile::tempdir().unwrap();
    let portal = portal(tmp.path(), ".*");
    let page = "the body is not a nix-cache-info but an HTML page ('<!DOCTYPE html> <html><body>Welcome to our captive portal</b…')";
    let left_out =
        format!("warning: substituter left out: {}/nix-cache-info: invalid nix-cache-info: nix-cache-info line 1: {page}", portal.url);
    let root = tmp.path().join("root");
    let alone = copy_with(tmp.path(), &root, &portal.url, &case_key(C02), &[], &[OK]);
    assert_eq!(alone.status.code(), Some(1));
    assert!(stderr(&alone).contains(&left_out), "{}", stderr(&alone));
    assert_absent(tmp.path(), &root, OK);
    let subs = format!("{}?priority=10 {}", portal.url, file_url(&case_dir(C02).join("cache")));
    let o = copy_with(tmp.path(), &root, &subs, &case_key(C02), &[], &[OK]);
    check(&o, "the next cache after a parked domain");
    // Said once: the narinfo asked alongside `nix-cache-info` (a page too) adds nothing.
    let err = stderr(&o);
    let named: Vec<&str> = err.lines().filter(|l| l.contains(&portal.url)).collect();
    assert!(named.len() == 1 && named[0].starts_with(&left_out), "{err}");
    assert_nix_verifies(tmp.path(), &root);
    assert!(portal.requests(|p| p.starts_with("/nar/")).is_empty(), "the portal's pages were never used");
    let theirs = tmp.path().join("theirs");
    let n = nix(
        tmp.path(),
        "nix-store",
        &[
            "--store",
            theirs.to_str().unwrap(),
            "-r",
            OK,
            "--option",
            "substituters",
            &subs,
            "--option",
            "trusted-public-keys",
            &case_key(C02),
        ],
    );
    assert!(
        !n.status.success() && stderr(&n).contains(&format!("NAR info file '{}.narinfo' is corrupt", &OK[11..43])),
        "Nix 2.8: {}",
        stderr(&n)
    );
}

#[test]
fn url_forms_under_a_path_prefix() {
    for form in ["nar/plain.nar", "nar/plain.nar?download=1", "ABSOLUTE/prefix/nar/plain.nar", "/prefix/nar/plain.nar"] {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_copy(tmp.path(), "www/prefix");
        let server = Scripted::start(&tmp.path().join("www"), None, 0, &tmp.path().join("log"));
        let url = form.replace("ABSOLUTE", &server.url);
        let file = narinfo_file(&cache, OK);
        let text = std::fs::read_to_string(&file).unwrap().replace("URL: nar/plain.nar\n", &format!("URL: {url}\n"));
        std::fs::write(&file, text).unwrap();
        let root = tmp.path().join("root");
        check(&copy_with(tmp.path(), &root, &format!("{}/prefix", server.url), &case_key(C02), &[], &[OK]), form);
        let gets = server.requests(|p| p.starts_with("/prefix/nar/plain.nar"));
        assert_eq!(gets.len(), 1, "{form}: {gets:?}");
        assert_nix_verifies(tmp.path(), &root);
    }
}

/// Each `nix-cache-info` is accepted or refused as real Nix 2.26 (`nix path-info --store`, whose
/// `BinaryCacheStore::init` reads the file) accepts or refuses it; several `StoreDir` lines are
/// each checked, as Nix checks them (the last one no longer decides).
#[test]
fn broken_nix_cache_info() {
    let good = file_url(&case_dir(C02).join("cache"));
    let variants: [(&str, Option<&str>, Option<&str>); 7] = [
        ("missing", None, None),
        ("garbage", Some("\u{1}\u{2}<html>not: a cache\n\u{ff}junk"), None),
        ("wrong-store-dir", Some("StoreDir: /gnu/store\n"), Some("store directory \"/gnu/store\"")),
        ("bad-priority", Some("StoreDir: /nix/store\nPriority: high\n"), Some("Priority \"high\"")),
        ("store-dir-repeated", Some("StoreDir: /nix/store\nPriority: 30\nStoreDir:\t/nix/store\r\n"), None),
        (
            "store-dir-then-another",
            Some("StoreDir: /nix/store\nStoreDir: /gnu/store\n"),
            Some("line 2: StoreDir \"/gnu/store\" differs from line 1's \"/nix/store\""),
        ),
        (
            "another-then-store-dir",
            Some("StoreDir: /gnu/store\nWantMassQuery: 1\nStoreDir: /nix/store\n"),
            Some("line 3: StoreDir \"/nix/store\" differs from line 1's \"/gnu/store\""),
        ),
    ];
    for (name, content, refusal) in variants {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_copy(tmp.path(), "c");
        match content {
            None => std::fs::remove_file(cache.join("nix-cache-info")).unwrap(),
            Some(c) => std::fs::write(cache.join("nix-cache-info"), c).unwrap(),
        }
        let root = tmp.path().join("root");
        let o = copy_with(tmp.path(), &root, &file_url(&cache), &case_key(C02), &[], &[OK]);
        let err = stderr(&o);
        match refusal {
            None => check(&o, name),
            Some(reason) => {
                assert_eq!(o.status.code(), Some(1), "{name}");
                let warn =
                    err.lines().find(|l| l.contains("warning") && l.contains(&file_url(&cache))).unwrap_or_else(|| panic!("{name}: {err}"));
                assert!(warn.contains(reason), "{name}: {warn}");
                // The cache is left out; the next one still serves the path.
                let subs = format!("{} {good}", file_url(&cache));
                check(&copy_with(tmp.path(), &root, &subs, &case_key(C02), &[], &[OK]), name);
            }
        }
        // Last: Nix writes a missing nix-cache-info into the cache.
        let theirs = nix_modern(tmp.path(), &["nix", "path-info", "--store", &file_url(&cache), OK]);
        assert_eq!(theirs.status.success(), refusal.is_none(), "{name}: Nix 2.26 says {}", stderr(&theirs));
    }
}

/// One cache's `nix-cache-info` that Nix cannot read (`Priority: high`, on which Nix's
/// `std::stoi` throws) leaves that cache out with a warning naming it, the line and the field,
/// and the next cache serves the path. Real Nix 2.8 ends the whole run ("error: stoi"): the
/// `std::invalid_argument` is no Nix error, which opening the substituters would have turned
/// into a warning (Nix 2.26's `BinaryCacheStore::init` reads `Priority` the same way).
#[test]
fn an_unreadable_nix_cache_info_leaves_its_cache_out_not_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = cache_copy(tmp.path(), "bad");
    std::fs::write(bad.join("nix-cache-info"), "StoreDir: /nix/store\nPriority: high\n").unwrap();
    let subs = format!("{} {}", file_url(&bad), file_url(&case_dir(C02).join("cache")));
    let root = tmp.path().join("root");
    let o = copy_with(tmp.path(), &root, &subs, &case_key(C02), &[], &[OK]);
    check(&o, "copy with one unreadable nix-cache-info");
    let warning = format!("warning: substituter left out: {}/nix-cache-info: invalid nix-cache-info: nix-cache-info line 2: Priority \"high\": not an integer", file_url(&bad));
    assert!(stderr(&o).contains(&warning), "{}", stderr(&o));
    assert_nix_verifies(tmp.path(), &root);
    let theirs = tmp.path().join("theirs");
    let n = nix(
        tmp.path(),
        "nix-store",
        &[
            "--store",
            theirs.to_str().unwrap(),
            "-r",
            OK,
            "--option",
            "substituters",
            &subs,
            "--option",
            "trusted-public-keys",
            &case_key(C02),
        ],
    );
    assert!(!n.status.success() && stderr(&n).contains("error: stoi"), "Nix 2.8: {}", stderr(&n));
}

/// As Nix reads a narinfo (2.8 and 2.26 alike, `NarInfo::NarInfo`): a field given again takes
/// its last value (here `URL`, first a NAR that does not exist), `Sig` lines repeat, an
/// unknown field need not have a space after its `:`; real Nix 2.8 substitutes the same file.
#[test]
fn narinfo_leniency_is_nixs() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = cache_copy(tmp.path(), "cache");
    let file = narinfo_file(&cache, OK);
    let text = std::fs::read_to_string(&file).unwrap();
    let sig = text.lines().find(|l| l.starts_with("Sig: ")).unwrap().to_owned();
    let text = format!("X-Cache:HIT\nURL: nar/nothing-here.nar\n{text}{sig}\n");
    std::fs::write(&file, text).unwrap();
    check(&copy_with(tmp.path(), &tmp.path().join("ours"), &file_url(&cache), &case_key(C02), &[], &[OK]), "sluice copy");
    let theirs = tmp.path().join("theirs");
    let o = nix(
        tmp.path(),
        "nix-store",
        &[
            "--store",
            theirs.to_str().unwrap(),
            "-r",
            OK,
            "--option",
            "substituters",
            &file_url(&cache),
            "--option",
            "trusted-public-keys",
            &case_key(C02),
        ],
    );
    check(&o, "nix-store -r of the same narinfo");
}

/// The narinfo line rules compared with real Nix 2.26 (`nix-store -r` through `nix-modern`) on
/// the same edited narinfo: each is accepted or refused by both, but for one kept refusal;
/// sluice's refusals name the line. Where Nix would lose a field (a line ending at its `:`
/// swallows the next line), both refuse, sluice naming why. Kept: a `Sig` line ending in
/// `\r\n`, which Nix takes with the `\r` in the signature it stores.
#[test]
fn narinfo_rules_are_nix_226s() {
    /// A name, how the narinfo is changed, and whether Nix 2.26 and sluice accept it.
    type Variant = (&'static str, fn(String) -> String, bool, bool);
    let variants: [Variant; 8] = [
        ("empty-ca-twice", |s| s + "CA: \nCA: \n", true, true),
        ("size-with-plus", |s| s.replace("NarSize: 136", "NarSize: +136"), true, true),
        ("size-with-leading-zero", |s| s.replace("NarSize: 136", "NarSize: 0136"), true, true),
        ("crlf-unknown-field", |s| format!("X-Served-By: edge\r\n{s}"), true, true),
        ("empty-unknown-then-unknown", |s| format!("X-A:\nX-B: c\n{s}"), true, true),
        ("empty-unknown-then-url", |s| s.replace("URL: ", "X-A:\nURL: "), false, false),
        ("compression-without-space", |s| s.replace("Compression: none", "Compression:none"), false, false),
        ("crlf-sig", |s| s.replace("==\n", "==\r\n"), true, false),
    ];
    for (name, edit, nix_accepts, accepted) in variants {
        let tmp = tempfile::tempdir().unwrap();
        let cache = cache_copy(tmp.path(), "cache");
        let file = narinfo_file(&cache, OK);
        let text = edit(std::fs::read_to_string(&file).unwrap());
        std::fs::write(&file, &text).unwrap();
        let theirs = tmp.path().join("theirs");
        let n = nix_modern(
            tmp.path(),
            &[
                "nix-store",
                "--store",
                theirs.to_str().unwrap(),
                "-r",
                OK,
                "--option",
                "substituters",
                &file_url(&cache),
                "--option",
                "trusted-public-keys",
                &case_key(C02),
            ],
        );
        assert_eq!(n.status.success(), nix_accepts, "{name}: Nix 2.26 says {}", stderr(&n));
        let o = copy_with(tmp.path(), &tmp.path().join("ours"), &file_url(&cache), &case_key(C02), &[], &[OK]);
        assert_eq!(o.status.success(), accepted, "{name}: {}", stderr(&o));
        if !accepted {
            assert!(stderr(&o).contains("narinfo line "), "{name}: {}", stderr(&o));
        }
    }
}
