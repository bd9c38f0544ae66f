//! `sluice missing`: what would be fetched for store paths, like `nix build --dry-run`
//! (Nix's `queryMissing` and `printMissing`, `src/libmain/shared.cc`).

use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::closure::{ClosureEvent, ClosureQuery, ValidityCheck};
use sluice_store::store::{open_store, Store};
use tokio::sync::mpsc;

use crate::progress::{fit, human_bytes, line_bar, MIB};
use crate::setup::{self, CacheFlags};

/// Arguments of `sluice missing`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The store the paths would be fetched into: a local store, a daemon or a binary cache
    /// [default: the `store` setting, whose default is `$NIX_REMOTE` or `auto`].
    #[arg(long)]
    store: Option<String>,
    /// Print `{"willSubstitute", "unknown", "downloadSize", "narSize"}` as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cache: CacheFlags,
    /// Store paths whose closures to examine.
    #[arg(required = true)]
    paths: Vec<String>,
}

/// Runs `sluice missing`.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let settings = setup::settings(&args.cache)?;
    let url = args.store.clone().unwrap_or_else(|| settings.store.clone());
    let rt = setup::runtime()?;
    let (mut fetch, mut unknown) = (BTreeSet::new(), BTreeSet::new());
    let (mut download, mut nar, mut valid) = (0u64, 0u64, 0u64);
    // On a terminal, a line of what the query found so far while it runs.
    let bar = crate::log::Log::get().bar().then(|| {
        let bar = line_bar();
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        bar
    });
    let engine = rt.block_on(async {
        // The destination is opened while the caches are asked (a fresh local store's
        // database is created meanwhile): its store directory is the one every destination
        // has (`store_url`), checked once it is open.
        let opening = tokio::spawn({
            let (url, settings) = (url.clone(), settings.clone());
            async move { open_store(&url, &settings).await.map_err(|e| e.to_string()) }
        });
        let opened = async { opening.await.map_err(|e| e.to_string())? };
        let store_dir = StoreDir::default();
        let roots = setup::parse_paths(&store_dir, &args.paths)?;
        let nothing: ValidityCheck = Arc::new(|_: &[StorePath]| HashSet::new());
        let query = setup::closure_query(&settings.substituters, setup::Caches::Substituters, &settings, &store_dir, nothing, &roots);
        let (dest, query) = tokio::try_join!(opened, query)?;
        if dest.store_dir() != &store_dir {
            return Err(format!("{url}: store directory {} is not {}", dest.store_dir().as_str(), store_dir.as_str()));
        }
        let query = ClosureQuery { is_valid: validity_in(dest), ..query };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let engine = tokio::spawn(async move { query.run(roots, tx).await });
        while let Some(event) = rx.recv().await {
            match event {
                ClosureEvent::Found { narinfo, .. } => {
                    download += narinfo.file_size.unwrap_or(0);
                    nar += narinfo.nar_size;
                    fetch.insert(store_dir.display_path(&narinfo.store_path));
                }
                ClosureEvent::Unknown(p) => {
                    unknown.insert(store_dir.display_path(&p));
                }
                ClosureEvent::Failed { path, errors } => {
                    for (_, e) in errors {
                        let warn = || crate::log::Log::get().msg(crate::log::LVL_WARN, &format!("warning: {e}"));
                        match &bar {
                            Some(bar) => bar.suspend(warn),
                            None => warn(),
                        }
                    }
                    unknown.insert(store_dir.display_path(&path));
                }
                ClosureEvent::Valid(_) => valid += 1,
            }
            if let Some(bar) = &bar {
                let line =
                    format!("querying: {} to fetch ({} DL), {valid} valid, {} unknown", fetch.len(), human_bytes(download), unknown.len());
                bar.set_message(fit(&line));
            }
        }
        Ok::<_, String>(engine)
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if args.json {
        let json = serde_json::json!({ "willSubstitute": fetch, "unknown": unknown, "downloadSize": download, "narSize": nar });
        println!("{json}");
    } else {
        report(&fetch, &unknown, download, nar);
    }
    // The answers are written to the disk cache while the report is: they are for later runs.
    rt.block_on(engine).map_err(|e| e.to_string())?;
    // Nothing is left running: the worker threads end with the process, not one by one.
    rt.shutdown_background();
    Ok(ExitCode::SUCCESS)
}

/// Writes what will be fetched and what is unknown to standard error, as Nix's
/// `printMissing` does.
fn report(fetch: &BTreeSet<String>, unknown: &BTreeSet<String>, download: u64, nar: u64) {
    // The report in one write: standard error is unbuffered, and a closure's list line by
    // line was three writes a path.
    let mut report = String::new();
    if !fetch.is_empty() {
        let n = fetch.len();
        let head = if n == 1 { "this path".to_string() } else { format!("these {n} paths") };
        let _ =
            writeln!(report, "{head} will be fetched ({:.2} MiB download, {:.2} MiB unpacked):", download as f64 / MIB, nar as f64 / MIB);
        fetch.iter().for_each(|p| report.extend(["  ", p, "\n"]));
    }
    if !unknown.is_empty() {
        report.push_str("don't know how to build these paths:\n");
        unknown.iter().for_each(|p| report.extend(["  ", p, "\n"]));
    }
    // A report that cannot be written (standard error closed) fails nothing the query did.
    let _ = std::io::stderr().lock().write_all(report.as_bytes());
}

/// The closure engine's validity check against `store` ([`Store::query_valid_paths`], waited
/// for on the engine's thread, which the runtime replaces meanwhile). A failed look-up is
/// logged and counts as "not valid".
fn validity_in(store: Arc<dyn Store>) -> ValidityCheck {
    let runtime = tokio::runtime::Handle::current();
    Arc::new(move |paths: &[StorePath]| -> HashSet<StorePath> {
        let valid = tokio::task::block_in_place(|| runtime.block_on(store.query_valid_paths(paths)));
        valid.map(|s| s.into_iter().collect()).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            HashSet::new()
        })
    })
}
