//! `sluice store verify`: Nix's `nix store verify` (`src/nix/verify.cc`) for any store, and
//! for a binary cache its files and closure too (`sluice_store::verify`); a local store's
//! `--all` is Nix's `nix-store --verify` (`LocalStore::verify_store`). One line per bad
//! path says what is wrong with it, then a summary; exit status 1 if anything is wrong.
//! `--repair` mends a cache from `--from`, and a local store by substituting its damaged paths
//! again (from `--from` or the substituters).

use std::process::ExitCode;
use std::sync::Arc;

use sluice_local_store::{LocalStore, Repairer, VerifyMessage};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::config::Settings;
use sluice_store::store::open_store;
use sluice_store::substitute::{repair_paths, Observer, SubstituteOptions};
use sluice_store::verify::{self, Target, VerifyOptions, VerifyReport};

use crate::setup::{self, CacheFlags};

/// Arguments of `sluice store verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The store or binary cache to verify [default: the `store` setting].
    #[arg(long)]
    store: Option<String>,
    /// Hash every NAR (and a cache's compressed files) against what its narinfo or
    /// registration says.
    #[arg(long)]
    check_contents: bool,
    /// Mend what is wrong: a cache from `--from`, a local store by substituting again.
    #[arg(long)]
    repair: bool,
    /// The store or cache to repair from (for a local store: instead of the substituters).
    #[arg(long)]
    from: Option<String>,
    /// Verify the closures of the paths.
    #[arg(short, long)]
    recursive: bool,
    /// Verify every path: every narinfo of a `file://` or S3 cache, the whole of a local store.
    #[arg(long)]
    all: bool,
    /// Do not check signatures.
    #[arg(long)]
    no_trust: bool,
    #[command(flatten)]
    cache: CacheFlags,
    /// Store paths to verify.
    paths: Vec<String>,
}

/// Runs `sluice store verify`.
pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.paths.is_empty() && !args.all {
        return Err("name the store paths to verify, or give --all".into());
    }
    let settings = setup::settings(&args.cache)?;
    let url = args.store.clone().unwrap_or_else(|| settings.store.clone());
    if args.all && setup::local_config(&url).is_ok() {
        return verify_local_store(&args, &url);
    }
    let rt = setup::runtime()?;
    let code = rt.block_on(verify_paths(&args, &url, &settings));
    setup::leave_runtime(rt);
    code
}

