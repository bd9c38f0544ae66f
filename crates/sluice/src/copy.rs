//! `sluice copy`: copy the closures of store paths from binary caches into a local store (the
//! substitution pipeline), or from any store to any store through the `Store` interface
//! (`sluice_store::push`): a local store into a binary cache, one cache into another, a daemon
//! at either end.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::closure;
use sluice_store::failure::summarize;
use sluice_store::push;
use sluice_store::store::open_store;
use sluice_store::store_url::StoreUrl;
use sluice_store::substitute::{copy_closure, SubstituteOptions};

use crate::log::{Log, LVL_WARN};
use crate::progress::{Progress, MIB};
use crate::setup::{self, CacheFlags};

/// Arguments of `sluice copy`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The store to copy from [default: into a local store the `substituters`, by priority;
    /// into any other the `store` setting's store, as `nix copy --to`]: a binary cache, or any
    /// store (local, a daemon, `ssh-ng://`, `ssh://`). As with `nix copy --from`, its paths
    /// need a trusted signature even with `?trusted=true`, which applies to substituters only.
    #[arg(long)]
    from: Option<String>,
    /// The store to copy into: a local store (`local`, `local?root=DIR` or a path,
    /// with the local store's parameters: `state`, `real`, `log`, `require-sigs`, `read-only`,
    /// …) or a binary cache (`file://DIR`, `http(s)://…` by PUT, `s3://BUCKET?…`, with
    /// `compression`, `compression-level`, `parallel-compression`, `secret-key`,
    /// `write-nar-listing`) or a daemon (`daemon`, `unix://PATH`, `ssh-ng://[user@]host[:port]`)
    /// or `ssh://[user@]host[:port]` [default: the `store`
    /// setting, whose default is `$NIX_REMOTE` or `auto`].
    #[arg(long)]
    to: Option<String>,
    /// NAR downloads in flight at once, at least 1 (over HTTP/1.1, `http-connections` also
    /// bounds the requests to each cache).
    #[arg(long, default_value_t = sluice_store::substitute::DEFAULT_JOBS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    jobs: u32,
    /// Print a JSON report on standard output.
    #[arg(long)]
    json: bool,
    /// Copy every valid path of `--from` (a store that lists its paths: a local store).
    #[arg(long, requires = "from", conflicts_with = "paths")]
    all: bool,
    /// Read store paths from standard input too, separated by white space.
    #[arg(long)]
    stdin: bool,
    /// Copy the derivations of the paths (a `.drv` stands for itself, any other path for its
    /// deriver in `--from`), as Nix's `--derivation`.
    #[arg(long, requires = "from")]
    derivation: bool,
    /// Let the destination substitute paths from its `substituters` before they are copied
    /// from `--from` (into a local store).
    #[arg(short = 's', long)]
    substitute_on_destination: bool,
    #[command(flatten)]
    cache: CacheFlags,
    /// Store paths whose closures to copy.
    #[arg(required_unless_present_any = ["all", "stdin"])]
    paths: Vec<String>,
}

/// Runs `sluice copy`; exit status 0 only when every path asked for is valid in the destination.
/// From binary caches into a local store, the substitution pipeline copies; any other pair of
/// stores goes through the `Store` interface.
pub fn run(mut args: Args) -> Result<ExitCode, String> {
    args.paths = paths(&args)?;
    // Without --to, the `store` setting's local store.
    let into_local = args.to.as_deref().is_none_or(|t| StoreUrl::parse(t).is_ok_and(|u| u.as_local().is_some()));
    let from_cache = args.from.as_deref().is_none_or(|f| StoreUrl::parse(f).is_ok_and(|u| u.as_cache().is_some()));
    match into_local && from_cache {
        true => substitute(args),
        false => push(args),
    }
}

/// The paths to copy: those given (and with `--stdin` read), every valid path of `--from`
/// with `--all`, their derivations with `--derivation`.
fn paths(args: &Args) -> Result<Vec<String>, String> {
    let given = setup::with_stdin(args.paths.clone(), args.stdin)?;
    let Some(from) = args.from.as_deref().filter(|_| args.all || args.derivation) else { return Ok(given) };
    let settings = setup::settings(&args.cache)?;
    setup::runtime()?.block_on(async {
        let src = open_store(from, &settings).await.map_err(|e| e.to_string())?;
        let paths = match args.all {
            true => src.query_all_valid_paths().await.map_err(|e| e.to_string())?.into_iter().collect(),
            false => crate::path_info::derivations(src.as_ref(), setup::parse_paths(src.store_dir(), &given)?).await?,
        };
        Ok(paths.iter().map(|p| src.store_dir().display_path(p)).collect())
    })
}

