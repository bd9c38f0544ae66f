//! The worker protocol's versions and features through `sluice daemon`: Nix 2.26's 1.38
//! greeting (its bytes kept in `tests/data/nix-2.26-greeting.txt`, captured from Nix 2.26 and
//! nix-daemon 2.26), Nix 2.8's 1.34 one, a 1.37 client's, and the batch operations of
//! DeterminateSystems' Nix (AddTempRoots, op 49; QueryPathInfos, op 50) and sluice's
//! QueryClosureInfos through sluice's own client, each answering as the per-path operations
//! do, in sluice daemon and in nix-daemon.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::features::{feature_set, read_features, FeatureSet};
use sluice_nix::wire::{read_string, read_trusted_flag, read_u64, ProtocolVersion, WORKER_MAGIC_1, WORKER_MAGIC_2};
use sluice_store::remote::{DaemonConnection, DaemonStore};
use sluice_store::store::Store;

use crate::daemon::{self, request, store_path_of, u64s, wait_for_socket, Env, LAST, MISSING, SHARED};

/// The bytes of one direction (`C>D` or `D>C`) of the golden greeting.
fn golden(direction: &str) -> Vec<u8> {
    let text = include_str!("data/nix-2.26-greeting.txt");
    let words = text.lines().filter_map(|l| l.strip_prefix(direction)).map(|l| l.split_whitespace().next().unwrap());
    words.flat_map(|w| (0..w.len()).step_by(2).map(move |i| u8::from_str_radix(&w[i..i + 2], 16).unwrap())).collect()
}

/// A daemon's greeting as a 1.38 client reads it: magic, version, features, version string,
/// trusted flag, then `LAST`.
fn read_greeting_1_38(r: &mut impl Read) -> (ProtocolVersion, FeatureSet, String, Option<bool>) {
    assert_eq!(read_u64(r, "magic").unwrap(), WORKER_MAGIC_2);
    let version = ProtocolVersion::from_wire(read_u64(r, "version").unwrap());
    let features = read_features(r, "features").unwrap();
    let nix_version = read_string(r, 1024, "version string").unwrap();
    let trusted = read_trusted_flag(r, "trusted").unwrap();
    assert_eq!(read_u64(r, "end of the greeting").unwrap(), LAST);
    (version, features, nix_version, trusted)
}

/// A proxy on `listen` to the daemon socket `upstream` for one connection, keeping what each
/// side sent: (client → daemon, daemon → client).
struct Recorder {
    sent: [Arc<Mutex<Vec<u8>>>; 2],
}

impl Recorder {
    fn start(listen: &Path, upstream: &Path) -> Self {
        let listener = UnixListener::bind(listen).unwrap();
        let upstream = upstream.to_owned();
        let sent: [Arc<Mutex<Vec<u8>>>; 2] = Default::default();
        let logs = sent.clone();
        std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let daemon = UnixStream::connect(upstream).unwrap();
            let pumps = [(client.try_clone().unwrap(), daemon.try_clone().unwrap()), (daemon, client)];
            let threads: Vec<_> = pumps
                .into_iter()
                .zip(logs)
                .map(|((mut from, mut to), log)| {
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 65536];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            log.lock().unwrap().extend_from_slice(&buf[..n]);
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
        });
        Recorder { sent }
    }

    /// What the client (0) or the daemon (1) sent so far.
    fn sent(&self, side: usize) -> Vec<u8> {
        self.sent[side].lock().unwrap().clone()
    }
}

