//! The contract of the `Store` interface (`sluice_store::store`), the same scenarios against
//! every kind of store, in-process, without Nix or a server process: a local store in a
//! scratch directory, `file://`, `http://` and `s3://` binary caches (the last two served by
//! a thread of the test), `memory://`, and `dummy://` for what it refuses.
//! Queries of absent paths, an addition and its NAR read back, a closure copied in order
//! (a path is visible only once its publish gate opens, never if it fails), and refusal of a
//! NAR that does not match its info.

use std::collections::BTreeSet;
use std::io::{Cursor, Read};
use std::sync::Arc;
use std::time::Duration;

use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::nar::writer::regular_file_nar;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use sluice_store::config::Settings;
use sluice_store::push::copy_closures;
use sluice_store::store::{open_store, PublishGate, Store, StoreError};

use crate::common::DirServer;
use crate::local_store::{honest_info, Scratch};

/// A fresh store of every kind that holds paths, under `scratch`: local (signatures not
/// required, so that unsigned paths are taken), `file://`, `http://` and `s3://` (served from
/// `scratch` by a [`DirServer`] in this process) and `memory://`.
fn writable_urls(scratch: &Scratch) -> [String; 5] {
    let dir = scratch.path();
    let server = DirServer::start(dir);
    std::fs::create_dir(dir.join("bucket")).unwrap();
    let s3 = format!("s3://bucket?endpoint={}&scheme=http", server.url.trim_start_matches("http://"));
    [
        format!("{}?require-sigs=false", dir.join("local").display()),
        format!("file://{}", dir.join("cache").display()),
        format!("{}/http", server.url),
        s3,
        "memory://".to_string(),
    ]
}

