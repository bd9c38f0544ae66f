//! Shared helpers for the integration tests: paths into `../shared`, running sluice and real
//! Nix 2.8 in isolated environments, and real nginx serving a cache (`shared/bin/cache-server`).
#![allow(dead_code)]

mod latency;
pub mod put_server;
mod scripted;
pub mod sshd;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sluice_local_store::is_temp_dir;

#[allow(unused_imports)]
pub use latency::LatencyProxy;
#[allow(unused_imports)]
pub use put_server::PutServer;
#[allow(unused_imports)]
pub use scripted::{closed_port, Scripted};

/// The read-only shared data directory next to the repository.
pub fn shared() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared");
    assert!(p.join("corpus").is_dir(), "expected the shared data at {}", p.display());
    p.canonicalize().unwrap()
}

/// The corpus directory.
pub fn corpus() -> PathBuf {
    shared().join("corpus")
}

/// The corpus's top-level store path.
pub const TOP: &str = "/nix/store/433r6hrfzj8vvazpcnl77q6m3lm3vw3g-nixos-system-nixos-23.05.20230726.b34b83f";

/// The corpus's public key.
pub fn corpus_key() -> String {
    std::fs::read_to_string(corpus().join("keys/cache-key.pub")).unwrap().trim().to_string()
}

/// A command environment without the caller's Nix configuration: its own HOME, cache and
/// config dirs under `tmp`, an empty `NIX_CONFIG` apart from `extra`, a default store
/// ([`default_store`]) and daemon socket ([`default_daemon_socket`]) under `tmp`, so that no
/// command can touch this machine's `/nix`, and the EC2 instance metadata service turned off
/// (`AWS_EC2_METADATA_DISABLED`).
pub fn isolate(cmd: &mut Command, tmp: &Path, extra: &str) {
    let home = tmp.join("home");
    std::fs::create_dir_all(&home).unwrap();
    cmd.env("HOME", &home)
        .env("XDG_CACHE_HOME", home.join(".cache"))
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("NIX_CONF_DIR", tmp.join("no-etc-nix"))
        .env("NIX_CONFIG", format!("substituters =\nexperimental-features = nix-command\n{extra}"))
        .env("NIX_REMOTE", default_store(tmp))
        .env("NIX_DAEMON_SOCKET_PATH", default_daemon_socket(tmp))
        // No test may ask this machine's instance metadata service for S3 credentials.
        .env("AWS_EC2_METADATA_DISABLED", "true");
}

/// The default store (`NIX_REMOTE`) a test's Nix commands get: a chroot store under `tmp`.
/// Nix opens its default store even when every store a command uses is given (`nix copy
/// --from A --to B`): without this, that is this machine's `/nix`.
pub fn default_store(tmp: &Path) -> String {
    format!("local?root={}", tmp.join("default-store").display())
}

/// The default daemon socket (`NIX_DAEMON_SOCKET_PATH`) of a test's commands, under `tmp`: a
/// daemon started without `--socket` binds it, and `daemon` connects to it, never this
/// machine's `/nix/var/nix/daemon-socket/socket`.
pub fn default_daemon_socket(tmp: &Path) -> PathBuf {
    tmp.join("default-daemon-socket")
}

/// `sluice ARGS` in an isolated environment under `tmp`.
pub fn sluice(tmp: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.args(args).output().unwrap()
}

/// `sluice ARGS` in an isolated environment under `tmp`, run by `sh` after the shell commands
/// `setup` (such as `umask 077 && ulimit -n 256`).
pub fn sluice_after(tmp: &Path, setup: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new("sh");
    isolate(&mut cmd, tmp, "");
    cmd.args(["-c", &format!("{setup} && exec \"$0\" \"$@\""), env!("CARGO_BIN_EXE_sluice")]).args(args).output().unwrap()
}

/// Real Nix 2.8's `PROG ARGS` in an isolated environment under `tmp`. Fails the test with a
/// clear message when Nix is not installed (CI installs Debian's nix-bin).
pub fn nix(tmp: &Path, prog: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new(prog);
    isolate(&mut cmd, tmp, "");
    cmd.args(args).output().unwrap_or_else(|e| panic!("cannot run {prog} (install Debian's nix-bin): {e}"))
}

