//! Logging as Nix does it, compared with real Nix 2.8 and 2.26 (`nix-modern`) copying the same
//! closure from the same cache: `copying path 'X' from 'URL'...` lines equal to both's, and
//! `--log-format internal-json` read by a parser: every line `@nix ` and JSON, activities
//! started and stopped in pairs, and each kind of line with Nix 2.26's keys and values.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Output;

use crate::common::*;
use serde_json::{json, Value};

/// The subset cache's top-level path (a 25-path closure).
fn subset_top() -> String {
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    summary["subsetRoot"].as_str().unwrap().to_string()
}

/// A copy of the corpus's subset cache under `tmp` (where Nix 2.26 sees it), as a `file://` URL.
fn subset_cache(tmp: &Path) -> String {
    let dir = tmp.join("cache");
    copy_dir(&corpus().join("cache-subset-none"), &dir);
    format!("file://{}", dir.display())
}

/// Which Nix copies.
#[derive(Clone, Copy, Debug)]
enum Copier {
    Sluice,
    Nix28,
    Nix226,
}

/// `copier` copying `top`'s closure from `url` into a fresh chroot store under `tmp`, with
/// `flags` (log flags) after the command.
fn copy(copier: Copier, tmp: &Path, url: &str, top: &str, flags: &[&str]) -> Output {
    let to = tmp.join(format!("{copier:?}-{}", flags.join("")));
    let to = to.to_str().unwrap();
    let key = corpus_key();
    let o = match copier {
        Copier::Sluice => sluice(tmp, &[&["copy", "--from", url, "--to", to, "--trusted-public-keys", &key, top], flags].concat()),
        Copier::Nix28 => {
            nix(tmp, "nix", &[&["copy", "--from", url, "--to", to, "--option", "trusted-public-keys", &key, top], flags].concat())
        }
        Copier::Nix226 => {
            nix_modern(tmp, &[&["nix", "copy", "--from", url, "--to", to, "--option", "trusted-public-keys", &key, top], flags].concat())
        }
    };
    check(&o, &format!("{copier:?} copy {flags:?}"));
    o
}

/// The `copying path` lines of a standard error, as a set.
fn copying_lines(o: &Output) -> BTreeSet<String> {
    stderr(o).lines().filter(|l| l.starts_with("copying path ")).map(str::to_string).collect()
}

#[test]
fn piped_output_prints_the_copying_lines_real_nix_prints() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, top) = (subset_cache(tmp.path()), subset_top());
    let ours = copying_lines(&copy(Copier::Sluice, tmp.path(), &url, &top, &[]));
    for nix in [Copier::Nix28, Copier::Nix226] {
        let o = copy(nix, tmp.path(), &url, &top, &[]);
        let want = copying_lines(&o);
        assert_eq!(want.len(), 25, "{nix:?} prints a line per path:\n{}", stderr(&o));
        assert_eq!(ours, want, "{nix:?}");
        // Nix counts the missing paths first; sluice queries them while copying (docs/logging.md).
        assert!(stderr(&o).lines().any(|l| l == "copying 25 paths..."), "{nix:?}");
    }
    // --quiet drops them, as Nix's.
    let q = copy(Copier::Sluice, tmp.path(), &url, &top, &["--quiet"]);
    assert!(copying_lines(&q).is_empty(), "{}", stderr(&q));
}

/// The `@nix` lines of a standard error, parsed; fails on any other line.
fn json_lines(o: &Output) -> Vec<Value> {
    let text = stderr(o);
    text.lines()
        .filter(|l| !l.starts_with("warning: the group 'nixbld'"))
        .map(|l| serde_json::from_str(l.strip_prefix("@nix ").unwrap_or_else(|| panic!("not an @nix line: {l}"))).unwrap())
        .collect()
}

