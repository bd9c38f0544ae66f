//! Substitution progress, fed by the pipeline's observer calls, in the run's log format
//! ([`crate::log`]): a progress line redrawn on a terminal (Nix's `progress-bar.cc` draws one
//! too), `copying path 'X' from 'URL'...` lines as Nix's simple logger prints them, or Nix's
//! JSON activities (one `actCopyPaths` for the copy, one `actCopyPath` per path), as Nix 2.26's
//! `copyPaths` (`store-api.cc`) starts them: each `actCopyPath` with parent 0 (Nix starts them
//! on its thread pool, where no activity is current) and fields `[path, from URL, "local"]`
//! (`LocalStore::getUri`). Where sluice differs: the closure is queried while paths arrive, so
//! the copy's text is `copying paths` without Nix's count, and `resSetExpected` and the
//! expected count of `resProgress` grow as paths are queued.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::failure::Failure;
use sluice_store::substitute::Observer;

use crate::log::{act, res, Activity, Log, LVL_INFO, LVL_WARN};

/// A local store's URI as Nix 2.26 names it in `actCopyPath` (`LocalStore::getUri`), whatever
/// its root.
const LOCAL_STORE_URI: &str = "local";
/// The widest the progress line gets, in columns (narrower on a narrower terminal).
const MAX_WIDTH: usize = 80;
/// The span over which a cache's current rate is measured.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// How often the progress line is redrawn.
const TICK: Duration = Duration::from_millis(200);

/// Renders substitution progress on standard error.
pub struct Progress {
    bar: Option<ProgressBar>,
    log: Log,
    store_dir: StoreDir,
    state: Mutex<State>,
    /// The copy's `actCopyPaths` activity.
    top: Activity,
}

/// What is known so far. Byte counts are compressed (downloaded) bytes.
#[derive(Default)]
struct State {
    /// Paths queued for substitution so far (the total grows while the closure is queried).
    known: u64,
    /// Their download sizes, summed.
    known_bytes: u64,
    /// Their NAR sizes, summed.
    known_nar: u64,
    done: u64,
    failed: u64,
    /// Paths whose NAR is arriving, with their `actCopyPath` activity.
    running: HashMap<StorePath, Activity>,
    downloaded: u64,
    /// Bytes per cache URL so far, and samples (time, bytes) of the last [`RATE_WINDOW`].
    caches: BTreeMap<String, (u64, VecDeque<(Instant, u64)>)>,
    finished: bool,
}

impl Progress {
    /// Starts showing the progress of a copy into a local store. With `json` (a `--json`
    /// report on standard output), nothing but errors and warnings is shown.
    pub fn start(store_dir: StoreDir, json: bool) -> Arc<Self> {
        let log = Log::get();
        let bar = (log.bar() && !json).then(line_bar);
        let top = Activity::start(LVL_INFO, act::COPY_PATHS, "copying paths", json!([]), 0);
        let progress = Arc::new(Progress { bar, log, store_dir, state: Mutex::new(State::default()), top });
        if progress.bar.is_some() {
            let weak = Arc::downgrade(&progress);
            std::thread::spawn(move || tick(weak));
        }
        progress
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the progress line before the summary is printed.
    pub fn finish(&self) {
        self.state().finished = true;
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// Leaves the progress line as it was, followed by "interrupted" (Ctrl-C).
    pub fn interrupted(&self) {
        let line = {
            let mut state = self.state();
            state.finished = true;
            state.running.clear();
            state.line(terminal_width().saturating_sub(" interrupted".len()))
        };
        if let Some(bar) = &self.bar {
            bar.abandon_with_message(format!("{line} interrupted"));
        }
    }

    /// Prints `text` at `level` without tearing the progress line.
    pub fn msg(&self, level: u8, text: &str) {
        self.above_bar(|| self.log.msg(level, text));
    }

    /// Prints the error `what` ([`Log::error`]) without tearing the progress line.
    pub fn error(&self, what: &str) {
        self.above_bar(|| self.log.error(what));
    }

    fn above_bar(&self, print: impl FnOnce()) {
        match &self.bar {
            Some(bar) => bar.suspend(print),
            None => print(),
        }
    }

    fn redraw(&self) {
        if let Some(bar) = &self.bar {
            let mut state = self.state();
            if !state.finished {
                state.sample(Instant::now());
                bar.set_message(state.line(terminal_width()));
            }
        }
    }

    fn report_counts(&self, state: &State) {
        self.top.progress(state.done, state.known, state.running.len() as u64, state.failed);
    }
}

/// Redraws the line every [`TICK`] (so that rates fall when bytes stop) until the copy ends.
fn tick(progress: Weak<Progress>) {
    while let Some(p) = progress.upgrade() {
        if p.state().finished {
            return;
        }
        p.redraw();
        drop(p);
        std::thread::sleep(TICK);
    }
}

/// The width the progress line may take: [`MAX_WIDTH`], or the terminal's when narrower, less
/// the last column (a line that fills it wraps on some terminals).
fn terminal_width() -> usize {
    let (_, cols) = console::Term::stderr().size();
    (cols as usize).min(MAX_WIDTH).saturating_sub(1)
}

impl State {
    /// Records a rate sample per cache at `now`, dropping samples older than the window.
    fn sample(&mut self, now: Instant) {
        for (bytes, samples) in self.caches.values_mut() {
            samples.push_back((now, *bytes));
            while samples.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
                samples.pop_front();
            }
        }
    }

    /// The progress line, at most `width` columns: paths done/running/known and failed,
    /// bytes downloaded of those known, and each cache's current rate (as many caches as fit).
    fn line(&self, width: usize) -> String {
        let mut line = format!("[{}/{}/{} paths", self.done, self.running.len(), self.known);
        if self.failed > 0 {
            line += &format!(", {} failed", self.failed);
        }
        line += &format!("] {} of {} DL", human_bytes(self.downloaded), human_bytes(self.known_bytes.max(self.downloaded)));
        for (url, (_, samples)) in &self.caches {
            if let (Some((t0, b0)), Some((t1, b1))) = (samples.front(), samples.back()) {
                let secs = t1.duration_since(*t0).as_secs_f64();
                let rate = if secs > 0.0 { (b1 - b0) as f64 / secs } else { 0.0 };
                let host = url.split("://").nth(1).unwrap_or(url).trim_end_matches('/');
                let part = format!(", {host} {}/s", human_bytes(rate as u64));
                if line.chars().count() + part.chars().count() > width {
                    break;
                }
                line += &part;
            }
        }
        truncate(&line, width)
    }
}

/// A progress line that shows its message only (cut by [`fit`] to the width it may take).
pub fn line_bar() -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{msg}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
    bar
}