/// Real Nix 2.26's `PROG ARGS` (`shared/bin/nix-modern`, which sees the host's /tmp only) in
/// an isolated environment under `tmp`, from `tmp`.
pub fn nix_modern(tmp: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(shared().join("bin/nix-modern"));
    isolate(&mut cmd, tmp, "");
    cmd.current_dir(tmp).args(args).output().unwrap()
}

/// A command that runs sluice (its arguments to be added) under GNU time, isolated in `tmp`,
/// which writes the peak RSS of the sluice process alone to `rss` ([`measured_rss`]). The
/// resource usage `wait4` gives for a child of the test process would not do: Linux keeps in
/// it the peak of the memory the child had before its `exec`, the test process's own, which is
/// hundreds of MiB when many tests run in it.
pub fn sluice_measured(tmp: &Path, rss: &Path) -> Command {
    let mut cmd = Command::new("/usr/bin/time");
    isolate(&mut cmd, tmp, "");
    cmd.args(["-f", "%M", "-o", rss.to_str().unwrap(), env!("CARGO_BIN_EXE_sluice")]);
    cmd
}

/// The peak RSS in KiB that a [`sluice_measured`] command wrote to `rss`.
pub fn measured_rss(rss: &Path) -> u64 {
    std::fs::read_to_string(rss).unwrap().lines().last().unwrap().trim().parse().unwrap()
}

/// Text of standard error, for assertions.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Panics with both output streams unless `o` succeeded.
pub fn check(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed ({}):\nstdout: {}\nstderr: {}", o.status, String::from_utf8_lossy(&o.stdout), stderr(o));
}

/// Asserts that real Nix finds the store at `root` clean: `nix-store --verify --check-contents`.
pub fn assert_nix_verifies(tmp: &Path, root: &Path) {
    let o = nix(tmp, "nix-store", &["--store", root.to_str().unwrap(), "--verify", "--check-contents"]);
    check(&o, "nix-store --verify --check-contents");
    let err = stderr(&o);
    for bad in ["error", "warning", "modified", "corrupt", "invalid", "missing"] {
        assert!(!err.to_lowercase().contains(bad), "nix-store --verify reported {bad:?}:\n{err}");
    }
}

/// `nix path-info --json -r` of real Nix, as a JSON array.
pub fn nix_path_info(tmp: &Path, store: &str, path: &str) -> Vec<serde_json::Value> {
    let o = nix(tmp, "nix", &["path-info", "--store", store, "--json", "-r", path]);
    check(&o, "nix path-info");
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Copies a directory tree (to make a writable copy of shared data).
pub fn copy_dir(from: &Path, to: &Path) {
    let o = Command::new("cp").arg("-a").arg(from).arg(to).output().unwrap();
    assert!(o.status.success(), "cp -a {} {}", from.display(), to.display());
}

/// Real nginx serving a cache directory through `shared/bin/cache-server`; stopped on drop.
pub struct CacheServer {
    pub url: String,
    pub access_log: PathBuf,
    port: u16,
    state: PathBuf,
}

impl CacheServer {
    /// Starts nginx on a free port with the given extra flags (`--http2`, `--tls`, `--rtt-ms N`).
    pub fn start(root: &Path, state: &Path, flags: &[&str]) -> CacheServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let o = Command::new(shared().join("bin/cache-server"))
            .args(["start", "--root", root.to_str().unwrap(), "--port", &port.to_string(), "--state-base", state.to_str().unwrap()])
            .args(flags)
            .output()
            .unwrap();
        check(&o, "cache-server start (needs nginx: install Debian's nginx-light)");
        let out = String::from_utf8_lossy(&o.stdout);
        let var = |k: &str| out.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).map(|v| v.trim_matches('\'').to_string());
        CacheServer {
            url: var("CACHE_URL").unwrap(),
            access_log: PathBuf::from(var("CACHE_ACCESS_LOG").unwrap()),
            port,
            state: state.to_path_buf(),
        }
    }

    /// Requests in the access log whose URI ends with `suffix`.
    pub fn requests(&self, suffix: &str) -> usize {
        let log = std::fs::read_to_string(&self.access_log).unwrap_or_default();
        log.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["uri"].as_str().is_some_and(|u| u.ends_with(suffix)))
            .count()
    }
}