/// Checks that activities start once, stop once, and get results only while running; returns
/// each line's kind: `(action, activity type of its activity, result type)`.
fn kinds(lines: &[Value]) -> Vec<(String, u64, u64)> {
    let mut open: BTreeMap<u64, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for l in lines {
        let action = l["action"].as_str().unwrap().to_string();
        let id = l["id"].as_u64();
        let (act, res) = match action.as_str() {
            "start" => {
                assert!(open.insert(id.unwrap(), l["type"].as_u64().unwrap()).is_none(), "started twice: {l}");
                (l["type"].as_u64().unwrap(), 0)
            }
            "stop" => (open.remove(&id.unwrap()).unwrap_or_else(|| panic!("stop without start: {l}")), 0),
            "result" => {
                (*open.get(&id.unwrap()).unwrap_or_else(|| panic!("result of no running activity: {l}")), l["type"].as_u64().unwrap())
            }
            "msg" => (0, 0),
            a => panic!("action {a}"),
        };
        out.push((action, act, res));
    }
    assert!(open.is_empty(), "activities never stopped: {open:?}");
    out
}

/// Each kind of line with its set of keys.
fn keys_by_kind(lines: &[Value]) -> BTreeMap<(String, u64, u64), BTreeSet<String>> {
    kinds(lines).into_iter().zip(lines).map(|(k, l)| (k, l.as_object().unwrap().keys().cloned().collect())).collect()
}

/// The lines of `action` for activity type `act` (result type `res`), in order.
fn of_kind<'a>(lines: &'a [Value], kind: (&str, u64, u64)) -> Vec<&'a Value> {
    kinds(lines).into_iter().zip(lines).filter(|((a, t, r), _)| (a.as_str(), *t, *r) == kind).map(|(_, l)| l).collect()
}

/// A line without its activity id (which carries the process id), as text with sorted keys.
fn without_id(l: &Value) -> String {
    let mut l = l.as_object().unwrap().clone();
    l.remove("id");
    l.sort_keys();
    Value::Object(l).to_string()
}

