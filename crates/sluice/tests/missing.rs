//! `sluice missing` against the corpus truth of real Nix's dry runs, the narinfo disk cache
//! (a warm run sends no narinfo request), and the priority rule between substituters.

use std::collections::BTreeSet;

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

/// A cache that offers the batch endpoint and cuts its closure answer off after `lines` lines
/// (it announces the whole answer's length, sends part of it and closes), serving each
/// narinfo of `dir` too; it records the hash parts asked for one by one.
struct CutBatch {
    url: String,
    asked: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The hash parts of the lines it sends.
    sent: Vec<String>,
}

impl CutBatch {
    fn start(dir: &std::path::Path, root: &str, lines: usize) -> CutBatch {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let narinfo = |hash: &str| std::fs::read_to_string(dir.join(format!("{hash}.narinfo"))).ok();
        // The closure breadth first from the root, as `sluice serve` sends it.
        let (mut answer, mut order, mut queue) = (Vec::new(), Vec::new(), std::collections::VecDeque::from([root[11..43].to_string()]));
        let mut seen: BTreeSet<String> = queue.iter().cloned().collect();
        while let Some(hash) = queue.pop_front() {
            let text = narinfo(&hash).unwrap();
            let refs = text.lines().find_map(|l| l.strip_prefix("References:")).unwrap_or("");
            queue.extend(refs.split_whitespace().map(|r| r[..32].to_string()).filter(|h| seen.insert(h.clone())));
            answer.push(format!("{}\n", serde_json::json!({ "hash": hash, "narinfo": text })));
            order.push(hash);
        }
        let (whole, cut) = (answer.concat(), answer[..lines].concat());
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (log, dir) = (asked.clone(), dir.to_path_buf());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let (mut head, mut line) = (Vec::new(), String::new());
                while reader.read_line(&mut line).unwrap_or(0) > 2 {
                    head.push(std::mem::take(&mut line));
                }
                let Some(target) = head.first().and_then(|l| l.split_whitespace().nth(1)).map(str::to_string) else { continue };
                let length =
                    head.iter().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|n| n.trim().parse().unwrap()));
                let mut body = vec![0; length.unwrap_or(0)];
                let _ = reader.read_exact(&mut body);
                // The batch answer announces its whole length and sends the cut.
                let reply = |status: &str, length: usize, body: &str| {
                    format!("HTTP/1.1 {status}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n{body}")
                };
                let info = "StoreDir: /nix/store\nSluiceBatch: 1\nPriority: 40\n";
                let hash = target.strip_prefix('/').and_then(|t| t.strip_suffix(".narinfo"));
                let sent = match (target.as_str(), hash) {
                    ("/nix-cache-info", _) => reply("200 OK", info.len(), info),
                    ("/_sluice/v1/closure", _) => reply("200 OK", whole.len(), &cut),
                    (_, Some(hash)) => {
                        log.lock().unwrap().push(hash.to_string());
                        match std::fs::read_to_string(dir.join(format!("{hash}.narinfo"))) {
                            Ok(text) => reply("200 OK", text.len(), &text),
                            Err(_) => reply("404 Not Found", 0, ""),
                        }
                    }
                    _ => reply("404 Not Found", 0, ""),
                };
                let _ = stream.write_all(sent.as_bytes());
            }
        });
        CutBatch { url, asked, sent: order[..lines].to_vec() }
    }
}

/// A batch answer is used line by line as it arrives: when it is cut off midway, the paths
/// whose lines came are not asked for again (they were all asked one by one when the answer
/// was only used whole), and the query still finds the whole closure.
#[test]
fn a_cut_batch_answer_keeps_the_lines_that_came() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = CutBatch::start(&corpus().join("cache-xz"), TOP, 400);
    let root = tmp.path().join("root");
    let o = sluice(tmp.path(), &["missing", "--json", "--store", root.to_str().unwrap(), "--substituters", &cache.url, TOP]);
    check(&o, "sluice missing");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = truth("dry-run-empty-store.txt");
    let want: Vec<&str> = text.lines().skip(1).map(str::trim).collect();
    assert_eq!(v["willSubstitute"].as_array().unwrap().len(), want.len());
    assert_eq!(v["willSubstitute"], serde_json::json!(want));
    let asked: BTreeSet<String> = cache.asked.lock().unwrap().iter().cloned().collect();
    let again: Vec<&String> = cache.sent[1..].iter().filter(|h| asked.contains(*h)).collect();
    assert!(again.is_empty(), "{} paths whose lines came were asked for again: {again:?}", again.len());
    assert_eq!(asked.len(), want.len() - 400 + 1, "the root with nix-cache-info, and each path whose line did not come");
}
