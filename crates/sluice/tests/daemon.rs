//! `sluice daemon` against real Nix 2.8 clients (`nix-store`, `nix`, `nix-instantiate` with
//! `--store unix://…`), their outputs compared with the same commands in direct mode on a
//! store prepared identically; and the worker-protocol handshake driver of case 19. These
//! tests need Nix on `PATH` and fail (never skip) without it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;

pub(crate) const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared");

pub(crate) fn sluice() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

pub(crate) fn cache_key() -> String {
    std::fs::read_to_string(format!("{SHARED}/corpus/keys/cache-key.pub")).expect("corpus signing key").trim().to_owned()
}

/// An isolated environment for Nix and the daemon: HOME, caches, an empty NIX_CONF_DIR.
pub(crate) struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    pub(crate) fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        for d in ["home", "conf", "cache"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        let env = Env { dir };
        // Even `nix-store --version` opens the default store: it must be the chroot one.
        let out = env.cmd("nix-store").arg("--version").output().expect("nix-store not found on PATH: these tests need real Nix 2.8");
        assert!(out.status.success(), "nix-store --version failed: {out:?}");
        env
    }

    pub(crate) fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// A command with Nix's environment isolated.
    pub(crate) fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("HOME", self.path("home"))
            .env("XDG_CACHE_HOME", self.path("cache"))
            .env("NIX_CONF_DIR", self.path("conf"))
            .env("NIX_CONFIG", "substituters =\nexperimental-features = nix-command")
            .env("NIX_REMOTE", format!("local?root={}", self.path("default-store").display()))
            .env("NIX_DAEMON_SOCKET_PATH", common::default_daemon_socket(self.dir.path()));
        c
    }

    /// Runs a Nix command; panics with its stderr unless it succeeds. Returns stdout.
    pub(crate) fn nix(&self, program: &str, args: &[&str]) -> String {
        let out = self.cmd(program).args(args).output().unwrap();
        assert!(out.status.success(), "{program} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Copies the bzip2 corpus cache subset (a closed set of paths) to a temporary cache.
    pub(crate) fn cache(&self) -> String {
        let dest = self.path("bin-cache");
        let ok = Command::new("cp").arg("-r").arg(format!("{SHARED}/corpus/cache-subset-bzip2")).arg(&dest).status().unwrap();
        assert!(ok.success());
        format!("file://{}", dest.display())
    }

    /// Starts `sluice daemon` on `<tmp>/socket` for the store at `<tmp>/<root>`, with the
    /// corpus cache as its substituter and `extra_config` lines.
    pub(crate) fn daemon(&self, root: &str, cache: &str, extra_config: &str) -> Daemon {
        self.daemon_on("socket", root, cache, extra_config, &[], None)
    }

    /// [`Env::daemon`], with its limit on open files (soft and hard, as `ulimit -n` sets
    /// them) lowered to `open_files` if given.
    fn daemon_limited(&self, root: &str, cache: &str, extra_config: &str, open_files: Option<u64>) -> Daemon {
        self.daemon_on("socket", root, cache, extra_config, &[], open_files)
    }

    /// [`Env::daemon_limited`] on `<tmp>/<socket>`, with more arguments `args`.
    fn daemon_on(&self, socket: &str, root: &str, cache: &str, extra_config: &str, args: &[&str], open_files: Option<u64>) -> Daemon {
        let socket = self.path(socket);
        let mut cmd = self.daemon_command(&socket, root, cache, extra_config);
        cmd.args(args);
        if let Some(n) = open_files {
            let limit = libc::rlimit { rlim_cur: n, rlim_max: n };
            // SAFETY: the closure only calls setrlimit, which is async-signal-safe.
            #[allow(unsafe_code)] // a libc call the test drives processes or files with
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                });
            }
        }
        wait_for_socket(cmd.spawn().unwrap(), &socket)
    }

    /// The command that starts `sluice daemon` on `socket` for the store at `<tmp>/<root>`,
    /// with `substituters`, the corpus key trusted and `extra_config` lines (to be started
    /// with [`wait_for_socket`]).
    pub(crate) fn daemon_command(&self, socket: &Path, root: &str, substituters: &str, extra_config: &str) -> Command {
        let config = format!("substituters = {substituters}\ntrusted-public-keys = {}\n{extra_config}", cache_key());
        let mut cmd = self.cmd(sluice());
        cmd.env("NIX_CONFIG", config).args(["daemon", "--socket"]).arg(socket).arg("--store").arg(self.path(root)).stderr(Stdio::null());
        cmd
    }

    /// Starts Nix 2.8's `nix-daemon` on `<tmp>/<socket>` for the store at `<tmp>/<root>`, with
    /// `nix_conf` as its whole configuration (its own `NIX_CONF_DIR`, `<tmp>/<socket>-conf`).
    ///
    /// The daemon runs in a mount namespace of its own in which this machine's `/nix` is
    /// `<tmp>/<socket>-host-nix`: Nix 2.8 moves a failed build's outputs out of its build
    /// chroot to their logical path (`/nix/store/…`, not the chroot store's real directory:
    /// `LocalDerivationGoal::buildDone`, "Move paths out of the chroot for easier debugging"),
    /// which without this is the machine's real store. (Without a `/nix`, there is none to keep.)
    pub(crate) fn nix_daemon(&self, socket: &str, root: &str, nix_conf: &str) -> Daemon {
        let conf = self.path(&format!("{socket}-conf"));
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::write(conf.join("nix.conf"), nix_conf).unwrap();
        let host_nix = self.path(&format!("{socket}-host-nix"));
        std::fs::create_dir_all(host_nix.join("store")).unwrap();
        let socket = self.path(socket);
        let mut cmd = self.cmd("unshare");
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "{ [ ! -e /nix ] || mount --bind \"$0\" /nix; } && exec nix-daemon \"$@\"",
        ])
        .arg(&host_nix);
        cmd.env_remove("NIX_CONFIG")
            .env("NIX_CONF_DIR", &conf)
            .env("NIX_DAEMON_SOCKET_PATH", &socket)
            .arg("--store")
            .arg(self.path(root))
            .stderr(Stdio::null());
        wait_for_socket(cmd.spawn().unwrap(), &socket)
    }

    /// The corpus bzip2 subset cache ([`Env::cache`]) with, from the corpus's `cache-drv`,
    /// the closure of the derivation `drv` (a base name) added.
    fn cache_with_derivation(&self, drv: &str) -> String {
        let cache = self.cache();
        let (from, to) = (PathBuf::from(format!("{SHARED}/corpus/cache-drv")), self.path("bin-cache"));
        let mut todo = vec![drv.to_owned()];
        let mut seen = std::collections::BTreeSet::new();
        while let Some(name) = todo.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let narinfo = format!("{}.narinfo", &name[..32]);
            let text = std::fs::read_to_string(from.join(&narinfo)).unwrap();
            let field = |f: &str| text.lines().find_map(|l| l.strip_prefix(f)).unwrap_or_default().to_owned();
            std::fs::copy(from.join(&narinfo), to.join(&narinfo)).unwrap();
            let url = field("URL: ");
            std::fs::copy(from.join(&url), to.join(&url)).unwrap();
            todo.extend(field("References: ").split_whitespace().map(str::to_owned));
        }
        assert!(seen.len() > 1, "{drv} has references");
        cache
    }
}