#[test]
fn internal_json_is_nix_226s_activity_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, top) = (subset_cache(tmp.path()), subset_top());
    let flags = ["--log-format", "internal-json", "-v"];
    let ours = copy(Copier::Sluice, tmp.path(), &url, &top, &flags);
    let ours = json_lines(&ours);
    let pid = ours.iter().find_map(|l| l["id"].as_u64()).unwrap() >> 32;
    assert!(ours.iter().filter_map(|l| l["id"].as_u64()).all(|id| id >> 32 == pid), "ids carry the pid, as Nix's");
    let nix226 = json_lines(&copy(Copier::Nix226, tmp.path(), &url, &top, &flags));
    let nix28 = json_lines(&copy(Copier::Nix28, tmp.path(), &url, &top, &flags));
    // Every kind of line sluice writes has Nix 2.26's keys; Nix 2.8's lack only `parent`.
    let (k226, k28) = (keys_by_kind(&nix226), keys_by_kind(&nix28));
    let mut compared = 0;
    for (kind, keys) in keys_by_kind(&ours) {
        if kind.0 == "msg" {
            continue;
        }
        assert_eq!(Some(&keys), k226.get(&kind), "keys of {kind:?}");
        if let Some(k) = k28.get(&kind) {
            assert_eq!(
                keys.difference(k).collect::<Vec<_>>(),
                if kind.0 == "start" { vec!["parent"] } else { vec![] },
                "{kind:?} against Nix 2.8"
            );
        }
        compared += 1;
    }
    // start/stop of actCopyPaths and actCopyPath, resProgress of both, resSetExpected.
    assert_eq!(compared, 7);
    // One actCopyPath per path, each line equal to Nix 2.26's but for the id (text, level 3,
    // parent 0, fields [path, from, "local"]), and to Nix 2.8's but for its parent.
    let copy_paths = |lines: &[Value]| of_kind(lines, ("start", 100, 0)).into_iter().map(without_id).collect::<BTreeSet<_>>();
    let mine = copy_paths(&ours);
    assert_eq!(mine.len(), 25);
    assert_eq!(mine, copy_paths(&nix226));
    let with_parent = of_kind(&nix28, ("start", 100, 0))
        .into_iter()
        .map(|l| without_id(&json!({"parent": 0}).as_object().unwrap().clone().into_iter().chain(l.as_object().unwrap().clone()).collect()))
        .collect::<BTreeSet<_>>();
    assert_eq!(mine, with_parent);
    // The copy: one actCopyPaths at level 3 (Nix's text names the count it knows up front).
    let top_activity = |lines: &[Value]| -> Vec<String> {
        of_kind(lines, ("start", 103, 0)).into_iter().filter(|l| l["level"] == 3).map(without_id).collect()
    };
    assert_eq!(top_activity(&ours), [r#"{"action":"start","level":3,"parent":0,"text":"copying paths","type":103}"#]);
    assert_eq!(top_activity(&nix226), [r#"{"action":"start","level":3,"parent":0,"text":"copying 25 paths","type":103}"#]);
    // Its last resSetExpected (NAR bytes of the actCopyPath activities) and resProgress
    // ([done, expected, running, failed]) are Nix 2.26's.
    for res in [106, 105] {
        let last = |lines: &[Value]| of_kind(lines, ("result", 103, res)).last().map(|l| l["fields"].clone());
        assert_eq!(last(&ours), last(&nix226), "result {res}");
    }
    assert_eq!(of_kind(&nix226, ("result", 103, 106)).last().unwrap()["fields"], json!([100, 567216]));
    // Each actCopyPath's progress is [bytes, NAR size, 0, 0], the NAR size Nix 2.26 expects.
    let expected = |lines: &[Value]| -> BTreeSet<u64> {
        of_kind(lines, ("result", 100, 105)).iter().map(|l| l["fields"][1].as_u64().unwrap()).collect()
    };
    assert!(expected(&nix226).is_subset(&expected(&ours)), "{:?} {:?}", expected(&nix226), expected(&ours));
    for l in of_kind(&ours, ("result", 100, 105)) {
        let f = l["fields"].as_array().unwrap();
        assert_eq!((f.len(), &f[2], &f[3]), (4, &json!(0), &json!(0)), "{l}");
    }
}

/// An error in JSON is Nix 2.26's `logEI` line: level 0, `msg` and `raw_msg`, null position.
#[test]
fn internal_json_errors_are_nix_226s() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, top) = (format!("file://{}", tmp.path().join("no-cache").display()), subset_top());
    let to = tmp.path().join("root");
    let args = ["copy", "--log-format", "internal-json", "--from", &url, "--to", to.to_str().unwrap(), &top];
    let ours = sluice(tmp.path(), &args);
    assert!(!ours.status.success());
    let theirs = nix_modern(tmp.path(), &[&["nix"][..], &args].concat());
    assert!(!theirs.status.success());
    let error = |o: &Output| -> Value {
        json_lines(o).into_iter().rfind(|l| l["action"] == "msg" && l["level"] == 0).unwrap_or_else(|| panic!("no error: {}", stderr(o)))
    };
    let (mine, nix) = (error(&ours), error(&theirs));
    let keys = |l: &Value| l.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&mine), keys(&nix));
    for k in ["column", "file", "line"] {
        assert_eq!(mine[k], Value::Null);
    }
    assert_eq!(mine["msg"].as_str().unwrap(), format!("error: {}", mine["raw_msg"].as_str().unwrap()));
    assert!(mine["raw_msg"].as_str().unwrap().contains(&top), "{mine}");
}

