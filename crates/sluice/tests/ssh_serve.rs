//! `sluice legacy-serve`, the far end of `ssh://` stores (Nix's serve protocol, as
//! `nix-store --serve --write`), used by real Nix 2.8 and 2.26 clients through a real sshd
//! ([`Sshd`]) with `remote-program=` a one-line wrapper; and the protocol driven by hand for
//! what a Nix client cannot be made to do (vanish mid-NAR, send a NAR that lies).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StoreDir;
use sluice_nix::wire::serve::{
    client_handshake, write_path_info_entry, write_serve_request, AddToStoreNar, DumpStorePath, ExportPaths, ImportPaths, QueryClosure,
    QueryPathInfos, QueryValidPaths, ServeCommand, ServeRequest,
};
use sluice_nix::wire::{read_store_path_set, read_u64, write_bytes, write_store_path_set, ProtocolVersion};

use crate::common::sshd::{Sshd, HOST};
use crate::common::*;
use crate::push::{source_store, subset};
use crate::ssh::{cut_input, wait_far_end_gone};

/// A one-line `remote-program` for Nix's `ssh://` store: `sluice legacy-serve` on the store
/// under `store` (Nix appends `--serve --write`).
fn serve_wrapper(tmp: &Path, name: &str, store: &Path) -> PathBuf {
    shaped_serve_wrapper(tmp, name, store, "exec CMD")
}

/// [`serve_wrapper`] running `shape` with `CMD` replaced by the far end's command (`dd … | CMD`
/// cuts its input midway).
fn shaped_serve_wrapper(tmp: &Path, name: &str, store: &Path, shape: &str) -> PathBuf {
    let file = tmp.join(name);
    let command = format!("{} legacy-serve --store local?root={} \"$@\"", env!("CARGO_BIN_EXE_sluice"), store.display());
    std::fs::write(&file, format!("#!/bin/sh\n{}\n", shape.replace("CMD", &command))).unwrap();
    let o = Command::new("chmod").arg("+x").arg(&file).output().unwrap();
    check(&o, "chmod");
    file
}

/// Real Nix `args` (2.26 through `nix-modern` when `modern`) with `NIX_SSHOPTS` reaching `sshd`
/// and the corpus key trusted.
fn nix_over_ssh(tmp: &Path, sshd: &Sshd, modern: bool, args: &[&str]) -> Output {
    let mut cmd = match modern {
        true => Command::new(shared().join("bin/nix-modern")),
        false => Command::new(args[0]),
    };
    isolate(&mut cmd, tmp, &format!("trusted-public-keys = {}", corpus_key()));
    let args = if modern { args } else { &args[1..] };
    cmd.current_dir(tmp).env("NIX_SSHOPTS", sshd.ssh_opts()).args(args).output().unwrap()
}

/// The paths registered in the chroot store under `root`, as real Nix 2.8 lists them.
fn nix_closure(tmp: &Path, root: &Path, path: &str) -> BTreeSet<String> {
    let o = nix(tmp, "nix-store", &["--store", root.to_str().unwrap(), "-qR", path]);
    check(&o, "nix-store -qR");
    String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect()
}

