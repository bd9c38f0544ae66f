//! The local store behind the [`Store`] interface: queries run on blocking threads, a NAR is
//! dumped by the thread that reads it, as it reads (or straight into the caller's writer by
//! [`Store::dump_nar`]), and additions pass the
//! one verification boundary ([`LocalStore::begin_add`] → [`PendingPath::unpack`] → the
//! registrar's [`LocalStore::commit_all`] under the store's signature policy).
//!
//! Additions are registered as the substitution pipeline registers substituted paths: each
//! unpacked path is handed to the handle's [`Registrar`] as soon as each of its references is
//! valid or was handed to it before (or its publish gate opens), and the registrar commits what
//! it was handed in batches, in order, one transaction and one flush per batch: a closure
//! pulled from a daemon or an SSH store is registered in a few batches, not one commit per path.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};

use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::registrar::{Finished, Registrar};
use crate::store::{NarReader, PublishGate, Store, StoreError, StoreFuture};
use sluice_local_store::{LocalStore, NarDump, PendingPath, SignaturePolicy, TempRoots, Uncommitted};

/// NARs unpacked at once into a local store (each on a blocking thread).
const UNPACK_PARALLELISM: usize = 32;

/// A local store opened for moving paths: the store, the temporary roots every path read or
/// added is held by for the handle's life, and the signature policy additions pass.
pub(crate) struct LocalStoreHandle {
    url: String,
    store: Arc<LocalStore>,
    roots: TempRoots,
    policy: SignaturePolicy,
    /// Registers the additions, started by the first one; its thread is waited for when the
    /// handle is dropped.
    registrar: OnceLock<(Registrar, Finished)>,
    /// Per path added through the handle: whether it is handed to the registrar (or found
    /// valid), which its dependents wait for.
    handed: Mutex<HashMap<StorePath, tokio::sync::watch::Sender<bool>>>,
}

impl LocalStoreHandle {
    /// A handle on `store` (opened from `url`) adding paths under `policy`.
    pub fn new(url: &str, store: Arc<LocalStore>, policy: SignaturePolicy) -> Self {
        let roots = store.temp_roots();
        LocalStoreHandle { url: url.to_string(), store, roots, policy, registrar: OnceLock::new(), handed: Mutex::default() }
    }

    /// Whether `path` was handed to the registrar (or found valid), as a channel to wait on.
    fn handed(&self, path: &StorePath) -> tokio::sync::watch::Sender<bool> {
        let mut handed = self.handed.lock().unwrap_or_else(|p| p.into_inner());
        handed.entry(path.clone()).or_insert_with(|| tokio::sync::watch::channel(false).0).clone()
    }

    /// Waits until each of `references` (valid ones left out) was handed to the registrar, or
    /// `publish` opened (then `published` is set: every reference is valid); `publish`'s error
    /// if it failed first.
    async fn references_handed(
        &self,
        references: Vec<StorePath>,
        publish: &mut PublishGate,
        published: &mut bool,
    ) -> Result<(), StoreError> {
        let (store, asked) = (self.store.clone(), references.clone());
        let valid = blocking(&self.url, move || Ok(store.query_valid_paths(&asked)?)).await?;
        let waits: Vec<_> = references.iter().filter(|r| !valid.contains(*r)).map(|r| self.handed(r).subscribe()).collect();
        let all = async {
            for mut handed in waits {
                let _ = handed.wait_for(|h| *h).await;
            }
        };
        tokio::select! {
            biased;
            opened = publish => {
                *published = true;
                opened
            }
            () = all => Ok(()),
        }
    }
}

impl Drop for LocalStoreHandle {
    /// Waits for the registrar's thread (what it was handed is registered by then), so that
    /// the store is closed once the handle's last user is done with it.
    fn drop(&mut self) {
        if let Some((registrar, finished)) = self.registrar.take() {
            drop(registrar);
            finished.wait();
        }
    }
}

/// Runs `f` on a blocking thread; a panic there becomes an error naming the store.
async fn blocking<T: Send + 'static>(url: &str, f: impl FnOnce() -> Result<T, StoreError> + Send + 'static) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| StoreError::Other(format!("{url}: {e}")))?
}

