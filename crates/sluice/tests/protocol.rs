//! The worker protocol's versions and features through `sluice daemon`: Nix 2.26's 1.38
//! greeting (its bytes kept in `tests/data/nix-2.26-greeting.txt`, captured from Nix 2.26 and
//! nix-daemon 2.26), Nix 2.8's 1.34 one, a 1.37 client's.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_nix::wire::features::{feature_set, read_features, FeatureSet};
use sluice_nix::wire::{read_string, read_trusted_flag, read_u64, ProtocolVersion, WORKER_MAGIC_1, WORKER_MAGIC_2};

use crate::daemon::{self, request, u64s, Env, LAST, MISSING, SHARED};

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
    assert_eq!(features, feature_set(&["addTempRoots", "queryPathInfos"]));
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
    assert_eq!(features, feature_set(&["addTempRoots", "queryPathInfos"]), "the daemon sends all it offers");
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
