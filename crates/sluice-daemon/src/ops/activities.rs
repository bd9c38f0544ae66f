//! The activities and results Nix's worker sends while it substitutes paths, so that a
//! client's progress bar (and nix-output-monitor) shows through `sluice daemon` what it shows
//! through `nix-daemon`: `actRealise`, `actBuilds` and `actCopyPaths` with the counts and
//! expected sizes of `Worker::updateProgress` (`build/worker.cc`); per path, `actSubstitute`
//! naming the cache (`build/substitution-goal.cc`) and below it `actCopyPath`, "copying path
//! 'P' from 'CACHE'" with the destination store's URI and the NAR's progress
//! (`store-api.cc`'s `copyStorePath`), and below that, for an HTTP cache, `actFileTransfer`,
//! "downloading 'NAR URL'" with the bytes downloaded (`filetransfer.cc`). Byte progress is
//! sent while a NAR streams, as often as the substitution pipeline reports it (every 50 ms).

use std::collections::BTreeMap;
use std::io::{self, Write};

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::{ActivityField, StderrWriter};

use crate::substitution::Progress;
use crate::Daemon;

/// Nix's `ActivityType` and `ResultType` numbers (`logging.hh`).
const ACT_COPY_PATH: u64 = 100;
const ACT_FILE_TRANSFER: u64 = 101;
const ACT_REALISE: u64 = 102;
const ACT_COPY_PATHS: u64 = 103;
const ACT_BUILDS: u64 = 104;
const ACT_SUBSTITUTE: u64 = 108;
const RES_PROGRESS: u64 = 105;
const RES_SET_EXPECTED: u64 = 106;
/// Nix's `lvlInfo`: `actCopyPath`'s level.
const LVL_INFO: u64 = 3;
/// Nix's `lvlTalkative`: `actFileTransfer`'s level.
const LVL_TALKATIVE: u64 = 4;

/// The URI Nix 2.8's `LocalStore::getUri` gives the destination, whatever its root.
const LOCAL_URI: &str = "local";

/// The activities of a path whose NAR is coming, and its download and NAR sizes.
struct Running {
    substitute: u64,
    copy: u64,
    /// `actFileTransfer`, for an HTTP cache's NAR.
    transfer: Option<u64>,
    download: u64,
    nar: u64,
}

/// A substitution's activities on one connection: the worker's three and each running path's
/// two (its `actSubstitute` and `actCopyPath`), with the counts the worker reports.
pub(super) struct SubstitutionActivities<'a> {
    stderr: StderrWriter,
    daemon: &'a Daemon,
    dir: StoreDir,
    realise: u64,
    builds: u64,
    copy_paths: u64,
    /// Paths whose NAR is coming: their activities.
    running: BTreeMap<StorePath, Running>,
    /// Download and NAR sizes of the queued paths.
    sizes: BTreeMap<StorePath, (u64, u64)>,
    expected: u64,
    done: u64,
    failed: u64,
    download_bytes: u64,
    nar_bytes: u64,
}

impl<'a> SubstitutionActivities<'a> {
    /// Starts the worker's activities (`Worker::Worker`).
    pub(super) fn start(w: &mut dyn Write, stderr: StderrWriter, daemon: &'a Daemon, dir: StoreDir) -> io::Result<Self> {
        let [realise, builds, copy_paths] = [(); 3].map(|()| daemon.activity_id());
        for (id, kind) in [(realise, ACT_REALISE), (builds, ACT_BUILDS), (copy_paths, ACT_COPY_PATHS)] {
            stderr.start_activity(w, id, 0, kind, "", &[], 0)?;
        }
        let activities = SubstitutionActivities {
            stderr,
            daemon,
            dir,
            realise,
            builds,
            copy_paths,
            running: BTreeMap::new(),
            sizes: BTreeMap::new(),
            expected: 0,
            done: 0,
            failed: 0,
            download_bytes: 0,
            nar_bytes: 0,
        };
        activities.update(w)?;
        Ok(activities)
    }