/// `sluice copy` of the corpus closure (1056 paths) from nginx at RTT 100 ms, in a real
/// terminal: a tmux pane 80 columns wide, captured every 250 ms. While it runs the pane shows
/// one progress line (never wrapped, at most 79 columns) of the form `[done/running/known
/// paths] X of Y DL…`, with done ≤ known and done never going back; at the end the line is
/// gone and the summary is there. A second copy gets Ctrl-C: the line stays, ending in
/// `interrupted`, and Nix's `error: interrupted by the user` follows.
#[test]
fn progress_line_in_a_real_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-xz"), &tmp.path().join("srv"), &["--rtt-ms", "100"]);
    let server_of_panes = Tmux(tmp.path().join("tmux.sock"));
    let tmux = |args: &[&str]| server_of_panes.run(args);
    // The pane's command: sluice in the isolated environment, then a pause keeping the pane.
    let run = |name: &str| {
        let mut env = std::process::Command::new("true");
        isolate(&mut env, tmp.path(), "");
        let vars: String = env.get_envs().map(|(k, v)| format!("{}='{}' ", k.to_str().unwrap(), v.unwrap().to_str().unwrap())).collect();
        let to = tmp.path().join(name);
        format!(
            "env {vars}{} copy --from {} --to {} --trusted-public-keys '{}' {TOP}; sleep 600",
            env!("CARGO_BIN_EXE_sluice"),
            server.url,
            to.display(),
            corpus_key()
        )
    };
    let pane = |session: &str| {
        String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", session]).stdout)
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // [done/running/known paths…] of a progress line.
    let counts = |line: &str| -> Option<(u64, u64, u64)> {
        let inner = line.strip_prefix('[')?.split(" paths").next()?;
        let n: Vec<u64> = inner.split('/').map(|x| x.parse().ok()).collect::<Option<_>>()?;
        (n.len() == 3 && line.contains("] ") && line.contains(" DL")).then(|| (n[0], n[1], n[2]))
    };
    check(&tmux(&["new-session", "-d", "-s", "copy", "-x", "80", "-y", "10", &run("s1")]), "tmux new-session");
    let started = std::time::Instant::now();
    let (mut seen, mut last_done, mut summary) = (0, 0, None);
    while started.elapsed() < std::time::Duration::from_secs(300) {
        let lines = pane("copy");
        if let Some(done) = lines.iter().find(|l| l.starts_with("copied ")) {
            assert!(!lines.iter().any(|l| l.starts_with('[')), "the line is cleared at the end: {lines:?}");
            summary = Some(done.clone());
            break;
        }
        if !lines.is_empty() {
            assert_eq!(lines.len(), 1, "one line, not wrapped: {lines:?}");
            assert!(lines[0].chars().count() <= 79, "{:?}", lines[0]);
            let (done, running, known) = counts(&lines[0]).unwrap_or_else(|| panic!("not a progress line: {:?}", lines[0]));
            assert!(done + running <= known && done >= last_done, "{:?} after done = {last_done}", lines[0]);
            last_done = done;
            seen += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    // The summary fits the 80 columns too (it was 86 characters and wrapped).
    assert!(summary.as_deref().is_some_and(|s| s.starts_with("copied 1056 paths (") && s.chars().count() <= 80), "{summary:?}");
    assert!(seen >= 3, "the line was seen at {seen} moments");
    // Ctrl-C once the line shows progress.
    check(&tmux(&["new-session", "-d", "-s", "stop", "-x", "80", "-y", "10", &run("s2")]), "tmux new-session");
    while pane("stop").first().and_then(|l| counts(l)).is_none_or(|(done, _, _)| done == 0) {
        assert!(started.elapsed() < std::time::Duration::from_secs(600), "{:?}", pane("stop"));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    check(&tmux(&["send-keys", "-t", "stop", "C-c"]), "tmux send-keys");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !pane("stop").iter().any(|l| l == "error: interrupted by the user") {
        assert!(std::time::Instant::now() < deadline, "{:?}", pane("stop"));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let lines = pane("stop");
    let line = lines.iter().rev().find(|l| l.starts_with('[')).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(line.ends_with(" interrupted") && line.chars().count() <= 79 && counts(line).is_some(), "{lines:?}");
}

/// A tmux server of the test's own (its socket), ended with the test.
struct Tmux(std::path::PathBuf);

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        std::process::Command::new("tmux").arg("-S").arg(&self.0).args(args).output().unwrap()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        self.run(&["kill-server"]);
    }
}

/// `-vv` shows sluice's own debug lines (each HTTP request it made), not the HTTP library's;
/// those come at Nix's `vomit` level, `-vvvv`. Regression: `-vv` printed mostly hyper's
/// connection-pool lines (`pooling idle connection`, `reuse idle connection`).
#[test]
fn debug_lines_are_sluices_own_until_vomit() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-subset-none"), &tmp.path().join("srv"), &[]);
    let top = subset_top();
    for (flag, libraries) in [("-vv", false), ("-vvvv", true)] {
        // A home of its own: no narinfo in the disk cache from the run before.
        let run = tmp.path().join(flag);
        std::fs::create_dir(&run).unwrap();
        let o = copy(Copier::Sluice, &run, &server.url, &top, &[flag]);
        let err = stderr(&o);
        let requests = err.lines().filter(|l| l.starts_with("DEBUG request method=GET")).count();
        // The cache's nix-cache-info, a narinfo and a NAR per path.
        assert_eq!(requests, 1 + 2 * 25, "{flag}: sluice's request lines\n{err}");
        assert_eq!(err.contains("idle connection"), libraries, "{flag}: the HTTP library's lines\n{err}");
    }
}

/// A copy's standard error read through a pipe: with each line one `write` (as before), every
/// line of the subset's 25 woke the reader (26 writes with the summary); now the copy's lines
/// come in a few writes (counted by `strace`), and then the summary, all of them.
#[test]
fn piped_lines_are_written_together() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, top) = (subset_cache(tmp.path()), subset_top());
    let trace = tmp.path().join("writes");
    let to = tmp.path().join("store");
    let mut cmd = std::process::Command::new("strace");
    isolate(&mut cmd, tmp.path(), "");
    cmd.args(["-f", "-qq", "-e", "trace=write,writev", "-e", "signal=none", "-o", trace.to_str().unwrap(), env!("CARGO_BIN_EXE_sluice")]);
    let o = cmd
        .args(["copy", "--from", &url, "--to", to.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &top])
        .output()
        .expect("strace runs (CI installs it)");
    check(&o, "copy under strace");
    let err = stderr(&o);
    assert_eq!(copying_lines(&o).len(), 25, "{err}");
    assert!(err.lines().last().unwrap().starts_with("copied 25 paths"), "{err}");
    let writes = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|call| call.starts_with("write(2,") || call.starts_with("writev(2,")))
        .count();
    // A write every 50 ms at most, then the summary's: a copy slowed by strace on a busy
    // machine takes a few windows more, far from a write per line.
    assert!((1..=10).contains(&writes), "{writes} writes to standard error:\n{err}");
}

