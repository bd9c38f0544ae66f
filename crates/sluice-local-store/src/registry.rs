//! Reading and writing path registrations in the store database, with the statements Nix
//! uses (`src/libstore/local-store.cc`: `addValidPath`, `registerValidPaths`,
//! `queryPathInfoInternal`). Column formats, as Nix writes them: `hash` is
//! `sha256:<base16>`, `deriver` a full store path, `sigs` space-separated, `ca` the content
//! address text; `narSize` 0, `ultimate` false, no deriver, no sigs and no ca are NULL.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::Hash;
use sluice_nix::store_path::{StoreDir, StorePath, HASH_PART_LEN};

use super::schema::Database;
use super::LocalStoreError;
use sluice_nix::path_info::ValidPathInfo;

/// A path's row and its references (space-separated: store paths contain no spaces) in one
/// statement, so that a lookup takes the database's read lock once; the path's own column
/// first. Completed by a `where` clause.
macro_rules! select_path_info {
    () => {
        "select path, id, hash, registrationTime, deriver, narSize, ultimate, sigs, ca, \
         (select group_concat(r.path, ' ') from Refs join ValidPaths r on reference = r.id where referrer = v.id) \
         from ValidPaths v "
    };
}
const QUERY_PATH_INFO: &str = concat!(select_path_info!(), "where path = ?");
/// The first valid path at or after a prefix, with its info: the `path` index makes this a
/// single seek (see [`Registry::path_info_from_hash_part`]).
const QUERY_PATH_INFO_FROM_HASH_PART: &str = concat!(select_path_info!(), "where path >= ? limit 1");
pub(super) const QUERY_REFERRERS: &str =
    "select path from Refs join ValidPaths on referrer = id where reference = (select id from ValidPaths where path = ?)";
const QUERY_ID: &str = "select id from ValidPaths where path = ?";
const QUERY_ALL: &str = "select path from ValidPaths";
const REGISTER_VALID_PATH: &str =
    "insert into ValidPaths (path, hash, registrationTime, deriver, narSize, ultimate, sigs, ca) values (?, ?, ?, ?, ?, ?, ?, ?)";
/// Nix writes `insert or replace`; both leave the one row a (referrer, reference) pair can have
/// (foreign keys are checked either way: `or` does not apply to them). But `replace`, which
/// may delete a row, makes SQLite keep a statement journal for every reference inserted
/// (`memjrnlWrite`, a tenth of a registration's CPU: docs/benchmarks.md).
const ADD_REFERENCE: &str = "insert or ignore into Refs (referrer, reference) values (?, ?)";
const ADD_DERIVATION_OUTPUT: &str = "insert or replace into DerivationOutputs (drv, id, path) values (?, ?, ?)";

/// The `ValidPaths` row of a path, as stored (its path first), and its references.
type Row = (String, i64, String, i64, Option<String>, Option<i64>, Option<i64>, Option<String>, Option<String>, Option<String>);

/// The database of one store, behind a mutex (SQLite connections are not `Sync`).
pub(super) struct Registry {
    db: Mutex<Database>,
    db_path: PathBuf,
    store_dir: StoreDir,
}

impl Registry {
    pub(super) fn new(db: Database, db_path: PathBuf, store_dir: StoreDir) -> Self {
        Registry { db: Mutex::new(db), db_path, store_dir }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Database> {
        // A panic while holding the lock cannot leave a transaction open (it rolls back on
        // drop), so the connection is still usable.
        self.db.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Maps an SQLite error to [`LocalStoreError::Db`], describing the operation.
    /// The error of a failed statement, made only if it failed (nothing is allocated
    /// otherwise).
    pub(super) fn sql_err<'a, F: FnOnce() -> String + 'a>(&'a self, what: F) -> impl FnOnce(rusqlite::Error) -> LocalStoreError + 'a {
        move |source| LocalStoreError::Db { db: self.db_path.clone(), what: what(), source }
    }

    fn corrupt(&self, what: String) -> LocalStoreError {
        LocalStoreError::Corrupt { db: self.db_path.clone(), what }
    }

    pub(super) fn display(&self, path: &StorePath) -> String {
        self.store_dir.display_path(path)
    }

    /// Parses a full store path read from the database.
    pub(super) fn parse_path(&self, text: &str, column: &str) -> Result<StorePath, LocalStoreError> {
        self.store_dir.parse_path(text).map_err(|e| self.corrupt(format!("{column} {text:?}: {e}")))
    }

    /// The registration of `path`, or `None` if it is not valid.
    pub(super) fn query_path_info(&self, path: &StorePath) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        let shown = self.display(path);
        let row = self.row(&self.lock().conn, &shown)?;
        self.info_from_row(path, &shown, row)
    }

    /// The registrations of `paths`, in order, read in one transaction: one read lock of the
    /// database for all, instead of one per statement. A failure affects only its own path.
    pub(super) fn query_path_infos(&self, paths: &[StorePath]) -> Vec<Result<Option<ValidPathInfo>, LocalStoreError>> {
        let shown: Vec<String> = paths.iter().map(|p| self.display(p)).collect();
        let rows: Vec<_> = {
            let db = self.lock();
            let _snapshot = self.read_transaction(&db.conn, paths.len());
            shown.iter().map(|s| self.row(&db.conn, s)).collect()
        };
        paths.iter().zip(&shown).zip(rows).map(|((path, shown), row)| self.info_from_row(path, shown, row?)).collect()
    }

    /// An explicit read transaction on `conn` when `statements` (more than one) are about to
    /// run; ends when dropped. Without one, SQLite locks and unlocks the database around
    /// every statement. `None` if beginning one failed: the statements then lock one by one.
    fn read_transaction<'c>(&self, conn: &'c Connection, statements: usize) -> Option<rusqlite::Transaction<'c>> {
        (statements > 1).then(|| conn.unchecked_transaction().ok()).flatten()
    }