    /// Reports `p`: a queued path raises the expected counts and sizes, a path whose NAR
    /// starts coming from a cache gets its two activities (again for a further attempt, from
    /// another cache), a path done or failed ends them.
    pub(super) fn report(&mut self, w: &mut dyn Write, p: Progress) -> io::Result<()> {
        match p {
            Progress::Queued { path, download, nar } => {
                self.expected += 1;
                self.download_bytes += download;
                self.nar_bytes += nar;
                self.sizes.insert(path, (download, nar));
            }
            Progress::Started { path, cache } => {
                self.stop_path(w, &path, false)?;
                let (download, nar) = self.sizes.get(&path).copied().unwrap_or((0, 0));
                let (substitute, copy) = (self.daemon.activity_id(), self.daemon.activity_id());
                let shown = self.dir.display_path(&path);
                let fields = [ActivityField::Str(shown.clone()), ActivityField::Str(cache.clone())];
                self.stderr.start_activity(w, substitute, 0, ACT_SUBSTITUTE, "", &fields, 0)?;
                let text = format!("copying path '{shown}' from '{cache}'");
                let fields = [ActivityField::Str(shown), ActivityField::Str(cache), ActivityField::Str(LOCAL_URI.to_owned())];
                self.stderr.start_activity(w, copy, LVL_INFO, ACT_COPY_PATH, &text, &fields, substitute)?;
                self.running.insert(path, Running { substitute, copy, transfer: None, download, nar });
            }
            Progress::Fetching { path, url } => {
                let Some(running) = self.running.get_mut(&path) else { return Ok(()) };
                let transfer = self.daemon.activity_id();
                let text = format!("downloading '{url}'");
                self.stderr.start_activity(
                    w,
                    transfer,
                    LVL_TALKATIVE,
                    ACT_FILE_TRANSFER,
                    &text,
                    &[ActivityField::Str(url)],
                    running.copy,
                )?;
                running.transfer = Some(transfer);
                return Ok(());
            }
            Progress::Bytes { path, downloaded, unpacked } => {
                let Some(running) = self.running.get(&path) else { return Ok(()) };
                if let Some(transfer) = running.transfer {
                    self.stderr.result(w, transfer, RES_PROGRESS, &[downloaded, running.download, 0, 0].map(ActivityField::Int))?;
                }
                return self.stderr.result(w, running.copy, RES_PROGRESS, &[unpacked, running.nar, 0, 0].map(ActivityField::Int));
            }
            Progress::Done(path) => {
                self.stop_path(w, &path, true)?;
                self.done += 1;
            }
            Progress::Failed(path) => {
                self.stop_path(w, &path, false)?;
                self.failed += 1;
            }
        }
        self.update(w)
    }

    /// Ends `path`'s activities, if it has any; `copied`: its whole NAR arrived first.
    fn stop_path(&mut self, w: &mut dyn Write, path: &StorePath, copied: bool) -> io::Result<()> {
        let Some(Running { substitute, copy, transfer, download, nar }) = self.running.remove(path) else { return Ok(()) };
        if let Some(transfer) = transfer {
            if copied {
                self.stderr.result(w, transfer, RES_PROGRESS, &[download, download, 0, 0].map(ActivityField::Int))?;
            }
            self.stderr.stop_activity(w, transfer)?;
        }
        if copied {
            self.stderr.result(w, copy, RES_PROGRESS, &[nar, nar, 0, 0].map(ActivityField::Int))?;
        }
        self.stderr.stop_activity(w, copy)?;
        self.stderr.stop_activity(w, substitute)
    }

    /// `Worker::updateProgress`: the builds (none), the substitutions done, expected, running
    /// and failed, and the download and NAR sizes expected.
    fn update(&self, w: &mut dyn Write) -> io::Result<()> {
        let substitutions = [self.done, self.expected, self.running.len() as u64, self.failed];
        self.stderr.result(w, self.builds, RES_PROGRESS, &[0, 0, 0, 0].map(ActivityField::Int))?;
        self.stderr.result(w, self.copy_paths, RES_PROGRESS, &substitutions.map(ActivityField::Int))?;
        for (kind, bytes) in [(ACT_FILE_TRANSFER, self.download_bytes), (ACT_COPY_PATH, self.nar_bytes)] {
            self.stderr.result(w, self.realise, RES_SET_EXPECTED, &[kind, bytes].map(ActivityField::Int))?;
        }
        Ok(())
    }

    /// Ends every activity still running and the worker's.
    pub(super) fn finish(mut self, w: &mut dyn Write) -> io::Result<()> {
        for path in self.running.keys().cloned().collect::<Vec<_>>() {
            self.stop_path(w, &path, false)?;
        }
        for id in [self.copy_paths, self.builds, self.realise] {
            self.stderr.stop_activity(w, id)?;
        }
        Ok(())
    }
}