/// Copies between any two stores through the `Store` interface.
/// Without `--to` into, without `--from` from, the `store` setting's store, as `nix copy`.
fn push(args: Args) -> Result<ExitCode, String> {
    let settings = setup::settings(&args.cache)?;
    let to = args.to.as_deref().unwrap_or(&settings.store);
    if args.substitute_on_destination {
        return Err(format!("{to}: --substitute-on-destination applies to copies from binary caches into a local store"));
    }
    let from = args.from.as_deref().unwrap_or(&settings.store);
    let started = Instant::now();
    let rt = setup::runtime()?;
    let (report, store_dir) = rt.block_on(async {
        let src = open_store(from, &settings).await.map_err(|e| e.to_string())?;
        let dst = open_store(to, &settings).await.map_err(|e| e.to_string())?;
        let roots = setup::parse_paths(src.store_dir(), &args.paths)?;
        let report = push::copy_closures(src.clone(), dst, &roots).await.map_err(|e| e.to_string())?;
        Ok::<_, String>((report, src.store_dir().clone()))
    })?;
    let secs = started.elapsed().as_secs_f64();
    for line in summarize(&store_dir, &report.failed, "copied") {
        Log::get().error(&line);
    }
    if args.json {
        print_report(&json_report(
            &store_dir,
            ("copied", &report.copied),
            report.already_valid,
            &report.failed,
            &[("narSize", report.nar_bytes)],
            secs,
        ))?;
    }
    eprintln!(
        "copied {} paths ({:.1} MiB) to {} in {:.2} s; {} already there, {} failed",
        report.copied.len(),
        report.nar_bytes as f64 / MIB,
        shown_url(to),
        secs,
        report.already_valid,
        report.failed.len()
    );
    Ok(if report.failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Substitutes from binary caches into a local store (the pipeline).
fn substitute(args: Args) -> Result<ExitCode, String> {
    let rt = setup::runtime()?;
    // Caught from here on: a copy interrupted while it opens the store or its caches stops as
    // cleanly as one interrupted later.
    let mut interrupts = {
        let _runtime = rt.enter();
        Interrupts::catch()
    };
    let setup::Destination { settings, store: dest, store_dir, roots } = setup::destination(&args.cache, args.to.as_deref(), &args.paths)?;
    let to = args.to.clone().unwrap_or_else(|| settings.store.clone());
    dest.ensure_writable("copy paths into it").map_err(|e| format!("{to}: {e}"))?;
    let urls = match &args.from {
        // The destination's substituters first (`-s`), as Nix's `copyPaths` lets the
        // destination substitute before it copies from the source.
        Some(from) if args.substitute_on_destination => settings.substituters.iter().chain([from]).cloned().collect(),
        Some(from) => vec![from.clone()],
        None => settings.substituters.clone(),
    };
    let urls = sluice_store::substituters::other_than(&urls, dest.state_dir());
    // The destination's `require-sigs` is already in `settings` (`setup::destination`).
    let policy = settings.signature_policy(None).map_err(|e| e.to_string())?;
    let opts = SubstituteOptions { jobs: args.jobs as usize, policy };
    // The run's temporary roots: every path of the closures from before its validity is
    // looked at, until the run ends.
    let temp_roots = dest.temp_roots();
    // The copy's lines, gathered into few writes while it runs.
    let gathering = crate::stderr::Gathering::start();
    let progress = Progress::start(store_dir.clone(), args.json);
    let started = Instant::now();
    let report = rt.block_on(async {
        let copy = async {
            let is_valid = closure::validity_in(Some(dest.clone()), Some(temp_roots.clone()));
            let caches = if args.from.is_some() { setup::Caches::Named } else { setup::Caches::Substituters };
            let mut query = setup::closure_query(&urls, caches, &settings, &store_dir, is_valid, &roots).await?;
            // `trusted` makes a substituter's paths need no signature; the store `nix copy
            // --from` copies from is not a substituter, and its paths are checked all the same
            // (Nix 2.8/2.26 `copyPaths` with `checkSigs`): so is `--from`'s here.
            if args.from.is_some() {
                Arc::get_mut(&mut query.substituters).into_iter().flatten().for_each(|s| s.trusted = false);
            }
            Ok(copy_closure(query, dest.clone(), temp_roots, roots.clone(), opts, progress.clone()).await)
        };
        tokio::select! {
            report = copy => report,
            // Ctrl-C: the line stays, marked; Nix's words for the error (`src/libmain/shared.cc`).
            () = interrupts.wait() => {
                progress.interrupted();
                Err("interrupted by the user".to_string())
            }
        }
    });
    // Written out now: what follows (failures, the `--json` report, the summary, the error of
    // an interrupted copy) comes after the copy's lines, in its own order.
    drop(gathering);
    let report = match report {
        Ok(report) => report,
        Err(e) => {
            // The signals are still caught while the copy's work ends: a second Ctrl-C does
            // not cut the clean-up short.
            stop(rt);
            default_signal_actions();
            return Err(e);
        }
    };
    default_signal_actions();
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    for line in summarize(&store_dir, &report.failed, "substituted") {
        progress.error(&line);
    }
    let valid = dest.query_valid_paths(&roots).map_err(|e| e.to_string())?;
    // What the user asked for is the closures: those of the valid roots count, not the roots.
    let closure = valid_closure(&dest, valid.iter().cloned().collect())?;
    // Closed before the report is written: a report that waits on its reader, ended there by
    // a signal, leaves the store as a finished command does.
    drop(dest);
    // Roots that failed have their reason printed already; others are named here.
    let missing: Vec<_> = roots.iter().filter(|r| !valid.contains(*r)).collect();
    if args.json {
        let sizes = [("downloadSize", report.downloaded), ("narSize", report.unpacked)];
        print_report(&json_report(&store_dir, ("substituted", &report.substituted), report.already_valid, &report.failed, &sizes, secs))?;
    }
    let already_valid = closure.saturating_sub(report.substituted.len());
    progress
        .msg(LVL_WARN, &summary(report.substituted.len(), report.unpacked, report.downloaded, secs, already_valid, report.failed.len()));
    for m in missing.iter().filter(|m| !report.failed.contains_key(**m)) {
        progress.error(&format!("{} is not valid in {}", store_dir.display_path(m), shown_url(&to)));
    }
    // The copy's tasks have ended (and its temporary roots with them), and the store is closed.
    setup::leave_runtime(rt);
    Ok(if missing.is_empty() && report.failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The summary of a copy in Nix's progress bar's words (`copied`, `DL`), with the counts that
/// are not 0 after it: `copied 1056 paths (21.8 MiB, 11.4 MiB DL) in 3.21 s; 2 failed`, which
/// fits 80 columns for a copy of thousands of paths.
fn summary(copied: usize, nar: u64, downloaded: u64, secs: f64, already_valid: usize, failed: usize) -> String {
    let mut line = format!("copied {copied} paths ({:.1} MiB, {:.1} MiB DL) in {secs:.2} s", nar as f64 / MIB, downloaded as f64 / MIB);
    let counts: Vec<String> = [(already_valid, "already valid"), (failed, "failed")]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
    if !counts.is_empty() {
        line.push_str(&format!("; {}", counts.join(", ")));
    }
    line
}

/// The number of paths in the closures of `roots`, valid paths of `store`.
fn valid_closure(store: &sluice_local_store::LocalStore, roots: Vec<StorePath>) -> Result<usize, String> {
    let mut seen: std::collections::BTreeSet<StorePath> = roots.iter().cloned().collect();
    let mut level = roots;
    while !level.is_empty() {
        let mut next = Vec::new();
        for info in store.query_path_infos(&level) {
            let info = info.map_err(|e| e.to_string())?;
            next.extend(info.into_iter().flat_map(|i| i.references).filter(|r| seen.insert(r.clone())));
        }
        level = next;
    }
    Ok(seen.len())
}

/// `url` as it is shown: without the `secret-key` and `secret-keys` parameters, which name
/// the files of secret keys.
fn shown_url(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else { return url.to_owned() };
    let kept: Vec<&str> = query.split('&').filter(|p| !matches!(p.split('=').next(), Some("secret-key" | "secret-keys"))).collect();
    match kept.is_empty() {
        true => base.to_owned(),
        false => format!("{base}?{}", kept.join("&")),
    }
}

/// The longest an interrupted copy waits for its work in flight to end: in practice, as long as
/// a registration or a read of one NAR takes.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Ends an interrupted copy's work before the process exits, so that the store is left as a
/// finished command leaves it: the runtime's tasks are dropped (with them the paths they hold:
/// temporary trees removed, locks released) and its blocking work waited for (a registration
/// in progress ends), then the unpacking threads, whose jobs stop at their NAR's next read
/// ([`sluice_store::wait_for_unpacking`]). The store itself, and its temporary roots, are
/// closed when the caller drops them. Both waits together are bounded by [`STOP_WAIT`]: past
/// it, the process exits with what is still running (what a `kill -9` would leave: the next
/// command that adds those paths clears their locks and trees).
fn stop(rt: tokio::runtime::Runtime) {
    let deadline = Instant::now() + STOP_WAIT;
    rt.shutdown_timeout(STOP_WAIT);
    if !sluice_store::wait_for_unpacking(deadline.saturating_duration_since(Instant::now())) {
        tracing::warn!("the copy's work did not end within {} s; what it held is left to the next command", STOP_WAIT.as_secs());
    }
}

/// SIGINT, SIGTERM and SIGHUP, caught from [`Interrupts::catch`] on; on each, Nix ends a
/// command as on Ctrl-C ("interrupted by the user": `signalHandlerThread` in
/// `src/libutil/unix/signals.cc`), so that a copy stopped by `timeout`, a service manager or a
/// closed terminal says so and writes out its last lines. A signal whose handler cannot be set
/// keeps its default action.
struct Interrupts(Vec<tokio::signal::unix::Signal>);

impl Interrupts {
    /// Installs the handlers; in a runtime's context. A signal that arrives from now on is
    /// seen by [`Interrupts::wait`], however much later it is first called.
    fn catch() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        Interrupts(
            [SignalKind::interrupt(), SignalKind::terminate(), SignalKind::hangup()]
                .into_iter()
                .filter_map(|kind| signal(kind).ok())
                .collect(),
        )
    }

    /// Waits for the first of the signals.
    async fn wait(&mut self) {
        if self.0.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(self.0.iter_mut().map(|s| Box::pin(s.recv()))).await;
    }
}

/// Gives SIGINT, SIGTERM and SIGHUP their default action back once the copy is over: tokio's
/// handlers ([`Interrupts`]) stay installed for the process's life and would leave a copy
/// whose `--json` report waits on a pipe nobody reads to SIGKILL alone. What is left to do
/// (the report, the summary) is ended by them as before the copy started.
#[allow(unsafe_code)]
fn default_signal_actions() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: setting a signal's disposition to the default; tokio's driver, which no
        // longer waits for it, only stops hearing of it.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
}

/// Prints `--json`'s report, a line on standard output. A reader that went away (`| head`)
/// is no error of the copy, which is done: `copy` ignores SIGPIPE (see `main.rs`), and the
/// write's `EPIPE` is passed over where `println!` would panic. Another write error is
/// returned.
fn print_report(json: &serde_json::Value) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{json}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("writing the report to standard output: {e}")),
        _ => Ok(()),
    }
}

/// The `--json` report of a copy: the paths it added (under `done.0`), how many were there
/// already, the failures with their reasons, byte counts by name, and the seconds it took.
fn json_report(
    store_dir: &StoreDir,
    done: (&str, &[StorePath]),
    already_valid: usize,
    failed: &BTreeMap<StorePath, impl std::fmt::Display>,
    sizes: &[(&str, u64)],
    secs: f64,
) -> serde_json::Value {
    let mut json = serde_json::json!({
        done.0: done.1.iter().map(|p| store_dir.display_path(p)).collect::<Vec<_>>(),
        "alreadyValid": already_valid,
        "failed": failed.iter().map(|(p, r)| (store_dir.display_path(p), r.to_string())).collect::<BTreeMap<_, _>>(),
        "seconds": secs,
    });
    for (name, bytes) in sizes {
        json[*name] = serde_json::json!(bytes);
    }
    json
}
