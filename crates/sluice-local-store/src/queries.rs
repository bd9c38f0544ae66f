//! Registry queries beyond path info and validity, with the statements Nix 2.8 uses
//! (`src/libstore/local-store.cc`): signatures added to a valid path (`addSignatures`), the
//! `DerivationOutputs` table both ways (`queryValidDerivers`,
//! `queryPartialDerivationOutputMap`), and the collector's invalidation
//! (`invalidatePathChecked`).

use std::collections::{BTreeMap, BTreeSet};

use rusqlite::{params, OptionalExtension, TransactionBehavior};
use sluice_nix::store_path::StorePath;

use super::registry::Registry;
use super::LocalStoreError;

const QUERY_SIGS: &str = "select sigs from ValidPaths where path = ?";
const UPDATE_SIGS: &str = "update ValidPaths set sigs = ? where path = ?";
const QUERY_VALID_DERIVERS: &str = "select v.path from DerivationOutputs d join ValidPaths v on d.drv = v.id where d.path = ?";
const QUERY_DERIVATION_OUTPUTS: &str = "select d.id, d.path from DerivationOutputs d join ValidPaths v on d.drv = v.id where v.path = ?";
/// Nix's `InvalidatePath`: the foreign keys delete the path's `Refs` (as referrer) and
/// `DerivationOutputs` rows with it.
const INVALIDATE_PATH: &str = "delete from ValidPaths where path = ?";

impl Registry {
    /// Adds `sigs` to the signatures of the valid path `path` (a set: duplicates are kept
    /// once), in one transaction. Fails with [`LocalStoreError::NotValid`] if `path` is not
    /// registered.
    pub(super) fn add_signatures(&self, path: &StorePath, sigs: &BTreeSet<String>) -> Result<(), LocalStoreError> {
        let shown = self.display(path);
        let err = || format!("adding signatures to {shown}");
        let mut db = self.lock();
        let tx = db.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(self.sql_err(err))?;
        let current: Option<Option<String>> = tx.query_row(QUERY_SIGS, [&shown], |r| r.get(0)).optional().map_err(self.sql_err(err))?;
        let Some(current) = current else {
            return Err(LocalStoreError::NotValid { path: shown });
        };
        let mut all: BTreeSet<&str> = current.iter().flat_map(|s| s.split(' ')).filter(|s| !s.is_empty()).collect();
        all.extend(sigs.iter().map(String::as_str).filter(|s| !s.is_empty()));
        let joined = all.into_iter().collect::<Vec<_>>().join(" ");
        tx.execute(UPDATE_SIGS, params![(!joined.is_empty()).then_some(&joined), shown]).map_err(self.sql_err(err))?;
        tx.commit().map_err(self.sql_err(err))
    }

    /// Unregisters `path` if it is valid and no other valid path references it, in one
    /// transaction (Nix's `invalidatePathChecked`); fails with [`LocalStoreError::PathInUse`]
    /// naming the referrers otherwise.
    pub(super) fn invalidate_checked(&self, path: &StorePath) -> Result<(), LocalStoreError> {
        let shown = self.display(path);
        let err = || format!("invalidating {shown}");
        let mut db = self.lock();
        let tx = db.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(self.sql_err(err))?;
        let referrers: Vec<String> = {
            let mut stmt = tx.prepare_cached(super::registry::QUERY_REFERRERS).map_err(self.sql_err(err))?;
            let rows = stmt.query_map([&shown], |r| r.get(0));
            rows.and_then(|rows| rows.collect()).map_err(self.sql_err(err))?
        };
        let others: Vec<String> = referrers.into_iter().filter(|r| *r != shown).map(|r| format!("'{r}'")).collect();
        if !others.is_empty() {
            return Err(LocalStoreError::PathInUse { path: shown, referrers: others.join(", ") });
        }
        tx.execute(INVALIDATE_PATH, [&shown]).map_err(self.sql_err(err))?;
        tx.commit().map_err(self.sql_err(err))
    }

    /// The valid derivations that list `path` as an output.
    pub(super) fn valid_derivers(&self, path: &StorePath) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        let shown = self.display(path);
        self.paths(QUERY_VALID_DERIVERS, Some(&shown), || format!("querying the derivers of {shown}"))
    }

    /// Output name → output path of the valid derivation `drv`, as registered (outputs whose
    /// path the derivation does not fix are not registered, as in Nix without
    /// `ca-derivations`). `None` if `drv` is not valid.
    pub(super) fn derivation_outputs(&self, drv: &StorePath) -> Result<Option<BTreeMap<String, StorePath>>, LocalStoreError> {
        let shown = self.display(drv);
        let err = || format!("querying the outputs of {shown}");
        let rows: Vec<(String, String)> = {
            let db = self.lock();
            let mut valid = db.conn.prepare_cached("select 1 from ValidPaths where path = ?").map_err(self.sql_err(err))?;
            if !valid.exists([&shown]).map_err(self.sql_err(err))? {
                return Ok(None);
            }
            let mut stmt = db.conn.prepare_cached(QUERY_DERIVATION_OUTPUTS).map_err(self.sql_err(err))?;
            let rows = stmt.query_map([&shown], |r| Ok((r.get(0)?, r.get(1)?)));
            rows.and_then(|rows| rows.collect()).map_err(self.sql_err(err))?
        };
        let outputs = rows.into_iter().map(|(name, path)| Ok((name, self.parse_path(&path, "output path")?)));
        outputs.collect::<Result<_, LocalStoreError>>().map(Some)
    }
}
