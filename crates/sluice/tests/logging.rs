//! Logging as Nix does it: `copying path 'X' from 'URL'...` lines equal to real Nix 2.8's for
//! the same copy, and `--log-format internal-json` read by a parser (every line `@nix ` and
//! JSON, activities started and stopped in pairs, Nix's activity and result types).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use serde_json::Value;

/// The 25-path closure of the corpus's subset cache, and that cache's `file://` URL.
fn subset() -> (String, String) {
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let url = format!("file://{}", corpus().join("cache-subset-none").display());
    (summary["subsetRoot"].as_str().unwrap().to_string(), url)
}

/// The `copying path` lines of a standard error, as a set.
fn copying_lines(o: &std::process::Output) -> BTreeSet<String> {
    stderr(o).lines().filter(|l| l.starts_with("copying path ")).map(str::to_string).collect()
}

#[test]
fn piped_output_prints_the_copying_lines_real_nix_prints() {
    let (top, url) = subset();
    let key = corpus_key();
    let tmp = tempfile::tempdir().unwrap();
    let (ours, theirs) = (tmp.path().join("ours"), tmp.path().join("theirs"));
    let o = sluice(tmp.path(), &["copy", "--from", &url, "--to", ours.to_str().unwrap(), "--trusted-public-keys", &key, &top]);
    check(&o, "sluice copy");
    let n = nix(tmp.path(), "nix", &["copy", "--from", &url, "--to", theirs.to_str().unwrap(), "--option", "trusted-public-keys", &key, &top]);
    check(&n, "nix copy");
    let want = copying_lines(&n);
    assert_eq!(want.len(), 25, "Nix 2.8 prints a line per path:\n{}", stderr(&n));
    assert_eq!(copying_lines(&o), want);
    // --quiet drops them, as Nix's.
    let quiet = tempfile::tempdir().unwrap();
    let q = sluice(quiet.path(), &["copy", "--quiet", "--from", &url, "--to", quiet.path().join("s").to_str().unwrap(), "--trusted-public-keys", &key, &top]);
    check(&q, "sluice copy --quiet");
    assert!(copying_lines(&q).is_empty(), "{}", stderr(&q));
}

#[test]
fn internal_json_is_nix_activity_lines() {
    let (top, url) = subset();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let o = sluice(tmp.path(), &["copy", "--log-format", "internal-json", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &top]);
    check(&o, "sluice copy --log-format internal-json");
    let mut open: BTreeMap<u64, Value> = BTreeMap::new();
    let (mut copy_paths, mut copy_path, mut last_progress) = (0, 0, None);
    for line in stderr(&o).lines() {
        let json: Value = serde_json::from_str(line.strip_prefix("@nix ").unwrap_or_else(|| panic!("not an @nix line: {line}"))).unwrap();
        match json["action"].as_str().unwrap() {
            "start" => {
                let id = json["id"].as_u64().unwrap();
                assert_eq!(id >> 32, u64::from(o_pid(&json)), "ids carry a pid, as Nix's");
                match json["type"].as_u64().unwrap() {
                    103 => copy_paths += 1,
                    100 => {
                        copy_path += 1;
                        let f = json["fields"].as_array().unwrap();
                        assert_eq!(json["level"], 3);
                        assert_eq!(f[1], url.as_str());
                        assert_eq!(f[2], root.to_str().unwrap());
                        assert_eq!(json["text"], format!("copying path '{}' from '{url}'", f[0].as_str().unwrap()));
                        assert!(open.contains_key(&json["parent"].as_u64().unwrap()), "the parent is the running actCopyPaths");
                    }
                    t => panic!("activity type {t}"),
                }
                assert!(open.insert(id, json).is_none(), "id started twice");
            }
            "stop" => assert!(open.remove(&json["id"].as_u64().unwrap()).is_some(), "stop without start: {line}"),
            "result" => {
                assert!(open.contains_key(&json["id"].as_u64().unwrap()), "result of no running activity: {line}");
                if json["type"] == 105 && open[&json["id"].as_u64().unwrap()]["type"] == 103 {
                    last_progress = Some(json["fields"].clone());
                }
            }
            "msg" => assert!(json["msg"].is_string() && json["level"].is_u64()),
            a => panic!("action {a}"),
        }
    }
    assert!(open.is_empty(), "activities never stopped: {open:?}");
    assert_eq!((copy_paths, copy_path), (1, 25));
    // [done, expected, running, failed]
    assert_eq!(last_progress, Some(serde_json::json!([25, 25, 0, 0])));
}

/// The process id in an activity id's upper half (the run's pid is not known to the test; every
/// id of a run has the same).
fn o_pid(json: &Value) -> u32 {
    static PID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *PID.get_or_init(|| (json["id"].as_u64().unwrap() >> 32) as u32)
}
