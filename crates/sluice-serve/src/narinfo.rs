//! The narinfo `sluice serve` answers for a valid path, as Nix's `BinaryCacheStore::writeNarInfo`
//! would have written it (`src/libstore/binary-cache-store.cc`), signed on the fly.
//!
//! The NAR is served uncompressed (`Compression: none`, `FileHash`/`FileSize` equal to
//! `NarHash`/`NarSize`) at `nar/<hash part>-<NarHash in nixbase32>.nar`: the hash part finds the
//! path, the NAR hash makes the URL change whenever the path's contents could (a path
//! invalidated and added again with other contents gets a new URL, never a stale cached one).
//! The same function renders the per-path answer and every batch answer, so both are the same
//! bytes and their signatures verify the same way; [`Rendered`] keeps what was rendered for
//! paths served again.

use std::sync::Mutex;

use bytes::Bytes;
use hashlink::LruCache;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StoreDir, StorePath};

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

/// Most narinfos [`Rendered`] keeps (each a few hundred bytes to a few KiB of text, and its
/// path info).
pub(crate) const RENDERED_ENTRIES: usize = 16 * 1024;

/// The narinfos served last, rendered and signed, at most [`RENDERED_ENTRIES`] (least recently
/// served dropped first), so that a path asked for again costs no signature and no rendering.
///
/// It never decides validity: every request reads the path's info from the store first (so a
/// path the garbage collector deleted is 404 at once), and an entry is used only when that
/// info equals the one it was rendered from. A path invalidated and added again (another
/// registration time, perhaps other contents) or given another signature is rendered anew.
pub struct Rendered {
    entries: Mutex<LruCache<StorePath, (ValidPathInfo, Bytes)>>,
}

impl Default for Rendered {
    fn default() -> Self {
        Rendered::with_capacity(RENDERED_ENTRIES)
    }
}

impl Rendered {
    /// A cache of at most `entries` narinfos.
    pub fn with_capacity(entries: usize) -> Self {
        Rendered { entries: Mutex::new(LruCache::new(entries)) }
    }

    /// The narinfo of `info` as [`render`] makes it, from the cache when it was rendered from
    /// an equal info.
    pub fn get(&self, info: &ValidPathInfo, keys: &[SecretKey], store_dir: &StoreDir) -> Bytes {
        let lock = || self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cached, text)) = lock().get(&info.path) {
            if cached == info {
                return text.clone();
            }
        }
        let text = Bytes::from(render(info, keys, store_dir));
        lock().insert(info.path.clone(), (info.clone(), text.clone()));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_nix::hash::Hash;

    fn info(registration_time: i64) -> ValidPathInfo {
        let store_dir = StoreDir::default();
        ValidPathInfo {
            path: store_dir.parse_path("/nix/store/0c7ry3w8ggj1mgwwxmrkjbpsg7sm25s9-hello-2.12").unwrap(),
            nar_hash: Hash::parse("sha256:1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s").unwrap(),
            nar_size: 226560,
            references: Default::default(),
            deriver: None,
            registration_time,
            ultimate: false,
            sigs: Default::default(),
            ca: None,
        }
    }

    #[test]
    fn a_changed_registration_is_rendered_anew_and_the_cache_is_bounded() {
        let (store_dir, key) = (StoreDir::default(), SecretKey::generate("test-1"));
        let rendered = Rendered::with_capacity(1);
        let first = info(1);
        let text = rendered.get(&first, std::slice::from_ref(&key), &store_dir);
        assert_eq!(text, render(&first, std::slice::from_ref(&key), &store_dir));
        // Signed again from scratch, the same text (ed25519 is deterministic): served from the
        // cache, the same bytes, until the registration changes.
        assert_eq!(rendered.get(&first, std::slice::from_ref(&key), &store_dir), text);
        let mut resigned = first.clone();
        resigned.sigs.insert("other-1:c2lnbmF0dXJl".to_string());
        let again = rendered.get(&resigned, std::slice::from_ref(&key), &store_dir);
        assert!(std::str::from_utf8(&again).unwrap().contains("Sig: other-1:c2lnbmF0dXJl\n"), "{again:?}");
        assert_eq!(rendered.entries.lock().unwrap().len(), 1);
    }
}