/// A copy of the subset's closure from a cache that sends the top path's NAR only after
/// `delay` seconds, started with its standard error piped, into `tmp/store`; the server is
/// returned with the child, to live as long as it.
fn copy_waiting_for_the_top(tmp: &Path, delay: u64) -> (Scripted, std::process::Child) {
    let (dir, top) = (tmp.join("cache"), subset_top());
    subset_cache(tmp);
    let hash = top.trim_start_matches("/nix/store/").split('-').next().unwrap();
    let narinfo = std::fs::read_to_string(dir.join(format!("{hash}.narinfo"))).unwrap();
    let nar = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap();
    let rules = tmp.join("rules.json");
    std::fs::write(&rules, json!([{"path": format!("/{nar}"), "delay": delay}]).to_string()).unwrap();
    let server = Scripted::start(&dir, Some(&rules), 0, &tmp.join("log"));
    let to = tmp.join("store");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.args(["copy", "--from", &server.url, "--to", to.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &top]);
    let child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    (server, child)
}

/// Lines gathered are late by at most 50 ms: while the subset's top path waits for its NAR,
/// which the cache sends after 3 s, the `copying path` lines of the others are in the pipe.
#[test]
fn gathered_lines_are_written_while_the_copy_waits() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let (_server, mut child) = copy_waiting_for_the_top(tmp.path(), 3);
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let seen = started.elapsed();
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(child.wait().unwrap().success(), "{first}\n{rest:?}");
    let ended = started.elapsed();
    let top = subset_top();
    assert!(first.starts_with("copying path '") && !first.contains(&top), "{first}");
    assert!(rest.iter().any(|l| l.contains(&top)), "{rest:?}");
    assert!(
        ended >= std::time::Duration::from_secs(3) && seen + std::time::Duration::from_secs(2) < ended,
        "first line at {seen:?}, end at {ended:?}"
    );
}