impl Drop for CacheServer {
    fn drop(&mut self) {
        let _ = Command::new(shared().join("bin/cache-server"))
            .args(["stop", "--port", &self.port.to_string(), "--state-base", self.state.to_str().unwrap()])
            .output();
    }
}

/// A case's directory under `shared/cases`.
pub fn case_dir(case: &str) -> PathBuf {
    shared().join("cases").join(case)
}

/// `(variant, store path)` rows of a case's `paths.txt` (first and last columns).
pub fn case_paths(case: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(case_dir(case).join("paths.txt")).unwrap();
    text.lines()
        .filter(|l| l.contains("/nix/store/"))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let path = words.iter().find(|w| w.starts_with("/nix/store/")).unwrap();
            let variant = if words[0].starts_with("cache") { words[1] } else { words[0] };
            (variant.to_string(), path.to_string())
        })
        .collect()
}

/// The one key a case's paths are signed with.
pub fn case_key(case: &str) -> String {
    std::fs::read_to_string(case_dir(case).join("trusted-public-key.txt")).unwrap().trim().to_string()
}

/// Entries of the store directory under `root`.
pub fn store_entries(root: &Path) -> Vec<String> {
    match std::fs::read_dir(root.join("nix/store")) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    }
}

/// Asserts that `path` is neither registered nor present, and nothing temporary is left.
pub fn assert_absent(tmp: &Path, root: &Path, path: &str) {
    let base = path.trim_start_matches("/nix/store/");
    let entries = store_entries(root);
    assert!(!entries.iter().any(|e| e.contains(&base[..32])), "{path}: something was left in the store: {entries:?}");
    let o = nix(tmp, "nix-store", &["--store", root.to_str().unwrap(), "--check-validity", path]);
    assert!(!o.status.success(), "{path} is registered");
}

/// `sluice copy` of `paths` into the store under `root` from `substituters` (space-separated),
/// trusting `key`, with extra `--option NAME VALUE` pairs.
pub fn copy_with(tmp: &Path, root: &Path, substituters: &str, key: &str, options: &[(&str, &str)], paths: &[&str]) -> Output {
    let mut args = vec!["copy", "--substituters", substituters, "--to", root.to_str().unwrap(), "--trusted-public-keys", key];
    for (k, v) in options {
        args.extend(["--option", k, v]);
    }
    args.extend(paths);
    sluice(tmp, &args)
}

/// Entries of the store directory that a finished run must not leave: directories of
/// temporary trees (`sluice_local_store::is_temp_dir`), anything hidden except Nix's `.links`,
/// and `.lock` files.
pub fn store_leftovers(root: &Path) -> Vec<String> {
    store_entries(root).into_iter().filter(|e| (e.starts_with('.') && e != ".links") || e.ends_with(".lock") || is_temp_dir(e)).collect()
}

/// Asserts that the sluice command that just ended closed the store under `root`, before
/// anything else opens it: no temporary roots left, the database's write-ahead log
/// checkpointed and removed (the database was closed), nothing temporary in the store, and
/// no tree at a store path that is not registered.
pub fn assert_store_closed(root: &Path) {
    let state = root.join("nix/var/nix");
    let roots = std::fs::read_dir(state.join("temproots")).map_or(0, |d| d.count());
    assert_eq!(roots, 0, "temporary roots left");
    assert!(!state.join("db/db.sqlite-wal").exists(), "the database was not closed");
    assert_eq!(store_leftovers(root), Vec::<String>::new());
    let paths = registered_paths(root);
    let registered: std::collections::BTreeSet<&str> = paths.iter().filter_map(|p| p.rsplit('/').next()).collect();
    let unregistered: Vec<String> = store_entries(root)
        .into_iter()
        .filter(|e| !e.starts_with('.') && !e.ends_with(".lock") && !registered.contains(e.as_str()))
        .collect();
    assert_eq!(unregistered, Vec::<String>::new(), "trees at store paths that are not registered");
}