async fn open(url: &str) -> Arc<dyn Store> {
    open_store(url, &Settings::default()).await.unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// The path `<hash>-contract-<name>`, its hash part made from `name`.
fn path(name: &str) -> StorePath {
    let hash = Hash::digest_bytes(HashAlgo::Sha256, name.as_bytes()).to_nix32();
    StorePath::from_base_name(&format!("{}-contract-{name}", &hash[..32])).unwrap()
}

/// The path `name` as a file holding `contents`, referring to `references`: its info and NAR.
fn item(name: &str, contents: &str, references: &[&StorePath]) -> (ValidPathInfo, Vec<u8>) {
    let nar = regular_file_nar(contents.as_bytes(), false);
    let mut info = honest_info(path(name).to_string().as_str(), &nar);
    info.references = references.iter().map(|r| (*r).clone()).collect();
    (info, nar)
}

fn open_gate() -> PublishGate {
    Box::pin(async { Ok(()) })
}

async fn add(store: &dyn Store, (info, nar): &(ValidPathInfo, Vec<u8>), gate: PublishGate) -> Result<(), StoreError> {
    store.add_to_store(info.clone(), Box::new(Cursor::new(nar.clone())), gate).await
}

async fn is_valid(store: &dyn Store, path: &StorePath) -> bool {
    store.query_valid_paths(std::slice::from_ref(path)).await.unwrap_or_else(|e| panic!("{}: {e}", store.url())).contains(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_answers_queries_of_absent_paths() {
    let scratch = Scratch::new();
    for url in writable_urls(&scratch).into_iter().chain(["dummy://".to_string()]) {
        let store = open(&url).await;
        let absent = [path("absent"), path("also-absent")];
        let infos = store.query_path_infos(&absent).await.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(infos.iter().all(Option::is_none), "{url}: {infos:?}");
        assert_eq!(store.query_valid_paths(&absent).await.unwrap_or_else(|e| panic!("{url}: {e}")), BTreeSet::new(), "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_adds_a_path_and_gives_its_nar_back() {
    let scratch = Scratch::new();
    for url in writable_urls(&scratch) {
        let store = open(&url).await;
        // The local store takes a path only once its references are valid, as Nix's does.
        let dependency = item("dependency", "depended on\n", &[]);
        let added = item("added", "the contents\n", &[&dependency.0.path]);
        for new in [&dependency, &added] {
            add(store.as_ref(), new, open_gate()).await.unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        let info = &added.0;
        let found = store.query_path_infos(std::slice::from_ref(&info.path)).await.unwrap().pop().flatten();
        let found = found.unwrap_or_else(|| panic!("{url}: {} not valid once added", info.path)).info;
        assert_eq!(
            (&found.path, &found.nar_hash, found.nar_size, &found.references),
            (&info.path, &info.nar_hash, info.nar_size, &info.references),
            "{url}"
        );
        assert_eq!(store.query_path_from_hash_part(info.path.hash_part()).await.unwrap(), Some(info.path.clone()), "{url}");
        assert_eq!(store.query_path_from_hash_part(path("absent").hash_part()).await.unwrap(), None, "{url}");
        // A NAR reader is read on a blocking thread, as the trait says.
        let mut reader = store.nar_from_path(info).await.unwrap_or_else(|e| panic!("{url}: {e}"));
        let nar = tokio::task::spawn_blocking(move || {
            let mut nar = Vec::new();
            reader.read_to_end(&mut nar).map(|_| nar)
        });
        let nar = nar.await.unwrap().unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(nar == added.1, "{url}: the NAR read back differs from the one added");
        let (sink, dumped) = shared_sink();
        store.dump_nar(info, Box::new(sink)).await.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(*dumped.lock().unwrap() == added.1, "{url}: the NAR dumped differs from the one added");
    }
}

/// A writer whose bytes stay readable after it is given away.
fn shared_sink() -> (impl std::io::Write + Send + 'static, Arc<std::sync::Mutex<Vec<u8>>>) {
    struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let bytes = Arc::default();
    (Sink(Arc::clone(&bytes)), bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_takes_a_closure_in_order() {
    let scratch = Scratch::new();
    // The source: bottom ← middle ← top (which also refers to itself).
    let source = open("memory://").await;
    let (bottom, middle, top) = (path("bottom"), path("middle"), path("top"));
    for added in [item("bottom", "b\n", &[]), item("middle", "m\n", &[&bottom]), item("top", "t\n", &[&middle, &top])] {
        add(source.as_ref(), &added, open_gate()).await.unwrap();
    }
    for url in writable_urls(&scratch) {
        let store = open(&url).await;
        let report =
            copy_closures(source.clone(), store.clone(), std::slice::from_ref(&top)).await.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(report.failed.is_empty(), "{url}: {:?}", report.failed);
        assert_eq!(report.copied.iter().collect::<BTreeSet<_>>(), BTreeSet::from([&bottom, &middle, &top]), "{url}");
        let infos = store.query_path_infos(&[top.clone(), middle.clone()]).await.unwrap();
        let references: Vec<BTreeSet<StorePath>> = infos.into_iter().map(|i| i.unwrap().info.references).collect();
        assert_eq!(references, [BTreeSet::from([middle.clone(), top.clone()]), BTreeSet::from([bottom.clone()])], "{url}");
        let again = copy_closures(source.clone(), store.clone(), std::slice::from_ref(&top)).await.unwrap();
        assert_eq!((again.copied.len(), again.already_valid), (0, 3), "{url}: copied again");

        // A path becomes visible only once its publish gate opens...
        let gated = item("gated", "g\n", &[&top]);
        let (open_it, gate) = tokio::sync::oneshot::channel::<()>();
        let adding = tokio::spawn({
            let (store, gated) = (store.clone(), gated.clone());
            async move { add(store.as_ref(), &gated, Box::pin(async move { gate.await.map_err(|e| StoreError::Other(e.to_string())) })).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A local store registers a path as soon as each of its references is registered or
        // queued before it (`Store::add_to_store`), which is what the gate guards, sooner:
        // this one's only reference is valid.
        let local = url.starts_with('/');
        assert_eq!(is_valid(store.as_ref(), &gated.0.path).await, local, "{url}: visible before its gate opened (or, local, not yet)");
        let _ = open_it.send(()); // A local store may have dropped the gate it did not need.
        adding.await.unwrap().unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(is_valid(store.as_ref(), &gated.0.path).await, "{url}: not visible once its gate opened");
        // ...and never if it fails (a reference failed: it is not there).
        let refused = item("after-a-failed-reference", "r\n", &[&bottom, &path("failed-reference")]);
        let failed: PublishGate =
            Box::pin(async { Err(StoreError::ReferenceFailed { path: "refused".into(), reference: "bottom".into() }) });
        assert!(add(store.as_ref(), &refused, failed).await.is_err(), "{url}: added although its gate failed");
        assert!(!is_valid(store.as_ref(), &refused.0.path).await, "{url}: visible although its gate failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_refuses_a_nar_that_is_not_its_info() {
    let scratch = Scratch::new();
    for url in writable_urls(&scratch) {
        let store = open(&url).await;
        let (mut wrong_hash, nar) = item("wrong-hash", "what was hashed\n", &[]);
        wrong_hash.nar_hash = Hash::digest_bytes(HashAlgo::Sha256, b"something else");
        let (mut wrong_size, nar2) = item("wrong-size", "sized\n", &[]);
        wrong_size.nar_size += 8;
        let garbage = b"not a NAR at all".to_vec();
        let not_a_nar = honest_info(path("not-a-nar").to_string().as_str(), &garbage);
        for bad in [(wrong_hash, nar), (wrong_size, nar2), (not_a_nar, garbage)] {
            let name = bad.0.path.to_string();
            assert!(add(store.as_ref(), &bad, open_gate()).await.is_err(), "{url}: {name} was added");
            assert!(!is_valid(store.as_ref(), &bad.0.path).await, "{url}: {name} is valid");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dummy_store_refuses_with_nix_messages() {
    let store = open("dummy://").await;
    let (info, nar) = item("refused", "r\n", &[]);
    let message = |result: Result<(), StoreError>| result.err().map(|e| e.to_string());
    assert_eq!(
        message(add(store.as_ref(), &(info.clone(), nar), open_gate()).await),
        Some("operation 'addToStore' is not supported by store 'dummy'".into())
    );
    assert_eq!(
        message(store.nar_from_path(&info).await.map(drop)),
        Some("operation 'narFromPath' is not supported by store 'dummy'".into())
    );
    assert_eq!(
        message(store.query_path_from_hash_part(info.path.hash_part()).await.map(drop)),
        Some("operation 'queryPathFromHashPart' is not supported by store 'dummy'".into())
    );
    let source = open("memory://").await;
    add(source.as_ref(), &item("refused", "r\n", &[]), open_gate()).await.unwrap();
    let report = copy_closures(source, store, std::slice::from_ref(&info.path)).await.unwrap();
    let failed: Vec<String> = report.failed.values().map(|f| f.message.clone()).collect();
    assert!(
        report.copied.is_empty() && failed.len() == 1 && failed[0].contains("operation 'addToStore' is not supported by store 'dummy'"),
        "{failed:?}"
    );
}

/// A copy whose source claims a reference cycle (`one` ↔ `two`) fails the cycle's paths with
/// the cycle's message and the path referring to it (`user`) with its failed reference, in
/// every kind of store, instead of leaving `user` waiting for ever for a path that is never
/// added; `alone`, outside the cycle, is copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_fails_a_claimed_cycle_and_its_referrers() {
    let scratch = Scratch::new();
    let source = open("memory://").await;
    let (one, two, alone, user) = (path("one"), path("two"), path("alone"), path("user"));
    for added in [item("one", "1\n", &[&two]), item("two", "2\n", &[&one]), item("alone", "a\n", &[]), item("user", "u\n", &[&one, &alone])]
    {
        add(source.as_ref(), &added, open_gate()).await.unwrap();
    }
    for url in writable_urls(&scratch) {
        let store = open(&url).await;
        let copy = copy_closures(source.clone(), store.clone(), std::slice::from_ref(&user));
        let report =
            tokio::time::timeout(Duration::from_secs(20), copy).await.unwrap_or_else(|_| panic!("{url}: still copying after 20 s"));
        let report = report.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(report.copied, std::slice::from_ref(&alone), "{url}: {:?}", report.failed);
        assert_eq!(report.failed.keys().collect::<BTreeSet<_>>(), BTreeSet::from([&one, &two, &user]), "{url}");
        for member in [&one, &two] {
            assert!(report.failed[member].message.contains("cycle"), "{url}: {}", report.failed[member].message);
        }
        assert!(!is_valid(store.as_ref(), &user).await, "{url}");
    }
}