/// SIGTERM and SIGHUP end a copy as Ctrl-C does, as Nix treats all three
/// (`src/libutil/unix/signals.cc`): it exits with status 1 after `error: interrupted by the
/// user`, and every path it registered has its `copying path` line. Regression: SIGTERM
/// killed it, and the lines gathered in its last 50 ms were lost with it.
#[test]
fn sigterm_and_sighup_interrupt_a_copy() {
    use std::io::BufRead;
    for signal in ["TERM", "HUP"] {
        let tmp = tempfile::tempdir().unwrap();
        let (_server, mut child) = copy_waiting_for_the_top(tmp.path(), 30);
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().unwrap().unwrap();
        // The other paths are registered while the top one waits for its NAR.
        std::thread::sleep(std::time::Duration::from_millis(500));
        check(&std::process::Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).output().unwrap(), "kill");
        let rest: Vec<String> = std::iter::once(first).chain(lines.map(Result::unwrap)).collect();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(1), "SIG{signal}: {status:?}\n{rest:#?}");
        assert_eq!(rest.last().map(String::as_str), Some("error: interrupted by the user"), "SIG{signal}: {rest:#?}");
        let copying = rest.iter().filter(|l| l.starts_with("copying path ")).count() as u64;
        let (registered, _) = registered_rows(&tmp.path().join("store"));
        assert!(registered > 0 && copying >= registered, "SIG{signal}: {registered} registered, {copying} lines: {rest:#?}");
    }
}

/// Once the copy is done, SIGTERM ends it as before it started, even while its `--json`
/// report waits on a pipe nobody reads (shrunk to a page, so that the corpus's report fills
/// it), and the store is closed by then. Regressions: the copy's handler stayed installed and
/// swallowed SIGTERM, only SIGKILL ended the process; the store was closed only after the
/// report, so SIGTERM there left the database's write-ahead log and the temporary roots.
#[test]
fn sigterm_ends_a_copy_whose_report_waits() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("store");
    let url = format!("file://{}", corpus().join("cache-zstd").display());
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp.path(), "");
    cmd.args(["copy", "--json", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP]);
    let mut child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    // SAFETY: resizing the pipe this process holds the read end of.
    #[allow(unsafe_code)] // a libc call the test drives processes or files with
    let r = unsafe { libc::fcntl(stdout.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(r > 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !root.join("nix/var/nix/db/db.sqlite").exists() || registered_rows(&root).0 < 1056 {
        assert!(std::time::Instant::now() < deadline, "the copy did not finish");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The report is written after the last registration; give it time to fill the pipe.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "the report did not wait on the pipe");
    check(&std::process::Command::new("kill").arg("-TERM").arg(child.id().to_string()).output().unwrap(), "kill");
    let ended = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > ended {
            child.kill().unwrap();
            panic!("SIGTERM did not end a copy waiting on its report");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    drop(stdout);
    // The store was closed before the report was written.
    assert_store_closed(&root);
}

/// With `--json` and both streams in one pipe (`2>&1`), a failing copy's lines come in the
/// order they were made: the copy's lines and its errors, then the JSON report, then the
/// summary. Regression: the errors waited in the gathered lines while the report went out.
#[test]
fn errors_come_before_the_json_report_in_one_pipe() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, top) = (subset_cache(tmp.path()), subset_top());
    // A leaf the top path refers to (and so its referrers) cannot be substituted.
    let dir = tmp.path().join("cache");
    let leaf = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| std::fs::read_to_string(p).is_ok_and(|t| t.lines().any(|l| l == "References: ") && t.contains("StorePath: ")));
    let leaf = leaf.unwrap_or_else(|| panic!("no narinfo without references in {}", dir.display()));
    std::fs::remove_file(&leaf).unwrap();
    let to = tmp.path().join("store");
    let mut cmd = std::process::Command::new("sh");
    isolate(&mut cmd, tmp.path(), "");
    cmd.args([
        "-c",
        "exec \"$0\" \"$@\" 2>&1",
        env!("CARGO_BIN_EXE_sluice"),
        "copy",
        "--json",
        "--from",
        &url,
        "--to",
        to.to_str().unwrap(),
        "--trusted-public-keys",
        &corpus_key(),
        &top,
    ]);
    let o = cmd.output().unwrap();
    assert!(!o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().collect();
    let at = |pred: &dyn Fn(&str) -> bool| lines.iter().position(|l| pred(l)).unwrap_or_else(|| panic!("{out}"));
    let (json, last_error, summary) = (
        at(&|l| l.starts_with('{')),
        lines.iter().rposition(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("{out}")),
        at(&|l| l.starts_with("copied ")),
    );
    assert!(last_error < json && json < summary, "{out}");
}
