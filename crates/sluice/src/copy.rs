//! `sluice copy`: copy the closures of store paths from binary caches into a local store.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use sluice_nix::signature::TrustedKeys;
use sluice_store::closure;
use sluice_store::local::SignaturePolicy;
use sluice_store::substitute::{copy_closure, SubstituteOptions};

use crate::progress::{Progress, MIB};
use crate::setup::{self, CacheFlags};

/// Arguments of `sluice copy`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The binary cache to copy from [default: the `substituters`, by priority]. As with
    /// `nix copy --from`, its paths need a trusted signature even with `?trusted=true`,
    /// which applies to substituters only.
    #[arg(long)]
    from: Option<String>,
    /// The store to copy into (`local`, `local?root=DIR` or an absolute path, with the local
    /// store's parameters: `state`, `real`, `log`, `require-sigs`, `read-only`, …) [default:
    /// the `store` setting, whose default is `$NIX_REMOTE` or `auto`].
    #[arg(long)]
    to: Option<String>,
    /// NAR downloads in flight at once, at least 1 (over HTTP/1.1, `http-connections` also
    /// bounds the requests to each cache).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    jobs: u32,
    /// Print a JSON report on standard output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cache: CacheFlags,
    /// Store paths whose closures to copy.
    #[arg(required = true)]
    paths: Vec<String>,
}

/// Runs `sluice copy`; exit status 0 only when every path asked for is valid in the destination.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let setup::Destination { settings, store: dest, store_dir, roots } = setup::destination(&args.cache, args.to.as_deref(), &args.paths)?;
    let to = args.to.clone().unwrap_or_else(|| settings.store.clone());
    dest.ensure_writable("copy paths into it").map_err(|e| format!("{to}: {e}"))?;
    let urls = match &args.from {
        Some(from) => vec![from.clone()],
        None => settings.substituters.clone(),
    };
    let trusted_keys = TrustedKeys::parse(&settings.trusted_public_keys.join(" ")).map_err(|e| format!("trusted-public-keys: {e}"))?;
    let opts = SubstituteOptions { jobs: args.jobs as usize, policy: SignaturePolicy { require_sigs: settings.require_sigs, trusted_keys } };
    // The run's temporary roots: every path of the closures from before its validity is
    // looked at, until the run ends.
    let temp_roots = dest.temp_roots();
    let progress = Arc::new(Progress::new(store_dir.clone(), args.json));
    let started = Instant::now();
    let rt = setup::runtime()?;
    let report = rt.block_on(async {
        let is_valid = closure::validity_in(Some(dest.clone()), Some(temp_roots.clone()));
        let mut query = setup::closure_query(&urls, &settings, &store_dir, is_valid, &roots).await?;
        // `trusted` makes a substituter's paths need no signature; the store `nix copy
        // --from` copies from is not a substituter, and its paths are checked all the same
        // (Nix 2.8/2.26 `copyPaths` with `checkSigs`): so is `--from`'s here.
        if args.from.is_some() {
            Arc::get_mut(&mut query.substituters).into_iter().flatten().for_each(|s| s.trusted = false);
        }
        Ok::<_, String>(copy_closure(query, dest.clone(), temp_roots, roots.clone(), opts, progress.clone()).await)
    })?;
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    for reason in report.failed.values() {
        eprintln!("error: {reason}");
    }
    let valid = dest.query_valid_paths(&roots).map_err(|e| e.to_string())?;
    // Roots that failed have their reason printed already; others are named here.
    let missing: Vec<_> = roots.iter().filter(|r| !valid.contains(*r)).collect();
    if args.json {
        let json = serde_json::json!({
            "substituted": report.substituted.iter().map(|p| store_dir.display_path(p)).collect::<Vec<_>>(),
            "alreadyValid": report.already_valid,
            "failed": report.failed.iter().map(|(p, r)| (store_dir.display_path(p), r.clone())).collect::<std::collections::BTreeMap<_, _>>(),
            "downloadSize": report.downloaded,
            "narSize": report.unpacked,
            "seconds": secs,
        });
        println!("{json}");
    }
    eprintln!(
        "copied {} paths ({:.2} MiB downloaded, {:.2} MiB unpacked) in {:.2} s; {} already valid, {} failed",
        report.substituted.len(),
        report.downloaded as f64 / MIB,
        report.unpacked as f64 / MIB,
        secs,
        report.already_valid,
        report.failed.len()
    );
    for m in missing.iter().filter(|m| !report.failed.contains_key(**m)) {
        eprintln!("error: {} is not valid in {}", store_dir.display_path(m), to);
    }
    Ok(if missing.is_empty() && report.failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