/// Real Nix (2.8 or 2.26) copies the 25-path subset from sluice's far end and back into
/// another sluice far end, over ssh; real Nix finds each copy whole and valid.
fn nix_copies_both_ways(modern: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let from = format!("ssh://{HOST}?remote-program={}", serve_wrapper(tmp, "serve-src", &src).display());
    let local = tmp.join("local");
    let o = nix_over_ssh(tmp, &sshd, modern, &["nix", "copy", "--from", &from, "--to", local.to_str().unwrap(), &root]);
    check(&o, "nix copy --from ssh:// (sluice legacy-serve)");
    assert_eq!(nix_closure(tmp, &local, &root), paths);
    assert_nix_verifies(tmp, &local);
    let far = tmp.join("far");
    let to = format!("ssh://{HOST}?remote-program={}", serve_wrapper(tmp, "serve-far", &far).display());
    let o = nix_over_ssh(tmp, &sshd, modern, &["nix", "copy", "--from", local.to_str().unwrap(), "--to", &to, &root]);
    check(&o, "nix copy --to ssh:// (sluice legacy-serve --write)");
    assert_eq!(nix_closure(tmp, &far, &root), paths);
    assert_nix_verifies(tmp, &far);
    assert_store_closed(&far);
    // The far end's infos are the source's: NAR hashes, references, signatures.
    let (a, b) = (nix_path_info(tmp, src.to_str().unwrap(), &root), nix_path_info(tmp, far.to_str().unwrap(), &root));
    let strip = |v: Vec<serde_json::Value>| {
        v.into_iter()
            .map(|mut i| {
                i.as_object_mut().unwrap().remove("registrationTime");
                i
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(a), strip(b));
}

#[test]
fn nix_2_8_copies_from_and_to_legacy_serve() {
    nix_copies_both_ways(false);
}

#[test]
fn nix_2_26_copies_from_and_to_legacy_serve() {
    nix_copies_both_ways(true);
}

/// `nix-copy-closure` (Nix 2.8) both ways, the host naming the remote program.
#[test]
fn nix_copy_closure_2_8_to_and_from_legacy_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let far = tmp.join("far");
    let host = format!("{HOST}?remote-program={}", serve_wrapper(tmp, "serve-far", &far).display());
    let mut cmd = Command::new("nix-copy-closure");
    isolate(&mut cmd, tmp, "");
    let o = cmd
        .env("NIX_SSHOPTS", sshd.ssh_opts())
        .env("NIX_REMOTE", format!("local?root={}", src.display()))
        .args(["--to", &host, &root])
        .output()
        .unwrap();
    check(&o, "nix-copy-closure --to");
    assert_eq!(nix_closure(tmp, &far, &root), paths);
    assert_nix_verifies(tmp, &far);
    let back = tmp.join("back");
    let mut cmd = Command::new("nix-copy-closure");
    isolate(&mut cmd, tmp, &format!("trusted-public-keys = {}", corpus_key()));
    let o = cmd
        .env("NIX_SSHOPTS", sshd.ssh_opts())
        .env("NIX_REMOTE", format!("local?root={}", back.display()))
        .args(["--from", &host, &root])
        .output()
        .unwrap();
    check(&o, "nix-copy-closure --from");
    assert_eq!(nix_closure(tmp, &back, &root), paths);
    assert_nix_verifies(tmp, &back);
}

/// `sluice legacy-serve ARGS` with piped standard input and output.
fn spawn_serve(tmp: &Path, args: &[&str]) -> std::process::Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.arg("legacy-serve").args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// A path of the subset without references, with its info and NAR as the source store has them.
fn one_path(tmp: &Path, src: &Path) -> (sluice_nix::path_info::ValidPathInfo, Vec<u8>) {
    leaves(tmp, src, 1).remove(0)
}

/// `n` paths of the subset without references, with their infos and NARs as the source store
/// has them.
fn leaves(tmp: &Path, src: &Path, n: usize) -> Vec<(sluice_nix::path_info::ValidPathInfo, Vec<u8>)> {
    let url = sluice_store::store_url::StoreUrl::parse(&format!("local?root={}", src.display())).unwrap();
    let store = sluice_local_store::LocalStore::open(url.as_local().unwrap()).unwrap();
    let leaves = subset().1.into_iter().filter(|p| nix_path_info(tmp, src.to_str().unwrap(), p).len() == 1).take(n);
    leaves
        .map(|leaf| {
            let path = StoreDir::default().parse_path(&leaf).unwrap();
            let mut nar = Vec::new();
            store.dump_path(&path, &mut nar).unwrap();
            (store.query_path_info(&path).unwrap().unwrap(), nar)
        })
        .collect()
}

/// A client that vanishes mid-NAR, and one whose NAR does not match its claimed hash, leave
/// nothing registered and nothing in the store; without `--write` an import is refused with
/// Nix's message; a whole NAR is then added.
#[test]
fn additions_are_verified_and_a_vanished_client_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, _) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let (info, nar) = one_path(tmp, &src);
    let far = tmp.join("far");
    let store = format!("local?root={}", far.display());
    let dir = StoreDir::default();
    let v = ProtocolVersion::new(2, 7);
    let send = |args: &[&str], nar: &[u8], info: &sluice_nix::path_info::ValidPathInfo| {
        let mut child = spawn_serve(tmp, args);
        let mut stdin = child.stdin.take().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        assert_eq!(client_handshake(&mut stdout, &mut stdin).unwrap(), v);
        // A far end that refuses may exit before it read the whole request.
        let _ = write_serve_request(&mut stdin, &dir, v, &AddToStoreNar { info: info.clone() });
        let _ = stdin.write_all(nar);
        drop(stdin);
        let answer = sluice_nix::wire::read_u64(&mut stdout, "answer").ok();
        (child.wait_with_output().unwrap(), answer)
    };
    // Half the NAR, then the client is gone.
    let (o, _) = send(&["--write", "--store", &store], &nar[..nar.len() / 2], &info);
    assert!(!o.status.success());
    assert!(registered_paths(&far).is_empty());
    assert_store_closed(&far);
    // A NAR whose last byte differs from the one hashed.
    let mut lying = nar.clone();
    let n = lying.len();
    lying[n - 9] ^= 1;
    let (o, _) = send(&["--write", "--store", &store], &lying, &info);
    assert!(!o.status.success());
    assert!(registered_paths(&far).is_empty(), "{}", stderr(&o));
    assert_store_closed(&far);
    // Without --write: Nix's refusal, nothing added.
    let (o, _) = send(&["--store", &store], &nar, &info);
    assert!(stderr(&o).contains("importing paths is not allowed"), "{}", stderr(&o));
    assert!(registered_paths(&far).is_empty());
    // The whole NAR: added, answered 1, and valid for real Nix.
    let (o, answer) = send(&["--write", "--store", &store], &nar, &info);
    check(&o, "AddToStoreNar");
    assert_eq!(answer, Some(1));
    assert_eq!(registered_paths(&far), [dir.display_path(&info.path)].into());
    assert_nix_verifies(tmp, &far);
}

