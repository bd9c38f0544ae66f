//! Verifying paths of any store (`sluice store verify`; Nix's `nix store verify`,
//! `src/nix/verify.cc`, which checks a path's NAR hash and signatures). A binary cache is
//! checked from its files, never from what a reader remembers of them: each narinfo is
//! fetched and must parse and describe its path, be vouched for by the signature policy (the
//! verification boundary's [`SignaturePolicy::vouch`]: a trusted signature or a content
//! address), its NAR must exist with the narinfo's `FileSize` and, with contents checked, its
//! bytes must have `FileHash` and decompress to a NAR of `NarHash` and `NarSize`; every
//! reference must have a narinfo (the closure is complete). Any other store (a local store's
//! paths, a daemon) is checked through the [`Store`] interface: the path is valid, built there
//! (`ultimate`) or vouched for, and with contents checked its NAR has the registered hash and
//! size. Paths are checked at once, as many as the store serves in parallel, the closure
//! followed as it is found.
//!
//! [`repair`] mends a cache from another store: what is missing is copied
//! ([`crate::push::copy_closures`]: references before referrers), what is broken is added
//! again from its NAR there (its broken NAR file removed first, as the upload keeps a file
//! of the same name).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Read;
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use sluice_binary_cache::BinaryCache;
use sluice_compress::Compression;
use sluice_local_store::{untrusted_detail, LocalStoreError, SignaturePolicy};
use sluice_nix::hash::{HashAlgo, Hasher};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::store::{Store, StoreError};

mod nar_file;

/// The store whose paths are verified.
#[derive(Clone)]
pub enum Target {
    /// A binary cache, checked from its files.
    Cache(Arc<BinaryCache>),
    /// Any other store, through its interface.
    Store(Arc<dyn Store>),
}

impl Target {
    /// The store as a [`Store`].
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Target::Cache(c) => c.clone(),
            Target::Store(s) => s.clone(),
        }
    }

    /// Paths checked at once: a cache's requests in flight, and with contents checked, as
    /// many NARs as keep the cores busy (a local store's are hashed on the cores too).
    fn jobs(&self, check_contents: bool) -> usize {
        let cores = sluice_compress::cores();
        match (self, check_contents) {
            (Target::Cache(c), false) => c.capacity().min(64),
            (Target::Cache(c), true) => c.capacity().min(2 * cores + 2),
            (Target::Store(s), _) => s.parallelism().clamp(1, 2 * cores + 2),
        }
    }
}

/// What to check.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Hash the NARs (and a cache's compressed files).
    pub check_contents: bool,
    /// Who must vouch for each path; `None` checks no signatures (`--no-trust`).
    pub trust: Option<SignaturePolicy>,
    /// Check the closures of the paths, not only the paths.
    pub recursive: bool,
}

/// What a verification found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Paths checked (those that exist, and the paths asked for).
    pub checked: usize,
    /// Each bad path, with every thing wrong with it.
    pub bad: BTreeMap<StorePath, Vec<String>>,
    /// Bad paths whose own narinfo or NAR is wrong (not only a reference missing).
    pub broken: BTreeSet<StorePath>,
    /// Paths that have no narinfo (not valid): asked for, or a reference of a path checked.
    pub missing: BTreeSet<StorePath>,
    /// The NAR file each broken path's narinfo names, where it parsed.
    pub nar_files: BTreeMap<StorePath, String>,
    /// Failures that are no one path's.
    pub errors: Vec<String>,
}

/// One path's check.
struct Checked {
    path: StorePath,
    /// `false` when the store has no narinfo (is not valid).
    exists: bool,
    problems: Vec<String>,
    references: Vec<StorePath>,
    nar_file: Option<String>,
}

