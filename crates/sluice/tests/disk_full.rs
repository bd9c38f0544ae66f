//! Disk full: the store lives on a 4 MiB tmpfs mounted by the test (needs
//! root), the corpus closure (22.8 MB of NARs) fills it mid-copy. The copy fails with a clear
//! error, every path registered before stays valid, and after the filesystem is enlarged a
//! rerun completes. The tmpfs is unmounted at the end, also when the test fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// A tmpfs mounted at a directory; unmounted (lazily) on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir).output().unwrap();
        check(&o, "mount -t tmpfs (this test needs root)");
        Tmpfs { dir: dir.to_path_buf() }
    }

    fn resize(&self, size: &str) {
        let o = Command::new("mount").args(["-o", &format!("remount,size={size}")]).arg(&self.dir).output().unwrap();
        check(&o, "remount");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).output();
    }
}

#[test]
fn store_filling_up_mid_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&tmp.path().join("mnt"), "4m");
    let root = fs.dir.join("root");
    let url = format!("file://{}", corpus().join("cache-xz").display());
    let o = copy_with(tmp.path(), &root, &url, &corpus_key(), &[], &[TOP]);
    assert_eq!(o.status.code(), Some(1), "the copy cannot fit");
    let err = stderr(&o);
    assert!(err.contains("No space left on device") && err.contains("/nix/store/"), "a clear error naming a path: {err}");
    let (rows, distinct) = registered_rows(&root);
    assert!(rows > 0 && rows < 1056 && rows == distinct, "some paths were registered before the disk filled: {rows}");
    // What is registered is valid. (Nix's verify needs a little room for its own bookkeeping.)
    fs.resize("8m");
    assert_nix_verifies(tmp.path(), &root);
    fs.resize("64m");
    check(&copy_with(tmp.path(), &root, &url, &corpus_key(), &[], &[TOP]), "the rerun with room");
    assert_eq!(registered_rows(&root), (1056, 1056));
    assert_eq!(store_leftovers(&root), Vec::<String>::new());
    assert_nix_verifies(tmp.path(), &root);
}