/// Verifies paths of any store (see the module documentation).
async fn verify_paths(args: &Args, url: &str, settings: &Settings) -> Result<ExitCode, String> {
    let trust = match args.no_trust {
        true => None,
        false => Some(settings.signature_policy(Some(true)).map_err(|e| e.to_string())?),
    };
    let opts = VerifyOptions { check_contents: args.check_contents, trust, recursive: args.recursive };
    let (target, mut unreadable) = match super::open_cache(url, settings).await? {
        Some(cache) => (Target::Cache(cache), Vec::new()),
        None => (Target::Store(open_store(url, settings).await.map_err(|e| e.to_string())?), Vec::new()),
    };
    let dir = target.store().store_dir().clone();
    let roots = match (&target, args.all) {
        (Target::Cache(cache), true) => {
            let (paths, errors) = sluice_store::binary_cache_store::all_cache_paths(cache).await.map_err(|e| e.to_string())?;
            unreadable = errors;
            paths
        }
        (Target::Store(_), true) => return Err(format!("{url}: --all lists only a local store, a file:// or an S3 cache; name the paths")),
        (_, false) => setup::parse_paths(&dir, &args.paths)?,
    };
    let report = verify::verify(&target, &roots, &opts).await;
    print_report(&dir, &report, &unreadable);
    let mut bad = report.bad.len() + unreadable.len() + report.errors.len();
    if args.repair && bad > 0 {
        let unmended = match &target {
            Target::Cache(cache) => {
                let from = args
                    .from
                    .as_deref()
                    .ok_or_else(|| format!("{url}: repairing a binary cache needs --from, a store that has the paths"))?;
                let from = open_store(from, settings).await.map_err(|e| e.to_string())?;
                verify::repair(cache.clone(), from, &report).await
            }
            Target::Store(_) => {
                let local = setup::local_config(url).map_err(|_| format!("{url}: only a binary cache or a local store can be repaired"))?;
                repair_local(args, settings, &local, &report).await?
            }
        };
        for (path, why) in &unmended {
            eprintln!("cannot repair {}: {why}", dir.display_path(path));
        }
        let mut again: Vec<StorePath> = roots.clone();
        again.extend(report.missing.iter().cloned());
        let after = verify::verify(&target, &again, &opts).await;
        eprintln!("after repair:");
        print_report(&dir, &after, &[]);
        bad = after.bad.len() + after.errors.len();
    }
    Ok(if bad == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Prints one line per bad path on standard output and the summary on standard error.
fn print_report(dir: &StoreDir, report: &VerifyReport, unreadable: &[String]) {
    for (path, problems) in &report.bad {
        println!("{}: {}", dir.display_path(path), problems.join("; "));
    }
    for line in unreadable.iter().chain(&report.errors) {
        println!("{line}");
    }
    eprintln!(
        "{} paths checked: {} bad, {} references missing, {} narinfos unreadable",
        report.checked,
        report.bad.len(),
        report.missing.len(),
        unreadable.len()
    );
}

/// No progress to show while repairing.
struct Quiet;
impl Observer for Quiet {}

/// Substitutes the broken paths of a local store again (from `--from` or the substituters).
async fn repair_local(
    args: &Args,
    settings: &Settings,
    config: &sluice_store::store_url::LocalStoreConfig,
    report: &VerifyReport,
) -> Result<std::collections::BTreeMap<StorePath, String>, String> {
    let store = LocalStore::open(config).map(Arc::new).map_err(|e| e.to_string())?;
    settings.configure_local_store(&store);
    let paths: Vec<StorePath> = report.broken.iter().cloned().collect();
    let (query, opts) = repair_query(args, settings, &store, &paths).await?;
    let done = repair_paths(query, store.clone(), store.temp_roots(), paths.clone(), opts, Arc::new(Quiet)).await;
    Ok(paths
        .into_iter()
        .filter(|p| !done.substituted.contains(p))
        .map(|p| {
            let why = done.failed.get(&p).map_or_else(|| "no substituter has it".to_owned(), |f| f.message.clone());
            (p, why)
        })
        .collect())
}

/// The closure query and options of a repair of `paths` in `store`.
async fn repair_query(
    args: &Args,
    settings: &Settings,
    store: &Arc<LocalStore>,
    paths: &[StorePath],
) -> Result<(sluice_store::closure::ClosureQuery, SubstituteOptions), String> {
    let (urls, caches) = match &args.from {
        Some(from) => (vec![from.clone()], setup::Caches::Named),
        None => (settings.substituters.clone(), setup::Caches::Substituters),
    };
    let is_valid = sluice_store::closure::validity_in(Some(store.clone()), Some(store.temp_roots()));
    let query = setup::closure_query(&urls, caches, settings, store.store_dir(), is_valid, paths).await?;
    let policy = settings.signature_policy(None).map_err(|e| e.to_string())?;
    Ok((query, SubstituteOptions { jobs: sluice_store::substitute::DEFAULT_JOBS, policy }))
}

/// `--all` of a local store: Nix's `nix-store --verify [--check-contents] [--repair]`.
fn verify_local_store(args: &Args, url: &str) -> Result<ExitCode, String> {
    let setup::Destination { settings, store, .. } = setup::destination(&args.cache, Some(url), &[])?;
    let rt = setup::runtime()?;
    let mut repairer = |path: &StorePath| {
        let done = rt.block_on(async {
            let (query, opts) = repair_query(args, &settings, &store, std::slice::from_ref(path)).await?;
            Ok::<_, String>(repair_paths(query, store.clone(), store.temp_roots(), vec![path.clone()], opts, Arc::new(Quiet)).await)
        })?;
        match done.failed.get(path) {
            Some(why) => Err(why.message.clone()),
            None if done.substituted.contains(path) => Ok(()),
            None => Err("no substituter has it".into()),
        }
    };
    let errors = store
        .verify_store(args.check_contents, args.repair.then_some(&mut repairer as Repairer<'_>), &mut |message| match message {
            VerifyMessage::Info(m) | VerifyMessage::Error(m) => eprintln!("{m}"),
            VerifyMessage::LoggedError(m) => eprintln!("error: {m}"),
            VerifyMessage::Warning(m) => eprintln!("warning: {m}"),
        })
        .map_err(|e| e.to_string())?;
    Ok(if errors { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
