//! `sluice store sign`: Nix's `nix store sign` (`src/nix/sigs.cc`, `CmdSign`): each path's
//! fingerprint is signed with the secret key, and the signature added where the path lacks
//! it: to a binary cache's narinfo (rewritten whole, as Nix's `addSignatures` of a binary
//! cache store does), or to a local store's registration. Prints Nix's `added N signatures`.

use std::collections::{BTreeSet, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;

use futures::stream::StreamExt;
use sluice_binary_cache::BinaryCache;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::StorePath;

use crate::setup::{self, ConfigFlags};

/// Arguments of `sluice store sign`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The binary cache or local store whose paths to sign [default: the `store` setting].
    #[arg(long)]
    store: Option<String>,
    /// The secret key to sign with (`NAME:BASE64`, as `sluice key generate` writes).
    #[arg(long, short = 'k')]
    key_file: PathBuf,
    /// Sign the closures of the paths.
    #[arg(short, long)]
    recursive: bool,
    /// Sign every path of a `file://` or S3 cache, or of a local store.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    config: ConfigFlags,
    /// Store paths to sign.
    paths: Vec<String>,
}

/// Runs `sluice store sign`.
pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.paths.is_empty() && !args.all {
        return Err("name the store paths to sign, or give --all".into());
    }
    let text = std::fs::read_to_string(&args.key_file).map_err(|e| format!("{}: {e}", args.key_file.display()))?;
    let key = SecretKey::parse(text.trim()).map_err(|e| format!("{}: {e}", args.key_file.display()))?;
    let settings = setup::settings(&(&args.config).into())?;
    let url = args.store.clone().unwrap_or_else(|| settings.store.clone());
    let rt = setup::runtime()?;
    let added = rt.block_on(async {
        match super::open_cache(&url, &settings).await? {
            Some(cache) => sign_cache(&cache, &args, &key).await,
            None => sign_local(&url, &args, &key),
        }
    });
    setup::leave_runtime(rt);
    eprintln!("added {} signatures", added?);
    Ok(ExitCode::SUCCESS)
}

/// Signs paths of a binary cache; how many signatures were added.
async fn sign_cache(cache: &BinaryCache, args: &Args, key: &SecretKey) -> Result<usize, String> {
    let dir = cache.store_dir();
    let roots = match args.all {
        true => {
            let (paths, unreadable) = sluice_store::binary_cache_store::all_cache_paths(cache).await.map_err(|e| e.to_string())?;
            if let Some(first) = unreadable.first() {
                return Err(first.clone());
            }
            paths
        }
        false => setup::parse_paths(dir, &args.paths)?,
    };
    let mut seen: BTreeSet<StorePath> = roots.iter().cloned().collect();
    let mut queue: VecDeque<StorePath> = roots.into();
    let mut added = 0;
    while !queue.is_empty() {
        let level: Vec<StorePath> = queue.drain(..).collect();
        let signed = futures::stream::iter(level)
            .map(|path| async move {
                let text = cache.narinfo_text(&path).await.map_err(|e| e.to_string())?;
                let text = text.ok_or_else(|| format!("{} is not valid in {}", dir.display_path(&path), cache.url()))?;
                let mut narinfo = cache.parse_narinfo(&path, dir, &text).map_err(|e| e.to_string())?;
                let sig = key.sign(&narinfo.fingerprint(dir));
                let new = !narinfo.signatures.contains(&sig);
                if new {
                    narinfo.signatures.push(sig);
                    cache.write_narinfo(&narinfo).await.map_err(|e| e.to_string())?;
                }
                Ok::<_, String>((new, narinfo.references))
            })
            .buffer_unordered(cache.capacity().min(64))
            .collect::<Vec<_>>()
            .await;
        for result in signed {
            let (new, references) = result?;
            added += usize::from(new);
            if args.recursive {
                queue.extend(references.into_iter().filter(|r| seen.insert(r.clone())));
            }
        }
    }
    Ok(added)
}

/// Signs paths of a local store; how many signatures were added.
fn sign_local(url: &str, args: &Args, key: &SecretKey) -> Result<usize, String> {
    let config = setup::local_config(url).map_err(|_| format!("{url}: only a binary cache or a local store can be signed here"))?;
    let store = sluice_local_store::LocalStore::open(&config).map_err(|e| e.to_string())?;
    let dir = store.store_dir().clone();
    let mut paths: BTreeSet<StorePath> = match args.all {
        true => store.query_all_valid_paths().map_err(|e| e.to_string())?,
        false => setup::parse_paths(&dir, &args.paths)?.into_iter().collect(),
    };
    let mut stack: Vec<StorePath> = paths.iter().cloned().collect();
    while let Some(path) = stack.pop().filter(|_| args.recursive) {
        let info = store.query_path_info(&path).map_err(|e| e.to_string())?;
        stack.extend(info.into_iter().flat_map(|i| i.references).filter(|r| paths.insert(r.clone())));
    }
    let mut added = 0;
    for path in &paths {
        let info = store.query_path_info(path).map_err(|e| e.to_string())?;
        let info = info.ok_or_else(|| format!("{} is not valid in {url}", dir.display_path(path)))?;
        let sig = key.sign(&info.fingerprint(&dir));
        if !info.sigs.contains(&sig) {
            store.add_signatures(path, &BTreeSet::from([sig])).map_err(|e| e.to_string())?;
            added += 1;
        }
    }
    Ok(added)
}