/// `line` cut to the width a progress line may take ([`terminal_width`]).
pub fn fit(line: &str) -> String {
    truncate(line, terminal_width())
}

/// `s` cut to `width` characters, with "…" as its last when cut.
fn truncate(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    let mut cut: String = s.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Bytes in a MiB.
pub const MIB: f64 = 1024.0 * 1024.0;

/// `bytes` in MiB (GiB from 1 GiB on), with one decimal, as Nix's progress bar shows sizes.
pub fn human_bytes(bytes: u64) -> String {
    let mib = bytes as f64 / MIB;
    if mib >= 1024.0 {
        format!("{:.1} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

impl Observer for Progress {
    fn queued(&self, _path: &StorePath, download: u64, nar: u64) {
        let mut state = self.state();
        state.known += 1;
        state.known_bytes += download;
        state.known_nar += nar;
        self.report_counts(&state);
        // As Nix's `copyPaths`: the NAR bytes expected of the `actCopyPath` activities.
        self.top.result(res::SET_EXPECTED, json!([act::COPY_PATH, state.known_nar]));
    }

    fn started(&self, path: &StorePath, cache: &str) {
        let mut state = self.state();
        if state.running.contains_key(path) {
            return;
        }
        let shown = self.store_dir.display_path(path);
        let text = format!("copying path '{shown}' from '{cache}'");
        let activity = Activity::start(LVL_INFO, act::COPY_PATH, &text, json!([shown, cache, LOCAL_STORE_URI]), 0);
        state.running.insert(path.clone(), activity);
        state.caches.entry(cache.to_string()).or_default();
        self.report_counts(&state);
        drop(state);
        if self.bar.is_none() && self.log.format != crate::log::LogFormat::InternalJson {
            self.msg(LVL_INFO, &format!("{text}..."));
        }
    }

    fn downloaded(&self, cache: &str, bytes: u64) {
        let mut state = self.state();
        state.downloaded += bytes;
        state.caches.entry(cache.to_string()).or_default().0 += bytes;
    }

    fn done(&self, path: &StorePath, nar_size: u64) {
        let mut state = self.state();
        state.done += 1;
        if let Some(activity) = state.running.remove(path) {
            activity.progress(nar_size, nar_size, 0, 0);
        }
        self.report_counts(&state);
    }

    fn warning(&self, message: &str) {
        self.msg(LVL_WARN, &format!("warning: {message}"));
    }

    fn failed(&self, path: &StorePath, _reason: &Failure) {
        let mut state = self.state();
        state.failed += 1;
        state.running.remove(path);
        self.report_counts(&state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_fits_and_counts_failures_apart() {
        let mut state = State { known: 1056, known_bytes: 900 << 20, done: 1000, failed: 12, downloaded: 880 << 20, ..State::default() };
        let t0 = Instant::now();
        state.caches.insert("https://cache.nixos.org".into(), (0, VecDeque::new()));
        state.sample(t0);
        state.caches.get_mut("https://cache.nixos.org").unwrap().0 = 10 << 20;
        state.sample(t0 + Duration::from_secs(2));
        assert_eq!(state.line(200), "[1000/0/1056 paths, 12 failed] 880.0 MiB of 900.0 MiB DL, cache.nixos.org 5.0 MiB/s");
        // A cache's rate that does not fit is left out whole; a narrower terminal cuts the rest.
        assert_eq!(state.line(79), "[1000/0/1056 paths, 12 failed] 880.0 MiB of 900.0 MiB DL");
        assert_eq!(state.line(40), "[1000/0/1056 paths, 12 failed] 880.0 Mi…");
        assert_eq!(state.line(40).chars().count(), 40);
        // The rate is of the window only: samples older than it are gone.
        state.sample(t0 + Duration::from_secs(8));
        assert!(state.line(200).ends_with("cache.nixos.org 0.0 MiB/s"), "{}", state.line(200));
    }
}
