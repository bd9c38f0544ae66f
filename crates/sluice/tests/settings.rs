//! Settings: a Nix user's configuration means to sluice what it means
//! to real Nix 2.8, each checked side by side with Nix on the same files and caches.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;

/// Runs `cmd` with only the Nix configuration given by `env` (`NIX_CONFIG` and the config
/// directories of [`isolate`] removed or replaced).
fn configured(mut cmd: Command, tmp: &Path, env: &[(&str, &Path)]) -> Output {
    isolate(&mut cmd, tmp, "");
    cmd.env_remove("NIX_CONFIG")
        .env_remove("NIX_USER_CONF_FILES")
        .env_remove("XDG_CONFIG_DIRS")
        .env("XDG_CONFIG_HOME", tmp.join("no-xdg-home"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The `warning: unknown setting` lines of `o`, in order.
fn unknown_warnings(o: &Output) -> Vec<String> {
    stderr(o).lines().filter(|l| l.starts_with("warning: unknown setting")).map(String::from).collect()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Which files are read, in which precedence, and which names get Nix's warning: for
/// `NIX_USER_CONF_FILES` and for `XDG_CONFIG_HOME` with `XDG_CONFIG_DIRS`. The winner shows in
/// the `store` setting (Nix's `show-config`, sluice's default store for `path-info`).
#[test]
fn config_files_and_unknown_settings_as_nix_2_8() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let root = |name: &str| t.join(format!("root-{name}")).to_str().unwrap().to_owned();
    write(
        &t.join("etc/nix.conf"),
        &format!(
            "substituter = file:///typo\nbinary-caches =\nextra-binary-caches =\nbuild-max-jobs = 2\nextra-etc-unknown = 1\nstore = {}\n",
            root("etc")
        ),
    );
    write(&t.join("u1.conf"), &format!("u1-unknown = 1\nstore = {}\n", root("u1")));
    write(&t.join("u2.conf"), &format!("u2-unknown = 1\nstore = {}\ntrusted-binary-caches =\n", root("u2")));
    write(&t.join("home/nix/nix.conf"), &format!("home-unknown = 1\nstore = {}\n", root("home")));
    write(&t.join("d1/nix/nix.conf"), &format!("d1-unknown = 1\nstore = {}\n", root("d1")));
    write(&t.join("d2/nix/nix.conf"), &format!("d2-unknown = 1\nstore = {}\nlock-cpu = false\n", root("d2")));
    // Only the winners hold the path, so that `path-info` finds it only in the right store.
    let path = corpus_path("firewall-rules");
    let from = format!("file://{}", corpus().join("cache-xz").display());
    for winner in ["u1", "home"] {
        check(&copy_with(t, Path::new(&root(winner)), &from, &corpus_key(), &[], &[&path]), "sluice copy");
    }
    let user_files = std::ffi::OsString::from(format!("{}:{}", t.join("u1.conf").display(), t.join("u2.conf").display()));
    let dirs = std::ffi::OsString::from(format!("{}:{}", t.join("d1").display(), t.join("d2").display()));
    let home = t.join("home");
    /// The environment, the flags, and what is expected.
    type Scenario<'a> = (Vec<(&'a str, &'a Path)>, &'a [&'a str], String);
    let scenarios: [Scenario; 2] = [
        (
            vec![("NIX_USER_CONF_FILES", Path::new(&user_files))],
            &["extra-etc-unknown", "substituter", "u1-unknown", "u2-unknown"],
            root("u1"),
        ),
        (
            vec![("XDG_CONFIG_HOME", &home), ("XDG_CONFIG_DIRS", Path::new(&dirs))],
            &["d1-unknown", "d2-unknown", "extra-etc-unknown", "home-unknown", "substituter"],
            root("home"),
        ),
    ];
    for (env, unknown, winner) in scenarios {
        let mut env = env;
        let etc = t.join("etc");
        env.push(("NIX_CONF_DIR", &etc));
        let mut nix_cmd = Command::new("nix");
        nix_cmd.args(["--extra-experimental-features", "nix-command", "show-config"]);
        let nix_out = configured(nix_cmd, t, &env);
        check(&nix_out, "nix show-config");
        let mut sluice_cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        sluice_cmd.args(["path-info", &path]);
        let sluice_out = configured(sluice_cmd, t, &env);
        let expected: Vec<String> = unknown.iter().map(|n| format!("warning: unknown setting '{n}'")).collect();
        // sluice's own `lock-cpu` is known to sluice only.
        let nix_warnings: Vec<String> = unknown_warnings(&nix_out).into_iter().filter(|w| !w.contains("lock-cpu")).collect();
        assert_eq!(nix_warnings, expected, "{env:?}");
        assert_eq!(unknown_warnings(&sluice_out), expected, "{env:?}");
        let store_line = String::from_utf8_lossy(&nix_out.stdout).lines().find(|l| l.starts_with("store = ")).map(String::from);
        assert_eq!(store_line, Some(format!("store = {winner}")));
        check(&sluice_out, &format!("sluice path-info in the default store {winner}"));
        assert_eq!(String::from_utf8_lossy(&sluice_out.stdout).trim(), path);
    }
}

/// `NIX_REMOTE` chooses the default store unless the `store` setting does (Nix's `store`
/// defaults to `$NIX_REMOTE`); both Nix and sluice then find the path in it.
#[test]
fn nix_remote_and_store_setting_choose_the_default_store() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (root, path) = (t.join("root"), corpus_path("firewall-rules"));
    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(&copy_with(t, &root, &from, &corpus_key(), &[], &[&path]), "sluice copy");
    let root_url = root.to_str().unwrap();
    let etc = t.join("etc");
    for (remote, conf) in [(root_url, String::new()), ("/nonexistent-root", format!("store = {root_url}\n"))] {
        write(&t.join("etc/nix.conf"), &conf);
        let env: Vec<(&str, &Path)> = vec![("NIX_REMOTE", Path::new(remote)), ("NIX_CONF_DIR", &etc)];
        let mut nix_cmd = Command::new("nix");
        nix_cmd.args(["--extra-experimental-features", "nix-command", "path-info", &path]);
        let nix_out = configured(nix_cmd, t, &env);
        check(&nix_out, "nix path-info");
        let mut sluice_cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        sluice_cmd.args(["path-info", &path]);
        let sluice_out = configured(sluice_cmd, t, &env);
        check(&sluice_out, "sluice path-info");
        assert_eq!(sluice_out.stdout, nix_out.stdout);
    }
}

/// A tiny cache server that answers 401 unless the request carries basic authentication
/// `alice:s3cret`; stopped on drop.
struct AuthServer {
    url: String,
    child: std::process::Child,
}

impl AuthServer {
    fn start(root: &Path) -> AuthServer {
        let script = r#"
import base64, os, sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
want = "Basic " + base64.b64encode(b"alice:s3cret").decode()
class H(SimpleHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.headers.get("Authorization") != want:
            self.send_response(401); self.send_header("WWW-Authenticate", 'Basic realm="cache"')
            self.send_header("Content-Length", "0"); self.end_headers(); return
        super().do_GET()
os.chdir(sys.argv[1])
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;
        let mut child = Command::new("python3").args(["-c", script]).arg(root).stdout(std::process::Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
        AuthServer { url: format!("http://127.0.0.1:{}", line.trim()), child }
    }
}

impl Drop for AuthServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cache behind basic authentication: without credentials both Nix and sluice fail; with
/// the cache's host in `$NIX_CONF_DIR/netrc` (the default `netrc-file`) or in a `netrc-file`
/// named in nix.conf, both copy the path.
#[test]
fn netrc_file_authenticates_to_http_caches_as_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let server = AuthServer::start(&corpus().join("cache-xz"));
    let path = corpus_path("firewall-rules");
    let netrc = "machine other.example login x password y\nmachine 127.0.0.1\n  login alice\n  password s3cret\n";
    let etc = t.join("etc");
    let cases = [("none", "", false), ("default", "", true), ("named", "netrc-file = NAMED\n", true)];
    for (name, conf, works) in cases {
        let _ = std::fs::remove_file(etc.join("netrc"));
        match name {
            "default" => write(&etc.join("netrc"), netrc),
            "named" => write(&t.join("named-netrc"), netrc),
            _ => {}
        }
        let conf = conf.replace("NAMED", t.join("named-netrc").to_str().unwrap());
        write(&etc.join("nix.conf"), &format!("{conf}trusted-public-keys = {}\n", corpus_key()));
        let env: Vec<(&str, &Path)> = vec![("NIX_CONF_DIR", &etc)];
        let (nix_root, sluice_root) = (t.join(format!("nix-{name}")), t.join(format!("sluice-{name}")));
        let mut nix_cmd = Command::new("nix");
        nix_cmd.args([
            "--extra-experimental-features",
            "nix-command",
            "copy",
            "--from",
            &server.url,
            "--to",
            nix_root.to_str().unwrap(),
            &path,
        ]);
        let nix_out = configured(nix_cmd, t, &env);
        let mut sluice_cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        sluice_cmd.args(["copy", "--from", &server.url, "--to", sluice_root.to_str().unwrap(), &path]);
        let sluice_out = configured(sluice_cmd, t, &env);
        assert_eq!(nix_out.status.success(), works, "nix, netrc {name}: {}", stderr(&nix_out));
        assert_eq!(sluice_out.status.success(), works, "sluice, netrc {name}: {}", stderr(&sluice_out));
        if works {
            assert_nix_verifies(t, &sluice_root);
        } else {
            assert!(stderr(&sluice_out).contains("401"), "{}", stderr(&sluice_out));
        }
    }
}

/// `?trusted=true` on a substituter: its paths signed by a key nobody trusts are accepted, as
/// by Nix's substitution (`nix-store -r`); without it they are refused by both, and so they
/// are from `--from` even with it (`nix copy --from` does not consult it). Content is still
/// checked: a NAR that does not match its NarHash is refused from a trusted substituter too.
#[test]
fn trusted_substituter_accepts_unsigned_paths_but_checks_content() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let signed_by_other = corpus_path("firewall-rules");
    let corpus_cache = format!("file://{}", corpus().join("cache-xz").display());
    let bad_cache = format!("file://{}", case_dir("08-nar-hash-size-mismatch").join("cache-a").display());
    let differs = case_paths("08-nar-hash-size-mismatch").into_iter().find(|(v, _)| v == "content-differs").unwrap().1;
    let nobody = "nobody-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=";
    let trusted = format!("{corpus_cache}?trusted=true");
    let cases = [
        (true, trusted.clone(), &signed_by_other, true),
        (true, corpus_cache.clone(), &signed_by_other, false),
        (true, format!("{bad_cache}?trusted=true"), &differs, false),
        (false, trusted, &signed_by_other, false),
    ];
    for (i, (substituter, url, path, works)) in cases.iter().enumerate() {
        let (nix_root, sluice_root) = (t.join(format!("nix-{i}")), t.join(format!("sluice-{i}")));
        let (nix_store, sluice_store) = (nix_root.to_str().unwrap(), sluice_root.to_str().unwrap());
        let keys = ["--option", "trusted-public-keys", nobody];
        let (nix_out, sluice_out) = if *substituter {
            (
                nix(t, "nix-store", &[&["--store", nix_store, "-r", path, "--option", "substituters", url][..], &keys].concat()),
                sluice(t, &["copy", "--substituters", url, "--to", sluice_store, "--trusted-public-keys", nobody, path]),
            )
        } else {
            (
                nix(t, "nix", &[&["copy", "--from", url, "--to", nix_store, path][..], &keys].concat()),
                sluice(t, &["copy", "--from", url, "--to", sluice_store, "--trusted-public-keys", nobody, path]),
            )
        };
        assert_eq!(nix_out.status.success(), *works, "nix with {url}: {}", stderr(&nix_out));
        assert_eq!(sluice_out.status.success(), *works, "sluice with {url}: {}", stderr(&sluice_out));
        if *works {
            // All but the second each store registered it at.
            let info = |store| {
                nix_path_info(t, store, path)
                    .into_iter()
                    .map(|mut i| i.as_object_mut().unwrap().remove("registrationTime").map(|_| i))
                    .collect::<Vec<_>>()
            };
            assert_eq!(info(sluice_store), info(nix_store));
        } else {
            assert_absent(t, &sluice_root, path);
        }
    }
}

/// `http-connections = 0` is no limit (curl's), not one connection: over HTTP/1.1 a copy of
/// the 1056-path corpus at RTT 20 ms opens more connections than the default limit of 25.
/// `--jobs 0` is refused (Nix's `max-substitution-jobs` takes 0 as 1; zero jobs would copy
/// nothing).
#[test]
fn http_connections_zero_means_no_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let server = CacheServer::start(&corpus().join("cache-xz"), &t.join("state"), &["--rtt-ms", "20"]);
    let path = TOP;
    let o = copy_with(t, &t.join("root"), &server.url, &corpus_key(), &[("http-connections", "0")], &[path]);
    check(&o, "sluice copy with http-connections = 0");
    let log = std::fs::read_to_string(&server.access_log).unwrap();
    let conns: std::collections::BTreeSet<String> =
        log.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).map(|v| v["conn"].to_string()).collect();
    assert!(conns.len() > 25, "http-connections = 0 used {} connection(s)", conns.len());
    let o = sluice(t, &["copy", "--jobs", "0", "--to", t.join("root").to_str().unwrap(), path]);
    assert!(!o.status.success() && stderr(&o).contains("--jobs"), "{}", stderr(&o));
}

/// NARs compressed with lz4, lzip and pzstd (zstd beginning with a skippable frame), made by
/// the real tools from a corpus NAR: real Nix 2.8 (libarchive) and sluice both copy them.
#[test]
fn lz4_lzip_and_pzstd_caches_are_read_as_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let path = corpus_path("update-users-groups.pl");
    let hash = &path["/nix/store/".len()..][..32];
    let source = corpus().join("cache-xz");
    let narinfo = std::fs::read_to_string(source.join(format!("{hash}.narinfo"))).unwrap();
    let xz_url = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap();
    let nar = Command::new("xz").arg("-dc").arg(source.join(xz_url)).output().unwrap();
    check(&nar, "xz -dc");
    for (method, tool, args) in [("lz4", "lz4", &["-c"][..]), ("lzip", "lzip", &["-c"]), ("zstd", "pzstd", &["-c", "-p", "2", "-q"])] {
        let cache = t.join(format!("cache-{method}"));
        std::fs::create_dir_all(cache.join("nar")).unwrap();
        std::fs::copy(source.join("nix-cache-info"), cache.join("nix-cache-info")).unwrap();
        let input = t.join("plain.nar");
        std::fs::write(&input, &nar.stdout).unwrap();
        let out = Command::new(tool).args(args).arg(&input).output().unwrap_or_else(|e| panic!("{tool} (install Debian's {tool}): {e}"));
        check(&out, tool);
        if tool == "pzstd" {
            assert_eq!(out.stdout[..4], [0x50, 0x2a, 0x4d, 0x18], "pzstd output starts with a skippable frame");
        }
        let file = format!("nar/{hash}.nar.{method}");
        std::fs::write(cache.join(&file), &out.stdout).unwrap();
        let rewritten: String = narinfo
            .lines()
            .filter(|l| !l.starts_with("FileHash:") && !l.starts_with("FileSize:"))
            .map(|l| match l.split_once(": ") {
                Some(("URL", _)) => format!("URL: {file}\n"),
                Some(("Compression", _)) => format!("Compression: {method}\n"),
                _ => format!("{l}\n"),
            })
            .collect();
        std::fs::write(cache.join(format!("{hash}.narinfo")), rewritten).unwrap();
        let from = format!("file://{}", cache.display());
        let (nix_root, sluice_root) = (t.join(format!("nix-{method}")), t.join(format!("sluice-{method}")));
        check(
            &nix(
                t,
                "nix",
                &["copy", "--from", &from, "--to", nix_root.to_str().unwrap(), &path, "--option", "trusted-public-keys", &corpus_key()],
            ),
            &format!("nix copy ({method})"),
        );
        check(&copy_with(t, &sluice_root, &from, &corpus_key(), &[], &[&path]), &format!("sluice copy ({method})"));
        // Registration times are the seconds each copy ran in: everything else must agree.
        let without_time = |store: &Path| -> Vec<serde_json::Value> {
            let mut infos = nix_path_info(t, store.to_str().unwrap(), &path);
            infos.iter_mut().for_each(|i| assert!(i.as_object_mut().unwrap().remove("registrationTime").is_some()));
            infos
        };
        assert_eq!(without_time(&sluice_root), without_time(&nix_root));
        assert_nix_verifies(t, &sluice_root);
    }
}
