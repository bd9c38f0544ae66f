//! `sluice path-info`: metadata of store paths in a local store or a binary cache, printed as
//! `nix path-info` prints it (text with `-s`/`-S`, or `--json`): as Nix 2.26 does by default
//! (`src/nix/path-info.cc`, `UnkeyedValidPathInfo::toJSON` in `src/libstore/path-info.cc`,
//! `NarInfo::toJSON` in `src/libstore/nar-info.cc`, `renderSize` in `src/libutil/util.cc`), or
//! as Nix 2.8 does with `--as-nix 2.8` (`ValidPathInfo`'s JSON in `src/libstore/store-api.cc`).

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

use serde_json::{json, Map, Value};
use sluice_nix::path_info::PathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::store::{open_store, Store};

use crate::as_nix::NixVersion;
use crate::log::Log;
use crate::setup::{self, CacheFlags, ConfigFlags};

/// Arguments of `sluice path-info`.
#[derive(clap::Args, Debug)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// Print help (`-h` is `--human-readable`, as in Nix).
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
    /// The store to query: a local store, a daemon or a binary cache URL [default: the
    /// `store` setting, whose default is `$NIX_REMOTE` or `auto`].
    #[arg(long)]
    store: Option<String>,
    /// Include the closures of the paths.
    #[arg(short, long)]
    recursive: bool,
    /// Every valid path of the store (a local store's).
    #[arg(long, conflicts_with = "paths")]
    all: bool,
    /// Read store paths from standard input too, separated by white space.
    #[arg(long)]
    stdin: bool,
    /// The derivations of the paths (a `.drv` stands for itself, any other path for its
    /// deriver), as Nix's `--derivation`.
    #[arg(long)]
    derivation: bool,
    /// Print JSON as `nix path-info --json` does.
    #[arg(long)]
    json: bool,
    /// Print the NAR size of each path.
    #[arg(short = 's', long)]
    size: bool,
    /// Print the closure size of each path.
    #[arg(short = 'S', long)]
    closure_size: bool,
    /// With `-s` and `-S`, print sizes in powers of 1024 with one decimal (see `--as-nix`).
    #[arg(short = 'h', long)]
    human_readable: bool,
    /// Print each path's signatures (after `ultimate` and `ca:…` when it has them).
    #[arg(long)]
    sigs: bool,
    /// Print `--json` and `-h` sizes as this Nix version does: 2.26 (and every Nix since 2.19)
    /// prints an object keyed by path (`null` for a path that is not valid) and sizes such as
    /// `14.0 KiB`; 2.8 prints a list of objects with a `path` key (`"valid": false` for a path
    /// that is not valid) and sizes such as `14.0K`.
    #[arg(long, value_enum, default_value = "2.26", value_name = "VERSION")]
    as_nix: NixVersion,
    #[command(flatten)]
    config: ConfigFlags,
    /// Store paths.
    #[arg(required_unless_present_any = ["all", "stdin"])]
    paths: Vec<String>,
}

/// One path's metadata with, for binary caches, the narinfo's download fields.
type Entry = PathInfo;

