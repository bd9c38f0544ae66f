//! Progress rendering: a live bar on a terminal (paths done/total, bytes downloaded and
//! unpacked, the download rate of each cache), plain lines otherwise. Fed by the substitution
//! pipeline's observer calls.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::substitute::{Failure, Observer};

/// Renders substitution progress on standard error.
pub struct Progress {
    bar: Option<ProgressBar>,
    store_dir: StoreDir,
    downloaded: AtomicU64,
    unpacked: AtomicU64,
    /// Compressed bytes per cache URL.
    per_cache: Mutex<BTreeMap<String, u64>>,
    started: Instant,
}

impl Progress {
    /// A bar when standard error is a terminal (and `quiet` is off), plain lines otherwise.
    pub fn new(store_dir: StoreDir, quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} paths, {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        Progress {
            bar,
            store_dir,
            downloaded: AtomicU64::new(0),
            unpacked: AtomicU64::new(0),
            per_cache: Mutex::new(BTreeMap::new()),
            started: Instant::now(),
        }
    }

    /// Compressed bytes downloaded so far.
    pub fn downloaded(&self) -> u64 {
        self.downloaded.load(Ordering::Relaxed)
    }

    /// Removes the bar before the summary is printed.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    fn message(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rates: Vec<String> = self
            .per_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(cache, bytes)| format!("{cache} {:.1} MiB/s", *bytes as f64 / MIB / secs))
            .collect();
        format!(
            "{:.1} MiB downloaded ({}), {:.1} MiB unpacked",
            self.downloaded() as f64 / MIB,
            rates.join(", "),
            self.unpacked.load(Ordering::Relaxed) as f64 / MIB
        )
    }
}

/// Bytes in a MiB.
pub const MIB: f64 = 1024.0 * 1024.0;

impl Observer for Progress {
    fn queued(&self, _path: &StorePath, _download: u64, _nar: u64) {
        if let Some(bar) = &self.bar {
            bar.inc_length(1);
        }
    }

    fn downloaded(&self, cache: &str, bytes: u64) {
        self.downloaded.fetch_add(bytes, Ordering::Relaxed);
        if self.bar.is_some() {
            *self.per_cache.lock().unwrap_or_else(|p| p.into_inner()).entry(cache.to_string()).or_default() += bytes;
        }
    }

    fn done(&self, path: &StorePath, nar_size: u64) {
        self.unpacked.fetch_add(nar_size, Ordering::Relaxed);
        match &self.bar {
            Some(bar) => {
                bar.inc(1);
                bar.set_message(self.message());
            }
            None => eprintln!("copied path '{}'", self.store_dir.display_path(path)),
        }
    }

    fn warning(&self, message: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("warning: {message}")),
            None => eprintln!("warning: {message}"),
        }
    }

    fn failed(&self, _path: &StorePath, _reason: &Failure) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }
}