    /// The `ValidPaths` row and references of the path shown as `shown`.
    fn row(&self, conn: &Connection, shown: &str) -> Result<Option<Row>, LocalStoreError> {
        self.query_row(conn, QUERY_PATH_INFO, shown, || format!("querying the registration of {shown}"))
    }

    /// The one row `sql` (a [`select_path_info`] statement) finds for `param`, if any.
    fn query_row(&self, conn: &Connection, sql: &str, param: &str, err: impl Fn() -> String) -> Result<Option<Row>, LocalStoreError> {
        let mut stmt = conn.prepare_cached(sql).map_err(self.sql_err(&err))?;
        let row = stmt.query_row([param], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?, r.get(8)?, r.get(9)?))
        });
        row.optional().map_err(self.sql_err(err))
    }

    /// The registration of the valid path whose hash part is `hash_part` (32 nixbase32
    /// characters), if any, in one statement: one index seek to the first path not before
    /// `<store dir>/<hash part>`, which is that path if it starts with it (Nix's
    /// `queryPathFromHashPart`, then `queryPathInfo`).
    pub(super) fn path_info_from_hash_part(&self, hash_part: &str) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        if hash_part.len() != HASH_PART_LEN {
            return Ok(None);
        }
        let prefix = format!("{}/{hash_part}", self.store_dir.as_str());
        let row =
            self.query_row(&self.lock().conn, QUERY_PATH_INFO_FROM_HASH_PART, &prefix, || format!("looking up the hash part {hash_part}"))?;
        match row {
            Some(row) if row.0.starts_with(&prefix) => {
                let path = self.parse_path(&row.0, "path")?;
                let shown = row.0.clone();
                self.info_from_row(&path, &shown, Some(row))
            }
            _ => Ok(None),
        }
    }

    /// The path info of `path` (shown as `shown`) from its row.
    fn info_from_row(&self, path: &StorePath, shown: &str, row: Option<Row>) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        let Some((_, _, hash, registration_time, deriver, nar_size, ultimate, sigs, ca, references)) = row else {
            return Ok(None);
        };
        let references = references.unwrap_or_default();
        let nar_hash = Hash::parse(&hash).map_err(|e| self.corrupt(format!("hash of {shown}: {e}")))?;
        let nar_size = u64::try_from(nar_size.unwrap_or(0)).map_err(|_| self.corrupt(format!("narSize of {shown} is negative")))?;
        Ok(Some(ValidPathInfo {
            path: path.clone(),
            nar_hash,
            nar_size,
            references: references
                .split(' ')
                .filter(|r| !r.is_empty())
                .map(|r| self.parse_path(r, "reference"))
                .collect::<Result<_, _>>()?,
            deriver: deriver.filter(|d| !d.is_empty()).map(|d| self.parse_path(&d, "deriver")).transpose()?,
            registration_time,
            ultimate: ultimate == Some(1),
            sigs: sigs.iter().flat_map(|s| s.split(' ')).filter(|s| !s.is_empty()).map(str::to_owned).collect(),
            ca: ca
                .filter(|c| !c.is_empty())
                .map(|c| ContentAddress::parse(&c).map_err(|e| self.corrupt(format!("content address of {shown}: {e}"))))
                .transpose()?,
        }))
    }

    /// The subset of `paths` that is valid, read in one transaction.
    pub(super) fn valid_paths<'p>(
        &self,
        paths: impl ExactSizeIterator<Item = &'p StorePath>,
    ) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        let err = || "querying path validity".to_owned();
        let db = self.lock();
        let _snapshot = self.read_transaction(&db.conn, paths.len());
        let mut stmt = db.conn.prepare_cached(QUERY_ID).map_err(self.sql_err(err))?;
        let mut valid = BTreeSet::new();
        for path in paths {
            if stmt.exists([self.display(path)]).map_err(self.sql_err(err))? {
                valid.insert(path.clone());
            }
        }
        Ok(valid)
    }

    /// The valid paths that reference `path`.
    pub(super) fn referrers(&self, path: &StorePath) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        let shown = self.display(path);
        self.paths(QUERY_REFERRERS, Some(&shown), || format!("querying the referrers of {shown}"))
    }

    /// Every valid path.
    pub(super) fn all_valid_paths(&self) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.paths(QUERY_ALL, None, || "listing the valid paths".to_owned())
    }

    /// Runs a query selecting full store paths, with at most one parameter.
    pub(super) fn paths(&self, sql: &str, param: Option<&str>, what: impl Fn() -> String) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        let rows: Vec<String> = {
            let db = self.lock();
            let mut stmt = db.conn.prepare_cached(sql).map_err(self.sql_err(&what))?;
            let params: Vec<&str> = param.into_iter().collect();
            let rows = stmt.query_map(rusqlite::params_from_iter(params), |r| r.get(0));
            rows.and_then(|rows| rows.collect()).map_err(self.sql_err(&what))?
        };
        rows.iter().map(|p| self.parse_path(p, "path")).collect()
    }

    /// Registers `items` in one transaction, in the order given: each path's `ValidPaths`
    /// row, its references (the path itself included, if listed) and, for a derivation, its
    /// outputs. A reference must be valid already or come earlier in `items`; otherwise the
    /// whole transaction fails with [`LocalStoreError::MissingReference`]. A
    /// `registration_time` of 0 means now. Each statement is prepared once per call, and each
    /// reference's id looked up once (a path inserted earlier in `items` not at all).
    pub(super) fn register_all(&self, items: &[(&ValidPathInfo, Vec<(String, StorePath)>)]) -> Result<(), LocalStoreError> {
        let err = || format!("registering {} paths", items.len());
        let mut db = self.lock();
        let tx = db.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(self.sql_err(err))?;
        {
            let mut inserts = Inserts {
                registry: self,
                query_id: tx.prepare_cached(QUERY_ID).map_err(self.sql_err(err))?,
                register: tx.prepare_cached(REGISTER_VALID_PATH).map_err(self.sql_err(err))?,
                add_reference: tx.prepare_cached(ADD_REFERENCE).map_err(self.sql_err(err))?,
                add_output: tx.prepare_cached(ADD_DERIVATION_OUTPUT).map_err(self.sql_err(err))?,
                ids: HashMap::new(),
                now: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64),
            };
            for (info, outputs) in items {
                inserts.insert(info, outputs)?;
            }
        }
        tx.commit().map_err(self.sql_err(err))
    }
}