/// Runs `sluice path-info`.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let store_url = match &args.store {
        Some(url) => url.clone(),
        None => setup::default_store(&args.config)?,
    };
    // Nothing is added: a cache's paths need no trusted signature to be listed.
    let flags = CacheFlags { no_check_sigs: true, ..CacheFlags::from(&args.config) };
    let settings = setup::settings(&flags)?;
    // `-S` needs the whole closure of each path even without `-r` (Nix's `computeFSClosure`).
    let walk = args.recursive || args.closure_size;
    let store_dir = StoreDir::default();
    let given = setup::parse_paths(&store_dir, &setup::with_stdin(args.paths.clone(), args.stdin)?)?;
    let (roots, (mut entries, missing)) = setup::runtime()?.block_on(async {
        let store = open_store(&store_url, &settings).await.map_err(|e| e.to_string())?;
        let roots = match (args.all, args.derivation) {
            (true, _) => store.query_all_valid_paths().await.map_err(|e| e.to_string())?.into_iter().collect(),
            (false, true) => derivations(store.as_ref(), given).await?,
            (false, false) => given,
        };
        Ok::<_, String>((roots.clone(), store_entries(store.as_ref(), roots, walk).await?))
    })?;
    let closure_sizes = if args.closure_size { closure_sizes(&entries) } else { BTreeMap::new() };
    if !args.recursive {
        entries.retain(|p, _| roots.contains(p));
    }
    if args.json {
        match args.as_nix {
            NixVersion::V2_26 => {
                // An object keyed by path, `null` for a path that is not valid, keys sorted
                // (nlohmann's), status 0, a newline at the end (`pathInfoToJSON`).
                let mut json: BTreeMap<String, Value> =
                    entries.iter().map(|(p, e)| (store_dir.display_path(p), to_json_2_26(e, &store_dir, closure_sizes.get(p)))).collect();
                for m in &missing {
                    json.insert(store_dir.display_path(m), Value::Null);
                }
                println!("{}", Value::Object(json.into_iter().collect()));
            }
            NixVersion::V2_8 => {
                // A list in path order, an invalid path as `{"path": …, "valid": false}`, status
                // 0, no newline at the end.
                let mut json: BTreeMap<&StorePath, Value> =
                    entries.iter().map(|(p, e)| (p, to_json_2_8(e, &store_dir, closure_sizes.get(p)))).collect();
                for m in &missing {
                    json.insert(m, json!({"path": store_dir.display_path(m), "valid": false}));
                }
                print!("{}", Value::Array(json.into_values().collect()));
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    for m in &missing {
        Log::get().error(&format!("path '{}' is not valid", store_dir.display_path(m)));
    }
    {
        let width = entries.keys().map(|p| store_dir.display_path(p).len()).max().unwrap_or(0);
        let size = |n: u64| match (args.human_readable, args.as_nix) {
            (false, _) => format!("{n:>11}"),
            (true, NixVersion::V2_26) => render_size(n),
            (true, NixVersion::V2_8) => human_size_2_8(n),
        };
        for path in topo_sorted(&entries) {
            let e = &entries[path];
            let mut line = store_dir.display_path(path);
            if args.size || args.closure_size || args.sigs {
                line = format!("{line:width$}");
            }
            if args.size {
                line.push_str(&format!("\t{}", size(e.info.nar_size)));
            }
            if let Some((nar, _)) = closure_sizes.get(path) {
                line.push_str(&format!("\t{}", size(*nar)));
            }
            if args.sigs {
                let ultimate = e.info.ultimate.then(|| "ultimate".to_string());
                let ca = e.info.ca.as_ref().map(|ca| format!("ca:{ca}"));
                let sigs: Vec<String> = ultimate.into_iter().chain(ca).chain(e.info.sigs.iter().cloned()).collect();
                line.push_str(&format!("\t{}", sigs.join(" ")));
            }
            println!("{line}");
        }
    }
    Ok(if missing.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `bytes` as Nix 2.26's `path-info -h` prints it (`renderSize(value, true)`,
/// `src/libutil/util.cc`): divided by 1024 while above 1024, `%6.1f` and `KiB`, `MiB`, …; below
/// 1 KiB, the fraction of a KiB (`   0.5 KiB`).
fn render_size(bytes: u64) -> String {
    const PREFIXES: [char; 8] = ['K', 'M', 'G', 'T', 'P', 'E', 'Z', 'Y'];
    let (mut value, mut power) = (bytes as f64, 0);
    while value > 1024.0 && power < PREFIXES.len() {
        value /= 1024.0;
        power += 1;
    }
    if power == 0 {
        value /= 1024.0;
    }
    format!("{value:6.1} {}iB", PREFIXES[power.max(1) - 1])
}

/// `bytes` as Nix 2.8's `path-info -h` prints it (`printSize`, `src/nix/path-info.cc`):
/// divided by 1024 while above 1024, `%6.1f` and the unit letter (a space for bytes).
fn human_size_2_8(bytes: u64) -> String {
    const UNITS: [char; 9] = [' ', 'K', 'M', 'G', 'T', 'P', 'E', 'Z', 'Y'];
    let (mut value, mut power) = (bytes as f64, 0);
    while value > 1024.0 && power < UNITS.len() - 1 {
        value /= 1024.0;
        power += 1;
    }
    format!("{value:6.1}{}", UNITS[power])
}

type Entries = (BTreeMap<StorePath, Entry>, Vec<StorePath>);

/// The derivation each of `paths` stands for with `--derivation` (Nix's `toDerivations`): a
/// `.drv` itself, any other path its deriver, which must be valid in `store` (Nix's
/// `Store::queryValidDerivers`).
pub async fn derivations(store: &dyn Store, paths: Vec<StorePath>) -> Result<Vec<StorePath>, String> {
    let infos = store.query_path_infos(&paths).await.map_err(|e| e.to_string())?;
    let derivers: Vec<StorePath> = infos.iter().flatten().filter_map(|e| e.info.deriver.clone()).collect();
    let valid = store.query_valid_paths(&derivers).await.map_err(|e| e.to_string())?;
    let dir = store.store_dir();
    paths
        .into_iter()
        .zip(infos)
        .map(|(path, info)| match info.and_then(|e| e.info.deriver) {
            _ if path.is_derivation() => Ok(path),
            Some(deriver) if valid.contains(&deriver) => Ok(deriver),
            _ => Err(format!("'{}' does not have a known deriver", dir.display_path(&path))),
        })
        .collect()
}

/// The entries of `roots` (and their closures when `recursive`) in `store`, and the paths that
/// are not valid there: the closure is walked breadth-first, one batch per level, which the
/// store answers at once (a daemon client pipelines its requests, a cache fetches the level's
/// narinfos in parallel).
async fn store_entries(store: &dyn Store, roots: Vec<StorePath>, recursive: bool) -> Result<Entries, String> {
    let mut entries = BTreeMap::new();
    let mut missing = Vec::new();
    let mut seen: BTreeSet<StorePath> = roots.iter().cloned().collect();
    let mut level: Vec<StorePath> = seen.iter().cloned().collect();
    while !level.is_empty() {
        let mut next = Vec::new();
        for (path, entry) in level.iter().zip(store.query_path_infos(&level).await.map_err(|e| e.to_string())?) {
            match entry {
                Some(entry) => {
                    if recursive {
                        next.extend(entry.info.references.iter().filter(|r| seen.insert((*r).clone())).cloned());
                    }
                    entries.insert(path.clone(), entry);
                }
                None => missing.push(path.clone()),
            }
        }
        level = next;
    }
    Ok((entries, missing))
}

/// The entries with every path after its references, as Nix's `topoSortPaths` orders them
/// (`src/libutil/topo-sort.hh`): a depth-first walk in path order, each path emitted after the
/// references among the entries. The walk keeps its own stack: a cache's closure may be a
/// chain of any length.
fn topo_sorted(entries: &BTreeMap<StorePath, Entry>) -> Vec<&StorePath> {
    fn among<'a>(entries: &'a BTreeMap<StorePath, Entry>, path: &'a StorePath) -> impl Iterator<Item = &'a StorePath> {
        let refs = entries.get(path).map(|e| &e.info.references).into_iter().flatten();
        refs.filter(move |r| *r != path).filter_map(|r| entries.get_key_value(r).map(|(key, _)| key))
    }
    let (mut seen, mut out) = (BTreeSet::new(), Vec::new());
    for top in entries.keys() {
        if !seen.insert(top) {
            continue;
        }
        let mut walk = vec![(top, among(entries, top))];
        while let Some((path, refs)) = walk.last_mut() {
            match refs.next() {
                Some(r) if seen.insert(r) => walk.push((r, among(entries, r))),
                Some(_) => {}
                None => {
                    out.push(*path);
                    walk.pop();
                }
            }
        }
    }
    out
}

/// (closure NAR size, closure download size) of each entry, from the entries' references.
fn closure_sizes(entries: &BTreeMap<StorePath, Entry>) -> BTreeMap<StorePath, (u64, u64)> {
    let mut out = BTreeMap::new();
    for root in entries.keys() {
        let mut seen = BTreeSet::new();
        let mut stack = vec![root.clone()];
        let (mut nar, mut download) = (0, 0);
        while let Some(p) = stack.pop() {
            let Some(e) = entries.get(&p) else { continue };
            if !seen.insert(p) {
                continue;
            }
            nar += e.info.nar_size;
            download += e.nar_file.as_ref().and_then(|n| n.file_size).unwrap_or(0);
            stack.extend(e.info.references.iter().cloned());
        }
        out.insert(root.clone(), (nar, download));
    }
    out
}

/// A path's JSON as Nix 2.26 prints it (`UnkeyedValidPathInfo::toJSON` with impure info,
/// `NarInfo::toJSON` for a cache's path, then `closureSize`/`closureDownloadSize` with `-S`):
/// `ca`, `deriver` and `registrationTime` (0 is unknown) are `null` when absent; `ultimate`
/// and `signatures` always present.
fn to_json_2_26(e: &Entry, store_dir: &StoreDir, closure: Option<&(u64, u64)>) -> Value {
    let info = &e.info;
    // Keys in nlohmann's (sorted) order: serde_json keeps insertion order here.
    let mut o = BTreeMap::<&str, Value>::new();
    o.insert("narHash", json!(info.nar_hash.to_sri()));
    o.insert("narSize", json!(info.nar_size));
    o.insert("references", json!(info.references.iter().map(|r| store_dir.display_path(r)).collect::<Vec<_>>()));
    o.insert("ca", json!(info.ca.as_ref().map(|ca| ca.to_string())));
    o.insert("deriver", json!(info.deriver.as_ref().map(|d| store_dir.display_path(d))));
    o.insert("registrationTime", json!((info.registration_time != 0).then_some(info.registration_time)));
    o.insert("ultimate", json!(info.ultimate));
    o.insert("signatures", json!(info.sigs));
    if let Some(n) = &e.nar_file {
        o.insert("url", json!(n.url));
        if !n.compression.is_empty() {
            o.insert("compression", json!(n.compression));
        }
        if let Some(h) = &n.file_hash {
            o.insert("downloadHash", json!(h.to_sri()));
        }
        if let Some(s) = n.file_size.filter(|s| *s != 0) {
            o.insert("downloadSize", json!(s));
        }
    }
    if let Some((nar, download)) = closure {
        o.insert("closureSize", json!(nar));
        if e.nar_file.is_some() {
            o.insert("closureDownloadSize", json!(download));
        }
    }
    Value::Object(o.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

/// A path's JSON as Nix 2.8 prints it (`ValidPathInfo`'s JSON in `src/libstore/store-api.cc`).
fn to_json_2_8(e: &Entry, store_dir: &StoreDir, closure: Option<&(u64, u64)>) -> Value {
    let info = &e.info;
    let mut o = Map::new();
    o.insert("path".into(), json!(store_dir.display_path(&info.path)));
    o.insert("narHash".into(), json!(info.nar_hash.to_sri()));
    o.insert("narSize".into(), json!(info.nar_size));
    o.insert("references".into(), json!(info.references.iter().map(|r| store_dir.display_path(r)).collect::<Vec<_>>()));
    if let Some(ca) = &info.ca {
        o.insert("ca".into(), json!(ca.to_string()));
    }
    if let Some((nar, _)) = closure {
        o.insert("closureSize".into(), json!(nar));
    }
    if let Some(d) = &info.deriver {
        o.insert("deriver".into(), json!(store_dir.display_path(d)));
    }
    if e.nar_file.is_none() {
        o.insert("registrationTime".into(), json!(info.registration_time));
        if info.ultimate {
            o.insert("ultimate".into(), json!(true));
        }
    }
    if !info.sigs.is_empty() {
        o.insert("signatures".into(), json!(info.sigs));
    }
    if let Some(n) = &e.nar_file {
        o.insert("url".into(), json!(n.url));
        if let Some(h) = &n.file_hash {
            o.insert("downloadHash".into(), json!(h.to_sri()));
        }
        if let Some(s) = n.file_size {
            o.insert("downloadSize".into(), json!(s));
        }
        if let Some((_, dl)) = closure {
            o.insert("closureDownloadSize".into(), json!(dl));
        }
    }
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_nix::hash::{Hash, HashAlgo};
    use sluice_nix::path_info::ValidPathInfo;

    /// A chain of 100,000 paths, each referring to the next (and to itself), is ordered with
    /// every path after its references, on a thread with a 64 KiB stack.
    #[test]
    fn a_long_chain_is_sorted_on_a_small_stack() {
        const N: usize = 100_000;
        let path = |i: usize| StorePath::from_base_name(&format!("{i:032}-p")).unwrap();
        let entries: BTreeMap<StorePath, Entry> = (0..N)
            .map(|i| {
                let references = std::iter::once(path(i)).chain((i + 1 < N).then(|| path(i + 1))).collect();
                let info = ValidPathInfo {
                    path: path(i),
                    nar_hash: Hash::digest_bytes(HashAlgo::Sha256, b""),
                    nar_size: 0,
                    references,
                    deriver: None,
                    registration_time: 0,
                    ultimate: false,
                    sigs: Default::default(),
                    ca: None,
                };
                (path(i), PathInfo::of(info))
            })
            .collect();
        let sorted: Vec<StorePath> = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || topo_sorted(&entries).into_iter().cloned().collect())
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(sorted, (0..N).rev().map(path).collect::<Vec<_>>());
    }
}
