//! The narinfo disk cache: what each binary cache had (the narinfo text) or lacked, with
//! positive and negative TTLs (Nix's `narinfo-cache-positive-ttl`/`-negative-ttl`), and each
//! cache's `nix-cache-info`. Like Nix's `binary-cache-v6.sqlite` (`src/libstore/nar-info-disk-cache.cc`)
//! but sluice's own file: `$XDG_CACHE_HOME/sluice/narinfo-v1.sqlite` (default `~/.cache`).
//! Reads and writes are batched: one query per batch of hash parts, one transaction per batch
//! of answers, written by an upsert (`insert or replace` would delete and reinsert, which
//! needs a statement journal: 57 KB of allocation and copying per answer).
//!
//! Answers are kept per trusted key set ([`NarInfoCache::for_trusted_keys`]) and per
//! `nix-cache-info` (recording another one drops the cache's answers), so that a key rotation
//! or a cache rebuilt under the same URL is never served what was learnt before it (Lix #1268:
//! a rotated key blocked for the positive TTL, 30 days).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension};
use sluice_nix::cache_info::CacheInfo;

/// Seconds a cached `nix-cache-info` stays fresh (Nix: 7 days).
pub(crate) const CACHE_INFO_TTL: i64 = 7 * 24 * 3600;

const SCHEMA: &str = "
create table if not exists BinaryCaches (
    id integer primary key autoincrement not null,
    url text unique not null,
    timestamp integer not null,
    storeDir text not null,
    wantMassQuery integer not null,
    priority integer not null
);
create table if not exists NARs (
    cache integer not null,
    hashPart text not null,
    timestamp integer not null,
    present integer not null,
    narinfo text,
    primary key (cache, hashPart),
    foreign key (cache) references BinaryCaches(id) on delete cascade
);
create table if not exists SluiceBatch (
    cache integer primary key not null,
    foreign key (cache) references BinaryCaches(id) on delete cascade
);
";

/// A cached answer of one cache for one hash part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    /// The cache had the path; the narinfo text.
    Present(String),
    /// The cache did not have it.
    Absent,
}

/// Errors of the disk cache (the file path and SQLite's reason).
#[derive(Debug, thiserror::Error)]
#[error("narinfo disk cache {path}: {source}")]
pub struct DiskCacheError {
    path: String,
    #[source]
    source: rusqlite::Error,
}

/// The on-disk narinfo cache; safe to share between threads.
pub struct NarInfoCache {
    path: PathBuf,
    /// Appended to each cache's URL in `BinaryCaches`: the trusted key set's fingerprint.
    scope: String,
    conn: Mutex<Connection>,
    positive_ttl: i64,
    negative_ttl: i64,
}

fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