/// Verifies `roots` (with `recursive`, their closures) in `target` (see the module
/// documentation).
pub async fn verify(target: &Target, roots: &[StorePath], opts: &VerifyOptions) -> VerifyReport {
    let store = target.store();
    let dir = store.store_dir().clone();
    let mut seen: BTreeSet<StorePath> = roots.iter().cloned().collect();
    let mut queue: VecDeque<StorePath> = seen.iter().cloned().collect();
    let mut running = FuturesUnordered::new();
    let mut checked = Vec::new();
    let jobs = target.jobs(opts.check_contents);
    loop {
        while running.len() < jobs {
            let Some(path) = queue.pop_front() else { break };
            running.push(check(target, &dir, path, opts));
        }
        let Some(done) = running.next().await else { break };
        if opts.recursive {
            for r in &done.references {
                if seen.insert(r.clone()) {
                    queue.push_back(r.clone());
                }
            }
        }
        checked.push(done);
    }
    let exists: BTreeSet<StorePath> = checked.iter().filter(|c| c.exists).map(|c| c.path.clone()).collect();
    let mut report = VerifyReport::default();
    report.missing.extend(checked.iter().filter(|c| !c.exists).map(|c| c.path.clone()));
    // References not checked themselves: only whether they are there.
    let others: BTreeSet<StorePath> = checked.iter().flat_map(|c| c.references.iter()).filter(|r| !seen.contains(*r)).cloned().collect();
    let others: Vec<StorePath> = others.into_iter().collect();
    let present = match store.query_valid_paths(&others).await {
        Ok(present) => present,
        Err(e) => {
            report.errors.push(format!("asking whether the references of the paths checked are there: {e}"));
            others.iter().cloned().collect()
        }
    };
    report.missing.extend(others.iter().filter(|r| !present.contains(*r)).cloned());
    let roots: BTreeSet<&StorePath> = roots.iter().collect();
    for c in checked {
        if !c.exists && !roots.contains(&c.path) {
            continue;
        }
        report.checked += 1;
        let mut problems = c.problems;
        if !problems.is_empty() {
            report.broken.insert(c.path.clone());
            if let Some(file) = c.nar_file {
                report.nar_files.insert(c.path.clone(), file);
            }
        }
        for r in c.references.iter().filter(|r| report.missing.contains(*r) && !exists.contains(*r)) {
            problems.push(format!("its reference {} is missing from the store", dir.display_path(r)));
        }
        if !problems.is_empty() {
            report.bad.insert(c.path, problems);
        }
    }
    report
}

/// Checks one path.
async fn check(target: &Target, dir: &StoreDir, path: StorePath, opts: &VerifyOptions) -> Checked {
    let mut c = Checked { path, exists: true, problems: Vec::new(), references: Vec::new(), nar_file: None };
    match target {
        Target::Cache(cache) => check_narinfo(cache, dir, &mut c, opts).await,
        Target::Store(store) => check_in_store(store.as_ref(), dir, &mut c, opts).await,
    }
    c
}

/// The signature check of `info`; `None` when it is vouched for (or was built in the store).
/// An unsigned path is "untrusted", as `nix store verify` says (`src/nix/verify.cc`): nothing is
/// being added.
fn untrusted(dir: &StoreDir, info: &ValidPathInfo, opts: &VerifyOptions) -> Option<String> {
    let policy = opts.trust.as_ref()?;
    if info.ultimate {
        return None;
    }
    policy.vouch(dir, info).err().map(|e| match e {
        LocalStoreError::Untrusted { path, signers, trusted } => {
            format!("path '{path}' is untrusted ({})", untrusted_detail(&signers, &trusted))
        }
        LocalStoreError::UnsignedFalseCa { path, ca, implied } => {
            format!("path '{path}' is untrusted (it claims to be content-addressed but isn't: its content address {ca} implies {implied})")
        }
        e => e.to_string(),
    })
}