/// Nix 2.26's greeting, as kept in the golden file, is a 1.38 one with no features, and
/// nix-daemon 2.26's answer parses as such; replayed to sluice daemon it gets the 1.38 answer
/// with sluice's features and a Nix version of the 1.38 era. A live Nix 2.26 client sends
/// sluice daemon the same bytes and reports that version and its trust.
#[test]
fn nix_2_26_negotiates_1_38_as_its_captured_greeting_shows() {
    let client_bytes = golden("C>D");
    let r = &mut client_bytes.as_slice();
    assert_eq!(read_u64(r, "magic").unwrap(), WORKER_MAGIC_1);
    assert_eq!(ProtocolVersion::from_wire(read_u64(r, "version").unwrap()), ProtocolVersion::new(1, 38));
    assert_eq!(read_features(r, "client features").unwrap(), FeatureSet::new(), "Nix 2.26 offers no feature");
    assert_eq!((read_u64(r, "affinity").unwrap(), read_u64(r, "reserveSpace").unwrap()), (0, 0));
    assert!(r.is_empty());
    let nix_daemon = read_greeting_1_38(&mut golden("D>C").as_slice());
    assert_eq!(nix_daemon, (ProtocolVersion::new(1, 38), FeatureSet::new(), "2.26.3".to_owned(), Some(true)));

    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "");
    let mut replay = UnixStream::connect(env.path("socket")).unwrap();
    replay.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    replay.write_all(&client_bytes).unwrap();
    let (version, features, nix_version, trusted) = read_greeting_1_38(&mut replay);
    assert_eq!((version, trusted), (ProtocolVersion::new(1, 38), Some(true)));
    assert_eq!(features, feature_set(&["addTempRoots", "queryPathInfos", "sluice-query-closure"]));
    assert_eq!(nix_version, format!("2.24.0+sluice.{}", env!("CARGO_PKG_VERSION")));
    replay.write_all(&request(1, &[Err(MISSING)])).unwrap();
    assert_eq!((daemon::read_u64(&mut replay), daemon::read_u64(&mut replay)), (LAST, 0), "IsValidPath after the greeting");

    let recorder = Recorder::start(&env.path("proxy"), &env.path("socket"));
    let store = format!("unix://{}", env.path("proxy").display());
    let out = env
        .cmd(&format!("{SHARED}/bin/nix-modern"))
        .current_dir(env.path(""))
        .args(["nix", "store", "info", "--store", &store])
        .output()
        .unwrap();
    // Nix 2.26 prints the store's details on stderr.
    let info = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{info}");
    assert!(info.contains(&format!("Version: {nix_version}\n")) && info.contains("Trusted: 1"), "{info}");
    assert_eq!(recorder.sent(0)[..client_bytes.len()], client_bytes, "Nix 2.26's greeting is the golden file's");
}

/// Nix 2.8 (protocol 1.34) still negotiates 1.34: no features either way, the version string,
/// no trusted flag, `LAST`.
#[test]
fn nix_2_8_negotiates_1_34_without_features() {
    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "");
    let recorder = Recorder::start(&env.path("proxy"), &env.path("socket"));
    let store = format!("unix://{}", env.path("proxy").display());
    let out = env.cmd("nix").args(["store", "ping", "--store", &store]).output().unwrap();
    // Nix 2.8 prints the store's details on stderr.
    let ping = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && ping.contains("Version: 2.24.0+sluice."), "{ping}");
    // Magic, 1.34, affinity flag 0, reserveSpace 0, then its first request.
    assert_eq!(recorder.sent(0)[..32], u64s(&[0x6e69_7863, 0x122, 0, 0]));
    let answer = recorder.sent(1);
    let r = &mut answer.as_slice();
    assert_eq!((read_u64(r, "magic").unwrap(), read_u64(r, "version").unwrap()), (WORKER_MAGIC_2, 0x126));
    assert!(read_string(r, 1024, "version string").unwrap().starts_with("2.24.0+sluice."));
    assert_eq!(read_u64(r, "end of the greeting").unwrap(), LAST);
}

/// A client newer than the daemon (1.255) with features sluice has and lacks negotiates 1.38
/// and the common ones; a 1.37 client's greeting has no feature exchange, its bytes as before.
#[test]
fn a_newer_client_and_a_1_37_client_get_their_own_greetings() {
    let env = Env::new();
    let _daemon = env.daemon("root", &env.cache(), "");
    let connect = || {
        let c = UnixStream::connect(env.path("socket")).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    };
    let mut newer = connect();
    newer.write_all(&u64s(&[0x6e69_7863, 0x1ff])).unwrap();
    // Its features: a count, then the names.
    newer.write_all(&request(2, &[Err(b"provenance"), Err(b"queryPathInfos")])).unwrap();
    newer.write_all(&u64s(&[0, 0])).unwrap();
    let (version, features, _, trusted) = read_greeting_1_38(&mut newer);
    assert_eq!((version, trusted), (ProtocolVersion::new(1, 38), Some(true)));
    assert_eq!(features, feature_set(&["addTempRoots", "queryPathInfos", "sluice-query-closure"]), "the daemon sends all it offers");
    newer.write_all(&request(1, &[Err(MISSING)])).unwrap();
    assert_eq!((daemon::read_u64(&mut newer), daemon::read_u64(&mut newer)), (LAST, 0));

    let mut old = connect();
    old.write_all(&u64s(&[0x6e69_7863, 0x125, 0, 0])).unwrap();
    let mut expected = u64s(&[0x6478_696f, 0x126]);
    expected.extend(request(0, &[Err(format!("2.24.0+sluice.{}", env!("CARGO_PKG_VERSION")).as_bytes()), Ok(1), Ok(LAST)])[8..].iter());
    let mut answer = vec![0u8; expected.len()];
    old.read_exact(&mut answer).unwrap();
    assert_eq!(answer, expected);
}

