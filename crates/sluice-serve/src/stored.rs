//! A binary cache (`file://`, `s3://`, `http(s)://`) served as it is stored, as nginx in front
//! of its directory would serve it (Nix's `BinaryCacheStore`, `src/libstore/binary-cache-store.cc`,
//! reads it the same either way): a narinfo's text as stored (its `URL`, `Compression`,
//! `FileHash` and `FileSize` kept; re-signed only to add the server's keys), and a NAR file's
//! bytes as stored (an xz NAR stays xz: nothing is decompressed or recompressed). With
//! upstreams ([`crate::upstream`]) it is a pull-through cache: what the cache lacks comes from
//! them, and is kept in it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hashlink::LruCache;
use sluice_binary_cache::file::FileStamp;
use sluice_binary_cache::{BinaryCache, CacheFile};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::store::{NarReader, StoreError};

use crate::upstream::{Found, Keep, Upstreams};

/// The cache served, and its upstreams if it is a pull-through cache.
pub struct Stored {
    pub cache: Arc<BinaryCache>,
    pub upstreams: Option<Arc<Upstreams>>,
    /// The narinfos of a `file://` cache served last, with the version of the file each was
    /// read from ([`BinaryCache::file_stamp`]): a request asks only for the file's version
    /// (one `statx`), and reads and parses it again only if it is another. A file deleted is
    /// absent at once.
    served: Mutex<LruCache<String, (FileStamp, Served)>>,
}

/// Most narinfos [`Stored`] keeps (each its text and references).
const SERVED_ENTRIES: usize = 16 * 1024;

/// A narinfo as served.
#[derive(Clone)]
pub struct Served {
    pub text: Bytes,
    pub references: Arc<[StorePath]>,
}

/// A NAR file to serve.
pub enum NarFile {
    /// A `file://` cache's file, and its size: sent as it is ([`crate::sendfile`]).
    Local(std::fs::File, u64),
    /// Its bytes, to be read on a blocking thread, and their number when known.
    Stream(NarReader, Option<u64>),
}

/// A narinfo lookup's outcome.
pub enum Lookup {
    Found(Served),
    /// Not there; for how long the answer may be cached (`Cache-Control: max-age`), if it is
    /// known to last.
    Missing(Option<Duration>),
}

/// `narinfo` with a signature by each of `keys` that it lacks (Nix's `ValidPathInfo::sign`).
fn signed(mut narinfo: NarInfo, keys: &[SecretKey], store_dir: &StoreDir) -> Served {
    let fingerprint = narinfo.fingerprint(store_dir);
    for key in keys {
        let sig = key.sign(&fingerprint);
        if !narinfo.signatures.contains(&sig) {
            narinfo.signatures.push(sig);
        }
    }
    Served { text: narinfo.to_text(store_dir).into(), references: narinfo.references.into() }
}

/// Whether `name` (after `nar/`) is the name of a NAR file in a binary cache: letters and
/// digits of nixbase32 and `-`, then `.nar` and an optional extension of letters and digits.
pub fn is_nar_file(name: &str) -> bool {
    let Some((stem, ext)) = name.split_once(".nar") else { return false };
    let stem_ok = stem.len() <= 128 && stem.split('-').all(|part| !part.is_empty() && sluice_nix::base32::is_digits(part));
    let ext_ok =
        ext.is_empty() || (2..=8).contains(&ext.len()) && ext.starts_with('.') && ext[1..].bytes().all(|b| b.is_ascii_alphanumeric());
    stem_ok && ext_ok
}

impl Stored {
    /// `cache` served as stored, with `upstreams` if any.
    pub fn new(cache: Arc<BinaryCache>, upstreams: Option<Arc<Upstreams>>) -> Self {
        Stored { cache, upstreams, served: Mutex::new(LruCache::new(SERVED_ENTRIES)) }
    }

    /// The narinfo of `hash_part`, signed with `keys` too: the cache's, else the upstreams'.
    pub async fn narinfo(&self, hash_part: &str, keys: &[SecretKey]) -> Result<Lookup, StoreError> {
        let store_dir = self.cache.store_dir();
        let served = || self.served.lock().unwrap_or_else(|p| p.into_inner());
        // Taken before the file is read: a file replaced meanwhile has another version, and
        // is read again next time.
        let file = crate::routes::is_hash_part(hash_part).then(|| self.cache.file_stamp(&format!("{hash_part}.narinfo"))).flatten();
        let stamp = match file.transpose()? {
            Some(Some(stamp)) => match served().get(hash_part) {
                Some((kept, s)) if *kept == stamp => return Ok(Lookup::Found(s.clone())),
                _ => Some(stamp),
            },
            _ => None,
        };
        if let Some((text, narinfo)) = self.cache.narinfo_by_hash_part(hash_part).await? {
            let found = match keys {
                [] => Served { text: text.into(), references: narinfo.references.into() },
                _ => signed(narinfo, keys, store_dir),
            };
            if let Some(stamp) = stamp {
                served().insert(hash_part.to_string(), (stamp, found.clone()));
            }
            return Ok(Lookup::Found(found));
        }
        let Some(upstreams) = &self.upstreams else { return Ok(Lookup::Missing(None)) };
        Ok(match upstreams.narinfo(hash_part).await {
            Found::Yes(narinfo) => Lookup::Found(signed(*narinfo, keys, store_dir)),
            Found::No(ttl) => Lookup::Missing(ttl),
        })
    }

    /// The NAR file `rel` (`nar/…`) as stored: from the cache, else fetched from an upstream
    /// (whose narinfo of `hash_part` names it, if this server did not serve that narinfo
    /// itself). `None` when there is none, or none to be fetched now (one that failed its
    /// check, or whose fetch failed a moment ago: [`crate::upstream`]).
    pub async fn nar(&self, rel: &str, hash_part: Option<&str>) -> Result<Option<NarFile>, StoreError> {
        match self.cache.open_cache_file(rel).await? {
            Some(CacheFile::Local { file, len }) => return Ok(Some(NarFile::Local(file, len))),
            Some(CacheFile::Stream(stream)) => return Ok(Some(NarFile::Stream(stream.reader, stream.len))),
            None => {}
        }
        let Some(upstreams) = &self.upstreams else { return Ok(None) };
        let flight = upstreams.flight(rel, hash_part, &Keep::Cache(self.cache.clone())).await.map_err(StoreError::Other)?;
        Ok(flight.map(|f| NarFile::Stream(Box::new(f.follow()), None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nar_file_names() {
        for good in
            ["1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s.nar.xz", "0c7ry3w8ggj1mgwwxmrkjbpsg7sm25s9-1b8m.nar", "abc.nar.zst"]
        {
            assert!(is_nar_file(good), "{good}");
        }
        for bad in ["", ".nar", "../x.nar", "a/b.nar", "x.nar/..", "x.nar.x/y", "X.nar", "x.narinfo", "x.nar.", "e.nar.xz", "a--b.nar"] {
            assert!(!is_nar_file(bad), "{bad}");
        }
    }
}