/// QueryValidPaths and QueryPathInfos answer as `nix-store --serve` does, in one round trip.
#[test]
fn queries_answer_as_nix_store_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let dir = StoreDir::default();
    let mut child = spawn_serve(tmp, &["--store", &format!("local?root={}", src.display())]);
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let v = client_handshake(&mut stdout, &mut stdin).unwrap();
    let mut asked: BTreeSet<_> = paths.iter().map(|p| dir.parse_path(p).unwrap()).collect();
    let missing = dir.parse_path("/nix/store/00000000000000000000000000000000-missing").unwrap();
    asked.insert(missing.clone());
    write_serve_request(&mut stdin, &dir, v, &QueryValidPaths { lock: false, substitute: false, paths: asked.clone() }).unwrap();
    write_serve_request(&mut stdin, &dir, v, &QueryPathInfos { paths: asked.clone() }).unwrap();
    stdin.flush().unwrap();
    let valid = read_store_path_set(&mut stdout, &dir, "valid").unwrap();
    assert_eq!(valid.len(), 25);
    assert!(!valid.contains(&missing));
    let infos = sluice_nix::wire::serve::read_path_info_entries(&mut stdout, &dir, v, &asked).unwrap();
    assert_eq!(infos.len(), 25);
    let top = infos.iter().find(|i| dir.display_path(&i.path) == root).unwrap();
    let all = nix_path_info(tmp, src.to_str().unwrap(), &root);
    let theirs = all.iter().find(|i| i["path"] == root.as_str()).unwrap();
    assert_eq!(top.nar_hash.to_sri(), theirs["narHash"].as_str().unwrap());
    assert_eq!(top.nar_size, theirs["narSize"].as_u64().unwrap());
    assert_eq!(top.references.len(), theirs["references"].as_array().unwrap().len());
    assert!(!top.sigs.is_empty());
    drop(stdin);
    check(&child.wait_with_output().unwrap(), "legacy-serve");
}

/// ExportPaths writes what `nix-store --export` writes, byte for byte; ImportPaths of that
/// stream (without `--write`: refused) adds the paths, which real Nix then finds valid.
#[test]
fn export_and_import_paths_match_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let dir = StoreDir::default();
    let v = ProtocolVersion::new(2, 7);
    let mut sorted: Vec<&str> = paths.iter().map(String::as_str).collect();
    sorted.sort();
    let theirs = nix(tmp, "nix-store", &[&["--store", src.to_str().unwrap(), "--export"][..], &sorted].concat());
    check(&theirs, "nix-store --export");
    // Both export the closure, references first; Nix breaks ties between unrelated paths in
    // its own order, so the streams are compared path by path.
    let mut child = spawn_serve(tmp, &["--store", &format!("local?root={}", src.display())]);
    let (mut stdin, mut stdout) = (child.stdin.take().unwrap(), child.stdout.take().unwrap());
    client_handshake(&mut stdout, &mut stdin).unwrap();
    let all: BTreeSet<_> = paths.iter().map(|p| dir.parse_path(p).unwrap()).collect();
    write_serve_request(&mut stdin, &dir, v, &ExportPaths { paths: all }).unwrap();
    drop(stdin);
    let mut ours = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut ours).unwrap();
    check(&child.wait_with_output().unwrap(), "ExportPaths");
    let (ours, theirs_items) = (export_items(&ours), export_items(&theirs.stdout));
    assert!(ours.1 && theirs_items.1, "a path exported before its references");
    assert_eq!(ours.0.len(), 25);
    assert_eq!(ours.0, theirs_items.0);
    // Imported into an empty store, with and without --write.
    let far = tmp.join("far");
    let store = format!("local?root={}", far.display());
    for write in [false, true] {
        let args: &[&str] = if write { &["--write", "--store", &store] } else { &["--store", &store] };
        let mut child = spawn_serve(tmp, args);
        let (mut stdin, mut stdout) = (child.stdin.take().unwrap(), child.stdout.take().unwrap());
        client_handshake(&mut stdout, &mut stdin).unwrap();
        write_serve_request(&mut stdin, &dir, v, &ImportPaths).unwrap();
        let _ = stdin.write_all(&theirs.stdout);
        drop(stdin);
        let answer = sluice_nix::wire::read_u64(&mut stdout, "answer").ok();
        let o = child.wait_with_output().unwrap();
        match write {
            false => assert!(stderr(&o).contains("importing paths is not allowed") && answer.is_none(), "{}", stderr(&o)),
            true => {
                check(&o, "ImportPaths");
                assert_eq!(answer, Some(1));
            }
        }
    }
    assert_eq!(nix_closure(tmp, &far, &root), paths);
    assert_nix_verifies(tmp, &far);
    assert_store_closed(&far);
}

