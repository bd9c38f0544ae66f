//! `sluice store gc`: garbage collection of a `file://` or S3 binary cache
//! (`sluice_store::cache_gc`, which says in what order files go and why the cache stays
//! consistent). With `--dry-run`, prints what would be deleted and deletes nothing.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use sluice_store::cache_gc::{collect, GcOptions};

use crate::progress::MIB;
use crate::setup::{self, ConfigFlags};

/// Arguments of `sluice store gc`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The cache to collect: `file://DIR` or `s3://BUCKET?…`.
    #[arg(long)]
    store: String,
    /// Store paths whose closures are kept.
    #[arg(long, num_args = 1..)]
    keep: Vec<String>,
    /// A file of store paths whose closures are kept, one a line.
    #[arg(long)]
    keep_file: Vec<PathBuf>,
    /// Narinfos (and NAR files) written less than this long ago are kept, with their
    /// closures: a push in progress is never collected (`30s`, `15m`, `1h`, `7d`).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    keep_newer_than: Duration,
    /// Keep also the newest closures whose NAR files fit in this size (`500M`, `20G`).
    #[arg(long, value_parser = parse_size)]
    max_size: Option<u64>,
    /// Print what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    config: ConfigFlags,
}

/// Runs `sluice store gc`.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let settings = setup::settings(&(&args.config).into())?;
    let mut keep = args.keep.clone();
    for file in &args.keep_file {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        keep.extend(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned));
    }
    let rt = setup::runtime()?;
    let report = rt.block_on(async {
        let cache = super::open_cache(&args.store, &settings)
            .await?
            .ok_or_else(|| format!("{}: not a binary cache; `sluice store gc` collects file:// and S3 caches", args.store))?;
        let keep = setup::parse_paths(cache.store_dir(), &keep)?;
        let opts = GcOptions { keep, keep_newer_than: args.keep_newer_than, max_size: args.max_size, dry_run: args.dry_run };
        collect(&cache, &opts).await.map_err(|e| e.to_string())
    })?;
    setup::leave_runtime(rt);
    if args.dry_run {
        for name in &report.deleted {
            println!("would delete {name}");
        }
    }
    eprintln!(
        "{} {} files ({:.2} MiB); kept {} paths ({:.2} MiB of NAR); {} requests",
        if args.dry_run { "would delete" } else { "deleted" },
        report.deleted.len(),
        report.freed as f64 / MIB,
        report.kept,
        report.kept_bytes as f64 / MIB,
        report.requests
    );
    Ok(ExitCode::SUCCESS)
}

/// A duration: a number and a unit, `s`, `m`, `h` or `d` (seconds without one).
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.trim().split_at(text.trim().trim_end_matches(char::is_alphabetic).len());
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration such as 30s, 15m, 1h or 7d"))?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (s, m, h or d)")),
    };
    Ok(Duration::from_secs(n * secs))
}

/// A size in bytes: a number and an optional `K`, `M`, `G` or `T` (powers of 1024).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let (number, unit) = text.trim().split_at(text.trim().trim_end_matches(char::is_alphabetic).len());
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a size such as 500M or 20G"))?;
    let shift = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (K, M, G or T)")),
    };
    Ok(n << shift)
}
