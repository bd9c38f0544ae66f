//! The narinfo `sluice serve` answers for a valid path, as Nix's `BinaryCacheStore::writeNarInfo`
//! would have written it (`src/libstore/binary-cache-store.cc`), signed on the fly.
//!
//! The NAR is served uncompressed (`Compression: none`, `FileHash`/`FileSize` equal to
//! `NarHash`/`NarSize`) at `nar/<hash part>-<NarHash in nixbase32>.nar`: the hash part finds the
//! path, the NAR hash makes the URL change whenever the path's contents could (a path
//! invalidated and added again with other contents gets a new URL, never a stale cached one).
//! The same function renders the per-path answer and every batch answer, so both are the same
//! bytes and their signatures verify the same way.

use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::StoreDir;

/// The URL (relative to the cache) the NAR of `info` is served at.
pub fn nar_url(info: &ValidPathInfo) -> String {
    format!("nar/{}-{}.nar", info.path.hash_part(), info.nar_hash.to_nix32())
}

/// The narinfo text of `info`: its registered signatures, then one by each of `keys` over the
/// path's fingerprint (Nix's `ValidPathInfo::fingerprint`) unless already there.
pub fn render(info: &ValidPathInfo, keys: &[SecretKey], store_dir: &StoreDir) -> String {
    let file = (nar_url(info), "none".to_owned(), info.nar_hash.clone(), info.nar_size);
    NarInfo::signed(info, file, keys, store_dir).to_text(store_dir)
}