/// The temporary roots files of `<state>/temproots` and what each holds, read as a collector
/// reads them: with `gc.lock` held exclusively (Nix writes a root before it answers; sluice
/// daemon before it gives up the shared lock it keeps while its client asks).
fn temp_roots(state: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let gc_lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(state.join("gc.lock")).unwrap();
    gc_lock.lock().unwrap();
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(state.join("temproots")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let text = std::fs::read_to_string(state.join("temproots").join(&name)).unwrap();
        files.insert(name, text.split('\0').filter(|p| !p.is_empty()).map(str::to_owned).collect());
    }
    files
}

/// The roots added to the files of `<state>/temproots` since `before` (a connection's file may
/// exist before its first root: sluice daemon makes it when the connection first keeps the GC
/// lock), and the files now.
fn new_temp_roots(state: &Path, before: &BTreeMap<String, BTreeSet<String>>) -> (BTreeSet<String>, BTreeMap<String, BTreeSet<String>>) {
    let now = temp_roots(state);
    let added = now.iter().flat_map(|(name, held)| held.iter().filter(move |r| before.get(name).is_none_or(|b| !b.contains(*r))));
    (added.cloned().collect(), now)
}

/// sluice's client negotiates QueryPathInfos and AddTempRoots with sluice daemon and uses
/// them: on a real closure (glibc's, substituted from the corpus cache) and a missing path,
/// QueryPathInfos answers what QueryPathInfo answers path by path, and what nix-daemon 2.8
/// (no features: sluice's client falls back to pipelined per-path requests) answers on the
/// same store; AddTempRoots roots exactly the paths that AddTempRoot, path by path, roots (in
/// sluice daemon for a raw 1.37 client, and in nix-daemon for sluice's client); a
/// [`DaemonStore`] roots the paths it looks up.
#[test]
fn batch_path_infos_and_temp_roots_answer_as_the_per_path_operations() {
    let env = Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let key = crate::daemon::cache_key();
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    env.nix("nix", &["copy", "--from", &cache, "--to", &daemon.url, &glibc, "--option", "trusted-public-keys", &key]);
    let dir = StoreDir::default();
    let mut paths: Vec<StorePath> =
        env.nix("nix-store", &["--store", &daemon.url, "-qR", &glibc]).lines().map(|l| dir.parse_path(l).unwrap()).collect();
    assert!(paths.len() > 1);
    let closure: BTreeSet<String> = paths.iter().map(|p| dir.display_path(p)).collect();
    paths.push(dir.parse_path(std::str::from_utf8(MISSING).unwrap()).unwrap());

    let mut sluice = DaemonConnection::connect(&env.path("socket"), false).unwrap();
    assert_eq!(sluice.version(), ProtocolVersion::new(1, 38));
    assert_eq!(sluice.features(), &feature_set(&["addTempRoots", "queryPathInfos", "sluice-query-closure"]));
    assert_eq!(sluice.trusted(), Some(true));
    let batch = sluice.query_path_infos(&paths).unwrap();
    let one_by_one: Vec<_> = paths.iter().map(|p| sluice.query_path_info(p).unwrap()).collect();
    assert_eq!(batch, one_by_one);
    assert!(batch.last().unwrap().is_none() && batch.iter().filter(|i| i.is_some()).count() == closure.len());
    assert!(batch[0].as_ref().is_some_and(|i| i.nar_size > 0 && !i.sigs.is_empty()), "{:?}", batch[0]);

    let nix_daemon = env.nix_daemon("nix-socket", "root", "");
    let mut nix = DaemonConnection::connect(&env.path("nix-socket"), false).unwrap();
    assert_eq!((nix.version(), nix.features()), (ProtocolVersion::new(1, 34), &FeatureSet::new()));
    assert_eq!(nix.query_path_infos(&paths).unwrap(), batch, "nix-daemon 2.8's answers");

    let state = env.path("root/nix/var/nix");
    std::fs::create_dir_all(state.join("temproots")).unwrap();
    let live = &paths[..paths.len() - 1];
    let before = temp_roots(&state);
    sluice.add_temp_roots(live).unwrap();
    let (roots, before) = new_temp_roots(&state, &before);
    assert_eq!(roots, closure, "AddTempRoots in sluice daemon");

    let (mut raw, _) = daemon::raw_client(&env, 37);
    for p in live {
        raw.write_all(&request(11, &[Err(dir.display_path(p).as_bytes())])).unwrap();
    }
    for _ in live {
        assert_eq!((daemon::read_u64(&mut raw), daemon::read_u64(&mut raw)), (LAST, 1));
    }
    let (roots, before) = new_temp_roots(&state, &before);
    assert_eq!(roots, closure, "AddTempRoot path by path in sluice daemon");

    nix.add_temp_roots(live).unwrap();
    let (roots, before) = new_temp_roots(&state, &before);
    assert_eq!(roots, closure, "AddTempRoot path by path in nix-daemon 2.8");

    // DaemonStore (the copy's destination) roots what it looks up, as Nix's copyPaths does.
    let store = DaemonStore::connect(&daemon.url, &env.path("socket"), false, true).unwrap();
    let valid = futures::executor::block_on(store.query_valid_paths(&paths)).unwrap();
    assert_eq!(valid.iter().map(|p| dir.display_path(p)).collect::<BTreeSet<_>>(), closure);
    // Every path looked up, the missing one too (it may be added next).
    let asked: BTreeSet<String> = paths.iter().map(|p| dir.display_path(p)).collect();
    assert_eq!(new_temp_roots(&state, &before).0, asked, "DaemonStore::query_valid_paths");
    drop((sluice, raw, nix, nix_daemon, store, daemon));
}