/// The items of an export stream, each path's NAR and trailer as one byte string, sorted, and
/// whether every path came after its references.
fn export_items(stream: &[u8]) -> (Vec<Vec<u8>>, bool) {
    let dir = StoreDir::default();
    let mut r = stream;
    let (mut items, mut seen, mut ordered) = (Vec::new(), BTreeSet::new(), true);
    while sluice_nix::wire::read_u64(&mut r, "item").unwrap() == 1 {
        let start = r;
        sluice_nix::nar::reader::parse(&mut r, &mut sluice_nix::nar::Discard).unwrap();
        let t = sluice_nix::wire::serve::read_export_trailer(&mut r, &dir).unwrap();
        ordered &= t.references.iter().all(|p| *p == t.path || seen.contains(p));
        seen.insert(t.path);
        items.push(start[..start.len() - r.len()].to_vec());
    }
    assert!(r.is_empty());
    items.sort();
    (items, ordered)
}

/// A `remote-program` running real `nix-store` (Nix 2.26 through `nix-modern` when `modern`)
/// on the chroot store under `store`, never on this machine's `/nix` (Nix appends `--serve
/// --write`).
pub(crate) fn nix_store_wrapper(tmp: &Path, name: &str, store: &Path, modern: bool) -> PathBuf {
    let file = tmp.join(name);
    let nix_store = match modern {
        true => format!("{} nix-store", shared().join("bin/nix-modern").display()),
        false => "nix-store".to_string(),
    };
    let script = format!(
        "#!/bin/sh\ncd {t} && export NIX_REMOTE=local?root={s} XDG_CACHE_HOME={t}/far-cache NIX_CONF_DIR={t}/no-etc-nix && exec {nix_store} \"$@\"\n",
        t = tmp.display(),
        s = store.display()
    );
    std::fs::write(&file, script).unwrap();
    check(&Command::new("chmod").arg("+x").arg(&file).output().unwrap(), "chmod");
    file
}

/// A shell script `tmp/name` running `body`; its path.
fn program(tmp: &Path, name: &str, body: &str) -> PathBuf {
    let file = tmp.join(name);
    std::fs::write(&file, format!("#!/bin/sh\n{body}\n")).unwrap();
    check(&Command::new("chmod").arg("+x").arg(&file).output().unwrap(), "chmod");
    file
}

/// `sluice ARGS` with `NIX_SSHOPTS` reaching `sshd`.
fn sluice_over_ssh(tmp: &Path, sshd: &Sshd, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.env("NIX_SSHOPTS", sshd.ssh_opts()).args(args).output().unwrap()
}

/// sluice pulls the subset from real `nix-store --serve` (2.8 or 2.26) over ssh, verified by
/// the corpus key (refused, with nothing added, when that key is not trusted), and pushes it
/// back into an empty far store; real Nix finds both copies whole and valid.
fn sluice_copies_both_ways_with(modern: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let serve = nix_store_wrapper(tmp, "serve-src", &src, modern);
    // What the far end sends, kept (tee writes as it reads).
    let logged = program(tmp, "logged", &format!("{} \"$@\" | tee {}/sent", serve.display(), tmp.display()));
    let untrusted = format!("ssh://{HOST}?remote-program={}", logged.display());
    let local = tmp.join("local");
    let to_local = |from: &str, key: &str| {
        sluice_over_ssh(tmp, &sshd, &["copy", "--from", from, "--to", local.to_str().unwrap(), "--trusted-public-keys", key, &root])
    };
    let o = to_local(&untrusted, "other-1:1B6HzFX0V+uJBJHpvKMvUw8EOj66T8tSm5NqhpvJnvs=");
    assert!(!o.status.success() && stderr(&o).contains("other-1"), "{}", stderr(&o));
    assert!(registered_paths(&local).is_empty(), "untrusted paths were added");
    // Refused before any NAR was asked for: the far end sent the path infos only.
    let sent = std::fs::metadata(tmp.join("sent")).unwrap().len();
    assert!(sent < 64 << 10, "the far end sent {sent} bytes: NARs of paths refused");
    let from = format!("ssh://{HOST}?remote-program={}", serve.display());
    check(&to_local(&from, &corpus_key()), "sluice copy --from ssh://");
    assert_eq!(nix_closure(tmp, &local, &root), paths);
    assert_nix_verifies(tmp, &local);
    let info = sluice_over_ssh(tmp, &sshd, &["path-info", "--store", &from, &root]);
    check(&info, "sluice path-info --store ssh://");
    assert!(String::from_utf8_lossy(&info.stdout).contains(&root));
    let far = tmp.join("far");
    let to = format!("ssh://{HOST}?remote-program={}", nix_store_wrapper(tmp, "serve-far", &far, modern).display());
    let o = sluice_over_ssh(tmp, &sshd, &["copy", "--from", local.to_str().unwrap(), "--to", &to, &root]);
    check(&o, "sluice copy --to ssh://");
    assert!(stderr(&o).contains("copied 25 paths"), "{}", stderr(&o));
    assert_eq!(nix_closure(tmp, &far, &root), paths);
    assert_nix_verifies(tmp, &far);
    let again = sluice_over_ssh(tmp, &sshd, &["copy", "--from", local.to_str().unwrap(), "--to", &to, &root]);
    assert!(stderr(&again).contains("25 already there"), "{}", stderr(&again));
}