/// A cache's path, from its narinfo and NAR file.
async fn check_narinfo(cache: &BinaryCache, dir: &StoreDir, c: &mut Checked, opts: &VerifyOptions) {
    let text = match cache.narinfo_text(&c.path).await {
        Ok(Some(text)) => text,
        Ok(None) => {
            c.exists = false;
            return c.problems.push(format!("{} has no narinfo", cache.narinfo_url(&c.path)));
        }
        Err(e) => return c.problems.push(e.to_string()),
    };
    let narinfo = match cache.parse_narinfo(&c.path, dir, &text) {
        Ok(narinfo) => narinfo,
        Err(e) => return c.problems.push(e.to_string()),
    };
    c.references = narinfo.references.iter().filter(|r| **r != c.path).cloned().collect();
    c.nar_file = Some(narinfo.url.clone());
    c.problems.extend(untrusted(dir, &ValidPathInfo::from_narinfo(&narinfo, 0), opts));
    let nar_url = cache.nar_url(&narinfo);
    match opts.check_contents {
        true => c.problems.extend(check_nar_file(cache, &narinfo).await.err()),
        false => match cache.object_size(&narinfo.url).await {
            Err(e) => c.problems.push(e.to_string()),
            Ok(None) => c.problems.push(format!("its NAR {nar_url} is missing")),
            Ok(Some(size)) => match narinfo.file_size {
                Some(expected) if expected != size => {
                    c.problems.push(format!("its NAR {nar_url} is {size} bytes, not the narinfo's FileSize {expected}"))
                }
                None if size == 0 => c.problems.push(format!("its NAR {nar_url} is empty")),
                _ => {}
            },
        },
    }
}

/// Reads a narinfo's NAR file whole: its size and hash must be `FileSize` and `FileHash`,
/// and it must decompress to a NAR of `NarSize` and `NarHash`. The error says what differs.
async fn check_nar_file(cache: &BinaryCache, narinfo: &NarInfo) -> Result<(), String> {
    let nar_url = cache.nar_url(narinfo);
    let stream = cache.open_nar(narinfo).await.map_err(|e| e.to_string())?.ok_or_else(|| format!("its NAR {nar_url} is missing"))?;
    let expected = nar_file::Expected {
        compression: Compression::parse(&narinfo.compression).map_err(|e| format!("{nar_url}: {e}"))?,
        file_algo: narinfo.file_hash.as_ref().map_or(HashAlgo::Sha256, |h| h.algo()),
        file_size: narinfo.file_size,
        nar_algo: narinfo.nar_hash.algo(),
        nar_size: narinfo.nar_size,
    };
    let read = tokio::task::spawn_blocking(move || nar_file::read(stream.reader, &expected)).await;
    let nar_file::NarFile { decoded, file_hash, file_size } =
        read.map_err(|e| e.to_string()).and_then(|r| r).map_err(|e| format!("{nar_url}: {e}"))?;
    let mut wrong = Vec::new();
    if narinfo.file_size.is_some_and(|s| s != file_size) {
        wrong.push(format!("is {file_size} bytes, not the narinfo's FileSize {}", narinfo.file_size.unwrap_or_default()));
    }
    if narinfo.file_hash.as_ref().is_some_and(|h| *h != file_hash) {
        let expected = narinfo.file_hash.as_ref().map(|h| h.to_nix32_prefixed()).unwrap_or_default();
        wrong.push(format!("has hash {}, not the narinfo's FileHash {expected}", file_hash.to_nix32_prefixed()));
    }
    match decoded {
        Err(e) => wrong.push(format!("does not decompress ({}): {e}", narinfo.compression)),
        Ok((size, hash)) => {
            if size != narinfo.nar_size {
                wrong.push(format!("holds a NAR of {size} bytes, not the narinfo's NarSize {}", narinfo.nar_size));
            }
            if hash != narinfo.nar_hash {
                let expected = narinfo.nar_hash.to_nix32_prefixed();
                wrong.push(format!("holds a NAR of hash {}, not the narinfo's NarHash {expected}", hash.to_nix32_prefixed()));
            }
        }
    }
    match wrong.is_empty() {
        true => Ok(()),
        false => Err(format!("its NAR {nar_url} {}", wrong.join(", "))),
    }
}

