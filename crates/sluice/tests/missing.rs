//! `sluice missing` against the corpus truth of real Nix's dry runs, the narinfo disk cache
//! (a warm run sends no narinfo request), and the priority rule between substituters.

use crate::common::*;

fn truth(name: &str) -> String {
    std::fs::read_to_string(corpus().join("truth").join(name)).unwrap()
}

fn cache_url(name: &str) -> String {
    format!("file://{}", corpus().join(name).display())
}

#[test]
fn dry_run_of_an_empty_store_matches_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let o = sluice(tmp.path(), &["missing", "--store", root.to_str().unwrap(), "--substituters", &cache_url("cache-xz"), TOP]);
    check(&o, "sluice missing");
    assert_eq!(stderr(&o), truth("dry-run-empty-store.txt"));
}

#[test]
fn dry_run_of_a_partial_store_matches_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let present = truth("dry-run-partial-present.txt");
    let mut args = vec!["copy", "--from", "", "--to", root.to_str().unwrap(), "--no-check-sigs"];
    let url = cache_url("cache-xz");
    args[2] = &url;
    args.extend(present.lines());
    check(&sluice(tmp.path(), &args), "copy of the partial store");
    let o = sluice(tmp.path(), &["missing", "--store", root.to_str().unwrap(), "--substituters", &url, TOP]);
    check(&o, "sluice missing");
    assert_eq!(stderr(&o), truth("dry-run-partial-store.txt"));
}

#[test]
fn json_form_and_unknown_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let absent = "/nix/store/00000000000000000000000000000000-absent";
    let o = sluice(
        tmp.path(),
        &["missing", "--json", "--store", root.to_str().unwrap(), "--substituters", &cache_url("cache-xz"), TOP, absent],
    );
    check(&o, "sluice missing --json");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = truth("dry-run-empty-store.txt");
    let want: Vec<&str> = text.lines().skip(1).map(str::trim).collect();
    let got: Vec<&str> = v["willSubstitute"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(v["unknown"], serde_json::json!([absent]));
    let infos: Vec<serde_json::Value> = serde_json::from_str(&truth("path-info-cache-xz.json")).unwrap();
    let sum = |field: &str| infos.iter().map(|i| i[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!(v["narSize"].as_u64(), Some(sum("narSize")));
    assert_eq!(v["narSize"].as_u64(), Some(22848952), "summary.json's total NAR size");
    assert_eq!(v["downloadSize"].as_u64(), Some(sum("downloadSize")));
    // A malformed store path is an error naming it.
    let o = sluice(
        tmp.path(),
        &["missing", "--store", root.to_str().unwrap(), "--substituters", &cache_url("cache-xz"), "/nix/store/not-a-path"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/nix/store/not-a-path"), "{}", stderr(&o));
}

#[test]
fn warm_run_sends_no_narinfo_request() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-xz"), &tmp.path().join("srv"), &[]);
    let root = tmp.path().join("root");
    let args = ["missing", "--store", root.to_str().unwrap(), "--substituters", &server.url, TOP];
    check(&sluice(tmp.path(), &args), "cold run");
    assert_eq!(server.requests(".narinfo"), 1056, "cold: one request per narinfo");
    assert_eq!(server.requests("nix-cache-info"), 1);
    let o = sluice(tmp.path(), &args);
    check(&o, "warm run");
    assert_eq!(stderr(&o), truth("dry-run-empty-store.txt"));
    assert_eq!(server.requests(".narinfo"), 1056, "warm: no narinfo request");
    assert_eq!(server.requests("nix-cache-info"), 1, "warm: nix-cache-info from the disk cache");
}

#[test]
fn higher_priority_cache_wins_even_when_slower() {
    let tmp = tempfile::tempdir().unwrap();
    let subset = corpus().join("cache-subset-bzip2");
    let slow = CacheServer::start(&subset, &tmp.path().join("slow"), &["--rtt-ms", "60"]);
    let fast = CacheServer::start(&subset, &tmp.path().join("fast"), &[]);
    let summary: serde_json::Value = serde_json::from_str(&truth("summary.json")).unwrap();
    let top = summary["subsetRoot"].as_str().unwrap();
    let root = tmp.path().join("root");
    let subs = format!("{}?priority=60 {}?priority=10", fast.url, slow.url);
    let o =
        sluice(tmp.path(), &["copy", "--substituters", &subs, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), top]);
    check(&o, "copy from two caches");
    assert_eq!(slow.requests(".nar.bz2"), 25, "every NAR from the higher-priority cache");
    assert_eq!(fast.requests(".nar.bz2"), 0, "no NAR from the lower-priority cache");
    assert_nix_verifies(tmp.path(), &root);
}
