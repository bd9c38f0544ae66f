//! `nix-cache-info`: `StoreDir`, `WantMassQuery`, `Priority`. Source: Nix
//! `src/libstore/binary-cache-store.cc`. And sluice's own `SluiceBatch` (`sluice serve`'s batch
//! endpoints), which Nix ignores as it ignores every key it does not know.
//!
//! Read as Nix 2.26's `BinaryCacheStore::init` reads it: lines are `Key: value`, the key is
//! everything before the first `:` (not trimmed: ` StoreDir: …` is an unknown key), the value
//! is trimmed of spaces, tabs, CR and LF; unknown keys and lines without `:` are ignored; absent
//! keys take Nix's defaults (`/nix/store`, no mass query, priority 50). `StoreDir` is compared
//! with the reader's store directory by the reader (`BinaryCache::check_store_dir`). Nix
//! compares every `StoreDir` line, so two lines that differ are refused here: no store
//! directory passes both (repeating one value is fine). Of several `Priority` or
//! `WantMassQuery` lines the last counts, as in Nix. An HTML page (a parked domain's, a
//! captive portal's) is refused, where Nix reads it as a file without fields.

use crate::quoted::Quoted;

/// A binary cache's `nix-cache-info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheInfo {
    /// `StoreDir:`, the store directory of the paths in the cache.
    pub store_dir: String,
    /// `WantMassQuery: 1`: the cache may be queried for many paths at once.
    pub want_mass_query: bool,
    /// Lower is preferred (negative values too); Nix's default is 50.
    pub priority: i32,
    /// `SluiceBatch: 1`: the cache answers `sluice serve`'s batch endpoints, version 1.
    pub batch: bool,
}

/// The key advertising `sluice serve`'s batch endpoints.
pub const BATCH_KEY: &str = "SluiceBatch";

impl Default for CacheInfo {
    fn default() -> Self {
        CacheInfo { store_dir: "/nix/store".into(), want_mass_query: false, priority: 50, batch: false }
    }
}

/// A malformed line (1-based) and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("nix-cache-info line {line}: {what}")]
pub struct CacheInfoError {
    pub line: usize,
    pub what: String,
}

impl CacheInfo {
    /// Parses the file; `line` in errors is 1-based.
    pub fn parse(text: &str) -> Result<Self, CacheInfoError> {
        // Nix 2.26 takes a page as a file without fields; its narinfos then fail one by one.
        if let Some(start) = crate::html_page(text) {
            let what = format!("the body is not a nix-cache-info but an HTML page ({start}): a parked domain or a captive portal answers every URL with one");
            return Err(CacheInfoError { line: 1, what });
        }
        let mut info = CacheInfo::default();
        // The first `StoreDir` line, 1-based.
        let mut store_dir_line = None;
        for (i, raw) in text.lines().enumerate() {
            let Some((key, value)) = raw.split_once(':') else { continue };
            let value = value.trim_matches([' ', '\t', '\r', '\n']);
            match key {
                "StoreDir" => match store_dir_line {
                    None => {
                        store_dir_line = Some(i + 1);
                        info.store_dir = value.to_owned();
                    }
                    Some(first) if info.store_dir != value => {
                        let what = format!(
                            "StoreDir {} differs from line {first}'s {} (Nix checks each StoreDir line against the store directory)",
                            Quoted(value),
                            Quoted(&info.store_dir)
                        );
                        return Err(CacheInfoError { line: i + 1, what });
                    }
                    Some(_) => {}
                },
                "WantMassQuery" => info.want_mass_query = value == "1",
                "Priority" => {
                    info.priority =
                        stoi(value).map_err(|what| CacheInfoError { line: i + 1, what: format!("Priority {}: {what}", Quoted(value)) })?
                }
                BATCH_KEY => info.batch = value == "1",
                _ => {}
            }
        }
        Ok(info)
    }

    /// Prints Nix's three fields, one per line, and `SluiceBatch: 1` when set.
    pub fn to_text(&self) -> String {
        let batch = if self.batch { format!("{BATCH_KEY}: 1\n") } else { String::new() };
        format!("StoreDir: {}\nWantMassQuery: {}\nPriority: {}\n{batch}", self.store_dir, u8::from(self.want_mass_query), self.priority)
    }
}

