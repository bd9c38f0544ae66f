//! A binary-cache store keeps a bounded number of narinfos however many paths it is asked
//! about (`sluice serve --store file://…` or `s3://…` running for months), and still reads the
//! NAR of a path whose narinfo it has dropped.

use std::io::Read;

use sluice_binary_cache::{BinaryCache, NARINFOS_KEPT};
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::nar::writer::regular_file_nar;
use sluice_store::config::Settings;
use sluice_store::store::Store;
use sluice_store::store_url::StoreUrl;

/// The hash part of the `i`th made-up path: `i` in nixbase32, 32 digits.
fn hash_part(mut i: usize) -> String {
    const DIGITS: &[u8] = b"0123456789abcdfghijklmnpqrsvwxyz";
    let mut digits = [b'0'; 32];
    for d in digits.iter_mut().rev() {
        *d = DIGITS[i % 32];
        i /= 32;
    }
    String::from_utf8(digits.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narinfos_kept_are_bounded_and_a_dropped_one_is_fetched_again() {
    // tmpfs: thousands of small files, and the disk is not what is tested.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let nar = regular_file_nar(b"the contents of path 0\n", false);
    let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, &nar);
    std::fs::create_dir(dir.path().join("nar")).unwrap();
    std::fs::write(dir.path().join("nar/0.nar"), &nar).unwrap();
    std::fs::write(dir.path().join("nix-cache-info"), "StoreDir: /nix/store\n").unwrap();
    let count = NARINFOS_KEPT + 100;
    for i in 0..count {
        let h = hash_part(i);
        let text = format!(
            "StorePath: /nix/store/{h}-p{i}\nURL: nar/0.nar\nCompression: none\nNarHash: {}\nNarSize: {}\nReferences: \n",
            nar_hash.to_nix32_prefixed(),
            nar.len()
        );
        std::fs::write(dir.path().join(format!("{h}.narinfo")), text).unwrap();
    }
    let url = StoreUrl::parse(&format!("file://{}", dir.path().display())).unwrap().as_cache().cloned().expect("a cache URL");
    let settings = Settings::default();
    let client = sluice_binary_cache::http::LazyClient::new(settings.http_options());
    let cache = BinaryCache::open(&url, &client).await.unwrap();

    let first = cache.query_path_info_from_hash_part(&hash_part(0)).await.unwrap().expect("path 0 is in the cache");
    for i in 1..count {
        let info = cache.query_path_info_from_hash_part(&hash_part(i)).await.unwrap();
        assert_eq!(info.map(|info| info.nar_size), Some(nar.len() as u64), "path {i}");
    }
    assert_eq!(cache.narinfos_kept(), NARINFOS_KEPT);
    // Path 0's narinfo was dropped long ago: its NAR is found by fetching it again.
    let mut read = Vec::new();
    cache.nar_from_path(&first).await.unwrap().read_to_end(&mut read).unwrap();
    assert_eq!(read, nar);
    assert_eq!(cache.narinfos_kept(), NARINFOS_KEPT);
}