#[test]
fn sluice_copies_from_and_to_nix_2_8_store_serve() {
    sluice_copies_both_ways_with(false);
}

#[test]
fn sluice_copies_from_and_to_nix_2_26_store_serve() {
    sluice_copies_both_ways_with(true);
}

/// A pull over `ssh://` asks for the NARs in a dependency order, each path's references before
/// it, so that each path can be registered as soon as it has arrived (before, largest NAR
/// first, most paths waited for NARs asked after them): the requests real `nix-store --serve`
/// 2.8 was sent, kept by `tee`, ask for each path of the closure once, after its references.
#[test]
fn a_pull_asks_for_nars_references_first() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let serve = nix_store_wrapper(tmp, "serve-src", &src, false);
    let logged = program(tmp, "logged", &format!("tee {}/asked | {} \"$@\"", tmp.display(), serve.display()));
    let from = format!("ssh://{HOST}?remote-program={}", logged.display());
    let local = tmp.join("local");
    let o = sluice_over_ssh(
        tmp,
        &sshd,
        &["copy", "--from", &from, "--to", local.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root],
    );
    check(&o, "sluice copy --from ssh://");
    assert_eq!(nix_closure(tmp, &local, &root), paths);
    let asked = dumped_paths(&std::fs::read(tmp.join("asked")).unwrap());
    assert_eq!(asked.len(), paths.len(), "{asked:?}");
    assert_eq!(asked.iter().cloned().collect::<BTreeSet<_>>(), paths);
    for info in nix_path_info(tmp, src.to_str().unwrap(), &root) {
        let path = info["path"].as_str().unwrap();
        let at = asked.iter().position(|a| a == path).unwrap();
        for reference in info["references"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).filter(|r| *r != path) {
            let before = asked.iter().position(|a| a == reference).unwrap();
            assert!(before < at, "{path} was asked for (#{at}) before its reference {reference} (#{before}): {asked:#?}");
        }
    }
}

/// The paths of the DumpStorePath requests in `sent`, what a client sent a far end (the
/// greeting, then pulls' requests only), in order.
fn dumped_paths(mut sent: &[u8]) -> Vec<String> {
    let (dir, r) = (StoreDir::default(), &mut sent);
    read_u64(r, "magic").unwrap();
    let version = ProtocolVersion::from_wire(read_u64(r, "version").unwrap());
    let mut dumped = Vec::new();
    while !r.is_empty() {
        match ServeCommand::from_wire(read_u64(r, "command").unwrap()) {
            Some(ServeCommand::QueryClosure) => {
                QueryClosure::read(r, &dir, version).unwrap();
            }
            Some(ServeCommand::QueryPathInfos) => {
                QueryPathInfos::read(r, &dir, version).unwrap();
            }
            Some(ServeCommand::DumpStorePath) => dumped.push(dir.display_path(&DumpStorePath::read(r, &dir, version).unwrap().path)),
            other => panic!("a pull sent {other:?}"),
        }
    }
    dumped
}