/// Waits until `child` (a daemon) listens on `socket` (the socket file exists from its `bind`,
/// a moment before its `listen`, when a connection is still refused); a daemon that does not
/// is killed.
pub(crate) fn wait_for_socket(child: Child, socket: &Path) -> Daemon {
    let daemon = Daemon { child, url: format!("unix://{}", socket.display()) };
    let start = Instant::now();
    while sluice_local_store::unix_socket::connect(socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "the daemon did not listen on {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon
}

pub(crate) struct Daemon {
    pub(crate) child: Child,
    pub(crate) url: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn store_path_of(cache_dir: &Path, hash: &str) -> String {
    let text = std::fs::read_to_string(cache_dir.join(format!("{hash}.narinfo"))).unwrap();
    text.lines().find_map(|l| l.strip_prefix("StorePath: ")).unwrap().to_owned()
}

/// `nix path-info --json` without the fields that differ between two stores filled at
/// different times.
fn without_times(json: &str) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
    for item in v.as_array_mut().unwrap() {
        item.as_object_mut().unwrap().remove("registrationTime");
    }
    v
}

#[test]
fn real_nix_clients_match_direct_mode() {
    let env = Env::new();
    let cache = env.cache();
    let cache_dir = env.path("bin-cache");
    let daemon = env.daemon("root", &cache, "");
    let direct = format!("local?root={}", env.path("direct").display());
    let key = cache_key();
    let glibc = store_path_of(&cache_dir, "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let libgcc = store_path_of(&cache_dir, "py14wj21zshnib43vh5f66ihm7rx610h");

    // Same contents in both stores: nix copy from the file:// cache (AddMultipleToStore,
    // signatures checked by the daemon against its trusted key).
    for store in [daemon.url.as_str(), direct.as_str()] {
        env.nix("nix", &["copy", "--from", &cache, "--to", store, &glibc, "--option", "trusted-public-keys", &key]);
    }

    let ping = env.cmd("nix").args(["store", "ping", "--store", &daemon.url]).output().unwrap();
    let ping = format!("{}{}", String::from_utf8_lossy(&ping.stdout), String::from_utf8_lossy(&ping.stderr));
    assert!(ping.contains("Version: 2.24.0+sluice."), "{ping}");

    for args in [vec!["-qR", glibc.as_str()], vec!["-q", "--references", &glibc], vec!["-q", "--referrers", &libgcc]] {
        let via = env.nix("nix-store", &[&["--store", &daemon.url][..], &args].concat());
        let local = env.nix("nix-store", &[&["--store", &direct][..], &args].concat());
        assert_eq!(via, local, "nix-store {args:?}");
        assert!(!via.is_empty());
    }
    let via = env.nix("nix", &["path-info", "-r", "--json", "--store", &daemon.url, &glibc]);
    let local = env.nix("nix", &["path-info", "-r", "--json", "--store", &direct, &glibc]);
    assert_eq!(without_times(&via), without_times(&local));
    // sluice's own client (pipelined QueryPathInfo, lock-cpu on and off) sees the same.
    for lock in ["true", "false"] {
        let own = env
            .cmd(sluice())
            .env("NIX_CONFIG", format!("lock-cpu = {lock}"))
            .args(["path-info", "--as-nix", "2.8", "-r", "--json", "--store", &daemon.url, &glibc])
            .output()
            .unwrap();
        assert!(own.status.success(), "{}", String::from_utf8_lossy(&own.stderr));
        assert_eq!(without_times(&String::from_utf8(own.stdout).unwrap()), without_times(&local), "lock-cpu = {lock}");
    }

    // --add (AddToStore, fixed:r:sha256), twice: new and existing.
    let file = env.path("hello.txt");
    std::fs::write(&file, "hello from the daemon test\n").unwrap();
    let f = file.to_str().unwrap();
    for _ in 0..2 {
        assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "--add", f]), env.nix("nix-store", &["--store", &direct, "--add", f]));
    }

    // nix-instantiate of a generated workload (AddToStore text:sha256 and fixed:r:sha256).
    let wl = env.path("workload");
    let ok = Command::new(format!("{SHARED}/bench/gen-instantiate-workload")).arg(&wl).arg("100").stdout(Stdio::null()).status().unwrap();
    assert!(ok.success());
    let wl = wl.to_str().unwrap();
    let via = env.nix("nix-instantiate", &["--store", &daemon.url, wl]);
    assert_eq!(via, env.nix("nix-instantiate", &["--store", &direct, wl]));
    assert_eq!(via, env.nix("nix-instantiate", &["--store", &daemon.url, wl]), "warm run");
    let drv = via.trim();
    assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "-qR", drv]), env.nix("nix-store", &["--store", &direct, "-qR", drv]));

    // nix-store -r of a path the daemon substitutes itself from its file:// substituter.
    let data = store_path_of(&cache_dir, "2363xkmjdz47l55sjw25vx7081mz5qj0");
    let realised = env.nix(
        "nix-store",
        &["--store", &daemon.url, "-r", &data, "--option", "substituters", &cache, "--option", "trusted-public-keys", &key],
    );
    assert_eq!(realised.trim(), data);
    assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "-q", "--hash", &data]).trim().len(), "sha256:".len() + 52);

    // A path nobody has: a clear error, and the daemon keeps serving.
    let missing = "/nix/store/00000000000000000000000000000000-missing";
    let out = env.cmd("nix-store").args(["--store", &daemon.url, "-r", missing]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing"), "{}", String::from_utf8_lossy(&out.stderr));

    let out = env.cmd("nix-store").args(["--store", &daemon.url, "--verify"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("checking path existence"));
    let out = env.cmd("nix-store").args(["--store", &daemon.url, "--verify", "--check-contents"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The store and state directories deleted and made again, empty, between two connections
/// (what the `clearStore` of Nix's functional tests does under a running daemon): the next
/// connection works on the new store as a `nix-daemon` worker, which opens the store per
/// connection, does. Regression: the daemon kept the deleted directories and database open,
/// so the next `--add` failed (`…-sluice-unpacking: No such file or directory`,
/// `temproots/<pid>-<n>: No such file or directory`) and the old database still answered.
#[test]
fn a_connection_after_the_store_is_deleted_and_made_again_uses_the_new_store() {
    let env = Env::new();
    let daemon = env.daemon("root", "", "");
    let root = env.path("root");
    let add = |name: &str| {
        let file = env.path(name);
        std::fs::write(&file, format!("{name} through the daemon\n")).unwrap();
        env.nix("nix-store", &["--store", &daemon.url, "--add", file.to_str().unwrap()]).trim().to_owned()
    };
    let before = add("before.txt");
    for dir in ["nix/store", "nix/var/nix"] {
        std::fs::remove_dir_all(root.join(dir)).unwrap();
        std::fs::create_dir(root.join(dir)).unwrap();
    }
    let after = add("after.txt");
    let direct = format!("local?root={}", root.display());
    for store in [daemon.url.as_str(), &direct] {
        assert_eq!(
            env.nix("nix-store", &["--store", store, "--check-validity", "--print-invalid", &before, &after]).trim(),
            before,
            "{store}"
        );
    }
    assert!(root.join(after.trim_start_matches('/')).is_file(), "{after} is not in the new store directory");
}

/// `--store local` (no `root`) keeps its state (database, temporary roots, the daemon's
/// socket) where `NIX_STATE_DIR` says and build logs where `NIX_LOG_DIR` says, as Nix's local
/// store does (`globals.cc`, `local-fs-store.hh`): real Nix 2.8 given the same variables finds
/// what sluice daemon registered and the log it stored, and connects to the socket the
/// variables place. A `NIX_STORE_DIR` other than `/nix/store`, or a relative `NIX_STATE_DIR`,
/// is refused naming the variable. Every process has a `/nix` of its own (a tmpfs in a private
/// mount namespace): this machine's is never touched. Regression: sluice used `/nix/var/nix`
/// and `/nix/var/log/nix` whatever the environment said.
#[test]
fn local_store_directories_follow_the_environment() {
    use std::io::Write;
    let env = Env::new();
    let (state, log) = (env.path("state"), env.path("log"));
    let private_nix = |program: &str| {
        let mut c = env.cmd("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /nix && exec \"$0\" \"$@\"", program])
            .env("NIX_STATE_DIR", &state)
            .env("NIX_LOG_DIR", &log)
            .env("NIX_STORE_DIR", "/nix/store")
            .env_remove("NIX_DAEMON_SOCKET_PATH");
        c
    };
    let run = |mut c: Command| {
        let out = c.output().unwrap();
        assert!(out.status.success(), "{c:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let socket = state.join("daemon-socket/socket");
    let mut daemon = private_nix(sluice());
    daemon.args(["daemon", "--store", "local"]).stderr(Stdio::null());
    let _daemon = wait_for_socket(daemon.spawn().unwrap(), &socket);

    let file = env.path("hello.txt");
    std::fs::write(&file, "registered under NIX_STATE_DIR\n").unwrap();
    let mut add = private_nix("nix-store");
    add.args(["--store", "daemon", "--add"]).arg(&file);
    let path = run(add).trim().to_owned();
    assert!(state.join("db/db.sqlite").is_file() && state.join("temproots").is_dir());
    let mut check = private_nix("nix-store");
    check.args(["--store", "local", "--check-validity", &path]);
    run(check);

    std::os::unix::fs::symlink(&socket, env.path("socket")).unwrap();
    let (mut client, _) = raw_client(&env, 37);
    let (drv, text) = ("00000000000000000000000000000000-x.drv", "a build log under NIX_LOG_DIR\n");
    client.write_all(&[request(45, &[Err(drv.as_bytes())]), framed(text.as_bytes())].concat()).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1);
    assert!(log.join("drvs/00/000000000000000000000000000000-x.drv.bz2").is_file());
    let mut read_log = private_nix("nix-store");
    read_log.args(["--store", "local", "--read-log", &format!("/nix/store/{drv}")]);
    assert_eq!(run(read_log), text);

    for (var, value, why) in [
        ("NIX_STORE_DIR", "/gnu/store", "sluice supports only the store directory /nix/store"),
        ("NIX_STATE_DIR", "state", "not an absolute path"),
    ] {
        let mut refused = private_nix(sluice());
        let out = refused.env(var, value).args(["path-info", "--store", "local", &path]).output().unwrap();
        assert!(!out.status.success());
        let expected = format!("environment variable {var} has the invalid value {value:?}: {why}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&expected), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// `nix-store -r` of the corpus's whole closure (1056 paths) through a daemon whose hard
/// limit on open files is far below that: every path is substituted. Regression: the
/// daemon's substitution held a lock file per path found until the path was registered, and
/// most paths failed with `Too many open files`.
/// Garbage collection through `sluice daemon` and through Nix 2.8 itself (direct mode) on two
/// stores filled alike, with the same roots: a user's indirect root (`home/result`, made by
/// `--add-root`), a profile with two generations, a dead added file, a stray name in the store
/// directory. Compared: `--print-live`, `--print-dead`, `-q --roots` (the user's link, not
/// its `gcroots/auto` entry), `nix store delete` of a live path (refused, Nix's message) and
/// of a dead one, `nix store gc --max`, then `nix-collect-garbage -d` (the old generation
/// goes, then its paths): the same paths deleted, the same bytes freed, the same store left.
#[test]
fn garbage_collection_matches_nix() {
    let env = Env::new();
    let cache = env.cache();
    let cache_dir = env.path("bin-cache");
    let daemon = env.daemon("root", &cache, "");
    let direct = format!("local?root={}", env.path("direct").display());
    let key = cache_key();
    let all: Vec<String> = std::fs::read_dir(&cache_dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str().and_then(|n| n.strip_suffix(".narinfo")).map(|h| store_path_of(&cache_dir, h)))
        .collect();
    let glibc = store_path_of(&cache_dir, "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let libgcc = store_path_of(&cache_dir, "py14wj21zshnib43vh5f66ihm7rx610h");
    let file = env.path("dead.txt");
    std::fs::write(&file, "nobody roots this\n").unwrap();
    let generation_one = env.path("generation-one.txt");
    std::fs::write(&generation_one, "the first generation of a profile\n").unwrap();
    let result = env.path("home/result");
    // Per store: its URL, its root directory, and a command runner whose client state (the
    // profiles nix-collect-garbage -d edits) is that store's.
    let stores = [(daemon.url.clone(), env.path("root")), (direct.clone(), env.path("direct"))];
    let run = |url: &str, root: &Path, program: &str, args: &[&str]| {
        let out = env.cmd(program).env("NIX_STATE_DIR", root.join("nix/var/nix")).args(["--store", url]).args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).replace(root.to_str().unwrap(), "ROOT");
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let ok = |(ok, out, err): (bool, String, String)| {
        assert!(ok, "{err}");
        out
    };
    for (url, root) in &stores {
        env.nix(
            "nix",
            &[
                &["copy", "--from", &cache, "--to", url, "--option", "trusted-public-keys", &key][..],
                &all.iter().map(String::as_str).collect::<Vec<_>>(),
            ]
            .concat(),
        );
        ok(run(url, root, "nix-store", &["--add", file.to_str().unwrap()]));
        ok(run(url, root, "nix-store", &["-r", &glibc, "--add-root", result.to_str().unwrap(), "--indirect"]));
        let profile = root.join("nix/var/nix/profiles/test");
        let first = ok(run(url, root, "nix-store", &["--add", generation_one.to_str().unwrap()]));
        for generation in [first.trim(), &libgcc] {
            ok(run(url, root, "nix-env", &["-p", profile.to_str().unwrap(), "--set", generation]));
        }
    }
    let both = |program: &str, args: &[&str]| -> Vec<(bool, String, String)> {
        stores.iter().map(|(url, root)| run(url, root, program, args)).collect()
    };
    let sorted = |s: &str| s.lines().map(str::to_owned).collect::<std::collections::BTreeSet<_>>();

    for listing in ["--print-live", "--print-dead"] {
        let out = both("nix-store", &["--gc", listing]);
        assert_eq!(sorted(&ok(out[0].clone())), sorted(&ok(out[1].clone())), "nix-store --gc {listing}");
        assert!(!out[0].1.is_empty(), "{listing}");
    }
    let roots = both("nix-store", &["-q", "--roots", &glibc]);
    assert_eq!(sorted(&ok(roots[0].clone())), sorted(&ok(roots[1].clone())));
    assert!(roots[0].1.lines().any(|l| l == format!("{} -> {glibc}", result.display())), "{}", roots[0].1);
    assert!(!roots[0].1.contains("gcroots/auto"), "{}", roots[0].1);

    // nix store delete: a live path is refused with Nix's message, a dead one goes.
    for (ok_, _, err) in both("nix", &["store", "delete", &glibc]) {
        assert!(!ok_);
        assert!(err.contains(&format!("Cannot delete path '{glibc}' since it is still alive")), "{err}");
    }
    let dead_file = ok(run(&daemon.url, &stores[0].1, "nix-store", &["--add", file.to_str().unwrap()])).trim().to_owned();
    for (ok_, _, err) in both("nix", &["store", "delete", &dead_file]) {
        assert!(ok_, "{err}");
    }

    // nix store gc --max 1: stops after the first deletion; what went was dead.
    let dead_before = sorted(&ok(run(&daemon.url, &stores[0].1, "nix-store", &["--gc", "--print-dead"])));
    for (ok_, _, err) in both("nix", &["store", "gc", "--max", "1"]) {
        assert!(ok_, "{err}");
        let deleted: Vec<&str> = err.lines().filter_map(|l| l.strip_prefix("deleting '").and_then(|l| l.strip_suffix('\''))).collect();
        assert!(!deleted.is_empty() && deleted.len() < dead_before.len(), "{err}");
        assert!(deleted.iter().all(|p| dead_before.contains(*p)), "{deleted:?} not all in {dead_before:?}");
    }
    // Let both stores hold the same again before the full collection.
    let left = sorted(&ok(run(&daemon.url, &stores[0].1, "nix-store", &["--gc", "--print-dead"])));
    let left_direct = sorted(&ok(run(&direct, &stores[1].1, "nix-store", &["--gc", "--print-dead"])));
    for p in left_direct.symmetric_difference(&left) {
        let (url, root) = if left.contains(p) { &stores[0] } else { &stores[1] };
        ok(run(url, root, "nix", &["store", "delete", p]));
    }

    // nix-collect-garbage -d: the old generation goes, then everything dead, a stray name too.
    for (_, root) in &stores {
        std::fs::write(root.join("nix/store/stray-file"), "x").unwrap();
    }
    let out = both("nix-collect-garbage", &["-d"]);
    let summary = |err: &str| err.lines().filter(|l| l.contains("store paths deleted")).map(str::to_owned).collect::<Vec<_>>();
    let deleted = |err: &str| sorted(&err.lines().filter(|l| l.starts_with("deleting '")).collect::<Vec<_>>().join("\n"));
    assert!(out[0].0 && out[1].0, "{}\n{}", out[0].2, out[1].2);
    assert_eq!(deleted(&out[0].2), deleted(&out[1].2), "paths deleted");
    assert_eq!(summary(&out[0].2), summary(&out[1].2), "paths and bytes freed");
    assert!(deleted(&out[0].2).contains("deleting '/nix/store/stray-file'"), "{}", out[0].2);
    assert!(out[0].2.contains("-generation-one.txt'"), "the old generation's path: {}", out[0].2);
    let listing = |root: &Path| {
        std::fs::read_dir(root.join("nix/store"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(listing(&stores[0].1), listing(&stores[1].1), "store directories");
    let live = both("nix-store", &["--gc", "--print-live"]);
    assert_eq!(sorted(&ok(live[0].clone())), sorted(&ok(live[1].clone())));
    common::assert_nix_verifies(env.dir.path(), &stores[0].1);
}

/// The entries of `<root>/nix/store/.links` with their link counts.
fn links(root: &Path) -> std::collections::BTreeMap<String, u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(root.join("nix/store/.links"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().into_string().unwrap(), e.path().symlink_metadata().unwrap().nlink())
        })
        .collect()
}

/// Two source trees with files in common: the same text twice, once more executable (which
/// Nix does not link to the others: the NAR of a file carries its executable bit), and the
/// same symlink twice.
fn duplicated_trees(env: &Env, names: &[&str]) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    names
        .iter()
        .map(|name| {
            let dir = env.path(name);
            std::fs::create_dir_all(dir.join("sub")).unwrap();
            std::fs::write(dir.join("README"), "the same words in every tree\n").unwrap();
            std::fs::write(dir.join("sub/README"), "the same words in every tree\n").unwrap();
            std::fs::write(dir.join("run"), "the same words in every tree\n").unwrap();
            std::fs::set_permissions(dir.join("run"), std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::write(dir.join("own"), format!("only in {name}\n")).unwrap();
            std::os::unix::fs::symlink("README", dir.join("sub/link")).unwrap();
            dir.to_str().unwrap().to_owned()
        })
        .collect()
}

/// `nix-store --optimise` through `sluice daemon` (OptimiseStore) and through Nix 2.8 in
/// direct mode on a store filled alike (a corpus closure, two trees with files in common):
/// the same closing line (MiB freed, files linked), the same `.links` names with the same
/// link counts, and a second run finds nothing to do. Then `auto-optimise-store = true` (the
/// daemon's setting; Nix direct mode's option) deduplicates new paths as they are added:
/// again the same `.links`. Nix then verifies the daemon's store.
#[test]
fn optimise_store_matches_nix() {
    let env = Env::new();
    let cache = env.cache();
    let cache_dir = env.path("bin-cache");
    let mut daemon = env.daemon("root", &cache, "");
    let direct = format!("local?root={}", env.path("direct").display());
    let key = cache_key();
    let glibc = store_path_of(&cache_dir, "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let trees = duplicated_trees(&env, &["tree-a", "tree-b"]);
    let run = |url: &str, args: &[&str]| {
        let out = env.cmd("nix-store").args(["--store", url]).args(args).output().unwrap();
        assert!(out.status.success(), "nix-store {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stderr).unwrap()
    };
    for url in [daemon.url.as_str(), direct.as_str()] {
        env.nix("nix", &["copy", "--from", &cache, "--to", url, &glibc, "--option", "trusted-public-keys", &key]);
        for tree in &trees {
            run(url, &["--add", tree]);
        }
    }
    let (root, direct_root) = (env.path("root"), env.path("direct"));
    assert!(links(&root).is_empty() && links(&direct_root).is_empty());
    let freed = |err: &str| err.lines().filter(|l| l.contains("freed by hard-linking")).map(str::to_owned).collect::<Vec<_>>();
    let via = freed(&run(&daemon.url, &["--optimise"]));
    let nix = freed(&run(&direct, &["--optimise"]));
    assert_eq!(via, nix, "closing line");
    assert!(!via[0].starts_with("0.00 MiB freed by hard-linking 0 files"), "{via:?}");
    assert_eq!(links(&root), links(&direct_root), ".links after nix-store --optimise");
    assert!(links(&root).values().any(|&n| n > 2), "{:?}", links(&root));
    assert_eq!(freed(&run(&daemon.url, &["--optimise"])), ["0.00 MiB freed by hard-linking 0 files"]);
    assert_eq!(links(&root), links(&direct_root), ".links after a second run");

    drop(daemon);
    std::fs::remove_file(env.path("socket")).unwrap();
    daemon = env.daemon("root", &cache, "auto-optimise-store = true");
    let later = duplicated_trees(&env, &["tree-c"]);
    run(&daemon.url, &["--add", &later[0]]);
    run(&direct, &["--add", &later[0], "--option", "auto-optimise-store", "true"]);
    assert_eq!(links(&root), links(&direct_root), ".links after adding with auto-optimise-store");
    common::assert_nix_verifies(env.dir.path(), &root);
}

/// `nix-store --verify --check-contents --repair` as root through `sluice daemon` and through
/// Nix 2.8 in direct mode, on two stores filled alike from the corpus cache in which the same
/// file of a path was overwritten and a path nothing refers to was deleted: the same
/// messages (the modified path named with both hashes, the vanished one unregistered), both
/// succeed, the file is whole again (substituted from the cache through the verification
/// boundary) and Nix then finds nothing wrong in the daemon's store.
#[test]
fn verify_repair_matches_nix() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let cache = env.cache();
    let cache_dir = env.path("bin-cache");
    let daemon = env.daemon("root", &cache, "");
    let direct = format!("local?root={}", env.path("direct").display());
    let key = cache_key();
    let glibc = store_path_of(&cache_dir, "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let data = store_path_of(&cache_dir, "2363xkmjdz47l55sjw25vx7081mz5qj0");
    let subs = ["--option", "substituters", &cache, "--option", "trusted-public-keys", &key];
    let stores = [(daemon.url.clone(), env.path("root")), (direct.clone(), env.path("direct"))];
    let mut damaged_file = None;
    for (url, root) in &stores {
        env.nix("nix", &[&["copy", "--from", &cache, "--to", url, &glibc, &data][..], &subs[3..]].concat());
        let tree = root.join(glibc.trim_start_matches('/'));
        let file = walk(&tree).into_iter().find(|p| p.extension().is_some_and(|e| e == "so")).expect("a shared library in glibc");
        let chmod = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        chmod(file.parent().unwrap(), 0o755);
        chmod(&file, 0o644);
        std::fs::write(&file, "not a library any more").unwrap();
        chmod(&file, 0o444);
        chmod(file.parent().unwrap(), 0o555);
        let vanished = root.join(data.trim_start_matches('/'));
        chmod(&vanished, 0o755);
        std::fs::remove_dir_all(&vanished).or_else(|_| std::fs::remove_file(&vanished)).unwrap();
        damaged_file = Some(file.strip_prefix(root).unwrap().to_owned());
    }
    let outputs: Vec<(bool, String)> = stores
        .iter()
        .map(|(url, root)| {
            let out = env.cmd("nix-store").args(["--store", url, "--verify", "--check-contents", "--repair"]).args(subs).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr).replace(root.to_str().unwrap(), "ROOT");
            // Nix reports the substitution as an activity; sluice's repair does not.
            let err = err.lines().filter(|l| !l.starts_with("copying path")).collect::<Vec<_>>().join("\n");
            (out.status.success(), err)
        })
        .collect();
    assert_eq!(outputs[0], outputs[1], "sluice daemon, then Nix direct mode");
    assert!(outputs[0].0, "{}", outputs[0].1);
    assert!(outputs[0].1.contains(&format!("path '{glibc}' was modified! expected hash")), "{}", outputs[0].1);
    assert!(outputs[0].1.contains(&format!("path '{data}' disappeared, removing from database...")), "{}", outputs[0].1);
    let damaged_file = damaged_file.unwrap();
    assert_eq!(std::fs::read(stores[0].1.join(&damaged_file)).unwrap(), std::fs::read(stores[1].1.join(&damaged_file)).unwrap());
    common::assert_nix_verifies(env.dir.path(), &stores[0].1);
}

#[test]
fn daemon_substitutes_a_closure_larger_than_its_open_file_limit() {
    let env = Env::new();
    let cache_dir = Path::new(SHARED).join("corpus/cache-zstd").canonicalize().unwrap();
    let cache = format!("file://{}", cache_dir.display());
    let daemon = env.daemon_limited("root", &cache, "", Some(256));
    let top = store_path_of(&cache_dir, "433r6hrfzj8vvazpcnl77q6m3lm3vw3g");
    let key = cache_key();
    let realised = env.nix(
        "nix-store",
        &["--store", &daemon.url, "-r", &top, "--option", "substituters", &cache, "--option", "trusted-public-keys", &key],
    );
    assert_eq!(realised.trim(), top);
    assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "-qR", &top]).lines().count(), 1056, "the whole closure is valid");
    common::assert_nix_verifies(env.dir.path(), &env.path("root"));
}

#[test]
fn untrusted_client_cannot_add_unsigned_paths() {
    let env = Env::new();
    let cache = env.cache();
    // root is not in trusted-users here, so the test's own client is untrusted.
    let daemon = env.daemon("root", &cache, "trusted-users = nobody-in-particular\nrequire-sigs = true");
    let import = env.path("export");
    let file = env.path("x.txt");
    std::fs::write(&file, "x\n").unwrap();
    // Content-addressed additions are fine for untrusted users.
    let added = env.nix("nix-store", &["--store", &daemon.url, "--add", file.to_str().unwrap()]);
    assert!(added.starts_with("/nix/store/"));
    // An unsigned input-addressed path: exported from a direct store, imported via the daemon.
    let direct = format!("local?root={}", env.path("direct").display());
    let glibc_deps = store_path_of(&env.path("bin-cache"), "py14wj21zshnib43vh5f66ihm7rx610h");
    env.nix("nix", &["copy", "--from", &cache, "--to", &direct, &glibc_deps, "--option", "trusted-public-keys", &cache_key()]);
    let out = env.cmd("nix-store").args(["--store", &direct, "--export", &glibc_deps]).output().unwrap();
    std::fs::write(&import, &out.stdout).unwrap();
    let out =
        env.cmd("nix-store").args(["--store", &daemon.url, "--import"]).stdin(std::fs::File::open(&import).unwrap()).output().unwrap();
    // The export carries no signature, so the daemon must refuse it for an untrusted client.
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lacks a signature by a trusted key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Privileged settings are refused with a warning.
    let out = env.cmd("nix").args(["store", "ping", "--store", &daemon.url, "--option", "require-sigs", "false"]).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a trusted user"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Case 19's driver against `sluice daemon --stdio`, every scenario.
#[test]
fn worker_protocol_handshake_case_19() {
    let env = Env::new();
    let cmd = format!("{} daemon --stdio --store {}", sluice(), env.path("root").display());
    let run = |scenario: &str| -> String {
        let out = env
            .cmd("python3")
            .arg(format!("{SHARED}/cases/19-worker-protocol-handshake/client.py"))
            .args(["--cmd", &cmd, scenario])
            .output()
            .unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    // After a refusal the connection is closed: the driver's next request then meets either
    // the end of the stream, or (if the daemon process has exited already) a broken pipe.
    let closed = |out: &str| (out.contains("connection ended") || out.contains("BrokenPipeError")) && !out.contains("IsValidPath frames");
    let ok = run("ok-1.34");
    assert!(ok.contains("daemon version 1.38") && ok.contains("RESULT: IsValidPath answered 0"), "{ok}");
    assert!(!ok.contains("trust flag"), "1.34 has no trust flag: {ok}");
    // The driver's `client-newer-1.255` predates protocol 1.38: it claims 1.255 but does not
    // send the features a client must send once 1.38 is negotiated (nix-daemon 2.26 reads them
    // too). A newer client that does is protocol::a_newer_client_and_a_1_37_client_get_their_own_greetings.
    let major = run("major-2");
    assert!(major.contains("('ERROR', 'unsupported protocol version 2.34") && closed(&major), "{major}");
    let old = run("too-old-1.9");
    assert!(old.contains("client version is too old") && closed(&old), "{old}");
    let bad = run("bad-magic");
    assert!(bad.contains("RESULT: connection ended: EOF after 0 bytes") && bad.contains("protocol mismatch"), "{bad}");
    let unknown = run("unknown-op");
    assert_eq!(unknown.matches("'ERROR'").count(), 1, "{unknown}");
    assert!(unknown.contains("after op 999: [('ERROR', 'invalid operation 999')]") && closed(&unknown), "{unknown}");
}

/// sluice's own daemon client over a child's standard input and output, as `ssh-ng://` runs
/// `nix-daemon --stdio` (here `sluice daemon --stdio`, whose one client is trusted): it greets,
/// sets options, adds a path and finds it, with the replies of pipelined queries in order.
#[test]
fn the_daemon_client_runs_over_a_childs_stdio() {
    let env = Env::new();
    let mut child = env
        .cmd(sluice())
        .args(["daemon", "--stdio", "--store"])
        .arg(env.path("root"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (stdin, stdout) = (child.stdin.take().unwrap(), child.stdout.take().unwrap());
    let mut conn = sluice_store::remote::DaemonConnection::over("sluice daemon --stdio".into(), Box::new(stdout), Box::new(stdin)).unwrap();
    assert_eq!(conn.version().to_string(), "1.38");
    assert!(conn.daemon_version().is_some_and(|v| v.starts_with("2.24.0+sluice.")), "{:?}", conn.daemon_version());
    conn.set_options(&sluice_nix::wire::ops::SetOptions::default()).unwrap();
    let (path, nar, ca) = honest_dep();
    let missing = StoreDir::default().parse_path("/nix/store/00000000000000000000000000000000-missing").unwrap();
    assert!(!conn.is_valid_path(&path).unwrap());
    let info = sluice_nix::path_info::ValidPathInfo {
        path: path.clone(),
        deriver: None,
        nar_hash: Hash::digest_bytes(HashAlgo::Sha256, &nar),
        references: Default::default(),
        registration_time: 0,
        nar_size: nar.len() as u64,
        ultimate: false,
        sigs: Default::default(),
        ca: Some(ca),
    };
    conn.add_to_store_nar(&info, &mut nar.as_slice(), true).unwrap();
    assert!(conn.is_valid_path(&path).unwrap());
    let infos = conn.query_path_infos(&[missing, path.clone()]).unwrap();
    assert!(infos[0].is_none());
    let found = infos[1].as_ref().expect("the path added is valid");
    assert_eq!((&found.path, &found.nar_hash, found.nar_size), (&path, &info.nar_hash, info.nar_size));
    drop(conn);
    assert!(child.wait().unwrap().success());
}

/// `Cpus_allowed_list` of each of process `pid`'s daemon worker threads (`sluice-worker-N`).
fn worker_cpus(pid: u32) -> Vec<String> {
    let mut lists = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("sluice-worker") {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if let Some(list) = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")) {
            lists.push(list.trim().to_owned());
        }
    }
    lists
}

/// Waits (up to 10 s) until one of the daemon's workers may run exactly on `cpus`.
fn wait_for_worker_on(pid: u32, cpus: &str) {
    let start = Instant::now();
    loop {
        let lists = worker_cpus(pid);
        if lists.iter().any(|l| l == cpus) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no worker of the daemon runs on CPUs {cpus}: {lists:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn u64s(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(crate) fn read_u64(s: &mut impl std::io::Read) -> u64 {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

/// The CPUs this test may use, as `Cpus_allowed_list` shows them, and the last one of them.
fn own_cpus() -> (String, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_owned();
    let last = list.rsplit([',', '-']).next().unwrap().parse().unwrap();
    (list, last)
}

/// A client of the Nix 1.6–2.5 kind (protocol 1.32 here) that sends affinity flag 1 and a
/// CPU over a real socket: the worker serving it is pinned to that CPU for the connection; a
/// client sending flag 0 gets an unpinned worker. sluice's own client with `lock-cpu` pins
/// itself and its worker the same way.
#[test]
fn old_style_client_gets_its_worker_pinned() {
    use std::io::Write;
    let env = Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let pid = daemon.child.id();
    let socket = env.path("socket");
    let (all_cpus, cpu) = own_cpus();

    let mut old = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    old.write_all(&u64s(&[0x6e69_7863])).unwrap();
    assert_eq!(read_u64(&mut old), 0x6478_696f);
    assert_eq!(read_u64(&mut old), 0x126, "the daemon speaks 1.38");
    // Version 1.32, affinity flag 1 and the CPU, reserveSpace 0.
    old.write_all(&u64s(&[0x120, 1, cpu as u64, 0])).unwrap();
    assert_eq!(read_u64(&mut old), 0x616c_7473, "LAST (no version string below 1.33)");
    wait_for_worker_on(pid, &cpu.to_string());
    // The pinned connection works: IsValidPath of a path the store lacks answers 0.
    let path = b"/nix/store/00000000000000000000000000000000-missing";
    let mut request = u64s(&[1, path.len() as u64]);
    request.extend_from_slice(path);
    request.resize(request.len().next_multiple_of(8), 0);
    old.write_all(&request).unwrap();
    assert_eq!((read_u64(&mut old), read_u64(&mut old)), (0x616c_7473, 0));

    // Flag 0, with `--client-cpu free`: the new worker keeps the daemon's affinity.
    drop(daemon);
    let daemon = env.daemon_on("socket-free", "root", &cache, "", &["--client-cpu", "free"], None);
    let pid = daemon.child.id();
    let mut plain = std::os::unix::net::UnixStream::connect(env.path("socket-free")).unwrap();
    plain.write_all(&u64s(&[0x6e69_7863])).unwrap();
    assert_eq!((read_u64(&mut plain), read_u64(&mut plain)), (0x6478_696f, 0x126));
    plain.write_all(&u64s(&[0x120, 0, 0])).unwrap();
    assert_eq!(read_u64(&mut plain), 0x616c_7473);
    // The worker of `wait_for_socket`'s probe connection may not have ended yet.
    let start = Instant::now();
    let lists = loop {
        let lists = worker_cpus(pid);
        if lists.len() == 1 || start.elapsed() > Duration::from_secs(10) {
            break lists;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(lists.len(), 1, "{lists:?}");
    if all_cpus != cpu.to_string() {
        assert!(lists.contains(&all_cpus), "the flag-0 worker should be unpinned: {lists:?}");
    }
    drop((old, plain));

    // sluice's own client with lock-cpu: pinned to its current CPU, and so is its worker.
    let socket2 = env.path("socket-free");
    let (client_cpu, valid) = std::thread::spawn(move || {
        let mut store = sluice_store::remote::DaemonConnection::connect(&socket2, true).unwrap();
        let cpu = store.pinned_cpu().expect("the client pinned itself");
        wait_for_worker_on(pid, &cpu.to_string());
        let missing = store.store_dir().parse_path("/nix/store/00000000000000000000000000000000-missing").unwrap();
        (cpu, store.is_valid_path(&missing).unwrap())
    })
    .join()
    .unwrap();
    assert!(client_cpu <= cpu);
    assert!(!valid);
}

/// A client of today's kind (no CPU in the greeting) in its own process. With `--client-cpu
/// pin`, and with `auto` (the default) for a Nix client (a program named `nix`) while it works
/// alone: while it is connected, its main thread and its worker run on one CPU; once it has
/// disconnected and lives on (as `nix develop` execs a shell), its affinity is what it was.
/// With `auto`, a client that starts a lasting thread, or sends an operation after which
/// clients work in parallel (QueryAllValidPaths here), gets its CPUs back while still
/// connected; one that starts only threads that end at once (Nix 2.8 starts one per
/// AddToStore) or asks QueryMissing (Nix 2.26's `nix path-info` does) keeps them. A program
/// that is not Nix is left free: pinned, the test binary's own raw clients made test threads
/// it started, and their Nix children, run on one CPU (Nix 2.26's parallel xz then wrote one
/// block: parallel_decode failed under load).
#[test]
fn a_client_and_its_worker_share_a_cpu_while_connected_and_no_longer() {
    let (all_cpus, _) = own_cpus();
    if !all_cpus.contains([',', '-']) {
        eprintln!("skipped: one CPU");
        return;
    }
    let all = all_cpus_as_list(&all_cpus);
    let env = Env::new();
    let cache = env.cache();
    // The client: greets as 1.34 (affinity flag 0), prints its CPUs, does what argv[2] says
    // (start a thread, start and join 200 threads of half a millisecond one after the other, send QueryAllValidPaths or
    // an empty QueryMissing), prints its CPUs again, waits for a line on stdin, disconnects,
    // waits for another, prints its CPUs again.
    let script = r#"
import os, socket, struct, sys, threading, time
def cpus(): return ",".join(map(str, sorted(os.sched_getaffinity(0))))
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
u = lambda: struct.unpack("<Q", s.recv(8, socket.MSG_WAITALL))[0]
s.sendall(struct.pack("<Q", 0x6e697863)); u(); u()
s.sendall(struct.pack("<QQQ", 0x122, 0, 0))
n = u(); s.recv((n + 7) // 8 * 8, socket.MSG_WAITALL)
assert u() == 0x616c7473
print(cpus(), flush=True)
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
if sys.argv[2] == "short-threads":
    for _ in range(200):
        t = threading.Thread(target=time.sleep, args=(0.0005,)); t.start(); t.join()
if sys.argv[2] == "op":
    s.sendall(struct.pack("<Q", 23)); assert u() == 0x616c7473
    for _ in range(u()): n = u(); s.recv((n + 7) // 8 * 8, socket.MSG_WAITALL)
if sys.argv[2] == "missing":
    s.sendall(struct.pack("<QQ", 40, 0)); assert u() == 0x616c7473
    assert [u() for _ in range(5)] == [0] * 5
time.sleep(0.3)
print(cpus(), flush=True); sys.stdin.readline()
s.close()
sys.stdin.readline(); print(cpus(), flush=True)
"#;
    let nix = python_named_nix(&env);
    let python = Path::new("python3");
    // (daemon flags, the client's program, what it does while connected, pinned when
    // connected, after that).
    let cases: [(&[&str], &Path, &str, bool, bool); 9] = [
        (&[], &nix, "nothing", true, true),
        (&["--client-cpu", "auto"], &nix, "thread", true, false),
        (&["--client-cpu", "auto"], &nix, "short-threads", true, true),
        (&["--client-cpu", "auto"], &nix, "op", true, false),
        (&["--client-cpu", "auto"], &nix, "missing", true, true),
        (&["--client-cpu", "pin"], python, "thread", true, true),
        (&[], python, "nothing", false, false),
        (&["--client-cpu", "auto"], python, "nothing", false, false),
        (&["--client-cpu", "free"], &nix, "nothing", false, false),
    ];
    for (n, (args, program, act, pinned, still_pinned)) in cases.into_iter().enumerate() {
        let case = format!("{args:?} {} {act}", program.display());
        let daemon = env.daemon_on(&format!("socket-{n}"), "root", &cache, "", args, None);
        let mut client = Command::new(program)
            .args(["-c", script])
            .arg(env.path(&format!("socket-{n}")))
            .arg(act)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut to_client = client.stdin.take().unwrap();
        let mut from_client = std::io::BufReader::new(client.stdout.take().unwrap());
        let mut line = String::new();
        let mut next_line = |line: &mut String| {
            line.clear();
            std::io::BufRead::read_line(&mut from_client, line).unwrap();
            line.trim().to_owned()
        };
        let connected = next_line(&mut line);
        if pinned {
            assert!(!connected.contains(','), "{case}: the connected client runs on one CPU, not {connected}");
            // (A worker of the daemon's start-up probe may not have ended yet.)
            assert!(worker_cpus(daemon.child.id()).contains(&connected), "{case}: its worker runs on the client's CPU");
        } else {
            assert_eq!((connected.as_str(), worker_cpus(daemon.child.id())), (all.as_str(), vec![all_cpus.clone()]), "{case}");
        }
        let after = next_line(&mut line);
        let expected = if still_pinned { &connected } else { &all };
        assert_eq!(&after, expected, "{case}: the client's CPUs after it did {act}");
        use std::io::Write;
        to_client.write_all(b"disconnect\n").unwrap();
        // The worker ends when the connection does, and undoes the pin first.
        let start = Instant::now();
        while !worker_cpus(daemon.child.id()).is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "the worker did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
        to_client.write_all(b"report\n").unwrap();
        assert_eq!(next_line(&mut line), all, "{case}: the client's affinity after it disconnected");
        assert!(client.wait().unwrap().success());
    }
}

/// A copy of the Python interpreter named `nix` in `env`'s directory: a client that the daemon
/// takes for Nix (by its executable's name).
fn python_named_nix(env: &Env) -> PathBuf {
    let out = Command::new("python3").args(["-c", "import os, sys; print(os.path.realpath(sys.executable))"]).output().unwrap();
    let nix = env.path("bin/nix");
    std::fs::create_dir_all(nix.parent().unwrap()).unwrap();
    std::fs::copy(String::from_utf8(out.stdout).unwrap().trim(), &nix).unwrap();
    nix
}

/// `Cpus_allowed_list` (e.g. `0-1`) as a comma-separated list of CPUs (`0,1`).
fn all_cpus_as_list(list: &str) -> String {
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")
}

/// A daemon whose socket and store are under a directory too long for a socket address (Nix's
/// functional tests run in such directories): it binds its socket and, for a collection, the
/// collector's, and real Nix 2.26 and sluice's own client reach it (it failed with "path must
/// be shorter than SUN_LEN").
#[test]
fn a_daemon_below_a_long_directory_binds_and_serves() {
    let env = Env::new();
    let long = "d".repeat(110);
    let (socket, root) = (format!("{long}/socket"), format!("{long}/root"));
    std::fs::create_dir_all(env.path(&root)).unwrap();
    let daemon = env.daemon_on(&socket, &root, &env.cache(), "", &[], None);
    let url = format!("unix://{}", env.path(&socket).display());
    let tmp = env.path("modern");
    std::fs::create_dir_all(&tmp).unwrap();
    let info = common::nix_modern(&tmp, &["nix", "--extra-experimental-features", "nix-command", "store", "info", "--store", &url]);
    common::check(&info, "nix store info through a long socket path (Nix 2.26)");
    let gc = common::nix_modern(&tmp, &["nix-store", "--gc", "--store", &url]);
    common::check(&gc, "nix-store --gc through it: the collector's socket is under the long state directory");
    let missing = "/nix/store/00000000000000000000000000000000-missing";
    let own = common::sluice(&tmp, &["path-info", "--store", &url, missing]);
    assert!(common::stderr(&own).contains("is not valid"), "sluice's client reached the daemon: {}", common::stderr(&own));
    drop(daemon);
}

/// Socket activation: `systemd-socket-activate` listens on a socket and starts `sluice daemon`
/// at the first connection with that socket passed (`LISTEN_FDS`, `LISTEN_PID`), as systemd's
/// `nix-daemon.socket` does: Nix 2.8 and Nix 2.26 clients are served on it, and the daemon
/// creates no socket of its own (it bound its default one and left the passed one unanswered).
#[test]
fn a_socket_activated_daemon_serves_the_socket_systemd_passes() {
    let env = Env::new();
    let (socket, default) = (env.path("activated.socket"), env.path("default.socket"));
    let mut cmd = env.cmd("systemd-socket-activate");
    cmd.arg("-l").arg(&socket).arg(sluice()).args(["daemon", "--store"]).arg(env.path("root"));
    cmd.env("NIX_DAEMON_SOCKET_PATH", &default).stderr(Stdio::null());
    let daemon = wait_for_socket(cmd.spawn().expect("systemd-socket-activate (systemd) is installed"), &socket);
    let file = env.path("activated.txt");
    std::fs::write(&file, "served on the socket systemd passed\n").unwrap();
    let added = env.cmd("timeout").args(["30", "nix-store", "--store", &daemon.url, "--add"]).arg(&file).output().unwrap();
    assert!(added.status.success(), "Nix 2.8: {}", String::from_utf8_lossy(&added.stderr));
    let path = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    assert!(path.starts_with("/nix/store/") && path.ends_with("-activated.txt"), "{path}");
    assert!(env.path("root").join(path.trim_start_matches('/')).exists());
    let (ok, _, err) = as_root(&env, true, "nix", &["path-info", "--store", &daemon.url, &path]);
    assert!(ok, "Nix 2.26: {err}");
    assert!(!default.exists(), "the daemon bound its default socket {}", default.display());
}

/// `sluice daemon --substituters URL --option NAME VALUE`, as `nix-daemon --option`: the
/// settings given win over nix.conf's (which has no substituter here), and a Nix 2.8 client
/// that sets none of them has the path substituted from the cache given.
#[test]
fn daemon_settings_from_its_command_line() {
    let env = Env::new();
    let cache = env.cache();
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let key = cache_key();
    let args = ["--substituters", &cache, "--option", "trusted-public-keys", &key, "--option", "narinfo-cache-negative-ttl", "0"];
    let daemon = env.daemon_on("socket", "root", "", "", &args, None);
    let out = env
        .cmd("nix-store")
        .env("NIX_CONFIG", "experimental-features = nix-command")
        .args(["--store", &daemon.url, "-r", &glibc])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), glibc);
}

/// A raw client connection to `env`'s daemon after the greeting, as protocol 1.34 (affinity
/// flag 0, reserveSpace 0; the daemon sends its version string, then `LAST`).
fn raw_client_1_34(env: &Env) -> std::os::unix::net::UnixStream {
    raw_client(env, 34).0
}

/// `env`'s daemon on the corpus cache, and a raw 1.34 client connected to it.
fn daemon_and_client_1_34(env: &Env) -> (Daemon, std::os::unix::net::UnixStream) {
    let daemon = env.daemon("root", &env.cache(), "");
    (daemon, raw_client_1_34(env))
}

/// A raw client connection after the greeting as protocol 1.`minor` (1.30 to 1.37: no
/// feature exchange), with the daemon's trusted flag (≥ 1.35: 1 trusted, 2 not).
pub(crate) fn raw_client(env: &Env, minor: u64) -> (std::os::unix::net::UnixStream, Option<u64>) {
    raw_client_on(&env.path("socket"), minor)
}

/// [`raw_client`] of the daemon listening on `socket`.
pub(crate) fn raw_client_on(socket: &Path, minor: u64) -> (std::os::unix::net::UnixStream, Option<u64>) {
    use std::io::Write;
    let mut client = std::os::unix::net::UnixStream::connect(socket).unwrap();
    client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    client.write_all(&u64s(&[0x6e69_7863])).unwrap();
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (0x6478_696f, 0x126));
    client.write_all(&u64s(&[0x100 | minor, 0, 0])).unwrap();
    if minor >= 33 {
        read_string(&mut client);
    }
    let trusted = (minor >= 35).then(|| read_u64(&mut client));
    assert_eq!(read_u64(&mut client), 0x616c_7473);
    (client, trusted)
}

pub(crate) fn read_string(s: &mut impl std::io::Read) -> Vec<u8> {
    let len = read_u64(s) as usize;
    let mut bytes = vec![0u8; len.next_multiple_of(8)];
    s.read_exact(&mut bytes).unwrap();
    bytes.truncate(len);
    bytes
}

/// A request: operation `op`, then its arguments (numbers, or strings with their length and
/// padding).
pub(crate) fn request(op: u64, args: &[Result<u64, &[u8]>]) -> Vec<u8> {
    let mut out = u64s(&[op]);
    for arg in args {
        match arg {
            Ok(n) => out.extend(u64s(&[*n])),
            Err(s) => {
                out.extend(u64s(&[s.len() as u64]));
                out.extend_from_slice(s);
                out.resize(out.len().next_multiple_of(8), 0);
            }
        }
    }
    out
}

pub(crate) const LAST: u64 = 0x616c_7473;
pub(crate) const MISSING: &[u8] = b"/nix/store/00000000000000000000000000000000-missing";

/// A client that pipelines: two requests and the first half of a third in one write. Both
/// replies must arrive while the worker waits for the rest of the third (a worker that held
/// replies back until the next request was complete would leave this client waiting forever),
/// and the third is answered once complete.
#[test]
fn pipelined_requests_get_their_replies_before_the_next_request_is_complete() {
    use std::io::Write;
    let env = Env::new();
    let (_daemon, mut client) = daemon_and_client_1_34(&env);
    let is_valid = request(1, &[Err(MISSING)]);
    client.write_all(&[is_valid.as_slice(), is_valid.as_slice(), &is_valid[..12]].concat()).unwrap();
    for n in 1..=2 {
        let reply = (read_u64(&mut client), read_u64(&mut client));
        assert_eq!(reply, (LAST, 0), "reply {n}: LAST, then false");
    }
    client.write_all(&is_valid[12..]).unwrap();
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (LAST, 0), "reply 3");
}

/// The system calls of `sluice daemon` (traced with `strace -f -y`, so that each descriptor
/// shows its file) while `adds` is run, once it is attached.
fn daemon_syscalls(env: &Env, daemon: &Daemon, calls: &str, adds: impl FnOnce()) -> Vec<String> {
    let out = env.path("strace");
    let pid = daemon.child.id();
    let mut strace = Command::new("strace")
        .args(["-f", "-qq", "-y", "-e", &format!("trace={calls}"), "-e", "signal=none", "-o"])
        .arg(&out)
        .args(["-p", &pid.to_string()])
        .spawn()
        .expect("strace runs (CI installs it)");
    // Attached: every thread of the daemon shows strace as its tracer.
    let deadline = Instant::now() + Duration::from_secs(20);
    let traced = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten().all(|task| {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            status.lines().any(|l| l.starts_with("TracerPid:") && l.split_whitespace().nth(1) != Some("0"))
        })
    };
    while !traced() {
        assert!(Instant::now() < deadline, "strace did not attach to the daemon");
        std::thread::sleep(Duration::from_millis(10));
    }
    adds();
    let _ = Command::new("kill").args(["-INT", &strace.id().to_string()]).status();
    strace.wait().unwrap();
    std::fs::read_to_string(&out).unwrap().lines().map(str::to_owned).collect()
}

/// Text additions of valid paths in a row (a warm `nix-instantiate`) take the shared GC lock
/// for their temporary roots once, not twice each, write the roots once per lock given up,
/// not once each, and poll nothing.
#[test]
fn warm_text_adds_in_a_row_keep_the_gc_lock_and_poll_nothing() {
    let env = Env::new();
    let (daemon, mut client) = daemon_and_client_1_34(&env);
    const ADDS: usize = 20;
    let add_all = |client: &mut std::os::unix::net::UnixStream| {
        for n in 0..ADDS {
            assert!(add_text(client, &format!("text-{n}"), &format!("text {n}")).ends_with(format!("-text-{n}").as_bytes()));
        }
    };
    add_all(&mut client);
    let mut client = raw_client_1_34(&env);
    let calls = daemon_syscalls(&env, &daemon, "flock,poll,ppoll,write", || add_all(&mut client));
    let count = |what: &str| calls.iter().filter(|l| l.contains(what)).count();
    // Taken and released, and again whenever the client was slower than the lease's idle
    // limit (a loaded machine; the trace slows the daemon too): far from 2 per addition.
    let gc_lock = count("gc.lock>");
    assert!((1..=ADDS / 2).contains(&gc_lock), "{gc_lock} flock calls on gc.lock for {ADDS} additions:\n{}", calls.join("\n"));
    // At most one write per release (the last may come after the trace ends).
    let root_writes = calls.iter().filter(|l| l.contains(" write(") && l.contains("/temproots/")).count();
    assert!(root_writes <= gc_lock / 2 + 1, "{root_writes} writes of temporary roots for {ADDS} additions:\n{}", calls.join("\n"));
    assert_eq!(count("poll("), 0, "{}", calls.join("\n"));
}

/// New text paths added in a row (a cold `nix-instantiate`) are unpacked in one directory of
/// temporary trees, not one made and removed for each (whose temporary root took the GC lock
/// twice), and the directory goes once the client is quiet. The additions are sent together
/// on a connection of their own, so that the lease is neither given up for a slow client nor
/// in the gap after an earlier one (`GC_LOCK_GAP` of `sluice-local-store`): the counts are exact.
#[test]
fn cold_text_adds_in_a_row_share_one_directory_of_temporary_trees() {
    use std::io::Write;
    let env = Env::new();
    let (daemon, mut first) = daemon_and_client_1_34(&env);
    add_text(&mut first, "first", "connection and store opened");
    drop(first);
    let mut client = raw_client_1_34(&env);
    const ADDS: usize = 20;
    let requests: Vec<u8> =
        (0..ADDS).flat_map(|n| request(8, &[Err(format!("text-{n}").as_bytes()), Err(format!("text {n}").as_bytes()), Ok(0)])).collect();
    let calls = daemon_syscalls(&env, &daemon, "mkdir,mkdirat,flock", || {
        client.write_all(&requests).unwrap();
        for n in 0..ADDS {
            assert_eq!(until_last(&mut client), Ok(()));
            assert!(read_string(&mut client).ends_with(format!("-text-{n}").as_bytes()));
        }
        // The lease is given up once the client has been quiet for `LEASE_IDLE` (10 ms).
        std::thread::sleep(Duration::from_millis(200));
    });
    let count = |what: &str| calls.iter().filter(|l| l.contains(what)).count();
    // One directory; the connection's lease taken and given up once, and the directory's own
    // temporary root once.
    let (dirs, gc_lock) = (count("sluice-unpacking\""), count("gc.lock>"));
    assert_eq!(dirs, 1, "directories of temporary trees for {ADDS} additions:\n{}", calls.join("\n"));
    assert_eq!(gc_lock, 4, "flock calls on gc.lock for {ADDS} additions:\n{}", calls.join("\n"));
    let left: Vec<String> = common::store_entries(&env.path("root")).into_iter().filter(|e| e.ends_with("-sluice-unpacking")).collect();
    assert_eq!(left, Vec::<String>::new(), "the directory is removed once the client is quiet");
}

/// Each new text path is made durable with an `fsync` of its file and of the store directory,
/// not with a `syncfs` of the whole file system.
#[test]
fn text_adds_flush_their_files_not_the_file_system() {
    let env = Env::new();
    let (daemon, mut client) = daemon_and_client_1_34(&env);
    add_text(&mut client, "first", "connection and store opened");
    let calls = daemon_syscalls(&env, &daemon, "fsync,fdatasync,syncfs,sync", || {
        add_text(&mut client, "second", "text");
    });
    let calls: Vec<&str> = calls.iter().map(|l| l.split_once(' ').map_or(l.as_str(), |(_, call)| call.trim())).collect();
    assert_eq!(calls.len(), 2, "{calls:#?}");
    assert!(calls[0].starts_with("fsync(") && calls[0].contains("-second>) = 0"), "{calls:#?}");
    assert!(calls[1].starts_with("fsync(") && calls[1].ends_with("/nix/store>) = 0"), "{calls:#?}");
}

/// A pipelined quick request's reply does not wait behind a slow request sent with it: here
/// EnsurePath of a path the store lacks, whose substituter accepts connections and never
/// answers.
#[test]
fn a_reply_is_not_held_back_by_a_slow_request_after_it() {
    use std::io::Write;
    let env = Env::new();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let cache = format!("http://{}", silent.local_addr().unwrap());
    let _daemon = env.daemon("root", &cache, "");
    let mut client = raw_client_1_34(&env);
    client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    client.write_all(&[request(1, &[Err(MISSING)]), request(10, &[Err(MISSING)])].concat()).unwrap();
    let reply = (read_u64(&mut client), read_u64(&mut client));
    assert_eq!(reply, (LAST, 0), "IsValidPath is answered while EnsurePath waits for the cache");
    drop(silent);
}

/// The fields of a QueryPathInfo reply after `LAST` and `1` (protocol 1.34) that identify the
/// path's contents: NAR hash (base16), NAR size, content address; checks the others are empty.
fn read_path_info(client: &mut impl std::io::Read) -> (String, u64, String) {
    let deriver = read_string(client);
    let nar_hash = String::from_utf8(read_string(client)).unwrap();
    let references = read_u64(client);
    let _registration_time = read_u64(client);
    let nar_size = read_u64(client);
    let ultimate = read_u64(client);
    let sigs = read_u64(client);
    let ca = String::from_utf8(read_string(client)).unwrap();
    assert_eq!((deriver.len(), references, ultimate, sigs), (0, 0, 0, 0));
    (nar_hash, nar_size, ca)
}

/// QueryPathInfo requests sent together (answered in one database transaction) each get
/// their own reply, in order: valid, missing, valid. A malformed request among them ends the
/// connection with an error, after the replies to the requests before it.
#[test]
fn pipelined_path_info_requests_are_answered_in_order() {
    use std::io::{Read, Write};
    let env = Env::new();
    let (_daemon, mut client) = daemon_and_client_1_34(&env);
    let added = add_text(&mut client, "greeting", "hello");
    assert!(added.ends_with(b"-greeting"), "{}", String::from_utf8_lossy(&added));

    let query = |path: &[u8]| request(26, &[Err(path)]);
    client.write_all(&[query(&added), query(MISSING), query(&added)].concat()).unwrap();
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (LAST, 1), "reply 1");
    let first = read_path_info(&mut client);
    // The NAR of a 5-byte regular file is 120 bytes.
    assert_eq!(first.1, 120);
    assert_eq!(first.0.len(), 64, "base16 sha256: {}", first.0);
    assert!(first.2.starts_with("text:sha256:"), "{}", first.2);
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (LAST, 0), "reply 2: not valid");
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (LAST, 1), "reply 3");
    assert_eq!(read_path_info(&mut client), first);

    client.write_all(&[query(&added), query(b"/nix/store/not-a-store-path")].concat()).unwrap();
    assert_eq!((read_u64(&mut client), read_u64(&mut client)), (LAST, 1), "the request before the malformed one");
    assert_eq!(read_path_info(&mut client), first);
    assert_eq!(read_u64(&mut client), 0x6378_7470, "STDERR_ERROR for the malformed one");
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("not-a-store-path"), "the error names the path");
}

/// The corpus's `libidn2` derivation: its `.drv`, the `.drv` of its input `libunistring` and
/// the builder script are only in the cache (from `cache-drv`), its output and the output's
/// closure only in the cache (the bzip2 subset).
const LIBIDN2_DRV: &str = "lwdbwfnqd05c45mlvn9537salc088cyg-libidn2-2.3.4.drv";
const LIBIDN2: &str = "/nix/store/xyvbjffswy2ix1ipcpb6gnw3abxsaym7-libidn2-2.3.4";

/// Realising a derivation's outputs when the `.drv` is not valid but a cache has it: Nix 2.8's
/// `nix-store -r X.drv` and Nix 2.26's `nix build 'X.drv^*'` through `sluice daemon` and
/// through Nix 2.8's `nix-daemon`, each on a fresh store with the same cache. Both daemons
/// substitute the `.drv` with its closure, then the outputs: the same output printed, the
/// same store left (the `.drv` closure and the output closure, nothing built).
#[test]
fn derivation_only_in_a_cache_is_substituted_first() {
    let env = Env::new();
    let cache = env.cache_with_derivation(LIBIDN2_DRV);
    let drv = format!("/nix/store/{LIBIDN2_DRV}");
    let nix_conf = format!("substituters = {cache}\ntrusted-public-keys = {}\n", cache_key());
    // The clients read the `.drv` from the store's real directory; root's `substituters` is
    // the daemon's (the client's own setting is forwarded).
    let key = cache_key();
    let options = ["--option", "substituters", &cache, "--option", "trusted-public-keys", &key];
    let real = |store: &str, root: &str| format!("{store}?real={}", env.path(root).join("nix/store").display());
    let mut stores = Vec::new();
    for (client, n) in [("Nix 2.8", 1), ("Nix 2.26", 2)] {
        let (sluice_root, nix_root) = (format!("sluice-{n}"), format!("nix-daemon-{n}"));
        let sluice = env.daemon_on(&format!("sluice-{n}.socket"), &sluice_root, &cache, "", &[], None);
        let nix_daemon = env.nix_daemon(&format!("nix-daemon-{n}.socket"), &nix_root, &nix_conf);
        for (daemon, root) in [(&sluice, &sluice_root), (&nix_daemon, &nix_root)] {
            let url = real(&daemon.url, root);
            let (ok, out, err) = match n {
                1 => as_root(&env, false, "nix-store", &[&["--store", &url, "-r", &drv][..], &options].concat()),
                _ => as_root(
                    &env,
                    true,
                    "nix",
                    &[&["build", "--store", &url, &format!("{drv}^*"), "--no-link", "--print-out-paths"][..], &options].concat(),
                ),
            };
            assert!(ok, "{client} through {}: {err}", daemon.url);
            assert_eq!(out.trim(), LIBIDN2, "{client} through {}: {err}", daemon.url);
            let entries = store_entries(&env, root);
            stores.push((client, root.clone(), entries));
        }
    }
    for pair in stores.chunks(2) {
        let [(client, sluice_root, via_sluice), (_, _, via_nix)] = pair else { unreachable!() };
        assert_eq!(via_sluice, via_nix, "{client}: the stores left by sluice ({sluice_root}) and nix-daemon");
        for name in [
            LIBIDN2_DRV,
            "issb5gssbayvxbl7b2n5880lcslarhbg-libunistring-1.1.drv",
            "xyvbjffswy2ix1ipcpb6gnw3abxsaym7-libidn2-2.3.4",
            "8j3ihyw3p978y2hzm7mkwvzqxk86h123-libunistring-1.1",
        ] {
            assert!(via_sluice.iter().any(|e| e == name), "{client}: {name} not in {via_sluice:?}");
        }
    }
}

/// The activities of a client's `--log-format internal-json` log that Nix's worker and
/// substitution goals start (not QueryMissing's lookups, nor the downloads of narinfos and
/// `nix-cache-info`: only those of NARs), each with its level, text and fields
/// and the last result of each kind sent for it (a `setExpected` per activity type it is
/// about; of a NAR's progress only its size, the bytes done being sent at intervals), sorted.
fn substitution_activities(log: &str) -> Vec<serde_json::Value> {
    use serde_json::{json, Value};
    let mut started: Vec<(u64, Value)> = Vec::new();
    for line in log.lines().filter_map(|l| l.strip_prefix("@nix ")) {
        let v: Value = serde_json::from_str(line).unwrap();
        let id = v["id"].as_u64().unwrap_or(0);
        match v["action"].as_str() {
            Some("start") if v["type"] == 101 && !v["fields"][0].as_str().unwrap_or_default().contains("/nar/") => {}
            Some("start") if ![0, 109].contains(&v["type"].as_u64().unwrap()) => {
                started
                    .push((id, json!({"type": v["type"], "level": v["level"], "text": v["text"], "fields": v["fields"], "results": {}})));
            }
            Some("result") => {
                if let Some((_, entry)) = started.iter_mut().find(|(i, _)| *i == id) {
                    let (kind, mut fields) = (v["type"].as_u64().unwrap(), v["fields"].clone());
                    let key = match kind {
                        106 => format!("106 of {}", fields[0]),
                        _ => kind.to_string(),
                    };
                    if entry["type"] == 100 {
                        fields[0] = Value::Null;
                    }
                    entry["results"][key] = fields;
                }
            }
            _ => {}
        }
    }
    let mut all: Vec<Value> = started.into_iter().map(|(_, v)| v).collect();
    all.sort_by_key(|v| v.to_string());
    all
}

/// The activities Nix's substitution goals send (`substitution-goal.cc`, `store-api.cc`'s
/// `copyStorePath`, `filetransfer.cc`) reach a real client through `sluice daemon` as through
/// Nix 2.8's `nix-daemon`: Nix 2.8's `nix-store -r` and Nix 2.26's `nix build` of the same path,
/// each on a fresh store with the same cache (`file://`, then nginx over HTTP, whose NARs are
/// downloads: `actFileTransfer`), log the same activities (types, levels, texts naming the
/// cache, fields) and the same final progress results.
#[test]
fn substitution_activities_match_nix_daemon() {
    let env = Env::new();
    let file = env.cache();
    let nginx = common::CacheServer::start(&env.path("bin-cache"), &env.path("nginx"), &[]);
    let glibc = &store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    for (cache, kind) in [(&file, "file"), (&nginx.url, "http")] {
        let nix_conf = format!("substituters = {cache}\ntrusted-public-keys = {}\n", cache_key());
        for (client, n) in [("Nix 2.8", 1), ("Nix 2.26", 2)] {
            let mut seen = Vec::new();
            let (sluice_root, nix_root) = (format!("sluice-{kind}-{n}"), format!("nix-daemon-{kind}-{n}"));
            let sluice = env.daemon_on(&format!("{sluice_root}.socket"), &sluice_root, cache, "", &[], None);
            let nix_daemon = env.nix_daemon(&format!("{nix_root}.socket"), &nix_root, &nix_conf);
            for (daemon, root) in [(&sluice, &sluice_root), (&nix_daemon, &nix_root)] {
                let url = format!("{}?real={}", daemon.url, env.path(root).join("nix/store").display());
                let log = ["--log-format", "internal-json", "-v", "--option", "substituters", cache];
                let (ok, _, err) = match n {
                    1 => as_root(&env, false, "nix-store", &[&["--store", &url, "-r", glibc][..], &log].concat()),
                    _ => as_root(&env, true, "nix", &[&["build", "--store", &url, glibc, "--no-link"][..], &log].concat()),
                };
                assert!(ok, "{client} through {}: {err}", daemon.url);
                seen.push(substitution_activities(&err));
            }
            // nix-daemon reports a NAR's progress (copied, downloaded) at intervals: a small NAR
            // may end without any.
            let [ours, theirs] = &mut seen[..] else { unreachable!() };
            for (a, b) in ours.iter_mut().zip(theirs.iter()) {
                if (b["type"] == 100 || b["type"] == 101) && b["results"] == serde_json::json!({}) {
                    a["results"] = serde_json::json!({});
                }
            }
            let pretty = |v: &Vec<serde_json::Value>| v.iter().map(|a| a.to_string()).collect::<Vec<_>>().join("\n");
            let what = format!("{client}, {kind} cache: through sluice daemon (left) and nix-daemon (right)");
            assert_eq!(pretty(&seen[0]), pretty(&seen[1]), "{what}");
            assert_eq!(seen[0].iter().filter(|a| a["type"] == 100).count(), 4, "{what}");
            let transfers = if kind == "http" { 4 } else { 0 };
            assert_eq!(seen[0].iter().filter(|a| a["type"] == 101).count(), transfers, "{what}");
        }
    }
}

/// The byte progress results (`resProgress`: done, expected) sent for the `actCopyPath` (100)
/// and `actFileTransfer` (101) activities about `name` in a client's internal-json log, in
/// the order sent, by activity type.
fn byte_progress(log: &str, name: &str) -> [Vec<(u64, u64)>; 2] {
    let mut ids: Vec<(u64, usize)> = Vec::new();
    let mut seen = [Vec::new(), Vec::new()];
    for line in log.lines().filter_map(|l| l.strip_prefix("@nix ")) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = v["id"].as_u64().unwrap_or(0);
        match v["action"].as_str() {
            Some("start") if v["type"] == 100 && v["text"].as_str().is_some_and(|t| t.contains(name)) => ids.push((id, 0)),
            Some("start") if v["type"] == 101 && v["text"].as_str().is_some_and(|t| t.contains("/nar/")) => ids.push((id, 1)),
            Some("result") if v["type"] == 105 => {
                if let Some((_, kind)) = ids.iter().find(|(i, _)| *i == id) {
                    seen[*kind].push((v["fields"][0].as_u64().unwrap(), v["fields"][1].as_u64().unwrap()));
                }
            }
            _ => {}
        }
    }
    seen
}

/// A NAR's progress reaches a real client through `sluice daemon` while it streams, as
/// through Nix 2.8's `nix-daemon` (`filetransfer.cc`'s progress callback, `copyStorePath`'s
/// progress sink): Nix 2.8's `nix-store -r` and Nix 2.26's `nix build` of a 24 MiB path from
/// an HTTP cache at RTT 20 ms, through each daemon, get `actFileTransfer` and `actCopyPath`
/// progress with bytes done below the size before the end, rising, and ending at the same
/// sizes nix-daemon announces (the download's FileSize, the NarSize; sluice's last report is
/// the whole size).
#[test]
fn byte_progress_streams_through_the_daemon_as_through_nix_daemon() {
    let env = Env::new();
    let blob = env.path("big-blob");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let bytes: Vec<u8> = (0..24 << 20)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect();
    std::fs::write(&blob, bytes).unwrap();
    let src = env.path("src").display().to_string();
    let path = env.nix("nix-store", &["--store", &src, "--add", blob.to_str().unwrap()]).trim().to_owned();
    let secret = format!("{SHARED}/corpus/keys/cache-key.sec");
    let to = format!("file://{}?compression=none&secret-key={secret}", env.path("big-cache").display());
    env.nix("nix", &["copy", "--from", &src, "--to", &to, &path]);
    let nginx = common::CacheServer::start(&env.path("big-cache"), &env.path("nginx"), &["--rtt-ms", "20"]);
    let nix_conf = format!("substituters = {}\ntrusted-public-keys = {}\n", nginx.url, cache_key());
    for (client, n) in [("Nix 2.8", 1), ("Nix 2.26", 2)] {
        let mut seen = Vec::new();
        let (sluice_root, nix_root) = (format!("sluice-{n}"), format!("nix-daemon-{n}"));
        let sluice = env.daemon_on(&format!("{sluice_root}.socket"), &sluice_root, &nginx.url, "", &[], None);
        let nix_daemon = env.nix_daemon(&format!("{nix_root}.socket"), &nix_root, &nix_conf);
        for (daemon, root) in [(&sluice, &sluice_root), (&nix_daemon, &nix_root)] {
            let url = format!("{}?real={}", daemon.url, env.path(root).join("nix/store").display());
            let log = ["--log-format", "internal-json", "-v", "--option", "substituters", &nginx.url];
            let (ok, _, err) = match n {
                1 => as_root(&env, false, "nix-store", &[&["--store", &url, "-r", &path][..], &log].concat()),
                _ => as_root(&env, true, "nix", &[&["build", "--store", &url, &path, "--no-link"][..], &log].concat()),
            };
            assert!(ok, "{client} through {}: {err}", daemon.url);
            seen.push(byte_progress(&err, "big-blob"));
        }
        for kind in 0..2 {
            let (ours, theirs) = (&seen[0][kind], &seen[1][kind]);
            let what =
                format!("{client}, {}: through sluice daemon {ours:?}, nix-daemon {theirs:?}", ["actCopyPath", "actFileTransfer"][kind]);
            let size = theirs.last().map(|p| p.1).unwrap_or_default();
            assert!(size > 24 << 20, "{what}");
            for progress in [ours, theirs] {
                assert!(progress.iter().any(|&(done, _)| done > 0 && done < size), "no progress before the end: {what}");
                assert!(progress.windows(2).all(|w| w[0].0 <= w[1].0), "{what}");
                // curl reports (0, 0) until the response's headers have come.
                assert!(progress.iter().all(|&(done, expected)| expected == size || (done, expected) == (0, 0)), "{what}");
            }
            // nix-daemon's last report may come before the NAR's last chunk.
            assert_eq!(ours.last(), Some(&(size, size)), "{what}");
        }
    }
}

/// Nix 2.26 (`nix-modern`, protocol 1.38 with no features) as a client: the same
/// answers as Nix 2.8 through the same daemon.
#[test]
fn nix_2_26_client_matches_nix_2_8() {
    let env = Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let key = cache_key();
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    env.nix("nix", &["copy", "--from", &cache, "--to", &daemon.url, &glibc, "--option", "trusted-public-keys", &key]);
    // The chroot's Nix reads .drv files from the daemon's store itself (/tmp is visible in it).
    let modern_url = format!("{}?real={}", daemon.url, env.path("root/nix/store").display());
    let modern = |args: &[&str]| -> String {
        let out = env.cmd(&format!("{SHARED}/bin/nix-modern")).current_dir(env.path("")).args(args).output().unwrap();
        assert!(out.status.success(), "nix-modern {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        format!("{}{}", String::from_utf8(out.stdout).unwrap(), String::from_utf8_lossy(&out.stderr))
    };
    let ping = modern(&["nix", "store", "ping", "--store", &modern_url]);
    assert!(ping.contains("Version: 2.24.0+sluice.") && ping.contains("Trusted: 1"), "{ping}");
    let only_stdout = |s: String| s.lines().filter(|l| l.starts_with("/nix/store/")).collect::<Vec<_>>().join("\n");
    let via_modern = only_stdout(modern(&["nix-store", "--store", &modern_url, "-qR", &glibc]));
    assert_eq!(via_modern, env.nix("nix-store", &["--store", &daemon.url, "-qR", &glibc]).trim_end());
    assert!(via_modern.lines().count() > 1);

    let file = env.path("hello.txt");
    std::fs::write(&file, "hello from Nix 2.26\n").unwrap();
    let f = file.to_str().unwrap();
    let added = only_stdout(modern(&["nix-store", "--store", &modern_url, "--add", f]));
    assert_eq!(added, env.nix("nix-store", &["--store", &daemon.url, "--add", f]).trim_end());

    let wl = env.path("workload");
    let ok = Command::new(format!("{SHARED}/bench/gen-instantiate-workload")).arg(&wl).arg("20").stdout(Stdio::null()).status().unwrap();
    assert!(ok.success());
    let wl = wl.to_str().unwrap();
    let drv = only_stdout(modern(&["nix-instantiate", "--store", &modern_url, wl]));
    assert!(drv.ends_with("-system.drv"), "{drv}");
    assert_eq!(drv, env.nix("nix-instantiate", &["--store", &daemon.url, wl]).trim_end());
    let info = modern(&["nix", "path-info", "--store", &modern_url, "--json", &drv]);
    assert!(info.contains("\"ca\"") && info.contains("text:sha256:"), "{info}");
}

/// Nix 2.26's `nix build --json` of store paths that are not derivation outputs, through the
/// daemon: one substituted, then already valid. Each result's entry is the path itself (a JSON
/// string), as through nix-daemon, whose results for what no builder ran have start and stop
/// times of 0; with a time, `nix build` indexes the string and fails ("cannot use operator[]
/// with a string argument", Nix's functional test build.sh).
#[test]
fn nix_build_json_of_paths_nothing_built_for() {
    let env = Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let url = format!("{}?real={}", daemon.url, env.path("root/nix/store").display());
    for when in ["substituted", "already valid"] {
        let args = ["build", "--json", "--no-link", "--store", &url, &glibc, "--option", "substituters", &cache];
        let (ok, out, err) = as_root(&env, true, "nix", &args);
        assert!(ok, "{when}: {err}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), serde_json::json!([glibc]), "{when}");
    }
}

/// Reads stderr messages up to the operation's end: `Ok` at `LAST` (its result follows), or
/// the message of an `ERROR` (protocol ≥ 1.26 form). Log lines and activities are skipped.
fn until_last(s: &mut impl std::io::Read) -> Result<(), String> {
    until_last_logged(s).1
}

/// [`until_last`], and the log lines (`NEXT`) sent before the end.
fn until_last_logged(s: &mut impl std::io::Read) -> (Vec<String>, Result<(), String>) {
    fn fields(s: &mut impl std::io::Read) {
        for _ in 0..read_u64(s) {
            match read_u64(s) {
                0 => {
                    read_u64(s);
                }
                1 => {
                    read_string(s);
                }
                t => panic!("activity field type {t}"),
            }
        }
    }
    let mut log = Vec::new();
    loop {
        match read_u64(s) {
            LAST => return (log, Ok(())),
            0x6378_7470 => {
                assert_eq!(read_string(s), b"Error");
                read_u64(s);
                read_string(s);
                let msg = String::from_utf8(read_string(s)).unwrap();
                assert_eq!((read_u64(s), read_u64(s)), (0, 0), "no position, no traces");
                return (log, Err(msg));
            }
            0x6f6c_6d67 => log.push(String::from_utf8_lossy(&read_string(s)).into_owned()),
            0x5354_5254 => {
                read_u64(s);
                read_u64(s);
                read_u64(s);
                read_string(s);
                fields(s);
                read_u64(s);
            }
            0x5354_4f50 => {
                read_u64(s);
            }
            0x5253_4c54 => {
                read_u64(s);
                read_u64(s);
                fields(s);
            }
            tag => panic!("unexpected stderr message {tag:#x}"),
        }
    }
}

/// QueryValidDerivers (op 33) of `path` on `client`: the derivations registered with it
/// among their outputs (`DerivationOutputs`).
fn valid_derivers(client: &mut std::os::unix::net::UnixStream, path: &str) -> Vec<String> {
    use std::io::Write;
    client.write_all(&request(33, &[Err(path.as_bytes())])).unwrap();
    until_last(client).unwrap();
    (0..read_u64(client)).map(|_| String::from_utf8(read_string(client)).unwrap()).collect()
}

/// IsValidPath of `path` on `client`, which must still be usable: the answer.
pub(crate) fn is_valid(client: &mut std::os::unix::net::UnixStream, path: &[u8]) -> u64 {
    use std::io::Write;
    client.write_all(&request(1, &[Err(path)])).unwrap();
    assert_eq!(until_last(client), Ok(()));
    read_u64(client)
}

/// AddTextToStore of `text` as `name` (no references): the new path.
pub(crate) fn add_text(client: &mut std::os::unix::net::UnixStream, name: &str, text: &str) -> Vec<u8> {
    use std::io::Write;
    client.write_all(&request(8, &[Err(name.as_bytes()), Err(text.as_bytes()), Ok(0)])).unwrap();
    assert_eq!(until_last(client), Ok(()));
    read_string(client)
}

/// A BuildDerivation request for `drv` with one output `out` (path, hash algorithm, hash),
/// no inputs, two arguments, one environment variable, build mode normal.
fn build_derivation(drv: &[u8], out: [&[u8]; 3]) -> Vec<u8> {
    let [path, algo, hash] = out;
    request(
        36,
        &[
            Err(drv),
            Ok(1),
            Err(b"out"),
            Err(path),
            Err(algo),
            Err(hash),
            Ok(0),
            Err(b"x86_64-linux"),
            Err(b"/bin/sh"),
            Ok(2),
            Err(b"-c"),
            Err(b"echo hi > $out"),
            Ok(1),
            Err(b"out"),
            Err(path),
            Ok(0),
        ],
    )
}

/// A build result as protocol 1.37 sends it: status, message and built outputs (id →
/// realisation JSON). Nothing was built: times built 0, deterministic, start and stop times 0
/// (Nix sets them only when a builder runs), no CPU times.
fn read_build_result(s: &mut impl std::io::Read) -> (u64, String, Vec<(String, String)>) {
    let status = read_u64(s);
    let msg = String::from_utf8(read_string(s)).unwrap();
    let (times_built, non_deterministic, start, stop) = (read_u64(s), read_u64(s), read_u64(s), read_u64(s));
    assert_eq!((times_built, non_deterministic), (0, 0));
    assert_eq!((start, stop), (0, 0), "start and stop times");
    assert_eq!((read_u64(s), read_u64(s)), (0, 0), "no CPU times");
    let outputs =
        (0..read_u64(s)).map(|_| (String::from_utf8(read_string(s)).unwrap(), String::from_utf8(read_string(s)).unwrap())).collect();
    (status, msg, outputs)
}

/// A daemon on a fresh store (with `extra_config`) and a protocol 1.37 client of it, which
/// the daemon must tell its trusted flag `trusted` (1 trusted, 2 not), with the path of a
/// text file `x` (`hi\n`) that the client added.
fn daemon_and_client_1_37(env: &Env, extra_config: &str, trusted: u64) -> (Daemon, std::os::unix::net::UnixStream, Vec<u8>) {
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, extra_config);
    let (mut client, flag) = raw_client(env, 37);
    assert_eq!(flag, Some(trusted), "the trusted flag");
    let out = add_text(&mut client, "x", "hi\n");
    (daemon, client, out)
}

const DRV: &[u8] = b"/nix/store/00000000000000000000000000000000-x.drv";
const ZERO_ID: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000!out";

/// BuildDerivation (op 36) from a trusted client (the tests run as root, the default
/// `trusted-users`): an output already valid → AlreadyValid; one the corpus cache has →
/// Substituted; one nobody has → MiscFailure saying that sluice does not build. The
/// connection stays usable after each.
#[test]
fn build_derivation_realises_outputs_by_substitution_only() {
    use std::io::Write;
    let env = Env::new();
    // Root is trusted by default.
    let (_daemon, mut client, out) = daemon_and_client_1_37(&env, "", 1);
    client.write_all(&build_derivation(DRV, [&out, b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg, outputs) = read_build_result(&mut client);
    assert_eq!((status, msg.as_str()), (2, ""), "AlreadyValid");
    let base = std::str::from_utf8(&out).unwrap().strip_prefix("/nix/store/").unwrap();
    let realisation = format!(r#"{{"dependentRealisations":{{}},"id":"{ZERO_ID}","outPath":"{base}","signatures":[]}}"#);
    assert_eq!(outputs, [(ZERO_ID.to_owned(), realisation)]);
    assert_eq!(is_valid(&mut client, &out), 1);

    let cached = store_path_of(&env.path("bin-cache"), "py14wj21zshnib43vh5f66ihm7rx610h");
    assert_eq!(is_valid(&mut client, cached.as_bytes()), 0);
    client.write_all(&build_derivation(DRV, [cached.as_bytes(), b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg, outputs) = read_build_result(&mut client);
    assert_eq!((status, msg.as_str(), outputs.len()), (1, "", 1), "Substituted");
    assert_eq!(is_valid(&mut client, cached.as_bytes()), 1);

    client.write_all(&build_derivation(DRV, [MISSING, b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg, outputs) = read_build_result(&mut client);
    assert_eq!(status, 9, "MiscFailure");
    assert_eq!(
        msg,
        "cannot build '/nix/store/00000000000000000000000000000000-x.drv': the sluice daemon does not build derivations \
         (outputs not valid and not substitutable: out (/nix/store/00000000000000000000000000000000-missing); \
         `sluice daemon --build-via unix://SOCKET` builds it through the nix-daemon listening on SOCKET)"
    );
    assert!(outputs.is_empty());
    assert_eq!(is_valid(&mut client, MISSING), 0);

    // Not a derivation: an error, and the connection goes on.
    client.write_all(&build_derivation(MISSING, [&out, b"", b""])).unwrap();
    let err = until_last(&mut client).unwrap_err();
    assert_eq!(
        err,
        "cannot build '/nix/store/00000000000000000000000000000000-missing': it is not a derivation (its name does not end in .drv)"
    );
    assert_eq!(is_valid(&mut client, &out), 1);

    // Protocol 1.34 (Nix 2.8): the result without CPU times.
    let mut old = raw_client_1_34(&env);
    old.write_all(&build_derivation(DRV, [&out, b"", b""])).unwrap();
    assert_eq!(until_last(&mut old), Ok(()));
    let (status, msg) = (read_u64(&mut old), read_string(&mut old));
    let _times = (read_u64(&mut old), read_u64(&mut old), read_u64(&mut old), read_u64(&mut old));
    assert_eq!((status, msg.as_slice(), read_u64(&mut old)), (2, &b""[..], 1), "AlreadyValid, one built output");
    read_string(&mut old);
    assert_eq!(String::from_utf8(read_string(&mut old)).unwrap().matches(base).count(), 1);
    assert_eq!(is_valid(&mut old, &out), 1);
}

/// The three frames of a framed stream holding `text` in two parts, and its terminator.
fn framed(text: &[u8]) -> Vec<u8> {
    let (a, b) = text.split_at(text.len() / 2);
    let mut out = Vec::new();
    for part in [a, b, &[][..]] {
        out.extend(u64s(&[part.len() as u64]));
        out.extend_from_slice(part);
    }
    out
}

/// AddBuildLog (op 45) from a trusted client: the log is stored bzip2-compressed where Nix
/// looks for it, and real Nix 2.8 prints it (`nix log --store <root>`). A second log for the
/// same derivation leaves the first; a path that is not a derivation is refused; the
/// connection stays usable after each. Real Nix 2.8 adds a log too (`nix store copy-log`).
#[test]
fn add_build_log_is_stored_where_nix_reads_it() {
    use std::io::{Read, Write};
    let env = Env::new();
    let (daemon, mut client, _) = daemon_and_client_1_37(&env, "", 1);
    // A derivation, so that `nix log` can read it; its output path is the one Nix computes.
    let masked = r#"Derive([("out","","","")],[],[],"x86_64-linux","/bin/sh",["-c","echo hi"],[("out","")])"#;
    let parsed = sluice_nix::derivation::Derivation::parse(&StoreDir::default(), "hello", masked.as_bytes()).unwrap();
    let hash = parsed.hash_modulo(&StoreDir::default(), true, &mut |_| unreachable!("no inputs")).unwrap().remove("out").unwrap();
    let out = StoreDir::default().display_path(&StoreDir::default().make_store_path("output:out", &hash, "hello").unwrap());
    let aterm = format!(r#"Derive([("out","{out}","","")],[],[],"x86_64-linux","/bin/sh",["-c","echo hi"],[("out","{out}")])"#);
    let drv = String::from_utf8(add_text(&mut client, "hello.drv", &aterm)).unwrap();
    let base = drv.strip_prefix("/nix/store/").unwrap();
    let text = "building 'hello'...\nhello from the build\n";
    // Nix clients send the base name.
    client.write_all(&[request(45, &[Err(base.as_bytes())]), framed(text.as_bytes())].concat()).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1);
    assert_eq!(is_valid(&mut client, drv.as_bytes()), 1);

    let file = env.path("root/nix/var/log/nix/drvs").join(&base[..2]).join(format!("{}.bz2", &base[2..]));
    let mut stored = String::new();
    bzip2::read::BzDecoder::new(std::fs::File::open(&file).unwrap()).read_to_string(&mut stored).unwrap();
    assert_eq!(stored, text);
    let root = env.path("root");
    assert_eq!(env.nix("nix", &["log", "--store", root.to_str().unwrap(), &drv]), text);

    // A second log: kept as it was (as Nix does); a full store path is accepted too.
    client.write_all(&[request(45, &[Err(drv.as_bytes())]), framed(b"another build\n")].concat()).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1);
    assert_eq!(env.nix("nix-store", &["--store", root.to_str().unwrap(), "--read-log", &drv]), text);

    // Not a derivation: refused after the log is read, and the connection goes on.
    client.write_all(&[request(45, &[Err(b"00000000000000000000000000000000-missing")]), framed(b"log\n")].concat()).unwrap();
    assert_eq!(
        until_last(&mut client),
        Err("cannot add a build log for '/nix/store/00000000000000000000000000000000-missing': it is not a derivation".to_owned())
    );
    assert_eq!(is_valid(&mut client, drv.as_bytes()), 1);

    // Real Nix 2.8 as the client: `nix store copy-log` from a direct store that has a log.
    let direct = env.path("direct");
    let file = env.path("hello.drv");
    std::fs::write(&file, aterm.replace("00000000000000000000000000000000-hello", "cb96vlc61mbs44an6dc04vkjh9avpzsc-hello")).unwrap();
    let direct_store = direct.to_str().unwrap();
    let other = env.nix("nix-store", &["--store", direct_store, "--add", file.to_str().unwrap()]).trim_end().to_owned();
    let other_base = other.strip_prefix("/nix/store/").unwrap();
    let log_dir = direct.join("nix/var/log/nix/drvs").join(&other_base[..2]);
    std::fs::create_dir_all(&log_dir).unwrap();
    let mut encoder = bzip2::write::BzEncoder::new(
        std::fs::File::create(log_dir.join(format!("{}.bz2", &other_base[2..]))).unwrap(),
        bzip2::Compression::default(),
    );
    encoder.write_all(b"copied by nix store copy-log\n").unwrap();
    encoder.finish().unwrap();
    env.nix("nix", &["store", "copy-log", "--store", direct_store, "--from", direct_store, "--to", &daemon.url, &other]);
    assert_eq!(env.nix("nix-store", &["--store", root.to_str().unwrap(), "--read-log", &other]), "copied by nix store copy-log\n");
}

/// An untrusted client (root not in `trusted-users`): AddBuildLog is refused and nothing is
/// stored; BuildDerivation of an input-addressed derivation is refused as Nix refuses it, even
/// one whose outputs are valid, and a fixed-output one gets the build failure. The connection stays usable after each.
#[test]
fn untrusted_client_cannot_add_logs_or_build_input_addressed_derivations() {
    use std::io::Write;
    let env = Env::new();
    let (_daemon, mut client, out) = daemon_and_client_1_37(&env, "trusted-users = nobody-in-particular", 2);

    client.write_all(&[request(45, &[Err(&DRV[11..])]), framed(b"a log\n")].concat()).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not privileged to add logs".to_owned()));
    assert!(!env.path("root/nix/var/log/nix/drvs").exists());
    assert_eq!(is_valid(&mut client, &out), 1);

    client.write_all(&build_derivation(DRV, [MISSING, b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not privileged to build input-addressed derivations".to_owned()));
    assert_eq!(is_valid(&mut client, &out), 1);

    // Refused even when its outputs are valid (Nix refuses before looking at them).
    client.write_all(&build_derivation(DRV, [&out, b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not privileged to build input-addressed derivations".to_owned()));
    assert_eq!(is_valid(&mut client, &out), 1);

    // A fixed output (flat, the sha256 of "1"): its path is computed, not taken from the client.
    let hash = b"6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b";
    client.write_all(&build_derivation(DRV, [MISSING, b"sha256", hash])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg, _) = read_build_result(&mut client);
    assert_eq!(status, 9, "MiscFailure: {msg}");
    assert!(msg.contains("does not build derivations") && msg.contains("-x)") && !msg.contains("-missing"), "{msg}");
    assert_eq!(is_valid(&mut client, &out), 1);
}

/// BuildPathsWithResults (op 46) of `drv!out!out`, an output of the derivation that a
/// derivation's output is (dynamic derivations): a MiscFailure with Nix 2.26's words (its
/// `Worker::makeGoal` does not build them either), keyed by the path as sent; the
/// connection goes on.
#[test]
fn dynamic_derivation_outputs_are_not_built_in_one_shot() {
    use std::io::Write;
    let env = Env::new();
    let (_daemon, mut client, out) = daemon_and_client_1_37(&env, "", 1);
    let target = [DRV, b"!out!out"].concat();
    client.write_all(&request(46, &[Ok(1), Err(&target), Ok(0)])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1, "one result");
    assert_eq!(read_string(&mut client), target, "keyed by the path as sent");
    let (status, msg, outputs) = read_build_result(&mut client);
    assert_eq!((status, msg.as_str()), (9, "Building dynamic derivations in one shot is not yet implemented."), "MiscFailure");
    assert!(outputs.is_empty());
    assert_eq!(is_valid(&mut client, &out), 1);
}

/// QueryRealisation (op 43) and RegisterDrvOutput (op 42) in both forms (before 1.31: plain
/// output paths and an id with a base name; from 1.31: realisation JSON) through a daemon
/// without `--build-via` and `ca-derivations`: no realisation is found, registering one is
/// refused, a malformed id is an error; the connection stays usable after each.
#[test]
fn realisations_are_never_found_and_cannot_be_registered() {
    use std::io::Write;
    let env = Env::new();
    let cache = env.cache();
    let _daemon = env.daemon("root", &cache, "");
    let id = "sha256:15e3c560894cbb27085cf65b5a2ecb18488c999497f4531b6907a7581ce6d527!out";
    let refused = format!(
        "cannot register the realisation of {id}: the sluice daemon keeps realisations only with the experimental feature \
         'ca-derivations' and `--build-via`"
    );
    for minor in [30, 37] {
        let (mut client, _) = raw_client(&env, minor);
        client.write_all(&request(43, &[Err(id.as_bytes())])).unwrap();
        assert_eq!(until_last(&mut client), Ok(()), "1.{minor}");
        assert_eq!(read_u64(&mut client), 0, "1.{minor}: no realisation");
        assert_eq!(is_valid(&mut client, MISSING), 0);

        client.write_all(&request(43, &[Err(b"sha256:abc!out")])).unwrap();
        let err = until_last(&mut client).unwrap_err();
        assert!(err.starts_with("invalid derivation output id: \"sha256:abc!out\""), "{err}");
        assert_eq!(is_valid(&mut client, MISSING), 0);

        let json =
            format!(r#"{{"dependentRealisations":{{}},"id":"{id}","outPath":"00000000000000000000000000000000-missing","signatures":[]}}"#);
        let register = if minor >= 31 {
            request(42, &[Err(json.as_bytes())])
        } else {
            request(42, &[Err(id.as_bytes()), Err(b"00000000000000000000000000000000-missing")])
        };
        client.write_all(&register).unwrap();
        assert_eq!(until_last(&mut client), Err(refused.clone()), "1.{minor}");
        assert_eq!(is_valid(&mut client, MISSING), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Untrusted clients, op by op (docs/daemon-trust.md): real clients run as `nobody` (the daemon
// sees its uid with SO_PEERCRED); ops no CLI reaches use the raw helpers above with root made
// untrusted by `trusted-users` (the same decision in the daemon: `Peer::trusted`).

/// Makes `env` usable by `nobody`: its directories reachable, a home and cache it may write.
fn open_to_nobody(env: &Env) {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    mode(env.dir.path(), 0o755);
    mode(&env.path("conf"), 0o755);
    for d in ["nobody-home", "nobody-cache"] {
        std::fs::create_dir_all(env.path(d)).unwrap();
        std::os::unix::fs::chown(env.path(d), Some(65534), Some(65534)).unwrap();
    }
}

/// The output of a Nix 2.8 command run as `nobody` with `env`'s isolated configuration:
/// (success, stdout, stderr).
fn as_nobody(env: &Env, program: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("runuser").args(["-u", "nobody", "--"]).args(nobody_env(env)).arg(program).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// [`as_nobody`] with Nix 2.26 (`nix-modern`: runuser inside its chroot, which sees /tmp).
fn modern_as_nobody(env: &Env, program: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(format!("{SHARED}/bin/nix-modern"))
        .current_dir(env.path(""))
        .args(["runuser", "-u", "nobody", "--"])
        .args(nobody_env(env))
        .arg(program)
        .args(args)
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// [`as_nobody`] as root (trusted by default), Nix 2.8 or (`modern`) 2.26.
fn as_root(env: &Env, modern: bool, program: &str, args: &[&str]) -> (bool, String, String) {
    let mut cmd = if modern {
        let mut c = env.cmd(&format!("{SHARED}/bin/nix-modern"));
        c.current_dir(env.path("")).arg(program);
        c
    } else {
        env.cmd(program)
    };
    let out = cmd.args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn nobody_env(env: &Env) -> Vec<String> {
    vec![
        "env".into(),
        format!("HOME={}", env.path("nobody-home").display()),
        format!("XDG_CACHE_HOME={}", env.path("nobody-cache").display()),
        format!("NIX_CONF_DIR={}", env.path("conf").display()),
        "NIX_CONFIG=substituters =\nexperimental-features = nix-command".into(),
        // Nix opens its default store even when every store a command uses is given.
        format!("NIX_REMOTE=local?root={}", env.path("nobody-home/default-store").display()),
    ]
}

/// The daemon's store entries (names under `<root>/nix/store`), to show that a refusal
/// changed nothing.
fn store_entries(env: &Env, root: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(env.path(root).join("nix/store"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with('.')).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Real Nix 2.8 clients as `nobody` (untrusted), one op after another: what Nix lets an
/// untrusted client do works, and what Nix refuses is refused with Nix's message, leaving the
/// store as it was.
#[test]
fn untrusted_nix_2_8_client_as_nobody_gets_nix_rights() {
    let env = Env::new();
    let cache = env.cache();
    open_to_nobody(&env);
    let daemon = env.daemon("root", &cache, "");
    let url = daemon.url.as_str();
    let key = cache_key();
    let data = store_path_of(&env.path("bin-cache"), "2363xkmjdz47l55sjw25vx7081mz5qj0");

    // AddToStore: allowed.
    let file = env.path("nobody.txt");
    std::fs::write(&file, "added by nobody\n").unwrap();
    let (ok, added, err) = as_nobody(&env, "nix-store", &["--store", url, "--add", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let added = added.trim().to_owned();
    assert!(added.starts_with("/nix/store/") && added.ends_with("-nobody.txt"), "{added}");

    // SetOptions: a restricted setting and an untrusted substituter are ignored with Nix's
    // warnings; the daemon's own substituter is accepted (EnsurePath/BuildPaths substitute).
    let (ok, out, err) = as_nobody(
        &env,
        "nix-store",
        &[
            "--store",
            url,
            "-r",
            &data,
            "--option",
            "substituters",
            &format!("{cache} file:///nonexistent-cache"),
            "--option",
            "trusted-public-keys",
            &key,
            "--option",
            "require-sigs",
            "false",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), data);
    assert!(err.contains("ignoring untrusted substituter 'file:///nonexistent-cache', you are not a trusted user."), "{err}");
    assert!(
        err.contains(
            "ignoring the client-specified setting 'require-sigs', because it is a restricted setting and you are not a trusted user"
        ),
        "{err}"
    );
    assert!(err.contains("ignoring the client-specified setting 'trusted-public-keys', because it is a restricted setting and you are not a trusted user"), "{err}");
    let before = store_entries(&env, "root");

    // BuildPaths with repair: refused.
    let (ok, _, err) = as_nobody(&env, "nix-store", &["--store", url, "-r", "--repair", &data]);
    assert!(!ok);
    assert!(err.contains("repairing is not allowed because you are not in 'trusted-users'"), "{err}");

    // VerifyStore with repair: refused; without: allowed.
    let (ok, _, err) = as_nobody(&env, "nix-store", &["--store", url, "--verify", "--repair"]);
    assert!(!ok);
    assert!(err.contains("you are not privileged to repair paths"), "{err}");
    let (ok, _, err) = as_nobody(&env, "nix-store", &["--store", url, "--verify", "--check-contents"]);
    assert!(ok, "{err}");

    // AddSignatures: refused (Nix 2.8; Nix ≥ 2.17 allows it), no signature added.
    let sk = env.path("nobody-home/sk");
    env.nix("nix-store", &["--generate-binary-cache-key", "nobody-1", sk.to_str().unwrap(), env.path("nobody-home/pk").to_str().unwrap()]);
    std::os::unix::fs::chown(&sk, Some(65534), None).unwrap();
    let (ok, _, err) = as_nobody(&env, "nix", &["store", "sign", "--store", url, "--key-file", sk.to_str().unwrap(), &added]);
    assert!(!ok);
    assert!(err.contains("you are not privileged to add signatures"), "{err}");
    let info = env.nix("nix", &["path-info", "--json", "--store", url, &added]);
    assert!(!info.contains("nobody-1"), "{info}");

    // AddToStoreNar (nix-store --import of an unsigned export): refused.
    let direct = format!("local?root={}", env.path("direct").display());
    let dep = store_path_of(&env.path("bin-cache"), "py14wj21zshnib43vh5f66ihm7rx610h");
    env.nix("nix", &["copy", "--from", &cache, "--to", &direct, &dep, "--option", "trusted-public-keys", &key]);
    let export = env.cmd("nix-store").args(["--store", &direct, "--export", &dep]).output().unwrap();
    let export_file = env.path("export");
    std::fs::write(&export_file, &export.stdout).unwrap();
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .args(nobody_env(&env))
        .args(["nix-store", "--store", url, "--import"])
        .stdin(std::fs::File::open(&export_file).unwrap())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot add path '{dep}' because it lacks a signature by a trusted key")), "{err}");

    // CollectGarbage: ignoring liveness is refused as Nix refuses it (to anyone); an
    // untrusted client may collect (here: only list the dead paths).
    let (ok, _, err) = as_nobody(&env, "nix-store", &["--store", url, "--delete", "--ignore-liveness", &added]);
    assert!(!ok);
    assert!(err.contains("you are not allowed to ignore liveness"), "{err}");
    let (ok, dead, err) = as_nobody(&env, "nix-store", &["--store", url, "--gc", "--print-dead"]);
    assert!(ok, "{err}");
    assert!(dead.lines().any(|l| l == added), "{dead}");
    assert_eq!(store_entries(&env, "root"), before, "refusals and listings change nothing");

    // FindRoots: another connection's temporary root is `{censored}` for nobody, labelled
    // for root.
    use std::io::Write;
    let (mut holder, _) = raw_client(&env, 37);
    holder.write_all(&request(11, &[Err(data.as_bytes())])).unwrap();
    assert_eq!(until_last(&mut holder), Ok(()));
    assert_eq!(read_u64(&mut holder), 1);
    let (ok, roots, err) = as_nobody(&env, "nix-store", &["--store", url, "--gc", "--print-roots"]);
    assert!(ok, "{err}");
    assert!(roots.lines().any(|l| l == format!("{{censored}} -> {data}")), "{roots}");
    assert!(!roots.contains("{temp:"), "{roots}");
    let roots = env.nix("nix-store", &["--store", url, "--gc", "--print-roots"]);
    assert!(roots.lines().any(|l| l.starts_with("{temp:") && l.ends_with(&format!(" -> {data}"))), "{roots}");
    drop(holder);

    // The handshake tells the client it is not trusted (Nix 2.26 shows it).
    let (ok, out, err) = modern_as_nobody(&env, "nix", &["store", "ping", "--store", url]);
    assert!(ok, "{err}");
    assert!(format!("{out}{err}").contains("Trusted: 0"), "{out}{err}");
    // Nix 2.26 as nobody: the same refusals.
    let (ok, _, err) = modern_as_nobody(&env, "nix-store", &["--store", url, "--verify", "--repair"]);
    assert!(!ok);
    assert!(err.contains("you are not privileged to repair paths"), "{err}");
    let (ok, _, err) = modern_as_nobody(&env, "nix-store", &["--store", url, "-r", "--repair", &data]);
    assert!(!ok);
    assert!(err.contains("repairing is not allowed because you are not in 'trusted-users'"), "{err}");
    assert_eq!(store_entries(&env, "root"), before, "refusals change nothing");
}

/// Ops no CLI reaches, as an untrusted client (root, not in `trusted-users`): AddPermRoot is
/// refused before its arguments are read (Nix 2.26: the connection ends) and no symlink is
/// made; AddTempRoot and AddIndirectRoot are allowed; CollectGarbage ignoring liveness and
/// VerifyStore with repair are refused and the connection goes on.
#[test]
fn untrusted_raw_client_gets_nix_rights() {
    use std::io::Write;
    let env = Env::new();
    let (_daemon, mut client, out) = daemon_and_client_1_37(&env, "trusted-users = nobody-in-particular", 2);
    let link = env.path("perm-root");
    client.write_all(&request(47, &[Err(&out), Err(link.to_str().unwrap().as_bytes())])).unwrap();
    assert_eq!(
        until_last(&mut client),
        Err("you are not privileged to create perm roots\n\nhint: you can just do this client-side without special privileges, and probably want to do that instead.".to_owned())
    );
    assert!(std::fs::symlink_metadata(&link).is_err(), "no root was made");
    let mut rest = Vec::new();
    assert_eq!(std::io::Read::read_to_end(&mut client, &mut rest).unwrap_or(0), 0, "connection closed");

    let (mut client, _) = raw_client(&env, 37);
    client.write_all(&request(11, &[Err(&out)])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1);
    std::os::unix::fs::symlink(std::str::from_utf8(&out).unwrap(), &link).unwrap();
    client.write_all(&request(12, &[Err(link.to_str().unwrap().as_bytes())])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    assert_eq!(read_u64(&mut client), 1);
    let auto: Vec<_> = std::fs::read_dir(env.path("root/nix/var/nix/gcroots/auto"))
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_link(e.path()).unwrap())
        .collect();
    assert_eq!(auto, std::slice::from_ref(&link));

    client.write_all(&request(20, &[Ok(3), Ok(1), Err(&out), Ok(1), Ok(0), Ok(0), Ok(0), Ok(0)])).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not allowed to ignore liveness".to_owned()));
    assert_eq!(is_valid(&mut client, &out), 1);
    client.write_all(&request(35, &[Ok(0), Ok(1)])).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not privileged to repair paths".to_owned()));
    assert_eq!(is_valid(&mut client, &out), 1);
    // BuildPathsWithResults with repair: refused as BuildPaths (Nix closes the connection).
    client.write_all(&request(46, &[Ok(1), Err(&out), Ok(1)])).unwrap();
    assert_eq!(until_last(&mut client), Err("repairing is not allowed because you are not in 'trusted-users'".to_owned()));
}

// ---------------------------------------------------------------------------------------------
// Forged content addresses. A content address is a fact about the content, not a permission:
// a path whose claimed CA yields its store path but whose NAR holds other content (with an
// honest NarHash/NarSize for that other content, unsigned) must be refused, for trusted and
// untrusted clients alike, with Nix's `ca hash mismatch importing path '…';\n  specified: …\n
// got:       …` (LocalStore::addToStore). These tests fail until the store's single
// verification boundary checks content addresses.

use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::nar::writer::regular_file_nar;
use sluice_nix::store_path::{StoreDir, StorePath};

/// One forged path: what the daemon must refuse, and the hashes the refusal must name.
struct Forgery {
    path: StorePath,
    /// The NAR served for the path (other content), and the references claimed.
    nar: Vec<u8>,
    references: Vec<StorePath>,
    ca: ContentAddress,
    /// `sha256:<nix32>` of what the CA claims and of what the NAR really holds.
    specified: String,
    got: String,
}

/// The three forms: `fixed:r:sha256` (a NAR), `fixed:sha256` (a flat file) and
/// `text:sha256` with a reference (to `dep`, an honest text path).
fn forgeries(dep: &StorePath) -> Vec<Forgery> {
    let dir = StoreDir::default();
    let sha = |b: &[u8]| Hash::digest_bytes(HashAlgo::Sha256, b);
    let (real, other) = (&b"the real content\n"[..], &b"other content\n"[..]);
    let nar = regular_file_nar(other, false);
    let mut out = Vec::new();
    let recursive = ContentAddress::Fixed { recursive: true, hash: sha(&regular_file_nar(real, false)) };
    let flat = ContentAddress::Fixed { recursive: false, hash: sha(real) };
    let real_text = format!("refers to {}\n", dir.display_path(dep));
    let text = ContentAddress::Text(sha(real_text.as_bytes()));
    for (name, ca, refs, got) in [
        ("forged-nar", recursive, vec![], sha(&nar)),
        ("forged-flat", flat, vec![], sha(other)),
        ("forged-text", text, vec![dep.clone()], sha(other)),
    ] {
        let path = ca.store_path(&dir, name, &refs, false).unwrap();
        out.push(Forgery {
            path,
            nar: nar.clone(),
            references: refs,
            specified: ca.hash().to_nix32_prefixed(),
            got: got.to_nix32_prefixed(),
            ca,
        });
    }
    out
}

/// An honest text path `dep` (referenced by the text forgery): its CA matches its NAR.
fn honest_dep() -> (StorePath, Vec<u8>, ContentAddress) {
    let contents = b"an honest dependency\n";
    let ca = ContentAddress::Text(Hash::digest_bytes(HashAlgo::Sha256, contents));
    (ca.store_path(&StoreDir::default(), "honest-dep", &[], false).unwrap(), regular_file_nar(contents, false), ca)
}

/// Writes an unsigned, uncompressed binary cache at `dir` serving `entries` (path, NAR,
/// references, CA), each narinfo describing its NAR honestly. Owned by `nobody` (a Nix client
/// opening a file:// store creates directories in it).
fn write_cache(dir: &Path, entries: &[(&StorePath, &[u8], &[StorePath], &ContentAddress)]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir.join("nar")).unwrap();
    std::fs::write(dir.join("nix-cache-info"), "StoreDir: /nix/store\nWantMassQuery: 1\nPriority: 40\n").unwrap();
    for (path, nar, refs, ca) in entries {
        let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, nar);
        let url = format!("nar/{}.nar", nar_hash.to_nix32());
        std::fs::write(dir.join(&url), nar).unwrap();
        let refs: Vec<&str> = refs.iter().map(StorePath::base_name).collect();
        let text = format!(
            "StorePath: /nix/store/{}\nURL: {url}\nCompression: none\nNarHash: {}\nNarSize: {}\nReferences: {}\nCA: {ca}\n",
            path.base_name(),
            nar_hash.to_nix32_prefixed(),
            nar.len(),
            refs.join(" ")
        );
        std::fs::write(dir.join(format!("{}.narinfo", path.hash_part())), text).unwrap();
    }
    for entry in walk(dir) {
        let mode = if entry.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(&entry, Some(65534), Some(65534)).unwrap();
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_owned()];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// Checks that `forgery` was refused with Nix's message and left nothing behind; returns
/// what is wrong, if anything.
fn check_refused(env: &Env, who: &str, f: &Forgery, result: (bool, String, String)) -> Option<String> {
    let (ok, _, err) = result;
    let shown = format!("/nix/store/{}", f.path.base_name());
    let mut wrong = Vec::new();
    if ok {
        wrong.push("accepted".to_owned());
    }
    for part in [&shown, &f.specified, &f.got] {
        if !err.contains(part.as_str()) {
            wrong.push(format!("the error does not name {part}"));
        }
    }
    if !err.contains("hash mismatch") {
        wrong.push("the error does not say 'hash mismatch'".into());
    }
    if std::fs::symlink_metadata(env.path("root/nix/store").join(f.path.base_name())).is_ok() {
        wrong.push(format!("root/nix/store/{} exists", f.path.base_name()));
    }
    let (mut client, _) = raw_client(env, 37);
    if is_valid(&mut client, shown.as_bytes()) != 0 {
        wrong.push("the path is valid".into());
    }
    (!wrong.is_empty()).then(|| format!("{who}, {} ({}): {}\n  client stderr: {}", f.ca, shown, wrong.join("; "), err.trim()))
}

/// `nix copy --no-check-sigs --from file://CACHE --to unix://SOCKET P` of each forgery by
/// `run` (a client as some user), each into a fresh daemon store; panics listing every
/// forgery that was not refused as it must be.
fn forged_copies_are_refused(who: &str, run: impl Fn(&Env, &[&str]) -> (bool, String, String)) {
    let (dep, dep_nar, dep_ca) = honest_dep();
    let mut failures = Vec::new();
    for f in forgeries(&dep) {
        let env = Env::new();
        open_to_nobody(&env);
        let cache_dir = env.path("forged-cache");
        write_cache(&cache_dir, &[(&dep, &dep_nar, &[], &dep_ca), (&f.path, &f.nar, &f.references, &f.ca)]);
        let cache = format!("file://{}", cache_dir.display());
        let daemon = env.daemon("root", &env.cache(), "");
        let shown = format!("/nix/store/{}", f.path.base_name());
        let result = run(&env, &["copy", "--no-check-sigs", "--from", &cache, "--to", &daemon.url, &shown]);
        failures.extend(check_refused(&env, who, &f, result));
        // The reference: Nix 2.8's own local store refuses the same copy with that message.
        let direct = format!("local?root={}", env.path("direct").display());
        let (ok, _, err) = as_root(&env, false, "nix", &["copy", "--no-check-sigs", "--from", &cache, "--to", &direct, &shown]);
        // (The client indents the message's continuation lines.)
        let expected = [
            format!("ca hash mismatch importing path '{shown}';\n"),
            format!("specified: {}\n", f.specified),
            format!("got:       {}\n", f.got),
        ];
        assert!(!ok && expected.iter().all(|e| err.contains(e.as_str())), "Nix's own store: {err}");
        // Nix 2.8 leaves the unpacked tree on disk (restorePath into the real path, then the
        // check); it is not valid. sluice must not leave it at all.
        assert!(!as_root(&env, false, "nix-store", &["--store", &direct, "--check-validity", &shown]).0, "not valid in Nix's store");
    }
    assert!(failures.is_empty(), "forged content addresses not refused as Nix refuses them:\n{}", failures.join("\n"));
}

#[test]
fn forged_ca_nix_2_8_copy_as_nobody_is_refused() {
    forged_copies_are_refused("Nix 2.8 as nobody", |env, args| as_nobody(env, "nix", args));
}

#[test]
fn forged_ca_nix_2_26_copy_as_nobody_is_refused() {
    forged_copies_are_refused("Nix 2.26 as nobody", |env, args| modern_as_nobody(env, "nix", args));
}

#[test]
fn forged_ca_nix_2_8_copy_as_root_is_refused() {
    forged_copies_are_refused("Nix 2.8 as root (trusted)", |env, args| as_root(env, false, "nix", args));
}

#[test]
fn forged_ca_nix_2_26_copy_as_root_is_refused() {
    forged_copies_are_refused("Nix 2.26 as root (trusted)", |env, args| as_root(env, true, "nix", args));
}

/// The keyed path info of `f` as AddToStoreNar and AddMultipleToStore send it (1.16 form).
fn wire_info(path: &StorePath, nar: &[u8], refs: &[StorePath], ca: &ContentAddress) -> Vec<u8> {
    let shown = format!("/nix/store/{}", path.base_name());
    let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, nar).to_base16();
    let refs: Vec<String> = refs.iter().map(|r| format!("/nix/store/{}", r.base_name())).collect();
    let mut args: Vec<Result<u64, &[u8]>> = vec![Err(shown.as_bytes()), Err(b""), Err(nar_hash.as_bytes()), Ok(refs.len() as u64)];
    args.extend(refs.iter().map(|r| Err(r.as_bytes())));
    let ca = ca.to_string();
    args.extend([Ok(0), Ok(nar.len() as u64), Ok(0), Ok(0), Err(ca.as_bytes())]);
    request(0, &args)[8..].to_vec()
}

/// AddToStoreNar (op 39, one path) and AddMultipleToStore (op 44) of each forgery by raw
/// clients, trusted (root by default) and untrusted (root not in `trusted-users`), both asking
/// not to check signatures: refused with Nix's message, nothing stored, connection usable.
#[test]
fn forged_ca_add_to_store_nar_and_add_multiple_are_refused() {
    use std::io::Write;
    let (dep, dep_nar, dep_ca) = honest_dep();
    let mut failures = Vec::new();
    for (who, config, flag) in [("trusted raw client", "", 1), ("untrusted raw client", "trusted-users = nobody-in-particular", 2)] {
        for op in [39u64, 44] {
            let env = Env::new();
            let daemon = env.daemon("root", &env.cache(), config);
            let (mut client, trusted) = raw_client(&env, 37);
            assert_eq!(trusted, Some(flag));
            // The honest dependency first (a valid content address: accepted).
            let mut add = request(39, &[])[..8].to_vec();
            add.extend(wire_info(&dep, &dep_nar, &[], &dep_ca));
            add.extend(u64s(&[0, 1]));
            add.extend(framed(&dep_nar));
            client.write_all(&add).unwrap();
            assert_eq!(until_last(&mut client), Ok(()), "{who}: the honest path");
            for f in forgeries(&dep) {
                let mut req = Vec::new();
                if op == 39 {
                    req.extend(u64s(&[39]));
                    req.extend(wire_info(&f.path, &f.nar, &f.references, &f.ca));
                    req.extend(u64s(&[0, 1]));
                    req.extend(framed(&f.nar));
                } else {
                    req.extend(u64s(&[44, 0, 1]));
                    let mut payload = u64s(&[1]);
                    payload.extend(wire_info(&f.path, &f.nar, &f.references, &f.ca));
                    payload.extend_from_slice(&f.nar);
                    req.extend(framed(&payload));
                }
                client.write_all(&req).unwrap();
                let result = match until_last(&mut client) {
                    Ok(()) => (true, String::new(), String::new()),
                    Err(msg) => (false, String::new(), msg),
                };
                failures.extend(check_refused(&env, &format!("{who}, op {op}"), &f, result));
                assert_eq!(is_valid(&mut client, MISSING), 0, "the connection goes on");
            }
            drop(daemon);
        }
    }
    assert!(failures.is_empty(), "forged content addresses not refused as Nix refuses them:\n{}", failures.join("\n"));
}

/// `sluice copy` of each forgery from a cache into a local store is refused too, as Nix's
/// message says, with nothing at the path: unsigned under `--no-check-sigs`, and signed by a
/// trusted key (a signature vouches for who made the path, the content address is checked
/// whoever vouches).
#[test]
fn forged_ca_sluice_copy_is_refused_even_signed() {
    use sluice_nix::path_info::ValidPathInfo;
    use sluice_nix::signature::SecretKey;
    let key = SecretKey::from_seed("forger-1", &[9; 32]);
    let (dep, dep_nar, dep_ca) = honest_dep();
    for f in forgeries(&dep) {
        for signed in [false, true] {
            let env = Env::new();
            let cache_dir = env.path("forged-cache");
            write_cache(&cache_dir, &[(&dep, &dep_nar, &[], &dep_ca), (&f.path, &f.nar, &f.references, &f.ca)]);
            let narinfo_file = cache_dir.join(format!("{}.narinfo", f.path.hash_part()));
            if signed {
                let info = ValidPathInfo {
                    path: f.path.clone(),
                    nar_hash: Hash::digest_bytes(HashAlgo::Sha256, &f.nar),
                    nar_size: f.nar.len() as u64,
                    references: f.references.iter().cloned().collect(),
                    deriver: None,
                    registration_time: 0,
                    ultimate: false,
                    sigs: Default::default(),
                    ca: Some(f.ca.clone()),
                };
                let text = std::fs::read_to_string(&narinfo_file).unwrap();
                std::fs::write(&narinfo_file, format!("{text}Sig: {}\n", key.sign(&info.fingerprint(&StoreDir::default())))).unwrap();
            }
            let root = env.path("root");
            let shown = format!("/nix/store/{}", f.path.base_name());
            let from = format!("file://{}", cache_dir.display());
            let public = key.to_public().to_string();
            let mut args = vec!["copy", "--from", &from, "--to", root.to_str().unwrap(), "--trusted-public-keys", &public, &shown];
            if !signed {
                args.insert(1, "--no-check-sigs");
            }
            let out = env.cmd(sluice()).args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            let what = format!("{} ({}), signed: {signed}", f.ca, shown);
            assert_eq!(out.status.code(), Some(1), "{what}: {err}");
            for part in [
                format!("ca hash mismatch importing path '{shown}'"),
                format!("specified: {}", f.specified),
                format!("got:       {}", f.got),
            ] {
                assert!(err.contains(&part), "{what}: the error lacks {part:?}: {err}");
            }
            assert!(std::fs::symlink_metadata(root.join("nix/store").join(f.path.base_name())).is_err(), "{what}: something at the path");
            let valid = env.cmd("nix-store").args(["--store", root.to_str().unwrap(), "--check-validity", &shown]).output().unwrap();
            assert!(!valid.status.success(), "{what}: the path is valid");
        }
    }
}

/// A `.drv` whose output paths are not the ones its contents imply, added by an untrusted
/// client (Nix 2.8 `nix-store --add` as nobody: AddToStore). Nix's `registerValidPaths`
/// calls `checkDerivationOutputs` for every derivation it registers and refuses it ("has
/// incorrect output '…', should be '…'"): otherwise anyone could register a derivation
/// claiming another package's output path (here glibc's), and the first build of it by Nix
/// sharing the store would put the attacker's bytes at that path. The daemon must refuse it
/// too, and must not register the lying output in `DerivationOutputs`.
#[test]
fn untrusted_client_cannot_add_a_derivation_whose_outputs_lie() {
    let env = Env::new();
    open_to_nobody(&env);
    let daemon = env.daemon("root", &env.cache(), "");
    let victim = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.35-163";
    let drv = format!(
        "Derive([(\"out\",\"{victim}\",\"\",\"\")],[],[],\"x86_64-linux\",\"/bin/sh\",[\"-c\",\"echo evil > $out\"],\
         [(\"builder\",\"/bin/sh\"),(\"name\",\"glibc-2.35-163\"),(\"out\",\"{victim}\"),(\"system\",\"x86_64-linux\")])"
    );
    let file = env.path("evil.drv");
    std::fs::write(&file, &drv).unwrap();
    // The reference: Nix 2.8's own store refuses it.
    let direct = format!("local?root={}", env.path("direct").display());
    let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", &direct, "--add", file.to_str().unwrap()]);
    assert!(!ok && err.contains(&format!("has incorrect output '{victim}'")), "Nix's own store: {err}");
    let (ok, out, err) = as_nobody(&env, "nix-store", &["--store", &daemon.url, "--add", file.to_str().unwrap()]);
    let derivers = valid_derivers(&mut raw_client(&env, 37).0, victim);
    assert!(!ok, "a derivation claiming {victim} was added: {out}; valid derivers of {victim}: {derivers:?}");
    assert!(err.contains(&format!("has incorrect output '{victim}', should be '/nix/store/")), "{err}");
    assert!(derivers.is_empty(), "valid derivers of {victim}: {derivers:?}");
}

/// The same lying derivation served by a hostile binary cache, unsigned: a `text:` content
/// address needs no signature, so any configured substituter can plant it when a client (here
/// nobody, `nix-store -r`) asks for the `.drv`. Nix 2.8 substituting it into its own store
/// refuses it at registration ("has incorrect output"); so must the daemon.
#[test]
fn substituted_derivation_whose_outputs_lie_is_refused() {
    let env = Env::new();
    open_to_nobody(&env);
    let victim = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.35-163";
    let drv = format!(
        "Derive([(\"out\",\"{victim}\",\"\",\"\")],[],[],\"x86_64-linux\",\"/bin/sh\",[\"-c\",\"echo evil > $out\"],\
         [(\"builder\",\"/bin/sh\"),(\"name\",\"glibc-2.35-163\"),(\"out\",\"{victim}\"),(\"system\",\"x86_64-linux\")])"
    );
    let ca = ContentAddress::Text(Hash::digest_bytes(HashAlgo::Sha256, drv.as_bytes()));
    let path = ca.store_path(&StoreDir::default(), "evil.drv", &[], false).unwrap();
    let nar = regular_file_nar(drv.as_bytes(), false);
    let cache_dir = env.path("hostile-cache");
    write_cache(&cache_dir, &[(&path, &nar, &[], &ca)]);
    let cache = format!("file://{}", cache_dir.display());
    let shown = format!("/nix/store/{}", path.base_name());
    // The reference: Nix 2.8 substituting it into its own store refuses it.
    let direct = format!("local?root={}", env.path("direct").display());
    let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", &direct, "-r", &shown, "--option", "substituters", &cache]);
    assert!(!ok && err.contains(&format!("has incorrect output '{victim}'")), "Nix's own store: {err}");
    let daemon = env.daemon("root", &cache, "");
    // EnsurePath (op 10) of the `.drv` itself, as an untrusted client.
    use std::io::Write;
    let (mut client, _) = raw_client(&env, 37);
    client.write_all(&request(10, &[Err(shown.as_bytes())])).unwrap();
    let (log, result) = until_last_logged(&mut client);
    let (_, outputs, _) = as_root(&env, false, "nix-store", &["--store", &daemon.url, "-q", "--outputs", &shown]);
    assert!(result.is_err(), "a derivation claiming {victim} was substituted; its outputs: {outputs}");
    assert_eq!(result.unwrap_err(), format!("path '{shown}' is required, but there is no substituter that can build it"));
    let why = format!("derivation '{shown}' has incorrect output '{victim}', should be '/nix/store/");
    assert!(log.iter().any(|l| l.contains(&why)), "{log:?}");
    assert_eq!(is_valid(&mut client, shown.as_bytes()), 0, "{shown} is valid");
}

/// A path named like a directory of temporary trees in use (`<hash part>-sluice-unpacking`:
/// anyone who lists the store directory sees the names of those in use), added by a client
/// that may skip signatures (root, trusted, `dontCheckSigs`; a cache signed by a trusted key
/// could serve it too): the addition would first remove "the unregistered tree at the path's
/// location", which is that directory with every concurrent addition's tree in it (their
/// additions would then fail). It must be refused, and the directory (locked by its holder)
/// left alone.
#[test]
fn a_path_named_like_the_temporary_directory_is_refused() {
    use std::io::Write;
    let env = Env::new();
    let daemon = env.daemon("root", &env.cache(), "");
    let store = env.path("root/nix/store");
    let name = "1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b-sluice-unpacking";
    let temp = store.join(name);
    let inflight = "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a-inflight";
    std::fs::create_dir_all(temp.join(inflight)).unwrap();
    // As its holder makes it: private, and locked while in use.
    std::fs::set_permissions(&temp, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let held = std::fs::File::open(&temp).unwrap();
    // SAFETY: flock on an open file descriptor.
    #[allow(unsafe_code)] // a libc call the test drives processes or files with
    let r = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) };
    assert_eq!(r, 0);
    let (mut client, trusted) = raw_client(&env, 37);
    assert_eq!(trusted, Some(1));
    let nar = regular_file_nar(b"x", false);
    let shown = format!("/nix/store/{name}");
    let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, &nar).to_base16();
    let args: Vec<Result<u64, &[u8]>> =
        vec![Err(shown.as_bytes()), Err(b""), Err(nar_hash.as_bytes()), Ok(0), Ok(0), Ok(nar.len() as u64), Ok(0), Ok(0), Err(b"")];
    let mut req = request(39, &args);
    req.extend(u64s(&[0, 1]));
    req.extend(framed(&nar));
    client.write_all(&req).unwrap();
    let result = until_last(&mut client);
    assert!(temp.join(inflight).is_dir(), "another addition's temporary tree was removed ({result:?})");
    assert!(result.is_err(), "a path named like the temporary directory was added");
    assert_eq!(is_valid(&mut client, shown.as_bytes()), 0);
    drop(daemon);
}

/// Through the daemon, the reason a substitution failed reaches the client: real Nix 2.8's
/// `nix-store -r` against `sluice daemon` whose substituter's paths are signed by a key it
/// does not trust sees the untrusted signature (once, with the count), then Nix's own final
/// error; Nix 2.8 in direct mode also names the signature ("is not signed by any of the keys").
#[test]
fn daemon_client_sees_why_substitution_failed() {
    let env = Env::new();
    let cache = env.cache();
    let other = format!("other-1:{}", cache_key().split_once(':').unwrap().1);
    let daemon = env.daemon("root", &cache, "");
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let args = ["-r", &glibc, "--option", "substituters", &cache, "--option", "trusted-public-keys", &other];
    let out = env.cmd("nix-store").args(["--store", &daemon.url]).args(args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let reasons: Vec<&str> = err.lines().filter(|l| l.contains("lack a signature by a trusted key")).collect();
    assert_eq!(reasons.len(), 1, "{err}");
    assert!(
        reasons[0].contains(
            "they are signed by corpus-nixos-1-1 but trusted-public-keys has other-1; if you trust that key, add it to trusted-public-keys"
        ),
        "{err}"
    );
    assert!(err.contains(&format!("error: path '{glibc}' is required, but there is no substituter that can build it")), "{err}");
    let direct = format!("local?root={}", env.path("direct").display());
    let out = env.cmd("nix-store").args(["--store", &direct]).args(args).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not signed by any of the keys in 'trusted-public-keys'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An expression with a fixed-output derivation, and a multi-output one depending on it whose
/// environment needs escapes: what real Nix writes for them is what sluice must accept.
const REAL_DERIVATIONS: &str = r#"
let
  src = derivation {
    name = "src"; system = "x86_64-linux"; builder = "/bin/sh"; args = [ "-c" "echo hi > $out" ];
    outputHashMode = "flat"; outputHashAlgo = "sha256";
    outputHash = "98ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4";
  };
in derivation {
  name = "top"; system = "x86_64-linux"; builder = "/bin/sh"; outputs = [ "out" "dev" ];
  args = [ "-c" "cat ${src} > $out; echo > $dev" ];
  text = "a \"quoted\" \\ line\n\twith a tab\r";
}
"#;

/// Real derivations from `nix-instantiate` (Nix 2.8 and 2.26 clients, as root and as nobody)
/// pass the daemon's output check, get the paths Nix's own store gives them, and have the
/// outputs Nix registers; the same derivations edited (another output path, another
/// environment, another fixed-output hash) and added by an untrusted Nix 2.26 client are
/// refused in the words Nix 2.8's own store refuses them with.
#[test]
fn real_derivations_are_admitted_and_edited_ones_refused_as_nix_does() {
    let env = Env::new();
    open_to_nobody(&env);
    let daemon = env.daemon("root", &env.cache(), "");
    let direct = format!("local?root={}", env.path("direct").display());
    let expr = env.path("drvs.nix");
    std::fs::write(&expr, REAL_DERIVATIONS).unwrap();
    let expr = expr.to_str().unwrap();
    let (ok, top, err) = as_root(&env, false, "nix-instantiate", &["--store", &direct, expr]);
    assert!(ok, "{err}");
    let top = top.trim().to_owned();
    let outputs = |store: &str| as_root(&env, false, "nix-store", &["--store", store, "-q", "--outputs", &top]);
    for (who, modern, nobody) in
        [("2.8 root", false, false), ("2.8 nobody", false, true), ("2.26 root", true, false), ("2.26 nobody", true, true)]
    {
        let args = ["--store", &daemon.url, expr];
        let (ok, via, err) = match (modern, nobody) {
            (false, true) => as_nobody(&env, "nix-instantiate", &args),
            (true, true) => modern_as_nobody(&env, "nix-instantiate", &args),
            (modern, false) => as_root(&env, modern, "nix-instantiate", &args),
        };
        assert!(ok, "{who}: {err}");
        assert_eq!(via.trim(), top, "{who}");
    }
    // The outputs registered (DerivationOutputs, read by QueryValidDerivers) are Nix's.
    let (_, shown, _) = outputs(&direct);
    assert_eq!(shown.lines().count(), 2, "{shown}");
    let (mut client, _) = raw_client(&env, 37);
    for out in shown.lines() {
        assert_eq!(valid_derivers(&mut client, out), std::slice::from_ref(&top), "{out}");
    }

    // Edited copies, added under the same name (`top.drv`, `src.drv`) with `nix-store --add`.
    let real = std::fs::read_to_string(env.path("direct").join(top.trim_start_matches('/'))).unwrap();
    let src_drv = real.split("[(\"").nth(2).and_then(|s| s.split('"').next()).unwrap().to_owned();
    assert!(src_drv.ends_with("-src.drv"), "{real}");
    let src_real = std::fs::read_to_string(env.path("direct").join(src_drv.trim_start_matches('/'))).unwrap();
    let (dev_path, out_path) = (shown.lines().next().unwrap().to_owned(), shown.lines().nth(1).unwrap().to_owned());
    assert!(dev_path.ends_with("-top-dev") && out_path.ends_with("-top"), "{shown}");
    let victim = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.35-163";
    let other_hash = "0000000000000000000000000000000000000000000000000000000000000000";
    let edits = [
        ("top.drv", real.replace(&out_path, victim), format!("has incorrect output '{victim}', should be '{out_path}'")),
        // Outputs are checked in name order: `dev` first.
        (
            "top.drv",
            real.replace("with a tab", "with a tab and more"),
            format!("has incorrect output '{dev_path}', should be '/nix/store/"),
        ),
        (
            "top.drv",
            real.replace(&format!("(\"out\",\"{out_path}\")"), &format!("(\"out\",\"{victim}\")")),
            format!("has incorrect environment variable 'out', should be '{out_path}'"),
        ),
        (
            "src.drv",
            src_real.replace("98ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4", other_hash),
            "has incorrect environment variable 'out', should be '/nix/store/".to_owned(),
        ),
    ];
    std::fs::create_dir_all(env.path("edited")).unwrap();
    for (name, text, why) in edits {
        let file = env.path("edited").join(name);
        std::fs::write(&file, &text).unwrap();
        let file = file.to_str().unwrap();
        let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", &direct, "--add", file]);
        assert!(!ok && err.contains(&why), "Nix's own store, {why}: {err}");
        let before = store_entries(&env, "root");
        let (ok, out, err) = modern_as_nobody(&env, "nix-store", &["--store", &daemon.url, "--add", file]);
        assert!(!ok, "{why}: added as {out}");
        assert!(err.contains(&why), "{why}: {err}");
        // The connection's directory of temporary trees goes when the daemon has seen the
        // client leave, which may be just after the client has exited.
        let left = Instant::now();
        while store_entries(&env, "root") != before && left.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(store_entries(&env, "root"), before);
    }
}

/// The `repair` flag of AddToStoreNar (op 39), AddMultipleToStore (op 44) and AddToStore (op
/// 7): a trusted client's addition of a valid path whose tree was damaged puts the tree back
/// (the data has the registered NAR hash); an untrusted client's flag is ignored and the
/// damage stays; without the flag nothing is rewritten. The connection goes on each time.
#[test]
fn add_ops_repair_a_damaged_path_for_trusted_clients() {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let (dep, dep_nar, dep_ca) = honest_dep();
    let contents = "an honest dependency\n";
    // AddToStore (≥ 1.25) of the same text: name, method, references, repair, framed data.
    let add_to_store = |repair: u64| {
        let mut req = request(7, &[Err(b"honest-dep"), Err(b"text:sha256"), Ok(0), Ok(repair)]);
        req.extend(framed(contents.as_bytes()));
        req
    };
    for (who, config, trusted) in [("trusted", "", true), ("untrusted", "trusted-users = nobody-in-particular", false)] {
        for op in [39u64, 44, 7] {
            let env = Env::new();
            let _daemon = env.daemon("root", &env.cache(), config);
            let (mut client, _) = raw_client(&env, 37);
            let send = |client: &mut std::os::unix::net::UnixStream, repair: u64| {
                let req = match op {
                    39 => [u64s(&[39]), wire_info(&dep, &dep_nar, &[], &dep_ca), u64s(&[repair, 1]), framed(&dep_nar)].concat(),
                    44 => {
                        let payload = [u64s(&[1]), wire_info(&dep, &dep_nar, &[], &dep_ca), dep_nar.clone()].concat();
                        [u64s(&[44, repair, 1]), framed(&payload)].concat()
                    }
                    _ => add_to_store(repair),
                };
                client.write_all(&req).unwrap();
                assert_eq!(until_last(client), Ok(()), "{who}, op {op}, repair {repair}");
                if op == 7 {
                    // The keyed path info of the result.
                    assert_eq!(read_string(client), format!("/nix/store/{}", dep.base_name()).into_bytes());
                    read_path_info(client);
                }
                assert_eq!(is_valid(client, MISSING), 0, "the connection goes on");
            };
            send(&mut client, 0);
            let file = env.path("root/nix/store").join(dep.base_name());
            assert_eq!(std::fs::read_to_string(&file).unwrap(), contents);
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            std::fs::write(&file, "damaged\n").unwrap();
            send(&mut client, 0);
            assert_eq!(std::fs::read_to_string(&file).unwrap(), "damaged\n", "{who}, op {op}: rewritten without repair");
            send(&mut client, 1);
            let expected = if trusted { contents } else { "damaged\n" };
            assert_eq!(std::fs::read_to_string(&file).unwrap(), expected, "{who}, op {op}, repair");
        }
    }
}

/// Derivations for builds through Nix's daemon, named after `marker`: `plain` (nothing to
/// substitute) and `withInput`, which reads the output of `src`, a fixed-output derivation
/// whose builder fails (so only a substituter can realise it). Each builder writes a marker
/// line to stderr.
const DELEGATED_BUILDS: &str = r#"
{ marker }:
let
  src = derivation {
    name = "delegated-src"; system = "x86_64-linux"; builder = "/bin/sh"; args = [ "-c" "exit 1" ];
    outputHashMode = "flat"; outputHashAlgo = "sha256";
    outputHash = "98ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4";
  };
  build = attr: script: derivation {
    name = "delegated-${attr}-${marker}"; system = "x86_64-linux"; builder = "/bin/sh";
    args = [ "-c" "echo marker-${attr}-${marker} >&2; ${script}" ];
  };
in {
  plain = build "plain" "echo ${marker} > $out";
  withInput = build "withInput" "read line < ${src}; echo $line > $out";
}
"#;

/// What Nix 2.8's `nix-daemon` needs to build for a chroot store here, as root.
const NIX_DAEMON_BUILD_CONF: &str = "sandbox = false\nbuild-users-group =\nsandbox-paths = /bin /usr /lib /lib64\nsubstituters =\n";

/// `nix-build` (Nix 2.8 and 2.26 clients) through `sluice daemon --build-via` a Nix 2.8
/// `nix-daemon` on a second socket for the same store, which has no substituter: the
/// builder's marker line reaches the client, the output is valid in sluice's view of the store
/// with the content the builder wrote; the fixed-output input that cannot be built is
/// substituted by sluice from its cache first. Nix 2.26's `nix build` (BuildPathsWithResults)
/// and BuildDerivation from a raw client are built the same way. Through `sluice daemon` without `--build-via`, the build fails as before.
#[test]
fn builds_go_through_nix_daemon_with_build_via() {
    use std::io::Write;
    let env = Env::new();
    let hi = b"hi\n";
    let ca = ContentAddress::Fixed { recursive: false, hash: Hash::digest_bytes(HashAlgo::Sha256, hi) };
    let src = ca.store_path(&StoreDir::default(), "delegated-src", &[], false).unwrap();
    let cache_dir = env.path("src-cache");
    write_cache(&cache_dir, &[(&src, &regular_file_nar(hi, false), &[], &ca)]);
    let cache = format!("file://{}", cache_dir.display());
    let _nix_daemon = env.nix_daemon("nix-build.socket", "root", NIX_DAEMON_BUILD_CONF);
    let build_via = format!("unix://{}", env.path("nix-build.socket").display());
    let daemon = env.daemon_on("socket", "root", &cache, "", &["--build-via", &build_via], None);
    let expr = env.path("delegated.nix");
    std::fs::write(&expr, DELEGATED_BUILDS).unwrap();
    let expr = expr.to_str().unwrap();
    let nar_hash = |content: &[u8]| Hash::digest_bytes(HashAlgo::Sha256, &regular_file_nar(content, false)).to_nix32_prefixed();
    let src_copied = format!("copying path '/nix/store/{}' from '{cache}'", src.base_name());
    for (client, modern, marker) in [("Nix 2.8", false, "old"), ("Nix 2.26", true, "new")] {
        let url = if modern { format!("{}?real={}", daemon.url, env.path("root/nix/store").display()) } else { daemon.url.clone() };
        for (attr, content) in [("plain", format!("{marker}\n")), ("withInput", "hi\n".to_owned())] {
            let start = Instant::now();
            let args =
                ["--store", &url, expr, "-A", attr, "--argstr", "marker", marker, "--no-out-link", "--option", "substituters", &cache];
            let (ok, out, err) = as_root(&env, modern, "nix-build", &args);
            eprintln!("{client} nix-build -A {attr}: {:?}", start.elapsed());
            assert!(ok, "{client} {attr}: {err}");
            assert!(
                err.contains(&format!("marker-{attr}-{marker}")),
                "{client} {attr}: the builder's line is not on the client's stderr: {err}"
            );
            let out = out.trim();
            assert!(out.starts_with("/nix/store/") && out.ends_with(&format!("-delegated-{attr}-{marker}")), "{client} {attr}: {out}");
            assert_eq!(std::fs::read_to_string(env.path("root").join(out.trim_start_matches('/'))).unwrap(), content, "{client} {attr}");
            assert_eq!(
                env.nix("nix-store", &["--store", &daemon.url, "-q", "--hash", out]).trim(),
                nar_hash(content.as_bytes()),
                "{client} {attr}"
            );
            if (attr, marker) == ("withInput", "old") {
                assert!(err.contains(&src_copied), "{client}: {src} not substituted by sluice: {err}");
            }
        }
    }
    assert_eq!(
        env.nix("nix-store", &["--store", &daemon.url, "-q", "--hash", &format!("/nix/store/{}", src.base_name())]).trim(),
        nar_hash(hi)
    );
    // Nix 2.26's `nix build -L` asks with BuildPathsWithResults (op 46): the Nix daemon's result
    // and its log (which `nix build` shows only with -L).
    let url = format!("{}?real={}", daemon.url, env.path("root/nix/store").display());
    let args = [
        "build",
        "-L",
        "--store",
        &url,
        "-f",
        expr,
        "plain",
        "--argstr",
        "marker",
        "results",
        "--no-link",
        "--print-out-paths",
        "--option",
        "substituters",
        &cache,
    ];
    let (ok, out, err) = as_root(&env, true, "nix", &args);
    assert!(ok && err.contains("marker-plain-results"), "nix build: {err}");
    assert_eq!(std::fs::read_to_string(env.path("root").join(out.trim().trim_start_matches('/'))).unwrap(), "results\n");

    // BuildDerivation (op 36) of a derivation sent whole, from a trusted raw client.
    let out = b"/nix/store/11111111111111111111111111111111-delegated-basic";
    let (mut client, trusted) = raw_client(&env, 37);
    assert_eq!(trusted, Some(1));
    client.write_all(&build_derivation(b"/nix/store/11111111111111111111111111111111-delegated-basic.drv", [out, b"", b""])).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg) = (read_u64(&mut client), String::from_utf8(read_string(&mut client)).unwrap());
    assert_eq!((status, msg.as_str()), (0, ""), "Built");
    assert_eq!(read_u64(&mut client), 1, "built once");
    assert_eq!(is_valid_after_result(&mut client, out), 1);
    assert_eq!(std::fs::read_to_string(env.path("root").join(std::str::from_utf8(&out[1..]).unwrap())).unwrap(), "hi\n");

    // Without --build-via: the error of a daemon that does not build.
    let plain = env.daemon_on("plain.socket", "root", &cache, "", &[], None);
    let (ok, _, err) =
        as_root(&env, false, "nix-build", &["--store", &plain.url, expr, "-A", "plain", "--argstr", "marker", "none", "--no-out-link"]);
    assert!(!ok, "built without --build-via");
    assert!(err.contains("the sluice daemon does not build, and no substituter has /nix/store/"), "{err}");
}

/// Two floating content-addressed derivations (`ca-derivations`): `root`, whose output
/// depends on `marker` only through its build (its content is fixed), and `dependent`, which
/// reads it.
const FLOATING_CA_BUILDS: &str = r#"
{ marker }:
let
  ca = name: script: derivation {
    name = "floating-${name}"; system = "x86_64-linux"; builder = "/bin/sh"; args = [ "-c" script ];
    __contentAddressed = true; outputHashMode = "recursive"; outputHashAlgo = "sha256";
  };
  root = ca "root" "echo marker-${marker} >&2; echo root > $out";
in {
  inherit root;
  dependent = ca "dependent" "read line < ${root}; echo $line-dependent > $out";
}
"#;

/// Nix 2.26's `nix-build` and `nix build` of floating content-addressed derivations through
/// `sluice daemon --build-via` a Nix 2.8 `nix-daemon`, both with the experimental feature
/// `ca-derivations`, as through a `nix-daemon`: the builds are the Nix daemon's (BuildPaths,
/// BuildPathsWithResults), their output paths known from its realisations
/// (QueryDerivationOutputMap, QueryRealisation through `nix realisation info`); a second
/// build of `dependent` after `root` changed only its build (another marker) gives the same
/// path, and a third has nothing to build. Without the feature in sluice's configuration, the build fails saying what it needs.
#[test]
fn floating_ca_derivations_build_through_nix_daemon_with_build_via() {
    let env = Env::new();
    let (_nix_daemon, _daemon, url) = floating_ca_daemons(&env, "root");
    let build_via = format!("unix://{}", env.path("root-build.socket").display());
    let expr = env.path("floating.nix");
    std::fs::write(&expr, FLOATING_CA_BUILDS).unwrap();
    let expr = expr.to_str().unwrap();
    let feature_args = ["--option", "experimental-features", "ca-derivations nix-command"];
    let build = |url: &str, attr: &str, marker: &str| {
        let mut args = vec!["--store", url, expr, "-A", attr, "--argstr", "marker", marker, "--no-out-link"];
        args.extend(feature_args);
        as_root(&env, true, "nix-build", &args)
    };
    let (ok, out, err) = build(&url, "dependent", "one");
    assert!(ok, "nix-build: {err}");
    assert!(err.contains("marker-one"), "the Nix daemon's build log is not on the client's stderr: {err}");
    let dependent = out.trim().to_owned();
    assert!(dependent.starts_with("/nix/store/") && dependent.ends_with("-floating-dependent"), "{out}");
    assert_eq!(std::fs::read_to_string(env.path("root").join(&dependent[1..])).unwrap(), "root-dependent\n");
    let (ok, out, err) = build(&url, "dependent", "two");
    assert!(ok && err.contains("marker-two"), "nix-build with another root build: {err}");
    assert_eq!(out.trim(), dependent, "the same content, the same path");
    // Realised already: nothing to build (QueryMissing knows the realisations), as Nix says.
    let (ok, out, err) = build(&url, "dependent", "two");
    assert!(ok && !err.contains("will be built") && !err.contains("marker-two"), "nix-build of what is realised: {err}");
    assert_eq!(out.trim(), dependent);

    let mut args = vec!["build", "--store", &url, "-f", expr, "root", "--argstr", "marker", "two", "--no-link", "--print-out-paths"];
    args.extend(feature_args);
    let (ok, out, err) = as_root(&env, true, "nix", &args);
    assert!(ok, "nix build: {err}");
    let root = out.trim().to_owned();
    assert!(root.ends_with("-floating-root"), "{out}");
    let mut args = vec!["realisation", "info", "--store", &url, "-f", expr, "root", "--argstr", "marker", "two"];
    args.extend(feature_args);
    let (ok, out, err) = as_root(&env, true, "nix", &args);
    assert!(ok, "nix realisation info: {err}");
    assert!(out.contains(&root) && out.contains("!out"), "{out}");

    let plain = env.daemon_on("plain.socket", "root", "", "", &["--build-via", &build_via], None);
    let plain_url = format!("{}?real={}", plain.url, env.path("root/nix/store").display());
    let (ok, _, err) = build(&plain_url, "root", "two");
    assert!(!ok, "built without ca-derivations");
    assert!(err.contains("has no fixed path: the sluice daemon realises floating content-addressed outputs only with"), "{err}");
}

/// Nix 2.8's `nix-daemon` with `ca-derivations` on the store `<tmp>/<root>` (socket
/// `<root>-build.socket`), and `sluice daemon --build-via` it with the feature (socket
/// `<root>.socket`): the two daemons and sluice's store URL for a Nix 2.26 client.
fn floating_ca_daemons(env: &Env, root: &str) -> (Daemon, Daemon, String) {
    let conf = format!("{NIX_DAEMON_BUILD_CONF}experimental-features = ca-derivations nix-command\n");
    let nix_daemon = env.nix_daemon(&format!("{root}-build.socket"), root, &conf);
    // Nix adds its realisation tables when it opens the store with `ca-derivations` (the
    // connection of `nix_daemon`'s wait for its socket does), taking the store's big lock for
    // writing: sluice, which holds it for reading while it runs and does not add them, starts
    // after that (see the report of issue 41's ca work).
    let ca_schema = env.path(&format!("{root}/nix/var/nix/db/ca-schema"));
    let start = Instant::now();
    while !ca_schema.exists() {
        assert!(start.elapsed() < Duration::from_secs(20), "Nix did not add its realisation tables");
        std::thread::sleep(Duration::from_millis(20));
    }
    let build_via = format!("unix://{}", env.path(&format!("{root}-build.socket")).display());
    let features = "experimental-features = ca-derivations";
    let daemon = env.daemon_on(&format!("{root}.socket"), root, "", features, &["--build-via", &build_via], None);
    let url = format!("{}?real={}", daemon.url, env.path(&format!("{root}/nix/store")).display());
    (nix_daemon, daemon, url)
}

/// Floating content-addressed outputs substituted by their realisations, as Nix 2.26's
/// `ca/build-cache.sh` does it: `nix copy --to file://…` of `dependent` (whose output refers to
/// `root`'s) through one `sluice daemon --build-via` writes its realisations
/// (`realisations/<id>.doi`, with that of `root`, which it depends on); `nix-build` of it
/// through another, on an empty store, with that cache as substituter, builds nothing (no
/// "will be built", no build log): QueryMissing finds the realisations, BuildPathsWithResults
/// substitutes the output paths and registers the realisations with the Nix daemon, root's
/// first, which then knows them (`nix realisation info`). sluice asked the Nix daemon, told
/// not to substitute, to build them.
#[test]
fn floating_ca_outputs_are_substituted_by_their_realisations() {
    let env = Env::new();
    let (_first_nix, _first, first) = floating_ca_daemons(&env, "first");
    let (_second_nix, _second, second) = floating_ca_daemons(&env, "second");
    // `dependent`'s output refers to `root`'s: its realisation depends on root's.
    let expr = env.path("floating.nix");
    std::fs::write(&expr, FLOATING_CA_BUILDS.replace("read line < ${root}; echo $line-dependent", "echo ${root}-dependent")).unwrap();
    let expr = expr.to_str().unwrap();
    let cache = format!("file://{}", env.path("ca-cache").display());
    let nix = |cmd: &[&str], store: &str, args: &[&str]| {
        let mut all = cmd.to_vec();
        all.extend(["--store", store, "-f", expr, "dependent", "--argstr", "marker", "one"]);
        all.extend(args);
        all.extend(["--option", "experimental-features", "ca-derivations nix-command"]);
        as_root(&env, true, "nix", &all)
    };
    let (ok, out, err) = nix(&["build"], &first, &["--no-link", "--print-out-paths", "-L"]);
    assert!(ok && err.contains("marker-one"), "nix build: {err}");
    let dependent = out.trim().to_owned();
    let (ok, _, err) = nix(&["copy"], &first, &["--to", &cache]);
    assert!(ok, "nix copy: {err}");
    let realisations = std::fs::read_dir(env.path("ca-cache/realisations")).unwrap().count();
    assert_eq!(realisations, 2, "dependent's and root's");

    let args = [
        "--store",
        &second,
        expr,
        "-A",
        "dependent",
        "--argstr",
        "marker",
        "one",
        "--no-out-link",
        "--option",
        "substituters",
        &cache,
        "--option",
        "require-sigs",
        "false",
        "--option",
        "experimental-features",
        "ca-derivations nix-command",
    ];
    let (ok, out, err) = as_root(&env, true, "nix-build", &args);
    assert!(ok, "nix-build: {err}");
    assert!(!err.contains("will be built") && !err.contains("marker-one"), "something was built: {err}");
    assert!(err.contains("will be fetched"), "{err}");
    assert_eq!(out.trim(), dependent);
    let root = std::fs::read_to_string(env.path("second").join(&dependent[1..])).unwrap();
    let root = root.strip_suffix("-dependent\n").unwrap_or_else(|| panic!("{root}"));
    assert_eq!(std::fs::read_to_string(env.path("second").join(&root[1..])).unwrap(), "root\n");
    let (ok, out, err) = nix(&["realisation", "info"], &second, &[]);
    assert!(ok && out.contains(&dependent) && out.contains("!out"), "nix realisation info: {out} {err}");
}

/// Derivations whose builds show a client's setting overrides, named after `marker`: `uname`
/// writes the kernel release the builder sees (`2.6.…` under `impersonate-linux-26`, a
/// restricted setting), `slow` sleeps 20 s (`timeout`, which an untrusted client may set,
/// stops it).
const OPTION_BUILDS: &str = r#"
{ marker }:
let build = name: script: derivation { name = "options-${name}-${marker}"; system = "x86_64-linux"; builder = "/bin/sh"; args = [ "-c" script ]; };
in {
  uname = build "uname" "/bin/uname -r > $out";
  slow = build "slow" "/bin/sleep 20; echo > $out";
}
"#;

/// A client's `--option` overrides reach the build that `sluice daemon --build-via` forwards
/// to Nix 2.8's `nix-daemon` as they reach a build straight through that `nix-daemon`: Nix 2.8
/// and 2.26 clients, as root (trusted) and as `nobody` (untrusted). A trusted client's
/// `impersonate-linux-26` makes the builder see a 2.6 kernel; an untrusted client's does not
/// (a restricted setting: sluice, trusted by the Nix daemon, must not pass it on); everyone's
/// `timeout` (Nix's name; unrestricted) stops a slow build with Nix's message.
#[test]
fn client_overrides_reach_delegated_builds_as_through_nix_daemon() {
    let env = Env::new();
    open_to_nobody(&env);
    let _builder = env.nix_daemon("nix-build.socket", "root", NIX_DAEMON_BUILD_CONF);
    let build_via = format!("unix://{}", env.path("nix-build.socket").display());
    let sluice = env.daemon_on("socket", "root", "", "", &["--build-via", &build_via], None);
    let reference = env.nix_daemon("reference.socket", "reference", NIX_DAEMON_BUILD_CONF);
    let expr = env.path("options.nix");
    std::fs::write(&expr, OPTION_BUILDS).unwrap();
    let expr = expr.to_str().unwrap();
    for (client, modern) in [("Nix 2.8", false), ("Nix 2.26", true)] {
        for (who, trusted) in [("root", true), ("nobody", false)] {
            let mut seen = Vec::new();
            for (daemon, url, root) in [("sluice --build-via", &sluice.url, "root"), ("nix-daemon", &reference.url, "reference")] {
                let what = format!("{client} as {who} through {daemon}");
                // Nix 2.26 reads a `.drv` from the store's real directory.
                let url = if modern { format!("{url}?real={}", env.path(root).join("nix/store").display()) } else { url.to_string() };
                let run = |attr: &str, option: [&str; 2]| {
                    let marker = format!("{}-{who}-{root}", if modern { "new" } else { "old" });
                    let args = [
                        "--store",
                        &url,
                        expr,
                        "-A",
                        attr,
                        "--argstr",
                        "marker",
                        &marker,
                        "--no-out-link",
                        "--option",
                        option[0],
                        option[1],
                    ];
                    match (trusted, modern) {
                        (true, _) => as_root(&env, modern, "nix-build", &args),
                        (false, false) => as_nobody(&env, "nix-build", &args),
                        (false, true) => modern_as_nobody(&env, "nix-build", &args),
                    }
                };
                let (ok, out, err) = run("uname", ["impersonate-linux-26", "true"]);
                assert!(ok, "{what}: {err}");
                let release = std::fs::read_to_string(env.path(root).join(out.trim().trim_start_matches('/'))).unwrap();
                assert_eq!(release.starts_with("2.6."), trusted, "{what}: the builder saw kernel {release}");
                let start = Instant::now();
                let (ok, _, err) = run("slow", ["timeout", "1"]);
                assert!(
                    !ok && start.elapsed() < Duration::from_secs(15),
                    "{what}: the slow build was not stopped ({:?}): {err}",
                    start.elapsed()
                );
                let timed_out = err.lines().find(|l| l.contains("timed out")).unwrap_or_else(|| panic!("{what}: {err}"));
                seen.push((release.starts_with("2.6."), timed_out.split("/nix/store/").next().unwrap().to_owned()));
            }
            assert_eq!(seen[0], seen[1], "{client} as {who}: sluice --build-via, then nix-daemon");
        }
    }
}

/// One substitution session for the daemon's lifetime: three Nix 2.8 clients, one after
/// another, each realising a different corpus leaf through `sluice daemon` from nginx, share
/// the session's connections to it (a new HTTP client per operation opened two per client),
/// and the cache's `nix-cache-info` is fetched once.
#[test]
fn clients_share_one_substitution_session() {
    let env = Env::new();
    let server = common::CacheServer::start(&common::corpus().join("cache-xz"), &env.path("nginx"), &[]);
    let daemon = env.daemon("root", &server.url, "");
    let leaves = [
        "/nix/store/00fzg18l8dcbp13xcmh25xm61yazjh55-junnox-themes-8.40",
        "/nix/store/01qmrka1cvljinvxk93rwxcxcj8mxgpp-erionven-1.12-share",
        "/nix/store/02qflg6ykr2r2da18rn6z40nl6bm4hzy-geoip-data-2023",
    ];
    for leaf in leaves {
        assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "-r", leaf, "--option", "substituters", &server.url]).trim(), leaf);
    }
    let log = std::fs::read_to_string(&server.access_log).unwrap();
    let connections: std::collections::BTreeSet<String> =
        log.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["conn"].to_string()).collect();
    assert_eq!((server.requests(".narinfo"), server.requests("nix-cache-info")), (3, 1), "{log}");
    // One connection, normally; a second when a client's request comes before the pool has
    // taken back the connection of the previous client's NAR (seen once under load). A client
    // per operation opened two per client: six.
    assert!(connections.len() < leaves.len(), "{} connections: {log}", connections.len());
}

/// A corpus path with a small closure (4 paths in the bzip2 subset cache).
const GLIBC: &str = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8";

/// The three daemons the builtin tests compare, each for its own store and with the corpus
/// subset cache (the clients, trusted, also pass it as `--option substituters`): `sluice`
/// (store `root`, no `--build-via`), `build-via` (`sluice daemon --build-via` a Nix 2.8
/// `nix-daemon` for the same store `via`: builtins still run in sluice) and `nix-daemon`
/// (Nix 2.8's own, store `reference`), all with `extra_config`.
struct BuiltinDaemons {
    cache: String,
    /// (name, daemon, store root), the reference last.
    daemons: Vec<(&'static str, Daemon, &'static str)>,
    _builder: Daemon,
}

impl BuiltinDaemons {
    fn start(env: &Env, extra_config: &str) -> Self {
        let cache = env.cache();
        let builder = env.nix_daemon("nix-build.socket", "via", NIX_DAEMON_BUILD_CONF);
        let build_via = format!("unix://{}", env.path("nix-build.socket").display());
        let sluice = env.daemon_on("socket", "root", &cache, extra_config, &[], None);
        let via = env.daemon_on("via.socket", "via", &cache, extra_config, &["--build-via", &build_via], None);
        let reference = env.nix_daemon(
            "reference.socket",
            "reference",
            &format!("{NIX_DAEMON_BUILD_CONF}trusted-public-keys = {}\n{extra_config}\n", cache_key()),
        );
        BuiltinDaemons {
            cache,
            daemons: vec![("sluice", sluice, "root"), ("build-via", via, "via"), ("nix-daemon", reference, "reference")],
            _builder: builder,
        }
    }

    /// The store URL of daemon `i` for a Nix 2.8 client, or (`modern`) a Nix 2.26 one, which
    /// reads outputs from the chroot store's real directory.
    fn url(&self, env: &Env, i: usize, modern: bool) -> String {
        let (_, d, root) = &self.daemons[i];
        if modern {
            format!("{}?real={}", d.url, env.path(root).join("nix/store").display())
        } else {
            d.url.clone()
        }
    }
}

/// What a client sees of a store path: its NAR hash and references (`nix-store -q`).
fn hash_and_references(env: &Env, store: &str, path: &str) -> (String, String) {
    (env.nix("nix-store", &["--store", store, "-q", "--hash", path]), env.nix("nix-store", &["--store", store, "-q", "--references", path]))
}

/// `nix-env -i` of a corpus path (Nix 2.8, then Nix 2.26) through `sluice daemon`, with and without
/// `--build-via`: sluice substitutes the path's closure and builds the profile's
/// `builtin:buildenv` derivation itself (Nix's `building '…'` line reaches the client). The
/// profile is the one Nix 2.8's own `nix-daemon` makes on another store from the same cache:
/// the same user-environment path, NAR hash, references and links.
#[test]
fn nix_env_install_builds_buildenv_in_sluice() {
    let env = Env::new();
    let d = BuiltinDaemons::start(&env, "");
    for modern in [false, true] {
        let client = if modern { "Nix 2.26" } else { "Nix 2.8" };
        let mut profiles = Vec::new();
        for (i, (name, _, root)) in d.daemons.iter().enumerate() {
            let url = d.url(&env, i, modern);
            let profile = env.path(&format!("{name}-{modern}-profile"));
            let start = Instant::now();
            // Nix 2.26 at another priority (its `--priority`), for a user environment of its own.
            let priority: &[&str] = if modern { &["--priority", "3"] } else { &[] };
            let args =
                [&["--store", &url, "-p", profile.to_str().unwrap(), "-i", GLIBC, "--option", "substituters", &d.cache], priority].concat();
            let (ok, _, err) = as_root(&env, modern, "nix-env", &args);
            eprintln!("{client}, {name}: nix-env -i {GLIBC}: {:?}", start.elapsed());
            assert!(ok, "{client}, {name}: {err}");
            assert!(
                err.contains("building '/nix/store/") && err.contains("-user-environment.drv'"),
                "{client}, {name}: the user environment was not built: {err}"
            );
            let target = profile_target(&profile);
            let real = env.path(root).join(target.strip_prefix("/").unwrap());
            assert_eq!(std::fs::read_link(real.join("lib")).unwrap(), Path::new(GLIBC).join("lib"), "{client}, {name}");
            let (hash, refs) = hash_and_references(&env, &d.url(&env, i, false), target.to_str().unwrap());
            assert!(refs.contains(GLIBC) && refs.contains("-env-manifest.nix"), "{client}, {name}: {refs}");
            profiles.push((target, hash, refs));
        }
        assert_eq!(profiles[0], profiles[2], "{client}: sluice daemon, then nix-daemon");
        assert_eq!(profiles[1], profiles[2], "{client}: sluice daemon --build-via, then nix-daemon");
    }
}

/// A package for the user environment: a directory `name` under the test directory with
/// `files` (path, contents), added to the store through `store`; returns its store path.
fn add_package(env: &Env, store: &str, name: &str, files: &[(&str, &str)]) -> String {
    let dir = env.path(name);
    for (path, contents) in files {
        std::fs::create_dir_all(dir.join(path).parent().unwrap()).unwrap();
        std::fs::write(dir.join(path), contents).unwrap();
    }
    env.nix("nix-store", &["--store", store, "--add", dir.to_str().unwrap()]).trim().to_owned()
}

/// The store path a `nix-env` profile's current generation links to.
fn profile_target(profile: &Path) -> PathBuf {
    std::fs::read_link(profile.parent().unwrap().join(std::fs::read_link(profile).unwrap())).unwrap()
}

/// Two already-built packages for `nix-env -f … -i`, `alpha` at priority `prio` and `beta` at
/// Nix's default 5. (`nix-env` cannot read a chroot store's profile to add to it, so both are
/// installed at once.)
const TWO_PACKAGES: &str = r#"{ alpha, beta, prio }:
let pkg = name: path: meta: rec { type = "derivation"; inherit name meta; outPath = builtins.storePath path; outputs = [ "out" ]; out = { inherit outPath; }; };
in [ (pkg "alpha" alpha { priority = prio; }) (pkg "beta" beta { }) ]"#;

/// `builtin:buildenv`'s collisions and priorities through `sluice daemon` (with and without
/// `--build-via`) as through Nix 2.8's `nix-daemon`: two packages with the same file at the
/// same priority fail with Nix's message, naming the same two files; with the first at
/// priority 4, its file wins, and their `share/doc` directories (a link made for the first,
/// then expanded) are merged; a dangling symlink in a package is skipped with Nix's warning.
/// The profile is the same store path with the same NAR hash and references.
#[test]
fn buildenv_collisions_and_priorities_match_nix() {
    let env = Env::new();
    let d = BuiltinDaemons::start(&env, "");
    let expr = env.path("two.nix");
    std::fs::write(&expr, TWO_PACKAGES).unwrap();
    let mut seen = Vec::new();
    for (i, (name, _, root)) in d.daemons.iter().enumerate() {
        let url = d.url(&env, i, false);
        if i == 0 {
            std::fs::create_dir_all(env.path("alpha")).unwrap();
            std::os::unix::fs::symlink("/nowhere/at/all", env.path("alpha/dangling")).unwrap();
        }
        let a = add_package(&env, &url, "alpha", &[("bin/hello", "A\n"), ("share/doc/a.txt", "a\n")]);
        let b = add_package(&env, &url, "beta", &[("bin/hello", "B\n"), ("share/doc/b.txt", "b\n")]);
        let install = |profile: &str, prio: &str| {
            let profile = env.path(&format!("{name}-{profile}"));
            let args = [
                "--store",
                &url,
                "-p",
                profile.to_str().unwrap(),
                "-f",
                expr.to_str().unwrap(),
                "-i",
                "--argstr",
                "alpha",
                &a,
                "--argstr",
                "beta",
                &b,
                "--arg",
                "prio",
                prio,
                "alpha",
                "beta",
            ];
            (as_root(&env, false, "nix-env", &args), profile)
        };
        let ((ok, _, err), _) = install("same", "5");
        assert!(!ok, "{name}: a collision was installed: {err}");
        let start = err.find("packages '").unwrap_or_else(|| panic!("{name}: {err}"));
        let collision = err[start..].split(" (0 being the highest priority)").next().unwrap().to_owned();
        assert!(collision.contains("/bin/hello' and '") && collision.contains("have the same priority 5"), "{name}: {err}");
        let ((ok, _, err), profile) = install("prio", "4");
        assert!(ok, "{name}: {err}");
        let target = profile_target(&profile);
        assert!(err.contains(&format!("skipping dangling symlink '{}/dangling'", target.display())), "{name}: {err}");
        let real = env.path(root).join(target.strip_prefix("/").unwrap());
        assert_eq!(std::fs::read_link(real.join("bin/hello")).unwrap(), Path::new(&a).join("bin/hello"), "{name}: priority 4 wins");
        assert_eq!(std::fs::read_link(real.join("share/doc/a.txt")).unwrap(), Path::new(&a).join("share/doc/a.txt"), "{name}");
        assert_eq!(std::fs::read_link(real.join("share/doc/b.txt")).unwrap(), Path::new(&b).join("share/doc/b.txt"), "{name}");
        let (hash, refs) = hash_and_references(&env, &url, target.to_str().unwrap());
        assert!(refs.contains(&a) && refs.contains(&b), "{name}: {refs}");
        seen.push((collision, target, hash, refs));
    }
    assert_eq!(seen[0], seen[2], "sluice daemon, then nix-daemon");
    assert_eq!(seen[1], seen[2], "sluice daemon --build-via, then nix-daemon");
}

/// Serves `files` (URL path, body) on a local port (HTTP/1.1, one request per connection);
/// with `auth`, only to requests carrying `Authorization: Basic <auth>` (else 401). Returns
/// the base URL.
fn serve_files(files: Vec<(&'static str, Vec<u8>)>, auth: Option<&'static str>) -> String {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let mut reader = std::io::BufReader::new(conn);
            let (mut line, mut head) = (String::new(), Vec::new());
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                head.push(std::mem::take(&mut line));
            }
            let path = head.first().and_then(|l| l.split_whitespace().nth(1)).unwrap_or("").to_owned();
            let authorized =
                auth.is_none_or(|a| head.iter().any(|l| l.trim_end().eq_ignore_ascii_case(&format!("authorization: Basic {a}"))));
            let body = files.iter().find(|(p, _)| *p == path).map(|(_, b)| b.as_slice());
            let (status, body) = match (authorized, body) {
                (false, _) => ("401 Unauthorized", &b"login needed"[..]),
                (true, Some(b)) => ("200 OK", b),
                (true, None) => ("404 Not Found", &b"no such file"[..]),
            };
            let mut conn = reader.into_inner();
            let _ = write!(conn, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = conn.write_all(body);
        }
    });
    url
}

/// `nix-build` of `<nix/fetchurl.nix>` with `args` (`--argstr`/`--arg` pairs) through `store`,
/// as root, Nix 2.8 or (`modern`) 2.26: (success, output path, stderr).
fn fetchurl(env: &Env, store: &str, modern: bool, args: &[&str]) -> (bool, String, String) {
    let expr = env.path("fetchurl.nix");
    std::fs::write(&expr, "{ ... }@args: import <nix/fetchurl.nix> args").unwrap();
    let expr = expr.to_str().unwrap().to_owned();
    let (ok, out, err) = as_root(env, modern, "nix-build", &[&["--store", store, &expr, "--no-out-link"], args].concat());
    (ok, out.trim().to_owned(), err)
}

/// `<nix/fetchurl.nix>` (`builtin:fetchurl`) from a local HTTP server through `sluice daemon`
/// (with and without `--build-via`: sluice fetches), Nix 2.8 and 2.26 clients: the same output
/// path, content and NAR hash as through Nix 2.8's own `nix-daemon`; a wrong hash fails through
/// all three with Nix's hash mismatch, naming the hash of what was fetched. sluice adds nothing
/// (but the `.drv` the client added); Nix's `nix-daemon` also leaves the output's lock file and
/// registers what it fetched under the path of the hash it got.
#[test]
fn fetchurl_is_built_in_sluice() {
    let env = Env::new();
    let body: &[u8] = b"fetched by builtin:fetchurl\n";
    let url = format!("{}/hello.txt", serve_files(vec![("/hello.txt", body.to_vec())], None));
    let d = BuiltinDaemons::start(&env, "");
    let sha256 = Hash::digest_bytes(HashAlgo::Sha256, body);
    let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, &regular_file_nar(body, false)).to_nix32_prefixed();
    let mut outputs = Vec::new();
    for (i, (name, _, root)) in d.daemons.iter().enumerate() {
        for modern in [false, true] {
            let store = d.url(&env, i, modern);
            let hash = if modern { sha256.to_sri() } else { sha256.to_base16() };
            let (ok, out, err) =
                fetchurl(&env, &store, modern, &["--argstr", "url", &url, "--argstr", if modern { "hash" } else { "sha256" }, &hash]);
            assert!(ok, "{name} (2.26: {modern}): {err}");
            assert_eq!(std::fs::read(env.path(root).join(out.trim_start_matches('/'))).unwrap(), body, "{name}");
            assert_eq!(env.nix("nix-store", &["--store", &store, "-q", "--hash", &out]).trim(), nar_hash, "{name}");
            outputs.push(out);
            // The second client finds it valid: delete it to have it fetched again.
            env.nix("nix-store", &["--store", &d.url(&env, i, false), "--delete", &outputs[outputs.len() - 1]]);
        }
        let before = store_entries(&env, root);
        let (ok, _, err) = fetchurl(&env, &d.url(&env, i, false), false, &["--argstr", "url", &url, "--argstr", "sha256", &"0".repeat(64)]);
        assert!(!ok, "{name}: a wrong hash was accepted");
        assert!(
            err.contains("hash mismatch in fixed-output derivation '/nix/store/") && err.contains(&format!("got:    {}", sha256.to_sri())),
            "{name}: {err}"
        );
        let added: Vec<String> = store_entries(&env, root)
            .into_iter()
            .filter(|e| !before.contains(e) && !e.ends_with(".drv") && !e.ends_with(".lock"))
            .collect();
        // Nix registers what it fetched under the path of the hash it got, here the good one.
        let expected = if *name == "nix-daemon" { vec![outputs[0].trim_start_matches("/nix/store/").to_owned()] } else { Vec::new() };
        assert_eq!(added, expected, "{name}");
    }
    assert!(outputs.iter().all(|o| *o == outputs[4]), "{outputs:?}");
}

/// A fixed output substituted from a binary cache of another store directory
/// (`file://…?store=/fnord/store`, filled by Nix's `nix store add-file`), as Nix 2.26's
/// `fetchurl.sh` does it: through `sluice daemon` (with and without `--build-via`) and Nix
/// 2.8's `nix-daemon`, `<nix/fetchurl.nix>` of a URL that does not exist gets the path under
/// `/nix/store` that its hash names, with the cache's content. sluice left the substituter out
/// ("sluice supports only the store directory /nix/store") and fetched the URL. A path whose
/// content address is not known (`nix-store -r` of the path itself) is not asked for there, as
/// in Nix; a `builtin:fetchurl` whose output is not fixed gets Nix 2.26's refusal.
#[test]
fn fixed_outputs_are_substituted_from_a_cache_of_another_store_directory() {
    let env = Env::new();
    let body: &[u8] = b"substituted from /fnord/store\n";
    let file = env.path("fnord.txt");
    std::fs::write(&file, body).unwrap();
    let cache = format!("file://{}?store=/fnord/store", env.path("fnord-cache").display());
    let added = env.nix("nix", &["store", "add-file", "--store", &cache, file.to_str().unwrap()]);
    assert!(added.trim().starts_with("/fnord/store/"), "{added}");
    let d = BuiltinDaemons::start(&env, "");
    let sha256 = Hash::digest_bytes(HashAlgo::Sha256, body).to_base16();
    let mut outputs = Vec::new();
    for (i, (name, _, root)) in d.daemons.iter().enumerate() {
        let store = d.url(&env, i, false);
        let args = ["--argstr", "url", "file:///no-such-dir/fnord.txt", "--argstr", "sha256", &sha256, "--option", "substituters", &cache];
        let (ok, out, err) = fetchurl(&env, &store, false, &args);
        assert!(ok, "{name}: {err}");
        assert_eq!(std::fs::read(env.path(root).join(out.trim_start_matches('/'))).unwrap(), body, "{name}");
        outputs.push(out);
    }
    assert!(outputs.iter().all(|o| *o == outputs[2]), "{outputs:?}");
    // The path itself, without its content address: not asked for under another name.
    let (_, sluice, _) = &d.daemons[0];
    env.nix("nix-store", &["--store", &sluice.url, "--delete", &outputs[0]]);
    let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", &sluice.url, "-r", &outputs[0], "--option", "substituters", &cache]);
    assert!(!ok && err.contains("is required, but there is no substituter that can build it"), "{err}");

    let expr = env.path("not-fixed.nix");
    std::fs::write(
        &expr,
        r#"derivation { name = "not-fixed"; system = "x86_64-linux"; builder = "builtin:fetchurl"; url = "file:///no-such-dir/x"; }"#,
    )
    .unwrap();
    let (ok, _, err) = as_root(&env, true, "nix-build", &["--store", &d.url(&env, 0, true), expr.to_str().unwrap(), "--no-out-link"]);
    assert!(!ok && err.contains("'builtin:fetchurl' must be a fixed-output or impure derivation"), "{err}");
}

/// A derivation as `nix-channel --update` makes it (Nix's `unpack-channel.nix`), of the
/// tarball `src` (a path, copied into the store as the client instantiates).
const UNPACK_CHANNEL: &str = r#"
{ src }:
derivation {
  name = "mychan-1.0"; channelName = "mychan"; inherit src;
  system = "builtin"; builder = "builtin:unpack-channel"; preferLocalBuild = true;
}
"#;

/// `nix-build` of [`UNPACK_CHANNEL`] of the tarball `src` through `store`, as root, Nix 2.8 or
/// (`modern`) 2.26: (success, output path, stderr).
fn unpack_channel(env: &Env, store: &str, modern: bool, src: &Path) -> (bool, String, String) {
    let expr = env.path("unpack-channel.nix");
    std::fs::write(&expr, UNPACK_CHANNEL).unwrap();
    let (ok, out, err) = as_root(
        env,
        modern,
        "nix-build",
        &["--store", store, expr.to_str().unwrap(), "--no-out-link", "--arg", "src", src.to_str().unwrap()],
    );
    (ok, out.trim().to_owned(), err)
}

/// One ustar header block for an entry `name` of `size` bytes, of `kind` (`b'0'` a file,
/// `b'5'` a directory, `b'2'` a symlink to `link`), with its checksum: to make tarballs that
/// `tar` refuses to write.
fn ustar_header(name: &str, size: usize, kind: u8, link: &str) -> Vec<u8> {
    let mut h = vec![0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[157..157 + link.len()].copy_from_slice(link.as_bytes());
    h[100..107].copy_from_slice(if kind == b'5' { b"0000755" } else { b"0000644" });
    h[108..115].copy_from_slice(b"0000000");
    h[116..123].copy_from_slice(b"0000000");
    h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
    h[136..147].copy_from_slice(b"00000000000");
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// `builtin:unpack-channel` (the derivation of `nix-channel --update`) through `sluice daemon`
/// (with and without `--build-via`: sluice unpacks) and Nix 2.8's `nix-daemon`, Nix 2.8 and
/// 2.26 clients, for a channel tarball written by GNU tar (xz, as `nixexprs.tar.xz`, and
/// gzip): the same output path, NAR hash and references, a directory `mychan` with the
/// tarball's tree (an executable, a symlink, an empty directory). Bad tarballs (not a tarball,
/// two top-level entries, an entry under `..`, an entry through a symlink out of the
/// directory, a hard link to a root-only file outside it, a character device, a FIFO, a 2 MiB
/// pax header) fail through every daemon, sluice's error saying why, and leave no output.
#[test]
fn unpack_channel_is_built_in_sluice() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let tree = env.path("chan-src/nixexprs-1.0");
    std::fs::create_dir_all(tree.join("pkgs/empty")).unwrap();
    std::fs::write(tree.join("default.nix"), "{ ... }: import ./pkgs\n").unwrap();
    std::fs::write(tree.join("pkgs/default.nix"), "{ hello = 42; }\n").unwrap();
    std::fs::write(tree.join("pkgs/run.sh"), "#!/bin/sh\necho run\n").unwrap();
    std::fs::set_permissions(tree.join("pkgs/run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(".", tree.join("nixpkgs")).unwrap();
    let tar = |name: &str, flags: &[&str], entries: &[&str]| {
        let file = env.path(name);
        let ok = Command::new("tar").args(flags).arg(&file).arg("-C").arg(env.path("chan-src")).args(entries).status().unwrap();
        assert!(ok.success(), "tar {name}");
        file
    };
    let d = BuiltinDaemons::start(&env, "");
    let mut seen = Vec::new();
    for tarball in [tar("nixexprs.tar.xz", &["-cJf"], &["nixexprs-1.0"]), tar("nixexprs.tar.gz", &["-czf"], &["nixexprs-1.0"])] {
        for (i, (name, _, root)) in d.daemons.iter().enumerate() {
            for modern in [false, true] {
                let what = format!("{name}, {} (2.26: {modern})", tarball.display());
                let store = d.url(&env, i, modern);
                let (ok, out, err) = unpack_channel(&env, &store, modern, &tarball);
                assert!(ok, "{what}: {err}");
                let chan = env.path(root).join(out.trim_start_matches('/')).join("mychan");
                assert_eq!(std::fs::read_to_string(chan.join("pkgs/default.nix")).unwrap(), "{ hello = 42; }\n", "{what}");
                assert_eq!(std::fs::read_link(chan.join("nixpkgs")).unwrap(), Path::new("."), "{what}");
                seen.push((what, out.clone(), hash_and_references(&env, &d.url(&env, i, false), &out)));
                // The next client finds it valid: delete it to have it unpacked again.
                env.nix("nix-store", &["--store", &d.url(&env, i, false), "--delete", &out]);
            }
        }
        let (_, out, (hash, refs)) = &seen[seen.len() - 1];
        for (what, o, h) in &seen[seen.len() - 6..] {
            assert_eq!((o, h), (out, &(hash.clone(), refs.clone())), "{what}, then Nix 2.26 through nix-daemon");
        }
    }
    assert_ne!(seen[0].1, seen[6].1, "the gzip tarball is another input, so another output path");

    // Bad tarballs.
    std::fs::write(env.path("garbage.tar.xz"), b"this is not a tarball\n".repeat(40)).unwrap();
    std::fs::create_dir_all(env.path("chan-src/second")).unwrap();
    let two = tar("two.tar.xz", &["-cJf"], &["nixexprs-1.0", "second"]);
    let escaping = env.path("escaped").display().to_string();
    let write_tar = |name: &str, entries: &[Vec<u8>]| {
        let mut tar = entries.concat();
        tar.resize(tar.len().next_multiple_of(512) + 1024, 0);
        std::fs::write(env.path(name), &tar).unwrap();
    };
    write_tar("dotdot.tar", &[ustar_header("chan/", 0, b'5', ""), ustar_header("chan/../../escaped", 3, b'0', ""), b"hi\n".to_vec()]);
    let symlink_out = [ustar_header("chan/", 0, b'5', ""), ustar_header("chan/out", 0, b'2', &env.path("").display().to_string())];
    write_tar("symlink.tar", &[&symlink_out[..], &[ustar_header("chan/out/escaped", 3, b'0', ""), b"hi\n".to_vec()]].concat());
    // A file only root may read, hard-linked from the tarball by its absolute path.
    let secret = env.path("secret");
    std::fs::write(&secret, "root's secret\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    write_tar("hardlink.tar", &[ustar_header("chan/", 0, b'5', ""), ustar_header("chan/secret", 0, b'1', &secret.display().to_string())]);
    write_tar("chardev.tar", &[ustar_header("chan/", 0, b'5', ""), ustar_header("chan/null", 0, b'3', "")]);
    write_tar("fifo.tar", &[ustar_header("chan/", 0, b'5', ""), ustar_header("chan/fifo", 0, b'6', "")]);
    // A pax header of 2 MiB, which the tar crate would hold in memory whole.
    let pax = 2 << 20;
    write_tar("pax.tar", &[ustar_header("PaxHeader/chan", pax, b'x', ""), vec![0; pax], ustar_header("chan/", 0, b'5', "")]);
    for (tarball, why) in [
        (env.path("garbage.tar.xz"), "unpacking channel tarball '/nix/store/"),
        (two, "contains more than one file"),
        (env.path("dotdot.tar"), "entry 'chan/../../escaped' is not inside the archive's directory"),
        (env.path("symlink.tar"), "trying to unpack outside of destination path"),
        (env.path("hardlink.tar"), "trying to unpack outside of destination path"),
        (env.path("chardev.tar"), "entry 'chan/null' is a device or FIFO, which a store path cannot hold"),
        (env.path("fifo.tar"), "entry 'chan/fifo' is a device or FIFO, which a store path cannot hold"),
        (env.path("pax.tar"), "more than 1048576 bytes of headers (pax, GNU long names, sparse maps) for one entry"),
    ] {
        for (i, (name, _, root)) in d.daemons.iter().enumerate() {
            let what = format!("{name}, {}", tarball.display());
            let store = d.url(&env, i, false);
            let before = store_entries(&env, root);
            let (ok, _, err) = unpack_channel(&env, &store, false, &tarball);
            assert!(!ok, "{what}: a bad tarball was unpacked");
            let added: Vec<String> = store_entries(&env, root)
                .into_iter()
                .filter(|e| !before.contains(e) && !e.ends_with(".drv") && !e.ends_with(".lock"))
                .collect();
            let src: Vec<&String> = added.iter().filter(|e| e.ends_with(&*tarball.file_name().unwrap().to_string_lossy())).collect();
            assert_eq!(added.len(), src.len(), "{what}: an output was left: {added:?}");
            if *name != "nix-daemon" || why == "contains more than one file" {
                assert!(err.contains(why), "{what}: {err}");
            }
            assert!(!Path::new(&escaping).exists() && !env.path(root).join("nix/escaped").exists(), "{what}");
        }
    }
}

/// `nix-channel --add URL mychan; nix-channel --update` (Nix 2.8, as root, its profiles under
/// its own `NIX_STATE_DIR`) with a channel served over HTTP, through `sluice daemon` (with and
/// without `--build-via`) and Nix 2.8's `nix-daemon`: the channel's directory in the channels
/// profile is the same store path with the same NAR hash and references through all three.
#[test]
fn nix_channel_update_matches_nix() {
    let env = Env::new();
    let tree = env.path("chan-src/nixexprs-2.0");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("default.nix"), "{ ... }: { hello = 42; }\n").unwrap();
    let ok = Command::new("tar")
        .arg("-cJf")
        .arg(env.path("nixexprs.tar.xz"))
        .arg("-C")
        .arg(env.path("chan-src"))
        .arg("nixexprs-2.0")
        .status()
        .unwrap();
    assert!(ok.success());
    let server = serve_files(
        vec![("/chan", b"a channel\n".to_vec()), ("/chan/nixexprs.tar.xz", std::fs::read(env.path("nixexprs.tar.xz")).unwrap())],
        None,
    );
    let d = BuiltinDaemons::start(&env, "");
    let mut seen = Vec::new();
    for (i, (name, _, _)) in d.daemons.iter().enumerate() {
        let (home, state) = (env.path(&format!("channel-home-{i}")), env.path(&format!("channel-state-{i}")));
        // As Nix's installer makes it.
        std::fs::create_dir_all(state.join("profiles/per-user/root")).unwrap();
        std::fs::create_dir_all(&home).unwrap();
        let channel = |args: &[&str]| {
            let out = env
                .cmd("nix-channel")
                .env("HOME", &home)
                .env("NIX_STATE_DIR", &state)
                .env("NIX_REMOTE", d.url(&env, i, false))
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "{name}: nix-channel {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        channel(&["--add", &format!("{server}/chan"), "mychan"]);
        channel(&["--update"]);
        let link = std::fs::read_link(state.join("profiles/per-user/root/channels")).unwrap();
        let profile = std::fs::read_link(state.join("profiles/per-user/root").join(link)).unwrap();
        let root = d.daemons[i].2;
        let mychan = std::fs::read_link(env.path(root).join(profile.strip_prefix("/").unwrap()).join("mychan")).unwrap();
        let out = mychan.parent().unwrap().to_str().unwrap().to_owned();
        assert_eq!(
            std::fs::read_to_string(env.path(root).join(mychan.strip_prefix("/").unwrap()).join("default.nix")).unwrap(),
            "{ ... }: { hello = 42; }\n",
            "{name}"
        );
        seen.push((out.clone(), hash_and_references(&env, &d.url(&env, i, false), &out)));
    }
    assert_eq!(seen[0], seen[2], "sluice daemon, then nix-daemon");
    assert_eq!(seen[1], seen[2], "sluice daemon --build-via, then nix-daemon");
}

/// `<nix/fetchurl.nix>` behind basic authentication, its credentials in the daemons'
/// `netrc-file`, with `executable = true` (a script, hashed as a NAR) and `unpack = true` (a
/// NAR of a directory with an executable file and a symlink, plain and `.nar.xz`): through
/// `sluice daemon` (with and without `--build-via`) the same output paths and NAR hashes as
/// through Nix 2.8's `nix-daemon`. A netrc file with a wrong password gets the server's 401.
#[test]
fn fetchurl_with_netrc_unpack_and_executable_matches_nix() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let netrc = env.path("netrc");
    std::fs::write(&netrc, "machine 127.0.0.1 login user password secret\n").unwrap();
    let archive = env.path("archive");
    std::fs::create_dir_all(&archive).unwrap();
    std::fs::write(archive.join("run.sh"), "#!/bin/sh\necho unpacked\n").unwrap();
    std::fs::set_permissions(archive.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("run.sh", archive.join("link")).unwrap();
    let nar = Command::new("nix-store").args(["--dump"]).arg(&archive).output().unwrap().stdout;
    let xz = {
        let mut child = Command::new("xz").arg("-c").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), &nar).unwrap();
        drop(child.stdin.take());
        child.wait_with_output().unwrap().stdout
    };
    let script = b"#!/bin/sh\necho fetched\n".to_vec();
    let nar_sha256 = Hash::digest_bytes(HashAlgo::Sha256, &nar).to_base16();
    let script_sha256 = Hash::digest_bytes(HashAlgo::Sha256, &regular_file_nar(&script, true)).to_base16();
    // "user:secret" in base64.
    let base = serve_files(vec![("/run.sh", script), ("/archive.nar", nar), ("/archive.nar.xz", xz)], Some("dXNlcjpzZWNyZXQ="));
    let d = BuiltinDaemons::start(&env, &format!("netrc-file = {}", netrc.display()));
    let cases = [
        ("executable", format!("{base}/run.sh"), script_sha256.as_str(), "executable"),
        ("nar", format!("{base}/archive.nar"), nar_sha256.as_str(), "unpack"),
        ("nar-xz", format!("{base}/archive.nar.xz"), nar_sha256.as_str(), "unpack"),
    ];
    let mut seen = Vec::new();
    for (i, (name, _, root)) in d.daemons.iter().enumerate() {
        let store = d.url(&env, i, false);
        let mut outs = Vec::new();
        for (case, url, hash, flag) in &cases {
            let (ok, out, err) = fetchurl(
                &env,
                &store,
                false,
                &["--argstr", "url", url, "--argstr", "sha256", hash, "--arg", flag, "true", "--argstr", "name", case],
            );
            assert!(ok, "{name} {case}: {err}");
            let real = env.path(root).join(out.trim_start_matches('/'));
            let script = if *flag == "unpack" { real.join("run.sh") } else { real.clone() };
            assert_eq!(std::fs::metadata(&script).unwrap().permissions().mode() & 0o111, 0o111, "{name} {case}: not executable");
            outs.push((out.clone(), hash_and_references(&env, &store, &out)));
        }
        seen.push(outs);
    }
    assert_eq!(seen[0], seen[2], "sluice daemon, then nix-daemon");
    assert_eq!(seen[1], seen[2], "sluice daemon --build-via, then nix-daemon");

    std::fs::write(&netrc, "machine 127.0.0.1 login user password wrong\n").unwrap();
    let wrong = env.daemon_on("wrong.socket", "wrong", &d.cache, &format!("netrc-file = {}", netrc.display()), &[], None);
    let (ok, _, err) = fetchurl(
        &env,
        &wrong.url,
        false,
        &["--argstr", "url", &cases[0].1, "--argstr", "sha256", cases[0].2, "--arg", "executable", "true"],
    );
    assert!(!ok && err.contains(&format!("unable to download '{}'", cases[0].1)) && err.contains("401"), "{err}");
}

/// `file://` URLs in `<nix/fetchurl.nix>`: fetched through `sluice daemon` for a trusted client
/// (root), to the output path the hash implies (Nix 2.8's `nix-daemon` cannot read them for a
/// chroot store: it fetches inside the chroot, "Couldn't read a file:// file"); refused for an untrusted one (`nobody`), whose
/// file would be read by the daemon as root (Nix reads it as a build user in its sandbox),
/// with nothing added but the `.drv`.
#[test]
fn fetchurl_reads_file_urls_for_trusted_clients_only() {
    let env = Env::new();
    open_to_nobody(&env);
    let file = env.path("local.txt");
    std::fs::write(&file, "a local file\n").unwrap();
    let url = format!("file://{}", file.display());
    let sha256 = Hash::digest_bytes(HashAlgo::Sha256, b"a local file\n").to_base16();
    let d = BuiltinDaemons::start(&env, "");
    let args = ["--argstr", "url", &url, "--argstr", "sha256", &sha256];
    let (ok, out, err) = fetchurl(&env, &d.url(&env, 0, false), false, &args);
    assert!(ok, "{err}");
    let ca = ContentAddress::Fixed { recursive: false, hash: Hash::digest_bytes(HashAlgo::Sha256, b"a local file\n") };
    assert_eq!(out, StoreDir::default().display_path(&ca.store_path(&StoreDir::default(), "local.txt", &[], false).unwrap()));
    assert_eq!(std::fs::read(env.path("root").join(out.trim_start_matches('/'))).unwrap(), b"a local file\n");
    env.nix("nix-store", &["--store", &d.url(&env, 0, false), "--delete", &out]);

    let expr = env.path("fetchurl.nix");
    let before = store_entries(&env, "root");
    let (ok, _, err) =
        as_nobody(&env, "nix-build", &[&["--store", &d.url(&env, 0, false), expr.to_str().unwrap(), "--no-out-link"], &args[..]].concat());
    assert!(!ok, "nobody had the daemon read {url}");
    assert!(err.contains(&format!("unable to download '{url}': file:// URLs are read only for trusted clients")), "{err}");
    let added: Vec<String> =
        store_entries(&env, "root").into_iter().filter(|e| !before.contains(e) && !e.ends_with(".drv") && !e.ends_with(".lock")).collect();
    assert!(added.is_empty(), "added {added:?}");
}

/// BuildDerivation (op 36) of a `builtin:fetchurl` derivation sent whole by an untrusted raw
/// client: a fixed output, which Nix lets any client build. sluice fetches it from a local
/// server into the path its hash implies (not the path the client wrote), and answers Built
/// with that output; a wrong hash is Nix's hash mismatch (OutputRejected), adding nothing. A
/// `builtin:buildenv` derivation with a fixed output gets the same check (without it, any
/// client could put a user environment at the path of any hash).
#[test]
fn untrusted_build_derivation_of_fetchurl_is_built_in_sluice() {
    use std::io::Write;
    let env = Env::new();
    let body = b"fetched for an untrusted client\n";
    let url = format!("{}/f.txt", serve_files(vec![("/f.txt", body.to_vec())], None));
    let (_daemon, mut client, out) = daemon_and_client_1_37(&env, "trusted-users = nobody-in-particular", 2);
    let fetch = |hash: &Hash| {
        let hex = hash.to_base16();
        let env = [Err(&b"out"[..]), Err(MISSING), Err(b"url"), Err(url.as_bytes())];
        let head = [
            Err(&b"/nix/store/00000000000000000000000000000000-f.txt.drv"[..]),
            Ok(1),
            Err(b"out"),
            Err(MISSING),
            Err(b"sha256"),
            Err(hex.as_bytes()),
        ];
        let rest = [Ok(0), Err(&b"builtin"[..]), Err(b"builtin:fetchurl"), Ok(0), Ok(2)];
        request(36, &[&head[..], &rest, &env, &[Ok(0)]].concat())
    };
    let good = Hash::digest_bytes(HashAlgo::Sha256, body);
    let ca = ContentAddress::Fixed { recursive: false, hash: good.clone() };
    let path = StoreDir::default().display_path(&ca.store_path(&StoreDir::default(), "f.txt", &[], false).unwrap());
    client.write_all(&fetch(&good)).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg) = (read_u64(&mut client), String::from_utf8(read_string(&mut client)).unwrap());
    assert_eq!((status, msg.as_str()), (0, ""), "Built");
    assert_eq!(read_u64(&mut client), 1, "built once");
    assert_eq!(is_valid_after_result(&mut client, path.as_bytes()), 1);
    assert_eq!(is_valid(&mut client, MISSING), 0, "the path the client wrote");
    assert_eq!(std::fs::read(env.path("root").join(path.trim_start_matches('/'))).unwrap(), body);

    let before = store_entries(&env, "root");
    client.write_all(&fetch(&Hash::digest_bytes(HashAlgo::Sha256, b"something else"))).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg) = (read_u64(&mut client), String::from_utf8(read_string(&mut client)).unwrap());
    assert_eq!(status, 5, "OutputRejected: {msg}");
    assert!(
        msg.starts_with("hash mismatch in fixed-output derivation '/nix/store/00000000000000000000000000000000-f.txt.drv':")
            && msg.contains(&format!("got:    {}", good.to_sri())),
        "{msg}"
    );
    read_u64(&mut client);
    assert_eq!(is_valid_after_result(&mut client, &out), 1, "the connection goes on");
    assert_eq!(store_entries(&env, "root"), before, "nothing added");

    // `builtin:buildenv` with a fixed output (so an untrusted client may send it) claiming the
    // hash of another file: its user environment is not what the hash says, and is refused.
    let other = Hash::digest_bytes(HashAlgo::Sha256, b"a tarball someone will fetch\n");
    let claimed = ContentAddress::Fixed { recursive: false, hash: other.clone() };
    let claimed = StoreDir::default().display_path(&claimed.store_path(&StoreDir::default(), "f.txt", &[], false).unwrap());
    let hex = other.to_base16();
    let head = [
        Err(&b"/nix/store/00000000000000000000000000000000-f.txt.drv"[..]),
        Ok(1),
        Err(b"out"),
        Err(claimed.as_bytes()),
        Err(b"sha256"),
        Err(hex.as_bytes()),
    ];
    let rest = [
        Ok(0),
        Err(&b"builtin"[..]),
        Err(b"builtin:buildenv"),
        Ok(0),
        Ok(2),
        Err(b"derivations"),
        Err(b""),
        Err(b"manifest"),
        Err(b"/nix/store/x"),
    ];
    client.write_all(&request(36, &[&head[..], &rest, &[Ok(0)]].concat())).unwrap();
    assert_eq!(until_last(&mut client), Ok(()));
    let (status, msg) = (read_u64(&mut client), String::from_utf8(read_string(&mut client)).unwrap());
    assert_eq!(status, 5, "OutputRejected: {msg}");
    assert!(
        msg.starts_with("hash mismatch in fixed-output derivation") && msg.contains(&format!("specified: {}", other.to_sri())),
        "{msg}"
    );
    read_u64(&mut client);
    assert_eq!(is_valid_after_result(&mut client, claimed.as_bytes()), 0, "a forged fixed output");
    assert_eq!(store_entries(&env, "root"), before, "nothing added");
}

/// The rest of a protocol 1.37 build result after its times built (non-determinism, times,
/// CPU times, built outputs), then IsValidPath of `path`.
fn is_valid_after_result(client: &mut std::os::unix::net::UnixStream, path: &[u8]) -> u64 {
    let (_non_deterministic, _start, _stop) = (read_u64(client), read_u64(client), read_u64(client));
    for _ in 0..2 {
        if read_u64(client) == 1 {
            read_u64(client);
        }
    }
    for _ in 0..read_u64(client) {
        read_string(client);
        read_string(client);
    }
    is_valid(client, path)
}

// ---------------------------------------------------------------------------------------------
// `sluice copy` to and from a daemon: the daemon client's
// NarFromPath and AddMultipleToStore, against Nix 2.8's `nix-daemon` and `sluice daemon`.

/// `sluice copy --from file://… --to unix://…` (AddMultipleToStore, signatures checked by the
/// daemon against its trusted key) and back out, `--from unix://… --to file://…` (NarFromPath),
/// through Nix 2.8's `nix-daemon` and through `sluice daemon`, each on its own chroot store.
/// Real Nix verifies both ends: the daemon's store passes `nix-store --verify --check-contents`
/// with the cache's signatures kept (`nix path-info --sigs`), and the cache written from it is
/// read by `nix copy --from` into a fresh store that passes the same check. The caches written
/// from the two daemons are the same files.
#[test]
fn sluice_copy_into_and_out_of_daemons() {
    let env = Env::new();
    let cache = env.cache();
    let key = cache_key();
    let key_name = key.split(':').next().unwrap().to_owned();
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    let closure: Vec<String> = env.nix("nix", &["path-info", "-r", "--store", &cache, &glibc]).lines().map(str::to_owned).collect();
    assert!(closure.len() > 1, "{closure:?}");
    let sluice_daemon = env.daemon("sluice-root", &cache, "");
    let nix_daemon = env.nix_daemon("nix-daemon.socket", "nix-root", &format!("trusted-public-keys = {key}\n"));
    let mut written = Vec::new();
    for (daemon, root) in [(&sluice_daemon, "sluice-root"), (&nix_daemon, "nix-root")] {
        let direct = env.path(root);
        let direct = direct.to_str().unwrap();
        // `sluice missing --store unix://…` asks the daemon what is valid: all, then nothing.
        let missing = |expected: usize| {
            let out =
                env.cmd(sluice()).args(["missing", "--json", "--store", &daemon.url, "--substituters", &cache, &glibc]).output().unwrap();
            let json: serde_json::Value =
                serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
            assert_eq!(json["willSubstitute"].as_array().unwrap().len(), expected, "{root}: {json}");
        };
        missing(closure.len());
        let into = env
            .cmd(sluice())
            .env("SLUICE_LOG", "sluice_store::remote=debug")
            .args(["copy", "--from", &cache, "--to", &daemon.url, &glibc])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&into.stderr);
        assert!(into.status.success(), "into {root}: {log}");
        // Both daemons speak 1.34: every path goes in an AddMultipleToStore (a batch holds the
        // paths whose references are added; this closure is nearly a chain).
        let batched: Vec<usize> =
            log.lines().filter_map(|l| l.split("AddMultipleToStore of ").nth(1)?.split(' ').next()?.parse().ok()).collect();
        assert_eq!(batched.iter().sum::<usize>(), closure.len(), "into {root}: {log}");
        missing(0);
        let valid = env.nix("nix-store", &["--store", &daemon.url, "-qR", &glibc]);
        assert_eq!(valid.lines().collect::<std::collections::BTreeSet<_>>(), closure.iter().map(String::as_str).collect(), "{root}");
        verified(&env, direct);
        for line in env.nix("nix", &["path-info", "--store", direct, "--sigs", "-r", &glibc]).lines() {
            assert!(line.split_whitespace().any(|w| w.starts_with(&format!("{key_name}:"))), "{root}: the cache's signature kept: {line}");
        }

        let out_dir = env.path(&format!("{root}-out"));
        let out = format!("file://{}", out_dir.display());
        let from =
            env.cmd(sluice()).args(["copy", "--from", &daemon.url, "--to", &format!("{out}?compression=xz"), &glibc]).output().unwrap();
        assert!(from.status.success(), "out of {root}: {}", String::from_utf8_lossy(&from.stderr));
        let fresh = env.path(&format!("{root}-fresh"));
        let fresh = fresh.to_str().unwrap();
        env.nix("nix", &["copy", "--from", &out, "--to", fresh, &glibc, "--option", "trusted-public-keys", &key]);
        verified(&env, fresh);
        let files: std::collections::BTreeSet<(String, Vec<u8>)> = walk_files(&out_dir)
            .into_iter()
            .map(|p| (p.strip_prefix(&out_dir).unwrap().display().to_string(), std::fs::read(&p).unwrap()))
            .collect();
        assert_eq!(files.iter().filter(|(n, _)| n.ends_with(".narinfo")).count(), closure.len(), "{out}");
        written.push(files);
    }
    assert!(written[0] == written[1], "the caches written from sluice daemon and from nix-daemon differ");

    // From one daemon straight into another: Nix 2.8's into a second sluice daemon.
    let second = env.daemon_on("second.socket", "second-root", &cache, "", &[], None);
    let copied = env.cmd(sluice()).args(["copy", "--from", &nix_daemon.url, "--to", &second.url, &glibc]).output().unwrap();
    assert!(copied.status.success(), "daemon to daemon: {}", String::from_utf8_lossy(&copied.stderr));
    verified(&env, env.path("second-root").to_str().unwrap());
    let infos = |url: &str| without_times(&env.nix("nix", &["path-info", "-r", "--json", "--sigs", "--store", url, &glibc]));
    assert_eq!(infos(&second.url), infos(&nix_daemon.url), "daemon to daemon");
}

/// A daemon that refuses paths inside an AddMultipleToStore batch (signed by a key it does
/// not trust): each refusal is reported against the path it is about (it was another path's
/// of the same batch, that the daemon had stopped at), and the paths sent after it in the
/// batch, which the daemon never looked at, get their own verdict.
#[test]
fn refusals_in_an_add_multiple_batch_name_the_path_refused() {
    let env = Env::new();
    let cache = env.cache();
    let top = store_path_of(&env.path("bin-cache"), "24ycq19xja05axfz8a72yhz9aw6mli99");
    let src = env.path("src");
    env.nix("nix", &["copy", "--from", &cache, "--to", src.to_str().unwrap(), &top, "--option", "trusted-public-keys", &cache_key()]);
    let secret = env.cmd(sluice()).args(["key", "generate", "other-1"]).output().unwrap().stdout;
    let mut public = env.cmd(sluice()).args(["key", "generate", "--public"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut public.stdin.take().unwrap(), &secret).unwrap();
    let other = String::from_utf8(public.wait_with_output().unwrap().stdout).unwrap();
    let daemon = env.daemon_on("socket", "root", &cache, &format!("trusted-public-keys = {}", other.trim()), &[], None);
    let out = env.cmd(sluice()).args(["copy", "--from", src.to_str().unwrap(), "--to", &daemon.url, &top]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let refusals: Vec<&str> = err.lines().filter(|l| l.contains("because it lacks a signature by a trusted key")).collect();
    assert!(refusals.len() >= 10, "{err}");
    for line in &refusals {
        let path = line.strip_prefix("error: ").and_then(|l| l.split(':').next()).unwrap();
        assert!(line.contains(&format!("cannot add path '{path}' because")), "{line}");
    }
    let dependents = err.lines().find(|l| l.contains("were not copied because a path they refer to failed")).unwrap();
    let leaves = refusals.len() + dependents.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap();
    assert!(err.ends_with(&format!("0 already there, {leaves} failed\n")), "{err}");
    assert!(store_entries(&env, "root").iter().all(|e| !e.contains('-')), "{:?}", store_entries(&env, "root"));
}

/// A narinfo's text without its `Sig` lines.
fn without_sigs(narinfo: &str) -> String {
    narinfo.lines().filter(|l| !l.starts_with("Sig: ")).map(|l| format!("{l}\n")).collect()
}

/// Asserts that Nix 2.8's `nix-store --verify --check-contents` finds nothing wrong in `store`.
fn verified(env: &Env, store: &str) {
    let out = env.cmd("nix-store").args(["--store", store, "--verify", "--check-contents"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("error") && !err.contains("warning") && !err.contains("modified"), "{store}: {err}");
    assert!(err.contains("checking store hashes..."), "{store}: {err}");
}

/// Every file under `dir`.
fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        match e.file_type().unwrap().is_dir() {
            true => out.extend(walk_files(&e.path())),
            false => out.push(e.path()),
        }
    }
    out
}

/// The daemon decides on an untrusted client's additions: `sluice copy --no-check-sigs` as
/// `nobody` of paths whose narinfos carry no signature is refused by Nix 2.8's `nix-daemon`
/// and by `sluice daemon` with Nix's message, and leaves nothing in either store; as root
/// (trusted), the same copy with `--no-check-sigs` is taken.
#[test]
fn untrusted_sluice_copy_into_a_daemon_is_the_daemons_decision() {
    let env = Env::new();
    let cache = env.cache();
    open_to_nobody(&env);
    let unsigned = env.path("bin-cache");
    for e in std::fs::read_dir(&unsigned).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".narinfo")) {
        let text = std::fs::read_to_string(e.path()).unwrap();
        std::fs::write(e.path(), without_sigs(&text)).unwrap();
    }
    let dep = store_path_of(&unsigned, "py14wj21zshnib43vh5f66ihm7rx610h");
    let sluice_daemon = env.daemon("sluice-root", &cache, "");
    let nix_daemon = env.nix_daemon("nix-daemon.socket", "nix-root", &format!("trusted-public-keys = {}\n", cache_key()));
    for (daemon, root) in [(&sluice_daemon, "sluice-root"), (&nix_daemon, "nix-root")] {
        let before = store_entries(&env, root);
        let (ok, _, err) = as_nobody(&env, sluice(), &["copy", "--no-check-sigs", "--from", &cache, "--to", &daemon.url, &dep]);
        assert!(!ok, "{root}: an untrusted unsigned add was taken");
        // Each daemon's words (Nix 2.8's `LocalStore::addToStore`, which colours the path;
        // sluice's, with the signers and the trusted keys), passed on by the client without
        // escape sequences, as Nix's logger writes to a pipe.
        assert!(!err.contains('\x1b'), "{root}: escape sequences reached a pipe: {err:?}");
        let words = match root {
            "nix-root" => format!("cannot add path '{dep}' because it lacks a valid signature"),
            _ => format!("cannot add path '{dep}' because it lacks a signature by a trusted key"),
        };
        assert!(
            err.contains(&format!("daemon at {}: AddMultipleToStore: {words}", daemon.url.trim_start_matches("unix://"))),
            "{root}: {err}"
        );
        let after = store_entries(&env, root);
        assert_eq!(after, before, "{root}: the refused add left something");
        let (ok, _, err) = as_root(&env, false, sluice(), &["copy", "--no-check-sigs", "--from", &cache, "--to", &daemon.url, &dep]);
        assert!(ok, "{root}: a trusted client's --no-check-sigs: {err}");
        assert_eq!(env.nix("nix-store", &["--store", &daemon.url, "-q", "--hash", &dep]).trim().len(), "sha256:".len() + 52);
    }
}

/// A batch that a daemon refuses partway: one leaf of a 25-path closure has no signature, and
/// an untrusted client (`nobody`, `--no-check-sigs`) sends the closure, so each daemon refuses
/// that path in the AddMultipleToStore that carries it, having added those sent before it (how
/// many of the 23 paths that do not refer to it end valid depends on how the additions fell
/// into batches: 11 to 23 in runs here).
/// Through Nix 2.8's `nix-daemon` and `sluice daemon`: `sluice copy` fails naming the path and
/// the operation; the destination holds a set closed under references (Nix's own `-qR` of what
/// is valid stays inside it) without the refused path or anything that refers to it, passes
/// `nix-store --verify --check-contents`, and has no other tree in its store directory (no
/// temporary or unregistered tree); the client's count of copied paths is what the daemon made
/// valid. With the signature back, the same copy completes the closure.
#[test]
fn a_batch_refused_partway_leaves_a_closed_valid_subset() {
    let env = Env::new();
    let cache = env.cache();
    open_to_nobody(&env);
    let dir = env.path("bin-cache");
    let top = store_path_of(&dir, "24ycq19xja05axfz8a72yhz9aw6mli99");
    let refused = store_path_of(&dir, "g6gz9bm1r6w22wpyw4al7y30r9c3hks4");
    let narinfo = dir.join("g6gz9bm1r6w22wpyw4al7y30r9c3hks4.narinfo");
    let signed = std::fs::read_to_string(&narinfo).unwrap();
    std::fs::write(&narinfo, without_sigs(&signed)).unwrap();
    let closure_in = |store: &str, path: &str| -> std::collections::BTreeSet<String> {
        env.nix("nix", &["path-info", "-r", "--store", store, path]).lines().map(str::to_owned).collect()
    };
    let closure = closure_in(&cache, &top);
    assert_eq!(closure.len(), 25);
    let tainted: std::collections::BTreeSet<&String> = closure.iter().filter(|p| closure_in(&cache, p).contains(&refused)).collect();
    assert!(tainted.len() > 1 && tainted.len() < closure.len(), "{tainted:?}");
    let sluice_daemon = env.daemon("sluice-root", &cache, "");
    let nix_daemon = env.nix_daemon("nix-daemon.socket", "nix-root", &format!("trusted-public-keys = {}\n", cache_key()));
    for (daemon, root) in [(&sluice_daemon, "sluice-root"), (&nix_daemon, "nix-root")] {
        let direct = env.path(root);
        let direct = direct.to_str().unwrap();
        let (ok, _, err) = as_nobody(&env, sluice(), &["copy", "--no-check-sigs", "--from", &cache, "--to", &daemon.url, &top]);
        assert!(!ok, "{root}: the copy succeeded: {err}");
        assert!(err.contains(&refused) && err.contains(": AddMultipleToStore: "), "{root}: {err}");
        let invalid =
            env.cmd("nix-store").args(["--store", direct, "--check-validity", "--print-invalid"]).args(&closure).output().unwrap();
        let invalid: std::collections::BTreeSet<String> = String::from_utf8_lossy(&invalid.stdout).lines().map(str::to_owned).collect();
        let valid: Vec<&String> = closure.iter().filter(|p| !invalid.contains(*p)).collect();
        assert!(tainted.iter().all(|p| invalid.contains(*p)), "{root}: a path referring to the refused one is valid: {valid:?}");
        eprintln!(
            "{root}: {} of {} paths valid after the refusal ({} refer to the refused path)",
            valid.len(),
            closure.len(),
            tainted.len()
        );
        if !valid.is_empty() {
            let mut args = vec!["--store", direct, "-qR"];
            args.extend(valid.iter().map(|p| p.as_str()));
            let closed: std::collections::BTreeSet<String> = env.nix("nix-store", &args).lines().map(str::to_owned).collect();
            assert_eq!(closed, valid.iter().map(|p| p.to_string()).collect(), "{root}: what is valid is not closed under references");
        }
        verified(&env, direct);
        let trees: Vec<String> = store_entries(&env, root).into_iter().filter(|e| !e.ends_with(".lock")).collect();
        let expected: Vec<String> = valid.iter().map(|p| p.trim_start_matches("/nix/store/").to_string()).collect();
        assert_eq!(trees, expected, "{root}: trees beside the valid paths");
        // The summary line's count (an error line may say "not copied" too).
        let copied: usize = err
            .lines()
            .find_map(|l| l.strip_prefix("copied ")?.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{root}: no count in {err}"));
        assert_eq!(copied, valid.len(), "{root}: {err}");
    }
    std::fs::write(&narinfo, signed).unwrap();
    for (daemon, root) in [(&sluice_daemon, "sluice-root"), (&nix_daemon, "nix-root")] {
        let (ok, _, err) = as_nobody(&env, sluice(), &["copy", "--no-check-sigs", "--from", &cache, "--to", &daemon.url, &top]);
        assert!(ok, "{root}: {err}");
        assert_eq!(closure_in(&daemon.url, &top), closure, "{root}");
        verified(&env, env.path(root).to_str().unwrap());
    }
}

/// Makes `dir` a tree whose deepest file has a path of 4,095 bytes (the most `PATH_MAX`
/// allows) once it is the store path `/nix/store/<hash>-deep` in the store under `root`: about
/// 2,000 nested directories.
fn deepest_tree(dir: &Path, root: &Path) {
    let in_store = root.join("nix/store/00000000000000000000000000000000-deep").as_os_str().len();
    let below = 4096 - 2 - in_store;
    let levels = (below - 100) / 2;
    std::fs::create_dir(dir).unwrap();
    std::fs::write(dir.join("f"), "top\n").unwrap();
    let mut deepest = dir.to_path_buf();
    for _ in 0..levels {
        deepest.push("a");
        std::fs::create_dir(&deepest).unwrap();
    }
    std::fs::write(deepest.join("l".repeat(below - 2 * levels)), "top\n").unwrap();
}

/// Any local user can add a tree as deep as the store accepts and have it optimised (Nix
/// 2.8 clients as `nobody`: `nix-store --add`, then `--optimise`; with
/// `auto-optimise-store = true`, the addition alone), and the daemon goes on serving: root then
/// verifies the store's contents and deletes the path through it. Each walk recursed, and
/// overflowing a worker's stack aborted the daemon for every client.
#[test]
fn the_deepest_tree_a_user_adds_is_optimised_verified_and_deleted_by_the_daemon() {
    let env = Env::new();
    let cache = env.cache();
    open_to_nobody(&env);
    let tree = env.path("deep");
    deepest_tree(&tree, &env.path("root"));
    let tree = tree.to_str().unwrap();
    for config in ["", "auto-optimise-store = true"] {
        let daemon = env.daemon("root", &cache, config);
        let url = daemon.url.as_str();
        let (ok, added, err) = as_nobody(&env, "nix-store", &["--store", url, "--add", tree]);
        assert!(ok, "{config}: {err}");
        let added = added.trim().to_owned();
        if config.is_empty() {
            let (ok, _, err) = as_nobody(&env, "nix-store", &["--store", url, "--optimise"]);
            assert!(ok, "{err}");
            assert!(err.contains("freed by hard-linking 1 files"), "the bottom file linked to f: {err}");
        }
        let real = env.path("root/nix/store").join(Path::new(&added).file_name().unwrap());
        use std::os::unix::fs::MetadataExt;
        assert!(real.join("f").metadata().unwrap().nlink() >= 2, "{config}: f is not in .links");
        let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", url, "--verify", "--check-contents"]);
        assert!(ok && !err.contains("error"), "{config}: {err}");
        let (ok, _, err) = as_root(&env, false, "nix-store", &["--store", url, "--delete", &added]);
        assert!(ok, "{config}: {err}");
        assert!(!real.exists(), "{config}: {} is still there", real.display());
        drop(daemon);
        std::fs::remove_file(env.path("socket")).unwrap();
    }
}

/// `builtin:buildenv` of two packages whose trees share 1,500 nested directories (each level a
/// collision the environment resolves by making the directory its own): both deepest files
/// are linked at the bottom, on a worker's stack, in seconds. Its walk recursed, and resolved
/// each path from the root (83 s at depth 1,000).
#[test]
fn buildenv_of_packages_1500_levels_deep() {
    let env = Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let deep = format!("share/{}", "d/".repeat(1500));
    let a = add_package(&env, &daemon.url, "alpha", &[(&format!("{deep}a.txt"), "a\n")]);
    let b = add_package(&env, &daemon.url, "beta", &[(&format!("{deep}b.txt"), "b\n")]);
    let expr = env.path("two.nix");
    std::fs::write(&expr, TWO_PACKAGES).unwrap();
    let profile = env.path("profile");
    let start = Instant::now();
    let args = [
        "--store",
        &daemon.url,
        "-p",
        profile.to_str().unwrap(),
        "-f",
        expr.to_str().unwrap(),
        "-i",
        "--argstr",
        "alpha",
        &a,
        "--argstr",
        "beta",
        &b,
        "--arg",
        "prio",
        "4",
        "alpha",
        "beta",
    ];
    let (ok, _, err) = as_root(&env, false, "nix-env", &args);
    eprintln!("nix-env -i of two packages 1500 levels deep: {:?}", start.elapsed());
    assert!(ok, "{err}");
    let real = env.path("root").join(profile_target(&profile).strip_prefix("/").unwrap());
    assert_eq!(std::fs::read_link(real.join(&deep).join("a.txt")).unwrap(), Path::new(&a).join(&deep).join("a.txt"));
    assert_eq!(std::fs::read_link(real.join(&deep).join("b.txt")).unwrap(), Path::new(&b).join(&deep).join("b.txt"));
}

/// A process whose environment names a path by its store name (`/nix/store/…`) keeps it alive
/// in a chroot store, through `sluice daemon` as through Nix 2.8's `nix-daemon`: live while
/// the process runs, dead once it is gone. sluice looked for the real directory's name only.
#[test]
fn a_runtime_root_by_its_store_name_keeps_a_path_in_a_chroot_store() {
    let env = Env::new();
    let cache = env.cache();
    let sluice_daemon = env.daemon("root", &cache, "");
    let nix_daemon = env.nix_daemon("reference.socket", "reference", "");
    let file = env.path("kept.txt");
    std::fs::write(&file, "kept by an environment\n").unwrap();
    let urls = [sluice_daemon.url.clone(), nix_daemon.url.clone()];
    let added: Vec<String> =
        urls.iter().map(|url| env.nix("nix-store", &["--store", url, "--add", file.to_str().unwrap()]).trim().to_owned()).collect();
    assert_eq!(added[0], added[1]);
    let listed = |url: &str, what: &str| env.nix("nix-store", &["--store", url, "--gc", what]).lines().any(|l| l == added[0]);
    let mut holder = Command::new("sleep").arg("60").env("KEEP", format!("x:{}/bin", added[0])).spawn().unwrap();
    for url in &urls {
        assert!(listed(url, "--print-live") && !listed(url, "--print-dead"), "{url}: not kept by the environment");
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
    for url in &urls {
        assert!(!listed(url, "--print-live") && listed(url, "--print-dead"), "{url}: still kept");
    }
}

/// A derivation with a floating content-addressed output is registered only where
/// `experimental-features` has `ca-derivations`, as Nix's `parseDerivation` decides at every
/// registration: `nix-store --add` of such a `.drv` as `nobody` through `sluice daemon` fails
/// with Nix 2.8's own words in direct mode, and `sluice copy` of it from a cache (where Nix
/// with the feature put it, unsigned but content-addressed) fails the same way; with the
/// feature, both register it.
#[test]
fn ca_floating_derivations_need_the_experimental_feature() {
    let env = Env::new();
    let cache = env.cache();
    open_to_nobody(&env);
    let drv = env.path("floating.drv");
    std::fs::write(&drv, r#"Derive([("out","","r:sha256","")],[],[],"x86_64-linux","/bin/sh",[],[("out","")])"#).unwrap();
    let drv = drv.to_str().unwrap();
    let disabled = "experimental Nix feature 'ca-derivations' is disabled";
    let direct = format!("local?root={}", env.path("direct").display());
    let out = env.cmd("nix-store").args(["--store", &direct, "--add", drv]).output().unwrap();
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(disabled),
        "Nix 2.8: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let added = env
        .nix("nix-store", &["--store", &direct, "--add", drv, "--option", "extra-experimental-features", "ca-derivations"])
        .trim()
        .to_owned();
    let bin_cache = format!("file://{}", env.path("ca-cache").display());
    env.nix(
        "nix",
        &[
            "copy",
            "--derivation",
            "--from",
            &direct,
            "--to",
            &bin_cache,
            &added,
            "--option",
            "extra-experimental-features",
            "ca-derivations",
        ],
    );

    for (config, allowed) in [("", false), ("experimental-features = ca-derivations", true)] {
        let daemon = env.daemon("root", &cache, config);
        let (ok, out, err) = as_nobody(&env, "nix-store", &["--store", &daemon.url, "--add", drv]);
        assert_eq!(ok, allowed, "daemon with '{config}': {err}");
        if allowed {
            assert_eq!(out.trim(), added);
        } else {
            assert!(err.contains(disabled), "{err}");
        }
        drop(daemon);
        std::fs::remove_file(env.path("socket")).unwrap();
        let to = format!("local?root={}", env.path(&format!("copy-{allowed}")).display());
        let out = env
            .cmd(sluice())
            .args(["copy", "--from", &bin_cache, "--to", &to, &added])
            .env("NIX_CONFIG", format!("substituters =\n{config}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), allowed, "sluice copy with '{config}': {err}");
        assert!(allowed || err.contains(disabled), "{err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Denial of service by an untrusted local user: the daemon bounds what one request and one
// user's connections may hold, so that nobody can stop it serving everyone.

/// A memory figure of `daemon`'s process from `/proc/<pid>/status`, in MiB: `field` is
/// `VmRSS` (resident now) or `VmHWM` (its peak).
fn memory_mib(daemon: &Daemon, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.child.id())).unwrap();
    let kib = status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).unwrap().trim().trim_end_matches("kB").trim();
    kib.parse::<u64>().unwrap() / 1024
}

/// A derivation of 300,000 outputs is read in linear time (found by a hostile review: each
/// output's name was looked for among those before it; 300,000 names are 45 billion
/// comparisons): an untrusted client's BuildDerivation (op 36, 1.37) of one with deferred
/// outputs gets its refusal within the client's 10 s, and the connection goes on.
#[test]
fn a_derivation_of_many_outputs_is_read_in_linear_time() {
    use std::io::Write;
    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "trusted-users = nobody-in-particular");
    let (mut client, _) = raw_client(&env, 37);
    client.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let names: Vec<String> = (0..300_000).map(|i| format!("o{i}")).collect();
    let mut outputs = vec![Ok(names.len() as u64)];
    for name in &names {
        outputs.extend([Err(name.as_bytes()), Err(&b""[..]), Err(&b""[..]), Err(&b""[..])]);
    }
    let rest = [Ok(0), Err(&b"x86_64-linux"[..]), Err(&b"/bin/sh"[..]), Ok(0), Ok(0), Ok(0)];
    let drv = b"/nix/store/00000000000000000000000000000000-many.drv";
    client.write_all(&request(36, &[&[Err(&drv[..])][..], &outputs, &rest].concat())).unwrap();
    assert_eq!(until_last(&mut client), Err("you are not privileged to build input-addressed derivations".to_owned()));
    assert_eq!(is_valid(&mut client, MISSING), 0);
}

/// An untrusted client's data to add is spooled with at most 1 MiB of it in memory (found by
/// a hostile review: 16 MiB, and 32 with the buffer it was read into, for each of the hundreds
/// of connections an untrusted user may hold). Eight AddToStore requests (op 7, 1.37, flat
/// files) whose 15 MiB of data have been sent but not ended grow the daemon by less than
/// 48 MiB (120 before); once ended, each file is added whole.
#[test]
fn an_untrusted_clients_data_to_add_is_spooled_with_little_memory() {
    use std::io::Write;
    let env = Env::new();
    let daemon = env.daemon("root", &env.cache(), "trusted-users = nobody-in-particular");
    let before = memory_mib(&daemon, "VmRSS");
    let data = vec![b'x'; 15 << 20];
    let mut clients: Vec<_> = (0..8u8)
        .map(|i| {
            let (mut client, _) = raw_client(&env, 37);
            let name = format!("spooled-{i}");
            let mut add = request(7, &[Err(name.as_bytes()), Err(b"fixed:sha256"), Ok(0), Ok(0)]);
            add.extend(u64s(&[data.len() as u64 + 1]));
            add.extend_from_slice(&data);
            add.push(b'0' + i);
            client.write_all(&add).unwrap();
            client
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let grown = memory_mib(&daemon, "VmRSS").saturating_sub(before);
    assert!(grown < 48, "the daemon grew by {grown} MiB for 8 × 15 MiB being added");
    for (i, client) in clients.iter_mut().enumerate() {
        client.write_all(&u64s(&[0])).unwrap();
        assert_eq!(until_last(client), Ok(()));
        let path = String::from_utf8(read_string(client)).unwrap();
        assert!(path.ends_with(&format!("-spooled-{i}")), "{path}");
        let added = std::fs::read(env.path("root").join(&path[1..])).unwrap();
        assert_eq!((added.len(), added.last()), (data.len() + 1, Some(&(b'0' + i as u8))));
    }
}

/// An untrusted client's AddMultipleToStore reads no NARs ahead of their unpacking (found by
/// a hostile review: each connection read up to 16 NARs of up to 1 MiB ahead, so that an
/// untrusted user's 256 connections could make the daemon hold 4 GiB, where its AddToStore
/// keeps 1 MiB in memory). Six untrusted connections each send 20 content-addressed paths
/// of 1 MiB in a framed payload they do not end: the daemon's peak memory grows by less than
/// 24 MiB (by 55 before); each connection, once it ends its payload, has all 20 paths added.
#[test]
fn an_untrusted_clients_add_multiple_reads_no_nars_ahead() {
    use std::io::Write;
    let env = Env::new();
    let daemon = env.daemon("root", &env.cache(), "trusted-users = nobody-in-particular");
    let before = memory_mib(&daemon, "VmHWM");
    let paths: Vec<Vec<(StorePath, Vec<u8>, ContentAddress)>> = (0..6u8)
        .map(|c| {
            (0..20u8)
                .map(|i| {
                    let mut contents = vec![b'x'; (1 << 20) - 4096];
                    contents[..2].copy_from_slice(&[b'a' + c, b'a' + i]);
                    let ca = ContentAddress::Text(Hash::digest_bytes(HashAlgo::Sha256, &contents));
                    let path = ca.store_path(&StoreDir::default(), &format!("ahead-{c}-{i}"), &[], false).unwrap();
                    (path, regular_file_nar(&contents, false), ca)
                })
                .collect()
        })
        .collect();
    let mut clients: Vec<_> = paths
        .iter()
        .map(|each| {
            let (mut client, trusted) = raw_client(&env, 37);
            assert_eq!(trusted, Some(2));
            let mut payload = u64s(&[each.len() as u64]);
            for (path, nar, ca) in each {
                assert!(nar.len() <= 1 << 20);
                payload.extend(wire_info(path, nar, &[], ca));
                payload.extend_from_slice(nar);
            }
            let mut req = u64s(&[44, 0, 1]);
            req.extend(u64s(&[payload.len() as u64]));
            req.extend(payload);
            client.write_all(&req).unwrap();
            client
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let grown = memory_mib(&daemon, "VmHWM").saturating_sub(before);
    assert!(grown < 24, "the daemon's peak memory grew by {grown} MiB for 6 × 20 MiB being added");
    for (client, each) in clients.iter_mut().zip(&paths) {
        client.write_all(&u64s(&[0])).unwrap();
        assert_eq!(until_last(client), Ok(()));
        for (path, _, _) in each {
            assert_eq!(is_valid(client, format!("/nix/store/{}", path.base_name()).as_bytes()), 1, "{}", path.base_name());
        }
    }
}

/// A QueryValidPaths request (op 31, protocol 1.37) of `n` distinct paths with 200-character
/// names (256 bytes each on the wire), without its last field (`substitute`).
fn valid_paths_request_but_its_end(n: u32) -> Vec<u8> {
    let mut out = u64s(&[31, u64::from(n)]);
    for i in 0..n {
        let hash = sluice_nix::base32::encode(Hash::digest_bytes(HashAlgo::Sha1, &i.to_le_bytes()).digest());
        let path = format!("/nix/store/{hash}-{}", "x".repeat(200));
        out.extend(u64s(&[path.len() as u64]));
        out.extend_from_slice(path.as_bytes());
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out
}

/// An untrusted user's requests share a bounded part of the daemon's memory while they are
/// read and answered (found by a hostile review: every connection of a user held its request
/// whole, up to the 128 MiB budget each, 256 connections at once, in the one daemon process).
/// Two 80 MiB path sets of one user at once are more than its 128 MiB share: the second is
/// refused naming the share and what the first holds, and its connection ends; the first is
/// answered, and once it is, its memory is given back: a 100 MiB request on the same
/// connection is answered.
#[test]
fn an_untrusted_users_large_requests_share_a_bounded_part_of_the_daemons_memory() {
    use std::io::Write;
    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "trusted-users = nobody-in-particular");
    let big = valid_paths_request_but_its_end(80 << 12);
    let (mut first, trusted) = raw_client(&env, 37);
    assert_eq!(trusted, Some(2));
    first.write_all(&big).unwrap();
    let (mut second, _) = raw_client(&env, 37);
    let _ = second.write_all(&big).and_then(|()| second.write_all(&u64s(&[0])));
    let refused = until_last(&mut second).expect_err("the second large request is refused");
    let prefix = "QueryValidPaths request refused: an untrusted user's requests hold at most 128 MiB of the daemon's memory at once \
                  (beyond the first 1 MiB of each request); this user's other requests hold ";
    let held: u64 = refused.strip_prefix(prefix).and_then(|r| r.strip_suffix(" MiB")?.parse().ok()).unwrap_or_else(|| panic!("{refused}"));
    assert!((70..=80).contains(&held), "the first request holds {held} MiB");
    let mut rest = Vec::new();
    assert_eq!(std::io::Read::read_to_end(&mut second, &mut rest).unwrap_or(0), 0, "connection closed");

    first.write_all(&u64s(&[0])).unwrap();
    assert_eq!(until_last(&mut first), Ok(()));
    assert_eq!(read_u64(&mut first), 0, "none of the paths is valid");
    first.write_all(&valid_paths_request_but_its_end(100 << 12)).unwrap();
    first.write_all(&u64s(&[0])).unwrap();
    assert_eq!(until_last(&mut first), Ok(()), "the first request's memory was given back");
    assert_eq!(read_u64(&mut first), 0);
}

/// A SetOptions declaring 100,000 overrides of 1 MiB each, 320 of them sent: the daemon stops
/// reading at the request's budget (4 MiB) and refuses it naming the request, its limit and
/// the field it reached, holding none of the rest, and serves the next client.
#[test]
fn an_oversized_request_is_refused_without_holding_what_it_sends() {
    use std::io::Write;
    let env = Env::new();
    let (daemon, mut client) = daemon_and_client_1_34(&env);
    let before = memory_mib(&daemon, "VmRSS");
    let mut writer = client.try_clone().unwrap();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        writer.write_all(&u64s(&[[19].as_slice(), &[0; 12], &[100_000]].concat()))?;
        let value = vec![b'v'; 1 << 20];
        for i in 0..320 {
            // A pair (name, value) is encoded as a request's two string arguments.
            writer.write_all(&request(0, &[Err(format!("k{i}").as_bytes()), Err(&value)])[8..])?;
        }
        Ok(())
    });
    let sent = sender.join().unwrap();
    let after = memory_mib(&daemon, "VmRSS");
    assert!(after < before + 64, "the daemon holds {after} MiB after the request (before it: {before} MiB)");
    assert!(sent.is_err(), "the daemon read all 320 MiB");
    assert_eq!(
        until_last(&mut client),
        Err("SetOptions request refused: more than its limit of 4194304 bytes was sent (the limit was reached reading setting override)"
            .to_owned())
    );
    assert_eq!(is_valid(&mut raw_client_1_34(&env), MISSING), 0, "the next client is served");
}

/// `n` connections to `env`'s daemon from user `nobody`: a thread of this process connects
/// with nobody's effective uid (what `SO_PEERCRED` reports), which it alone takes.
fn connect_as_nobody(env: &Env, n: usize) -> Vec<std::os::unix::net::UnixStream> {
    let socket = env.path("socket");
    std::thread::spawn(move || {
        // SAFETY: the raw system call changes this thread's credentials only (glibc's
        // `setresuid` would change every thread's); the thread ends after connecting.
        #[allow(unsafe_code)] // a libc call the test drives processes or files with
        let set = unsafe { libc::syscall(libc::SYS_setresuid, u32::MAX, 65534u32, u32::MAX) };
        assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
        (0..n).map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap()).collect()
    })
    .join()
    .unwrap()
}

/// Of `streams`, how many the daemon has closed (a read finds the end at once).
fn closed_by_daemon(streams: &[std::os::unix::net::UnixStream]) -> usize {
    streams
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            matches!(std::io::Read::read(&mut &**s, &mut [0u8; 1]), Ok(0))
        })
        .count()
}

/// `nobody` opens 150 idle connections (300 descriptors) to a daemon limited to 256 open
/// files: it admits 18 ((256 - 64) / 2 / 4 = 24 connections, the last 6 kept for trusted
/// users) and closes the other 132 at once; root's query is answered at once meanwhile; the
/// 18, which never greet, are closed after the 10 s handshake deadline, while root's
/// connection, which greeted, stays usable past it.
#[test]
fn an_untrusted_flood_of_idle_connections_leaves_room_for_trusted_users() {
    let env = Env::new();
    open_to_nobody(&env);
    let _daemon = env.daemon_limited("root", &env.cache(), "", Some(256));
    let flooded = Instant::now();
    let flood = connect_as_nobody(&env, 150);
    while closed_by_daemon(&flood) < 132 && flooded.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(closed_by_daemon(&flood), 132, "nobody's connections beyond its share are closed at once");
    let start = Instant::now();
    let mut root = raw_client_1_34(&env);
    assert_eq!(is_valid(&mut root, MISSING), 0);
    assert!(start.elapsed() < Duration::from_secs(2), "root waited {:?}", start.elapsed());
    while closed_by_daemon(&flood) < 150 && flooded.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(closed_by_daemon(&flood), 150, "idle connections are closed after the handshake deadline");
    assert!(flooded.elapsed() >= Duration::from_secs(10), "closed after {:?}, before the deadline", flooded.elapsed());
    assert_eq!(is_valid(&mut root, MISSING), 0, "a greeted connection outlives the deadline");
}

/// A client that trickles its greeting, one byte every 2 s (each well within the 10 s
/// handshake deadline), is disconnected 10 s after it connected, before it has sent even its
/// 8-byte magic number (16 s): the deadline bounds the whole greeting, not each read.
/// Meanwhile and afterwards a client that greets at once is served. Regression: the deadline
/// was `SO_RCVTIMEO`, renewed by every byte, so such a client held a worker for ever.
#[test]
fn a_client_trickling_its_greeting_is_disconnected_at_the_handshake_deadline() {
    use std::io::{Read, Write};
    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "");
    let mut greeting = u64s(&[0x6e69_7863, 0x126, 0, 0]).into_iter();
    let mut slow = std::os::unix::net::UnixStream::connect(env.path("socket")).unwrap();
    let connected = Instant::now();
    slow.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut answer = Vec::new();
    let closed = loop {
        if connected.elapsed() > Duration::from_secs(16) {
            break None;
        }
        if let Some(byte) = greeting.next() {
            if slow.write_all(&[byte]).is_err() {
                break Some(connected.elapsed());
            }
        }
        let mut buf = [0u8; 64];
        match slow.read(&mut buf) {
            Ok(0) => break Some(connected.elapsed()),
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break Some(connected.elapsed()),
        }
    };
    assert!(answer.is_empty(), "the daemon answered an unfinished magic number: {answer:?}");
    let closed = closed.expect("the trickling client was still connected 16 s after it connected");
    assert!(closed >= Duration::from_secs(9), "disconnected after {closed:?}, before the deadline");
    assert!(closed < Duration::from_secs(13), "disconnected after {closed:?}, long after the 10 s deadline");
    let mut prompt = raw_client_1_34(&env);
    assert_eq!(is_valid(&mut prompt, MISSING), 0, "a client that greets at once is served");
}

/// A server without `--store` serves the chroot store `NIX_REMOTE` names, as `nix-daemon`
/// serves the `store` setting: started in a test's environment (or a far end's wrapper that
/// sets `NIX_REMOTE`), it never opens this machine's `/nix`.
#[test]
fn servers_without_store_serve_the_store_nix_remote_names() {
    for server in [&["daemon", "--stdio"][..], &["legacy-serve"][..]] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        common::isolate(&mut cmd, tmp.path(), "");
        let o = cmd.args(server).stdin(std::process::Stdio::null()).output().unwrap();
        let opened = tmp.path().join("default-store/nix/var/nix/db/db.sqlite");
        assert!(opened.is_file(), "{server:?} did not open the store NIX_REMOTE names: {}", common::stderr(&o));
    }
}

/// The far ends of the SSH stores take the flag their client appends to `remote-program` when
/// `remote-program` already gives it (`ssh-ng://…?remote-program=sluice daemon --stdio` runs
/// `sluice daemon --stdio --stdio`; `ssh://…?remote-program=sluice legacy-serve --write` runs
/// `sluice legacy-serve --write --serve --write`), as `nix-daemon` and `nix-store` take a flag
/// twice: each serves its store and reads the client's greeting. Regression: clap refused the
/// second flag ("cannot be used multiple times"), so the README's ssh:// example failed.
#[test]
fn servers_take_a_flag_twice_as_their_ssh_clients_append_it() {
    for server in [&["daemon", "--stdio", "--stdio"][..], &["legacy-serve", "--write", "--serve", "--write"][..]] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        common::isolate(&mut cmd, tmp.path(), "");
        let o = cmd.args(server).stdin(std::process::Stdio::null()).output().unwrap();
        assert!(!common::stderr(&o).contains("cannot be used multiple times"), "{server:?}: {}", common::stderr(&o));
        let opened = tmp.path().join("default-store/nix/var/nix/db/db.sqlite");
        assert!(opened.is_file(), "{server:?} did not serve its store: {}", common::stderr(&o));
    }
}

/// Without `--socket` or `NIX_DAEMON_SOCKET_PATH`, `sluice daemon` listens on
/// `daemon-socket/socket` in the served store's state directory, as Nix 2.35's `nix-daemon`
/// (`getDaemonSocketPath`, `uds-remote-store.cc`): a chroot store given by `--store DIR`, by
/// `NIX_REMOTE=local?root=DIR` or with its own `state` has its own socket, where Nix 2.8 and
/// sluice's client (`daemon?root=DIR`, `unix://?state=S`) reach it. Regression: the daemon
/// bound `/nix/var/nix/daemon-socket/socket` whatever its store.
#[test]
fn a_daemon_without_socket_listens_in_its_stores_state_directory() {
    let env = Env::new();
    let under = |root: &str| env.path(root).join("nix/var/nix");
    let path = |p: &str| env.path(p).display().to_string();
    let (given, own) = (path("given"), format!("local?root={}&state={}", path("own"), path("own-state")));
    let cases: [(Vec<&str>, Option<String>, PathBuf, String); 3] = [
        (vec!["--store", &given], None, under("given"), format!("daemon?root={}", path("given"))),
        (vec![], Some(format!("local?root={}", path("remote"))), under("remote"), format!("daemon?root={}", path("remote"))),
        (vec!["--store", &own], None, env.path("own-state"), format!("unix://?state={}", path("own-state"))),
    ];
    for (args, remote, state, client) in cases {
        let mut cmd = env.cmd(sluice());
        cmd.env_remove("NIX_DAEMON_SOCKET_PATH").arg("daemon").args(&args).stderr(Stdio::null());
        if let Some(remote) = &remote {
            cmd.env("NIX_REMOTE", remote);
        }
        let socket = state.join("daemon-socket/socket");
        let daemon = wait_for_socket(cmd.spawn().unwrap(), &socket);
        let file = env.path("own-socket.txt");
        std::fs::write(&file, "through the store's own socket\n").unwrap();
        let path = env.nix("nix-store", &["--store", &daemon.url, "--add", file.to_str().unwrap()]).trim().to_owned();
        assert!(state.join("db/db.sqlite").is_file(), "{args:?} {remote:?}: the daemon serves another store");
        let found = env.cmd(sluice()).env_remove("NIX_DAEMON_SOCKET_PATH").args(["path-info", "--store", &client, &path]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&found.stdout).trim(), path, "{client}: {}", common::stderr(&found));
    }
}

/// `sluice daemon` given `--store` twice serves the last, as Nix takes the last value of an
/// option: a far end's wrapper may give one and Nix passes another from `remote-store` (clap
/// refused the second before).
#[test]
fn the_daemon_serves_the_last_store_given() {
    let tmp = tempfile::tempdir().unwrap();
    let (first, last) = (tmp.path().join("first"), tmp.path().join("last"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    common::isolate(&mut cmd, tmp.path(), "");
    let stores = [format!("local?root={}", first.display()), format!("local?root={}", last.display())];
    let o =
        cmd.args(["daemon", "--stdio", "--store", &stores[0], "--store", &stores[1]]).stdin(std::process::Stdio::null()).output().unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert!(last.join("nix/var/nix/db/db.sqlite").is_file(), "the last --store was not served: {}", common::stderr(&o));
    assert!(!first.exists(), "the first --store was opened");
}