/// A path of any store, through its interface.
async fn check_in_store(store: &dyn Store, dir: &StoreDir, c: &mut Checked, opts: &VerifyOptions) {
    let info = match store.query_path_infos(std::slice::from_ref(&c.path)).await {
        Ok(mut infos) => match infos.pop().flatten() {
            Some(found) => found.info,
            None => {
                c.exists = false;
                return c.problems.push(format!("{} is not valid in {}", dir.display_path(&c.path), store.url()));
            }
        },
        Err(e) => return c.problems.push(e.to_string()),
    };
    c.references = info.references.iter().filter(|r| **r != c.path).cloned().collect();
    c.problems.extend(untrusted(dir, &info, opts));
    if !opts.check_contents {
        return;
    }
    let nar = match store.nar_from_path(&info).await {
        Ok(nar) => nar,
        Err(e) => return c.problems.push(e.to_string()),
    };
    let algo = info.nar_hash.algo();
    let hashed = tokio::task::spawn_blocking(move || {
        let mut nar: Box<dyn Read + Send> = nar;
        let mut hasher = Hasher::new(algo);
        std::io::copy(&mut nar, &mut hasher).map(|_| hasher)
    })
    .await;
    match hashed {
        Ok(Ok(hasher)) => {
            let (size, hash) = (hasher.len(), hasher.finish());
            if hash != info.nar_hash || size != info.nar_size {
                c.problems.push(format!(
                    "was modified: expected hash {} ({} bytes), got {} ({size} bytes)",
                    info.nar_hash.to_nix32_prefixed(),
                    info.nar_size,
                    hash.to_nix32_prefixed()
                ));
            }
        }
        Ok(Err(e)) => c.problems.push(format!("reading its NAR: {e}")),
        Err(e) => c.problems.push(format!("reading its NAR: {e}")),
    }
}

/// Mends the cache `cache` from `from` after `report` (see the module documentation). Returns
/// the paths that could not be mended, with why.
pub async fn repair(cache: Arc<BinaryCache>, from: Arc<dyn Store>, report: &VerifyReport) -> BTreeMap<StorePath, String> {
    let dst: Arc<dyn Store> = cache.clone();
    let dir = dst.store_dir().clone();
    let mut failed = BTreeMap::new();
    let missing: Vec<StorePath> = report.missing.iter().cloned().collect();
    if !missing.is_empty() {
        match crate::push::copy_closures(from.clone(), dst.clone(), &missing).await {
            Ok(copied) => failed.extend(copied.failed.into_iter().map(|(p, f)| (p, f.message))),
            Err(e) => failed.extend(missing.iter().map(|p| (p.clone(), e.to_string()))),
        }
    }
    let readd = report.broken.iter().filter(|p| !report.missing.contains(*p)).map(|path| {
        let (cache, from, dst, dir) = (cache.clone(), from.clone(), dst.clone(), dir.clone());
        async move {
            let outcome: Result<(), StoreError> = async {
                let info = from
                    .query_path_infos(std::slice::from_ref(path))
                    .await?
                    .pop()
                    .flatten()
                    .ok_or_else(|| StoreError::NotValid { url: from.url().to_string(), path: dir.display_path(path) })?;
                if let Some(file) = report.nar_files.get(path) {
                    cache.delete_object(file).await?;
                }
                let nar = from.nar_from_path(&info.info).await?;
                let ready: crate::store::PublishGate = Box::pin(async { Ok(()) });
                dst.add_to_store(ValidPathInfo { ultimate: false, ..info.info }, nar, ready).await
            }
            .await;
            (path.clone(), outcome)
        }
    });
    let mut readd: FuturesUnordered<_> = readd.collect();
    while let Some((path, outcome)) = readd.next().await {
        if let Err(e) = outcome {
            failed.insert(path, e.to_string());
        }
    }
    failed
}