impl Store for LocalStoreHandle {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        self.store.store_dir()
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        let (store, paths) = (self.store.clone(), paths.to_vec());
        Box::pin(blocking(&self.url, move || store.query_path_infos(&paths).into_iter().map(|r| Ok(r?.map(PathInfo::of))).collect()))
    }

    /// Each path is rooted before it is looked up (Nix's `addTempRoot`, then `isValidPath`), so
    /// that a path found valid stays valid while the handle lives; a read-only store roots
    /// nothing, as Nix's `LocalStore::addTempRoot` does not there (nothing is deleted from it).
    fn query_valid_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, std::collections::BTreeSet<StorePath>> {
        let (store, paths, roots) = (self.store.clone(), paths.to_vec(), self.roots.clone());
        Box::pin(blocking(&self.url, move || match store.ensure_writable("root paths") {
            Ok(()) => Ok(store.query_valid_paths_rooted(&paths, &roots)?),
            Err(_) => Ok(store.query_valid_paths(&paths)?),
        }))
    }

    fn query_all_valid_paths(&self) -> StoreFuture<'_, std::collections::BTreeSet<StorePath>> {
        let store = self.store.clone();
        Box::pin(blocking(&self.url, move || Ok(store.query_all_valid_paths()?)))
    }

    fn query_path_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<StorePath>> {
        let (store, hash_part) = (self.store.clone(), hash_part.to_string());
        Box::pin(blocking(&self.url, move || Ok(store.query_path_from_hash_part(&hash_part)?)))
    }

    /// Nix's `LocalFSStore::getBuildLog` (`src/libstore/local-fs-store.cc`) for a derivation:
    /// `<log dir>/drvs/<2 chars>/<rest>`, then `<log dir>/drvs/<base name>`, each plain or
    /// `.bz2` (decompressed while read).
    fn build_log<'a>(&'a self, drv: &'a StorePath) -> StoreFuture<'a, Option<NarReader>> {
        let base = drv.base_name();
        let dir = self.store.log_dir().join("drvs");
        let candidates = [dir.join(&base[..2]).join(&base[2..]), dir.join(base)];
        Box::pin(blocking(&self.url, move || {
            for plain in candidates {
                let mut bz2 = plain.clone().into_os_string();
                bz2.push(".bz2");
                let open = |p: &std::path::Path| {
                    File::open(p).map(Some).or_else(|e| if e.kind() == io::ErrorKind::NotFound { Ok(None) } else { Err(e) })
                };
                let err = |p: &std::path::Path, e: io::Error| StoreError::Other(format!("reading the build log {}: {e}", p.display()));
                if let Some(f) = open(&plain).map_err(|e| err(&plain, e))? {
                    return Ok(Some(Box::new(f) as NarReader));
                }
                let bz2 = std::path::PathBuf::from(bz2);
                if let Some(f) = open(&bz2).map_err(|e| err(&bz2, e))? {
                    return Ok(Some(Box::new(bzip2::read::MultiBzDecoder::new(f)) as NarReader));
                }
            }
            Ok(None)
        }))
    }

    fn query_path_info_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<ValidPathInfo>> {
        let (store, hash_part) = (self.store.clone(), hash_part.to_string());
        Box::pin(blocking(&self.url, move || Ok(store.query_path_info_from_hash_part(&hash_part)?)))
    }

    /// The NAR is dumped by whoever reads it, as it is read ([`DumpedNar`]): no thread or pipe
    /// between the tree and the reader.
    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        let nar = DumpedNar { store: self.store.clone(), path: info.path.clone(), dump: None };
        Box::pin(async move { Ok(Box::new(nar) as NarReader) })
    }

    fn dump_nar<'a>(&'a self, info: &'a ValidPathInfo, mut sink: Box<dyn io::Write + Send>) -> StoreFuture<'a, ()> {
        let (store, path) = (self.store.clone(), info.path.clone());
        Box::pin(blocking(&self.url, move || Ok(store.dump_path(&path, &mut sink)?)))
    }

    /// The NAR is unpacked at once; the path is then handed to the registrar once its
    /// references allow (see the module doc), and handed to it again, once its publish gate
    /// opens, if the registrar handed it back (a reference of it was refused meanwhile).
    fn add_to_store<'a>(&'a self, info: ValidPathInfo, mut nar: NarReader, mut publish: PublishGate) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let path = info.path.clone();
            let references: Vec<StorePath> = info.references.iter().filter(|r| **r != path).cloned().collect();
            let (store, roots) = (self.store.clone(), self.roots.clone());
            let pending: Option<PendingPath> = blocking(&self.url, move || {
                let Some(mut pending) = store.begin_add(info, &roots)? else { return Ok(None) };
                pending.unpack(&mut nar)?;
                Ok(Some(pending))
            })
            .await?;
            let handed = self.handed(&path);
            let Some(mut pending) = pending else {
                handed.send_replace(true);
                return Ok(());
            };
            let mut published = false;
            self.references_handed(references, &mut publish, &mut published).await?;
            let (registrar, _) = self.registrar.get_or_init(|| Registrar::start(self.store.clone(), self.policy.clone()));
            let stopped = || StoreError::Other(format!("{}: the registrar stopped", self.url));
            loop {
                // Marked handed after it is: its dependents are handed after it.
                let registered = registrar.hand(pending, false).ok_or_else(stopped)?;
                handed.send_replace(true);
                let uncommitted = match registered.await.map_err(|_| stopped())? {
                    Ok(()) => return Ok(()),
                    Err(uncommitted) => uncommitted,
                };
                handed.send_replace(false);
                match uncommitted {
                    Uncommitted::Waiting(back, _) if !published => {
                        published = true;
                        (&mut publish).await?;
                        pending = *back;
                    }
                    uncommitted => return Err(uncommitted.into_error().into()),
                }
            }
        })
    }

    /// The store's signature policy ([`SignaturePolicy::vouch`]): signed by a trusted key, or
    /// content-addressed (checked against the content when it is added), or no signature
    /// required.
    fn check_trust(&self, info: &ValidPathInfo) -> Result<(), StoreError> {
        self.policy.vouch(self.store.store_dir(), info).map(drop).map_err(StoreError::from)
    }

    fn parallelism(&self) -> usize {
        UNPACK_PARALLELISM
    }
}

/// The NAR of a valid path of a local store, dumped as it is read on the reading thread (a
/// [`NarReader`] is read on a blocking thread): the path's validity is looked at and its root
/// opened at the first read. Errors name the path on disk.
struct DumpedNar {
    store: Arc<LocalStore>,
    path: StorePath,
    dump: Option<NarDump>,
}

impl io::Read for DumpedNar {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let dump = match &mut self.dump {
            Some(dump) => dump,
            None => self.dump.insert(self.store.nar_dump(&self.path).map_err(io::Error::other)?),
        };
        dump.read(buf).map_err(|e| io::Error::new(e.kind(), format!("dumping {}: {e}", self.store.real_path(&self.path).display())))
    }
}