/// The statements of one [`Registry::register_all`] transaction, and the ids of the paths it
/// has looked up or inserted.
struct Inserts<'a> {
    registry: &'a Registry,
    query_id: rusqlite::CachedStatement<'a>,
    register: rusqlite::CachedStatement<'a>,
    add_reference: rusqlite::CachedStatement<'a>,
    add_output: rusqlite::CachedStatement<'a>,
    ids: HashMap<&'a StorePath, i64>,
    /// The registration time of a path registered with 0, in seconds since the epoch.
    now: i64,
}

impl<'a> Inserts<'a> {
    /// Inserts one path's rows.
    fn insert(&mut self, info: &'a ValidPathInfo, outputs: &[(String, StorePath)]) -> Result<(), LocalStoreError> {
        let registry = self.registry;
        let shown = registry.display(&info.path);
        let err = || format!("registering {shown}");
        let mut reference_ids = Vec::with_capacity(info.references.len());
        for reference in info.references.iter().filter(|r| **r != info.path) {
            let id = match self.ids.get(reference) {
                Some(id) => Some(*id),
                None => self.query_id.query_row([registry.display(reference)], |r| r.get(0)).optional().map_err(registry.sql_err(err))?,
            };
            let id = id.ok_or_else(|| LocalStoreError::MissingReference { path: shown.clone(), reference: registry.display(reference) })?;
            self.ids.insert(reference, id);
            reference_ids.push(id);
        }
        let registration_time = match info.registration_time {
            0 => self.now,
            t => t,
        };
        let sigs = info.sigs.iter().map(String::as_str).collect::<Vec<_>>().join(" ");
        let id = self
            .register
            .insert(params![
                shown,
                info.nar_hash.to_base16_prefixed(),
                registration_time,
                info.deriver.as_ref().map(|d| registry.display(d)),
                (info.nar_size != 0).then_some(info.nar_size as i64),
                info.ultimate.then_some(1),
                (!sigs.is_empty()).then_some(sigs),
                info.ca.as_ref().map(ContentAddress::to_string),
            ])
            .map_err(registry.sql_err(err))?;
        self.ids.insert(&info.path, id);
        if info.references.contains(&info.path) {
            reference_ids.push(id);
        }
        for reference_id in reference_ids {
            self.add_reference.execute([id, reference_id]).map_err(registry.sql_err(err))?;
        }
        for (name, output) in outputs {
            self.add_output.execute(params![id, name, registry.display(output)]).map_err(registry.sql_err(err))?;
        }
        Ok(())
    }
}