/// A far end that dies mid-NAR fails the pull and leaves nothing half-registered (what is
/// registered is whole, for real Nix); a remote program that is not there is one error naming
/// the host.
#[test]
fn a_far_end_that_dies_or_is_missing_is_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, _) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let serve = nix_store_wrapper(tmp, "serve-src", &src, false);
    let dying = program(tmp, "dying", &format!("{} \"$@\" | stdbuf -o0 head -c 300000", serve.display()));
    let local = tmp.join("local");
    let from = format!("ssh://{HOST}?remote-program={}", dying.display());
    let o = sluice_over_ssh(
        tmp,
        &sshd,
        &["copy", "--from", &from, "--to", local.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root],
    );
    assert!(!o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(HOST), "{}", stderr(&o));
    assert!(registered_paths(&local).len() < 25);
    assert_store_closed(&local);
    if !registered_paths(&local).is_empty() {
        assert_nix_verifies(tmp, &local);
    }
    let missing = format!("ssh://{HOST}?remote-program=/nonexistent/nix-store");
    let o = sluice_over_ssh(tmp, &sshd, &["path-info", "--store", &missing, &root]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains(&format!("'{HOST}'")) && err.contains("127"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// A test's directory with sshd running and the subset's source store in it: the directory,
/// sshd, the store, and `n` of its paths without references ([`leaves`]).
fn before_a_far_end(n: usize) -> (tempfile::TempDir, Sshd, PathBuf, Vec<(ValidPathInfo, Vec<u8>)>) {
    let dir = tempfile::tempdir().unwrap();
    let sshd = Sshd::start(dir.path());
    let (root, _) = subset();
    let src = source_store(dir.path(), "cache-subset-none", &root);
    let leaves = leaves(dir.path(), &src, n);
    (dir, sshd, src, leaves)
}

/// A fake far end (`tests/common/hostile_serve.py`) under `tmp/name`, answering with
/// `replies` (file name → bytes, see the script): its `ssh://` URL and its directory (where
/// `log` lists the commands it was sent).
fn hostile_far_end(tmp: &Path, name: &str, replies: Vec<(String, Vec<u8>)>) -> (String, PathBuf) {
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, bytes) in replies {
        std::fs::write(dir.join(file), bytes).unwrap();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/hostile_serve.py");
    let program = tmp.join(format!("{name}.sh"));
    std::fs::write(&program, format!("#!/bin/sh\nexec python3 {} {} \"$@\"\n", script.display(), dir.display())).unwrap();
    check(&Command::new("chmod").arg("+x").arg(&program).output().unwrap(), "chmod");
    (format!("ssh://{HOST}?remote-program={}", program.display()), dir)
}

/// The replies of a far end that answers QueryClosure with `closure`, QueryPathInfos with
/// `infos` and DumpStorePath with `nars`.
fn far_replies(closure: &[&ValidPathInfo], infos: &[&ValidPathInfo], nars: &[(&ValidPathInfo, &[u8])]) -> Vec<(String, Vec<u8>)> {
    let dir = StoreDir::default();
    let mut closure_reply = Vec::new();
    write_store_path_set(&mut closure_reply, &dir, closure.iter().map(|i| &i.path)).unwrap();
    let mut infos_reply = Vec::new();
    for info in infos {
        write_path_info_entry(&mut infos_reply, &dir, ProtocolVersion::new(2, 7), info).unwrap();
    }
    write_bytes(&mut infos_reply, b"").unwrap();
    let nars = nars.iter().map(|(i, nar)| (format!("nar-{}", i.path.base_name()), nar.to_vec()));
    [("closure".to_string(), closure_reply), ("infos".to_string(), infos_reply)].into_iter().chain(nars).collect()
}

/// A far end's QueryClosure and QueryPathInfos answers are held to what was asked: an info of
/// a path not asked for is refused, not copied; a closure that lacks the path asked for, or is
/// not closed under the references its infos give, is refused before any NAR is asked for.
#[test]
fn a_lying_far_end_adds_nothing_it_was_not_asked_for() {
    let (dir, sshd, _, two) = before_a_far_end(2);
    let tmp = dir.path();
    let ((a, a_nar), (b, b_nar)) = (&two[0], &two[1]);
    let dir = StoreDir::default();
    let (a_shown, b_shown) = (dir.display_path(&a.path), dir.display_path(&b.path));
    let nars = [(a, a_nar.as_slice()), (b, b_nar.as_slice())];
    let local = tmp.join("local");
    let copy = |url: &str| {
        sluice_over_ssh(
            tmp,
            &sshd,
            &["copy", "--from", url, "--to", local.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &a_shown],
        )
    };
    // Asked the infos of a, it sends b's too.
    let (url, far) = hostile_far_end(tmp, "extra", far_replies(&[a], &[a, b], &nars));
    let o = copy(&url);
    assert!(!registered_paths(&local).contains(&b_shown), "a path not asked for was added: {}", stderr(&o));
    assert!(!o.status.success() && stderr(&o).contains(&b_shown), "{}", stderr(&o));
    assert!(!std::fs::read_to_string(far.join("log")).unwrap().contains("DumpStorePath"));
    // The closure of a, it says, is empty.
    let (url, _) = hostile_far_end(tmp, "empty", far_replies(&[], &[], &nars));
    let o = copy(&url);
    assert!(!o.status.success() && stderr(&o).contains(&a_shown), "a closure without its root was copied: {}", stderr(&o));
    // The closure is a alone, but a's info refers to b.
    let a_refers = ValidPathInfo { references: [a.path.clone(), b.path.clone()].into(), sigs: Default::default(), ..a.clone() };
    let (url, far) = hostile_far_end(tmp, "open", far_replies(&[&a_refers], &[&a_refers], &nars));
    let o = sluice_over_ssh(tmp, &sshd, &["copy", "--no-check-sigs", "--from", &url, "--to", local.to_str().unwrap(), &a_shown]);
    assert!(!o.status.success() && stderr(&o).contains(&b_shown), "{}", stderr(&o));
    assert!(!std::fs::read_to_string(far.join("log")).unwrap().contains("DumpStorePath"), "{}", stderr(&o));
    assert!(registered_paths(&local).is_empty());
    assert_store_closed(&local);
}

/// A pull sends its first request (QueryClosure) right behind the greeting, before the far end
/// has answered it: from a far end that answers the greeting only once a request has come, the
/// path is copied (before, each waited for the other until the stall limit), its NAR asked
/// for once; a push's first request (QueryValidPaths) is sent alike.
#[test]
fn the_first_request_goes_with_the_greeting() {
    let (dir, sshd, src, one) = before_a_far_end(1);
    let tmp = dir.path();
    let (a, a_nar) = &one[0];
    let a_shown = StoreDir::default().display_path(&a.path);
    let mut replies = far_replies(&[a], &[a], &[(a, a_nar.as_slice())]);
    replies.push(("greet-late".into(), Vec::new()));
    let (url, far) = hostile_far_end(tmp, "late", replies);
    let local = tmp.join("local");
    let (to, stall) = (local.to_str().unwrap(), "stalled-download-timeout");
    let o = sluice_over_ssh(tmp, &sshd, &["copy", "--option", stall, "5", "--no-check-sigs", "--from", &url, "--to", to, &a_shown]);
    check(&o, "a pull from a far end that greets late");
    assert_eq!(registered_paths(&local), BTreeSet::from([a_shown.clone()]));
    let log = std::fs::read_to_string(far.join("log")).unwrap();
    assert_eq!(log.lines().collect::<Vec<_>>(), ["QueryClosure", "QueryPathInfos", &format!("DumpStorePath {}", a.path.base_name())]);
    let mut valid = Vec::new();
    write_store_path_set(&mut valid, &StoreDir::default(), std::iter::once(&a.path)).unwrap();
    let (url, far) = hostile_far_end(tmp, "late-push", vec![("valid".into(), valid), ("greet-late".into(), Vec::new())]);
    let o = sluice_over_ssh(tmp, &sshd, &["copy", "--option", stall, "5", "--from", src.to_str().unwrap(), "--to", &url, &a_shown]);
    check(&o, "a push into a far end that greets late and has the path");
    assert_eq!(std::fs::read_to_string(far.join("log")).unwrap(), "QueryValidPaths\n");
}

/// A far end asked which paths it has cannot name others: a push into one that answers a path
/// not asked is refused, naming it (before, it counted as one more path already there).
#[test]
fn a_far_end_that_says_it_has_paths_not_asked_is_refused() {
    let (dir, sshd, src, two) = before_a_far_end(2);
    let tmp = dir.path();
    let ((a, _), (b, _)) = (&two[0], &two[1]);
    let dir = StoreDir::default();
    let mut valid = Vec::new();
    write_store_path_set(&mut valid, &dir, [&a.path, &b.path].into_iter()).unwrap();
    let (url, _) = hostile_far_end(tmp, "claims", vec![("valid".into(), valid)]);
    let o = sluice_over_ssh(tmp, &sshd, &["copy", "--from", src.to_str().unwrap(), "--to", &url, &dir.display_path(&a.path)]);
    assert!(!o.status.success() && stderr(&o).contains(&dir.display_path(&b.path)), "{}", stderr(&o));
}

/// `sluice copy OPTIONS` of a path of the subset from a far end that answers its queries and
/// then, asked for its NAR, does `misbehaviour` (`endless` or `stall`, see
/// `hostile_serve.py`), killed after 60 s (status 124): its output, the path and the
/// destination store.
fn copy_from_a_far_end_that(misbehaviour: &str, options: &[&str]) -> (Output, String, PathBuf, tempfile::TempDir) {
    let (dir, sshd, _, mut one) = before_a_far_end(1);
    let tmp = dir.path();
    let (a, _) = one.remove(0);
    let a_shown = StoreDir::default().display_path(&a.path);
    let mut replies = far_replies(&[&a], &[&a], &[]);
    replies.push((misbehaviour.into(), Vec::new()));
    let (url, _) = hostile_far_end(tmp, misbehaviour, replies);
    let local = tmp.join("local");
    let mut cmd = Command::new("timeout");
    isolate(&mut cmd, tmp, "");
    let o = cmd
        .env("NIX_SSHOPTS", sshd.ssh_opts())
        .args(["60", env!("CARGO_BIN_EXE_sluice"), "copy"])
        .args(options)
        .args(["--from", &url, "--to", local.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &a_shown])
        .output()
        .unwrap();
    (o, a_shown, local, dir)
}

/// A far end whose NAR goes on past the size its info gives is cut off there: the copy fails
/// at once naming the path, instead of reading for ever.
#[test]
fn a_far_end_whose_nar_never_ends_is_cut_off_at_its_size() {
    let (o, a_shown, local, _dir) = copy_from_a_far_end_that("endless", &[]);
    assert_ne!(o.status.code(), Some(124), "still reading the endless NAR after 60 s: {}", stderr(&o));
    assert!(!o.status.success() && stderr(&o).contains(&a_shown), "{}", stderr(&o));
    assert!(registered_paths(&local).is_empty());
    assert_store_closed(&local);
}

/// A far end that stops answering in the middle of a copy (it has the NAR asked for and sends
/// nothing) is given up after `stalled-download-timeout` without a byte moving either way, the
/// copy failing with an error naming the host, as an HTTP download that stalls is.
#[test]
fn a_far_end_that_stalls_is_given_up() {
    let (o, _, local, _dir) = copy_from_a_far_end_that("stall", &["--option", "stalled-download-timeout", "5"]);
    assert_ne!(o.status.code(), Some(124), "still waiting for the stalled far end after 60 s: {}", stderr(&o));
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains(&format!("'{HOST}'")) && err.contains("nothing moved either way for 5 s"), "{err}");
    assert!(registered_paths(&local).is_empty());
}

/// sluice pushes into `ssh://` with `sluice legacy-serve --write` at the far end as one stream
/// of pipelined AddToStoreNar, which the far end commits in batches: one `syncfs` for the 25
/// paths when the stream flows (one per path before), counted by strace; the far end also
/// commits whenever it has read all that has arrived (it answers before it waits), so a loaded
/// machine's pauses in the stream may add one or two. A push whose stream is cut midway leaves
/// nothing half-registered there (whole, registered paths with complete closures; nothing
/// temporary) and the push then completes; real Nix verifies the store each time.
#[test]
fn a_push_into_legacy_serve_is_one_batch_and_a_cut_one_leaves_nothing_half_registered() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = subset();
    let src = source_store(tmp, "cache-subset-none", &root);
    let push = |wrapper: &Path| {
        let to = format!("ssh://{HOST}?remote-program={}", wrapper.display());
        sluice_over_ssh(tmp, &sshd, &["copy", "--from", src.to_str().unwrap(), "--to", &to, &root])
    };
    let (far, traced) = (tmp.join("far"), tmp.join("syncfs"));
    let shape = format!("exec strace -f -qq -e trace=syncfs -o {} CMD", traced.display());
    check(&push(&shaped_serve_wrapper(tmp, "serve-far", &far, &shape)), "sluice copy --to ssh://");
    assert_eq!(nix_closure(tmp, &far, &root), paths);
    assert_nix_verifies(tmp, &far);
    let syncfs = std::fs::read_to_string(&traced).unwrap().lines().filter(|l| l.contains("syncfs(")).count();
    assert!((1..=3).contains(&syncfs), "{syncfs} syncfs for {} paths", paths.len());

    let cut_far = tmp.join("cut-far");
    let cut = shaped_serve_wrapper(tmp, "serve-cut", &cut_far, &cut_input());
    let o = push(&cut);
    assert!(!o.status.success(), "a push into a far end cut short succeeded");
    assert!(stderr(&o).contains(HOST), "{}", stderr(&o));
    wait_far_end_gone(&cut_far);
    assert_store_closed(&cut_far);
    let registered = registered_paths(&cut_far);
    assert!(registered.len() < paths.len(), "everything was copied: {registered:?}");
    if !registered.is_empty() {
        assert_nix_verifies(tmp, &cut_far);
    }
    for path in &registered {
        assert!(nix_closure(tmp, &cut_far, path).iter().all(|p| registered.contains(p)), "{path}'s closure is incomplete");
    }
    check(&push(&serve_wrapper(tmp, "serve-whole", &cut_far)), "the push again");
    assert_eq!(nix_closure(tmp, &cut_far, &root), paths);
    assert_nix_verifies(tmp, &cut_far);
}