/// The paths registered in the store under `root` (its `ValidPaths` table), as `/nix/store/…`;
/// none without a database.
pub fn registered_paths(root: &Path) -> std::collections::BTreeSet<String> {
    let db = root.join("nix/var/nix/db/db.sqlite");
    if !db.exists() {
        return Default::default();
    }
    let script = "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); [print(p) for (p,) in c.execute('select path from ValidPaths')]";
    let o = Command::new("python3").args(["-c", script]).arg(&db).output().unwrap();
    check(&o, "reading ValidPaths");
    String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()
}

/// `(rows, distinct paths)` of the `ValidPaths` table of the store under `root`.
pub fn registered_rows(root: &Path) -> (u64, u64) {
    let db = root.join("nix/var/nix/db/db.sqlite");
    let script = "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); print(*c.execute('select count(*), count(distinct path) from ValidPaths').fetchone())";
    let o = Command::new("python3").args(["-c", script]).arg(&db).output().unwrap();
    check(&o, "reading ValidPaths");
    let text = String::from_utf8_lossy(&o.stdout);
    let mut n = text.split_whitespace().map(|w| w.parse().unwrap());
    (n.next().unwrap(), n.next().unwrap())
}

/// The store path of the corpus whose name ends with `-{name}` (from cache-xz's narinfos).
pub fn corpus_path(name: &str) -> String {
    let suffix = format!("-{name}");
    for e in std::fs::read_dir(corpus().join("cache-xz")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "narinfo") {
            let text = std::fs::read_to_string(&p).unwrap();
            if let Some(sp) = text.lines().find_map(|l| l.strip_prefix("StorePath: ")).filter(|sp| sp.ends_with(&suffix)) {
                return sp.to_string();
            }
        }
    }
    panic!("no corpus path named {name}");
}

/// An s3s-fs server on a free port over `dir` (with credentials `AKTEST`/`SKTEST` if `auth`).
pub struct S3Server {
    child: std::process::Child,
    pub port: u16,
}

impl S3Server {
    pub fn start(dir: &Path, auth: bool) -> Self {
        let bin = std::env::var_os("S3S_FS").map(PathBuf::from).or_else(|| {
            let cargo_bin = PathBuf::from(std::env::var_os("HOME")?).join(".cargo/bin/s3s-fs");
            cargo_bin.exists().then_some(cargo_bin)
        });
        let bin = bin.unwrap_or_else(|| PathBuf::from("s3s-fs"));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut cmd = Command::new(&bin);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        if auth {
            cmd.args(["--access-key", "AKTEST", "--secret-key", "SKTEST"]);
        }
        let child = cmd
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {} (cargo install s3s-fs --version 0.14.1 --features binary): {e}", bin.display()));
        // Held from the start, so that a server that never listens is stopped by the panic.
        let server = S3Server { child, port };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("s3s-fs did not start on port {port}");
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A narinfo of a cache directory, as the cache-maintenance tests read it.
pub struct CacheNarinfo {
    /// The hash part its file is named by.
    pub hash: String,
    pub store_path: String,
    /// Its NAR file, relative to the cache.
    pub url: String,
    /// Its references other than itself, as store paths.
    pub references: Vec<String>,
}

/// The narinfos of the cache directory `dir`.
pub fn cache_narinfos(dir: &Path) -> Vec<CacheNarinfo> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let Some(hash) = name.strip_suffix(".narinfo") else { continue };
        let text = std::fs::read_to_string(dir.join(&name)).unwrap();
        let field = |f: &str| text.lines().find_map(|l| l.strip_prefix(f)).unwrap_or("").to_string();
        let store_path = field("StorePath: ");
        let references = field("References: ").split_whitespace().map(|r| format!("/nix/store/{r}")).filter(|r| *r != store_path).collect();
        out.push(CacheNarinfo { hash: hash.to_string(), store_path, url: field("URL: "), references });
    }
    out
}