/// sluice's client finds a closure in sluice daemon with one request (QueryClosureInfos, the
/// feature `sluice-query-closure`: the daemon counts one operation for the connection), where
/// nix-daemon 2.8 is asked a level at a time;
/// the infos are the same, the paths those of `nix-store -qR`, and a root the daemon lacks is
/// the error naming it.
#[test]
fn a_closure_is_one_request_to_sluice_daemon() {
    let env = Env::new();
    let cache = env.cache();
    let log = env.path("daemon.log");
    let mut cmd = env.daemon_command(&env.path("socket"), "root", &cache, "");
    cmd.env("SLUICE_LOG", "sluice_daemon=debug").stderr(std::fs::File::create(&log).unwrap());
    let daemon = wait_for_socket(cmd.spawn().unwrap(), &env.path("socket"));
    let key = crate::daemon::cache_key();
    let glibc = store_path_of(&env.path("bin-cache"), "1zhba591ddnyl66pbs4bdcmp3rd8nx09");
    env.nix("nix", &["copy", "--from", &cache, "--to", &daemon.url, &glibc, "--option", "trusted-public-keys", &key]);
    let dir = StoreDir::default();
    let expected: BTreeSet<String> = env.nix("nix-store", &["--store", &daemon.url, "-qR", &glibc]).lines().map(str::to_owned).collect();
    assert!(expected.len() > 3, "{expected:?}");
    let root = [dir.parse_path(&glibc).unwrap()];

    let operations = || std::fs::read_to_string(&log).unwrap().lines().filter(|l| l.ends_with(" operations")).map(str::to_owned).collect();
    let before: Vec<String> = operations();
    let store = DaemonStore::connect(&daemon.url, &env.path("socket"), false, true).unwrap();
    let closure = futures::executor::block_on(store.closure_infos(&root)).unwrap();
    drop(store);
    assert_eq!(closure.keys().map(|p| dir.display_path(p)).collect::<BTreeSet<_>>(), expected);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let counted = loop {
        let now: Vec<String> = operations();
        if now.len() > before.len() {
            break now[before.len()].clone();
        }
        assert!(std::time::Instant::now() < deadline, "no count of the connection's operations in the daemon's log");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(counted.ends_with(": 1 operations"), "{counted}");

    let _nix_daemon = env.nix_daemon("nix-socket", "root", "");
    let nix = DaemonStore::connect("unix://nix-daemon-2.8", &env.path("nix-socket"), false, true).unwrap();
    assert_eq!(futures::executor::block_on(nix.closure_infos(&root)).unwrap(), closure, "nix-daemon 2.8's infos, a level at a time");

    let store = DaemonStore::connect(&daemon.url, &env.path("socket"), false, true).unwrap();
    let missing = [dir.parse_path(std::str::from_utf8(MISSING).unwrap()).unwrap()];
    let e = futures::executor::block_on(store.closure_infos(&missing)).unwrap_err().to_string();
    assert!(e.contains(std::str::from_utf8(MISSING).unwrap()) && e.contains(&daemon.url), "{e}");
}