impl NarInfoCache {
    /// The default location: `$XDG_CACHE_HOME/sluice/narinfo-v1.sqlite`, else `~/.cache/…`.
    pub fn default_path() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("sluice").join("narinfo-v1.sqlite"))
    }

    /// Opens (creating) the cache at `path`; TTLs in seconds.
    pub fn open(path: &Path, positive_ttl: u64, negative_ttl: u64) -> Result<Self, DiskCacheError> {
        let err = |source| DiskCacheError { path: path.display().to_string(), source };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(rusqlite::Error::ToSqlConversionFailure(Box::new(e))))?;
        }
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(60)).map_err(err)?;
        // A cache, like Nix's (`SQLite::isCache`): no fsync; a lost write is only a lookup
        // made again.
        conn.execute_batch("pragma journal_mode = wal; pragma synchronous = off; pragma foreign_keys = on;").map_err(err)?;
        // The write-ahead log is moved into the database by the writes that fill it (SQLite's
        // automatic checkpoint), not by every run's end: a closure query's answers (about a
        // megabyte for a thousand paths) were written twice, the second time after its report.
        conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true).map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        Ok(NarInfoCache {
            path: path.to_path_buf(),
            scope: String::new(),
            conn: Mutex::new(conn),
            positive_ttl: positive_ttl as i64,
            negative_ttl: negative_ttl as i64,
        })
    }

    /// This cache, keeping its answers apart from those recorded under another set of
    /// `trusted-public-keys` (in any order).
    pub fn for_trusted_keys(mut self, keys: &[String]) -> Self {
        let mut keys: Vec<&str> = keys.iter().map(|k| k.trim()).collect();
        keys.sort_unstable();
        keys.dedup();
        let digest = sluice_nix::hash::Hash::digest_bytes(sluice_nix::hash::HashAlgo::Sha256, keys.join("\n").as_bytes());
        self.scope = format!(" trusted-keys={}", &digest.to_base16()[..16]);
        self
    }

    /// The `BinaryCaches` key of the cache `url`.
    fn key(&self, url: &str) -> String {
        format!("{url}{}", self.scope)
    }

    fn err(&self, source: rusqlite::Error) -> DiskCacheError {
        DiskCacheError { path: self.path.display().to_string(), source }
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cache's id and `nix-cache-info`, if recorded within [`CACHE_INFO_TTL`].
    pub fn cache_info(&self, url: &str) -> Result<Option<(i64, CacheInfo)>, DiskCacheError> {
        let conn = self.conn();
        conn.query_row(
            "select id, storeDir, wantMassQuery, priority, exists (select 1 from SluiceBatch where cache = id) from BinaryCaches where url = ? and timestamp > ?",
            params![self.key(url), now() - CACHE_INFO_TTL],
            |r| Ok((r.get(0)?, CacheInfo { store_dir: r.get(1)?, want_mass_query: r.get::<_, i64>(2)? != 0, priority: r.get(3)?, batch: r.get(4)? })),
        )
        .optional()
        .map_err(|e| self.err(e))
    }

    /// Records a cache's `nix-cache-info` (its `SluiceBatch` in a table of its own, which
    /// files made before it get when opened); returns its id. A `nix-cache-info` other than
    /// the one recorded drops the cache's answers.
    pub fn record_cache(&self, url: &str, info: &CacheInfo) -> Result<i64, DiskCacheError> {
        let conn = self.conn();
        let url = self.key(url);
        conn.execute(
            "delete from NARs where cache = (select id from BinaryCaches where url = ?1 and (storeDir != ?2 or wantMassQuery != ?3 or priority != ?4 \
             or exists (select 1 from SluiceBatch where cache = id) != ?5))",
            params![url, info.store_dir, info.want_mass_query as i64, info.priority, info.batch],
        )
        .map_err(|e| self.err(e))?;
        let id: i64 = conn
            .query_row(
                "insert into BinaryCaches (url, timestamp, storeDir, wantMassQuery, priority) values (?1, ?2, ?3, ?4, ?5)
                 on conflict(url) do update set timestamp = ?2, storeDir = ?3, wantMassQuery = ?4, priority = ?5 returning id",
                params![url, now(), info.store_dir, info.want_mass_query as i64, info.priority],
                |r| r.get(0),
            )
            .map_err(|e| self.err(e))?;
        let batch =
            if info.batch { "insert or ignore into SluiceBatch (cache) values (?)" } else { "delete from SluiceBatch where cache = ?" };
        conn.execute(batch, [id]).map_err(|e| self.err(e))?;
        Ok(id)
    }

    /// Whether anything is recorded for cache `cache` (a cold cache's lookups can be skipped).
    pub fn has_entries(&self, cache: i64) -> Result<bool, DiskCacheError> {
        self.conn().query_row("select exists (select 1 from NARs where cache = ?)", [cache], |r| r.get(0)).map_err(|e| self.err(e))
    }

    /// The fresh cached answers of cache `cache` for `hash_parts`, in one query per 500.
    pub fn lookup(&self, cache: i64, hash_parts: &[&str]) -> Result<HashMap<String, Cached>, DiskCacheError> {
        let conn = self.conn();
        let t = now();
        let mut out = HashMap::new();
        for chunk in hash_parts.chunks(500) {
            let marks = vec!["?"; chunk.len()].join(",");
            let sql = format!("select hashPart, present, narinfo, timestamp from NARs where cache = ? and hashPart in ({marks})");
            let mut stmt = conn.prepare_cached(&sql).map_err(|e| self.err(e))?;
            let args = std::iter::once(&cache as &dyn rusqlite::ToSql).chain(chunk.iter().map(|h| h as &dyn rusqlite::ToSql));
            let rows = stmt
                .query_map(rusqlite::params_from_iter(args), |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? != 0, r.get::<_, Option<String>>(2)?, r.get::<_, i64>(3)?))
                })
                .map_err(|e| self.err(e))?;
            for row in rows {
                let (hash, present, text, ts) = row.map_err(|e| self.err(e))?;
                match (present, text) {
                    (true, Some(text)) if ts > t - self.positive_ttl => out.insert(hash, Cached::Present(text)),
                    (false, _) if ts > t - self.negative_ttl => out.insert(hash, Cached::Absent),
                    _ => None,
                };
            }
        }
        Ok(out)
    }

    /// Records answers `(cache, hash part, narinfo text or None for absent)` in one transaction.
    pub fn record(&self, answers: &[(i64, String, Option<String>)]) -> Result<(), DiskCacheError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.err(e))?;
        {
            let mut stmt = tx
                .prepare_cached(
                    "insert into NARs (cache, hashPart, timestamp, present, narinfo) values (?, ?, ?, ?, ?) on conflict (cache, hashPart) \
                     do update set timestamp = excluded.timestamp, present = excluded.present, narinfo = excluded.narinfo",
                )
                .map_err(|e| self.err(e))?;
            let t = now();
            for (cache, hash, text) in answers {
                stmt.execute(params![cache, hash, t, text.is_some() as i64, text]).map_err(|e| self.err(e))?;
            }
        }
        tx.commit().map_err(|e| self.err(e))
    }

    /// Forgets a cached answer (a narinfo whose NAR turned out to be gone or wrong).
    pub fn forget(&self, cache: i64, hash_part: &str) -> Result<(), DiskCacheError> {
        self.conn()
            .execute("delete from NARs where cache = ? and hashPart = ?", params![cache, hash_part])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_and_batches() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("c.sqlite");
        let info = CacheInfo { store_dir: "/nix/store".into(), want_mass_query: true, priority: 40, batch: true };
        let cache = NarInfoCache::open(&db, 100, 100).unwrap();
        let id = cache.record_cache("http://x", &info).unwrap();
        assert_eq!(cache.record_cache("http://x", &info).unwrap(), id);
        assert_eq!(cache.cache_info("http://x").unwrap(), Some((id, info)));
        cache.record(&[(id, "a".into(), Some("text".into())), (id, "b".into(), None)]).unwrap();
        let got = cache.lookup(id, &["a", "b", "c"]).unwrap();
        assert_eq!(got.get("a"), Some(&Cached::Present("text".into())));
        assert_eq!(got.get("b"), Some(&Cached::Absent));
        assert_eq!(got.len(), 2);
        // A negative TTL of 0 makes absences stale at once; presences stay.
        let cache = NarInfoCache::open(&db, 100, 0).unwrap();
        let got = cache.lookup(id, &["a", "b"]).unwrap();
        assert_eq!(got.len(), 1);
        cache.forget(id, "a").unwrap();
        assert!(cache.lookup(id, &["a"]).unwrap().is_empty());
        // A new answer replaces the old one (the upsert's conflict branch).
        cache.record(&[(id, "b".into(), Some("now present".into()))]).unwrap();
        assert_eq!(cache.lookup(id, &["b"]).unwrap().get("b"), Some(&Cached::Present("now present".into())));
    }

    /// A `nix-cache-info` other than the one recorded (a cache rebuilt at the same URL) drops
    /// the cache's answers; the same one keeps them.
    #[test]
    fn another_cache_info_drops_the_answers() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NarInfoCache::open(&dir.path().join("c.sqlite"), 100, 100).unwrap();
        let info = CacheInfo { store_dir: "/nix/store".into(), want_mass_query: true, priority: 40, batch: false };
        let id = cache.record_cache("http://x", &info).unwrap();
        let other = cache.record_cache("http://y", &info).unwrap();
        cache.record(&[(id, "a".into(), Some("text".into())), (other, "a".into(), None)]).unwrap();
        assert_eq!(cache.record_cache("http://x", &info).unwrap(), id);
        assert_eq!(cache.lookup(id, &["a"]).unwrap().len(), 1);
        let rebuilt = CacheInfo { priority: 30, ..info.clone() };
        assert_eq!(cache.record_cache("http://x", &rebuilt).unwrap(), id);
        assert!(cache.lookup(id, &["a"]).unwrap().is_empty());
        assert_eq!(cache.lookup(other, &["a"]).unwrap().get("a"), Some(&Cached::Absent), "another cache keeps its answers");
    }

    /// Answers recorded under one set of trusted keys are not served under another (a key
    /// added for a rotation), and are under the same set in another order.
    #[test]
    fn answers_are_kept_per_trusted_key_set() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("c.sqlite");
        let open = |keys: &[&str]| {
            NarInfoCache::open(&db, 100, 100).unwrap().for_trusted_keys(&keys.iter().map(|k| k.to_string()).collect::<Vec<_>>())
        };
        let info = CacheInfo { store_dir: "/nix/store".into(), want_mass_query: true, priority: 40, batch: false };
        let old = open(&["old:AAAA", "other:BBBB"]);
        let id = old.record_cache("http://x", &info).unwrap();
        old.record(&[(id, "a".into(), Some("signed by old".into()))]).unwrap();
        let same = open(&["other:BBBB", "old:AAAA"]);
        assert_eq!(same.cache_info("http://x").unwrap(), Some((id, info.clone())));
        let rotated = open(&["old:AAAA", "other:BBBB", "new:CCCC"]);
        assert_eq!(rotated.cache_info("http://x").unwrap(), None);
        let new_id = rotated.record_cache("http://x", &info).unwrap();
        assert_ne!(new_id, id);
        assert!(rotated.lookup(new_id, &["a"]).unwrap().is_empty());
    }
}