/// `value` as C++'s `std::stoi` reads it, which Nix uses for `Priority`: an optional sign and
/// the decimal digits that follow, anything after them ignored (`10 # main` is 10); no digits
/// or a value outside `int` is an error, as `stoi`'s exceptions are in Nix.
fn stoi(value: &str) -> Result<i32, &'static str> {
    let trimmed = value.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let sign_len = usize::from(trimmed.starts_with(['+', '-']));
    let digits = trimmed[sign_len..].bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err("not an integer (Nix's std::stoi throws invalid_argument)");
    }
    trimmed[..sign_len + digits].parse().map_err(|_| "out of the range of an int (Nix's std::stoi throws out_of_range)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_defaults() {
        let c = CacheInfo::parse("StoreDir: /nix/store\n").unwrap();
        assert_eq!(c, CacheInfo::default());
        let c = CacheInfo::parse("StoreDir: /gnu/store\r\nWantMassQuery: 1\nPriority: 40\njunk\nX: y").unwrap();
        assert_eq!(c, CacheInfo { store_dir: "/gnu/store".into(), want_mass_query: true, priority: 40, batch: false });
        assert_eq!(CacheInfo::parse(&c.to_text()).unwrap(), c);
        let b = CacheInfo::parse("StoreDir: /nix/store\nSluiceBatch: 1\n").unwrap();
        assert!(b.batch);
        assert_eq!(CacheInfo::parse(&b.to_text()).unwrap(), b);
        // As Nix 2.26 reads them: `std::stoi`'s priorities, the key untrimmed, any StoreDir
        // (its comparison is the reader's).
        assert_eq!(CacheInfo::parse("Priority: -1\n").unwrap().priority, -1);
        assert_eq!(CacheInfo::parse("Priority: +30 # fast mirror\n").unwrap().priority, 30);
        assert_eq!(CacheInfo::parse("Priority:\t7\r\n").unwrap().priority, 7);
        assert_eq!(
            CacheInfo::parse("Priority: x\n").unwrap_err(),
            CacheInfoError { line: 1, what: "Priority \"x\": not an integer (Nix's std::stoi throws invalid_argument)".into() }
        );
        assert_eq!(CacheInfo::parse("\n\nPriority: 2147483648\n").unwrap_err().line, 3);
        assert_eq!(CacheInfo::parse(" Priority: 1\nPriority : 2\n").unwrap().priority, 50);
        assert_eq!(CacheInfo::parse("StoreDir: rel\n").unwrap().store_dir, "rel");
        // Several StoreDir lines: each must be the store's (Nix 2.26 `BinaryCacheStore::init`).
        assert_eq!(CacheInfo::parse("StoreDir: /nix/store\nPriority: 3\nStoreDir: /nix/store \r\n").unwrap().priority, 3);
        assert_eq!(
            CacheInfo::parse("StoreDir: /nix/store\nPriority: 3\nStoreDir: /gnu/store\n").unwrap_err(),
            CacheInfoError { line: 3, what: "StoreDir \"/gnu/store\" differs from line 1's \"/nix/store\" (Nix checks each StoreDir line against the store directory)".into() }
        );
        assert_eq!(
            CacheInfo::parse("Priority: 1\nPriority: 2\nWantMassQuery: 1\nWantMassQuery: 0\n").unwrap(),
            CacheInfo { priority: 2, ..CacheInfo::default() }
        );
        // A parked domain's page (Nix reads it as a file without fields).
        let page = CacheInfo::parse("\n  <html><head><title>parked</title></head></html>\n").unwrap_err();
        assert_eq!(page.what, "the body is not a nix-cache-info but an HTML page ('<html><head><title>parked</title></head></html>'): a parked domain or a captive portal answers every URL with one");
        let corpus =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/corpus/cache-xz/nix-cache-info")).unwrap();
        assert_eq!(CacheInfo::parse(&corpus).unwrap(), CacheInfo::default());
    }
}
