//! Nix's store database (`nix/var/nix/db/db.sqlite`), schema version 10 as in Nix 2.8
//! (`src/libstore/schema.sql`, `local-store.cc`: `openDB`). The `schema` file next to the
//! database holds the version; a store without it is new and gets the tables created.
//!
//! The connection is set up as Nix sets up its own so both can use the store at once: foreign
//! keys on, `synchronous = normal`, WAL journal with a 40000-page auto-checkpoint, and a long
//! busy timeout (Nix waits up to an hour for a locked database).

use std::fs;
use std::io;
use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::lock::{hold_shared, relock};
use super::{io_err, LocalStoreError};

/// The schema version Nix 2.8 writes and reads (`nixSchemaVersion`).
pub(super) const SCHEMA_VERSION: u32 = 10;

/// How long a statement waits for another process's lock on the database (Nix: one hour).
const BUSY_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// Tables, indexes and the trigger of schema 10. Same tables, columns, keys and names as Nix's
/// `schema.sql` (Nix 2.8), which Nix relies on when it opens the database.
const SCHEMA_SQL: &str = "
create table if not exists ValidPaths (
    id               integer primary key autoincrement not null,
    path             text unique not null,
    hash             text not null,
    registrationTime integer not null,
    deriver          text,
    narSize          integer,
    ultimate         integer,
    sigs             text,
    ca               text
);

create table if not exists Refs (
    referrer  integer not null,
    reference integer not null,
    primary key (referrer, reference),
    foreign key (referrer) references ValidPaths(id) on delete cascade,
    foreign key (reference) references ValidPaths(id) on delete restrict
);

create index if not exists IndexReferrer on Refs(referrer);
create index if not exists IndexReference on Refs(reference);

create trigger if not exists DeleteSelfRefs before delete on ValidPaths
  begin
    delete from Refs where referrer = old.id and reference = old.id;
  end;

create table if not exists DerivationOutputs (
    drv  integer not null,
    id   text not null,
    path text not null,
    primary key (drv, id),
    foreign key (drv) references ValidPaths(id) on delete cascade
);

create index if not exists IndexDerivationOutputs on DerivationOutputs(path);
";

/// An open store database and the shared `big-lock` held while it is open (none when it is
/// read-only).
pub(super) struct Database {
    pub(super) conn: Connection,
    _big_lock: Option<fs::File>,
}

/// Opens the existing database in `db_dir` as Nix's `read-only` mode does
/// (`src/libstore/local-store.cc`, `openDB`): SQLite's `immutable` mode, no big-lock, nothing
/// created or changed.
pub(super) fn open_read_only(db_dir: &Path) -> Result<Database, LocalStoreError> {
    let schema_path = db_dir.join("schema");
    let db_path = db_dir.join("db.sqlite");
    let found = fs::read_to_string(&schema_path).map_err(io_err("reading (the store is read-only, so it is not created)", &schema_path))?;
    if found.trim() != SCHEMA_VERSION.to_string() {
        return Err(LocalStoreError::Schema { path: schema_path, found: found.trim().to_owned() });
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let uri = format!("file:{}?immutable=1", uri_path(&db_path));
    let db_err = |what: &'static str| {
        let db = db_path.clone();
        move |source| LocalStoreError::Db { db, what: what.to_owned(), source }
    };
    let conn = Connection::open_with_flags(&uri, flags).map_err(db_err("opening read-only"))?;
    conn.set_prepared_statement_cache_capacity(32);
    conn.pragma_update(None, "foreign_keys", 1).map_err(db_err("enabling foreign keys"))?;
    Ok(Database { conn, _big_lock: None })
}

/// `path` for an SQLite `file:` URI: `?`, `#` and `%` percent-encoded.
fn uri_path(path: &Path) -> String {
    let text = path.to_string_lossy();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '?' | '#' | '%' => out.push_str(&format!("%{:02X}", c as u32)),
            _ => out.push(c),
        }
    }
    out
}

/// Opens (creating if the store is new) the database in `db_dir`.
pub(super) fn open(db_dir: &Path) -> Result<Database, LocalStoreError> {
    let big_lock_path = db_dir.join("big-lock");
    let big_lock = hold_shared(&big_lock_path).map_err(io_err("locking", &big_lock_path))?;

    let schema_path = db_dir.join("schema");
    let db_path = db_dir.join("db.sqlite");
    let read_schema = || match fs::read_to_string(&schema_path) {
        Ok(text) if text.trim() == SCHEMA_VERSION.to_string() => Ok(false),
        Ok(text) => Err(LocalStoreError::Schema { path: schema_path.clone(), found: text.trim().to_owned() }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(io_err("reading", &schema_path)(e)),
    };
    // A new store is created under the exclusive big-lock, as Nix does, so that processes
    // opening it at the same moment wait and then find it complete.
    let mut new_store = read_schema()?;
    if new_store {
        relock(&big_lock, true).map_err(io_err("locking", &big_lock_path))?;
        new_store = read_schema()?;
    }

    let db_err = |what: &'static str| {
        let db = db_path.clone();
        move |source| LocalStoreError::Db { db, what: what.to_owned(), source }
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(&db_path, flags).map_err(db_err("opening"))?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db_err("setting the busy timeout"))?;
    conn.set_prepared_statement_cache_capacity(32);
    conn.pragma_update(None, "foreign_keys", 1).map_err(db_err("enabling foreign keys"))?;
    conn.pragma_update(None, "synchronous", "normal").map_err(db_err("setting synchronous mode"))?;
    let mode: String = conn.pragma_query_value(None, "journal_mode", |row| row.get(0)).map_err(db_err("querying the journal mode"))?;
    if mode != "wal" {
        conn.pragma_update_and_check(None, "journal_mode", "wal", |_| Ok(())).map_err(db_err("setting the WAL journal mode"))?;
    }
    conn.pragma_update_and_check(None, "wal_autocheckpoint", 40000, |_| Ok(())).map_err(db_err("setting the auto-checkpoint interval"))?;
    if new_store {
        conn.execute_batch(SCHEMA_SQL).map_err(db_err("creating the schema"))?;
        // Written under another name and renamed, so that a process opening the new store at
        // the same moment sees no file or the whole version, never an empty one.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = db_dir.join(format!(".schema.{}.{n}", std::process::id()));
        fs::write(&temp, SCHEMA_VERSION.to_string())
            .and_then(|()| fs::rename(&temp, &schema_path))
            .map_err(io_err("writing", &schema_path))?;
    }
    relock(&big_lock, false).map_err(io_err("locking", &big_lock_path))?;
    Ok(Database { conn, _big_lock: Some(big_lock) })
}
