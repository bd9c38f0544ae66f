//! `nix-cache-info`: `StoreDir`, `WantMassQuery`, `Priority`. Source: Nix
//! `src/libstore/binary-cache-store.cc`. And sluice's own `SluiceBatch` (`sluice serve`'s batch
//! endpoints), which Nix ignores as it ignores every key it does not know.
//!
//! Lines are `Key: value`; unknown keys and lines without `:` are ignored (as Nix does),
//! absent keys take Nix's defaults (`/nix/store`, no mass query, priority 50).

/// A binary cache's `nix-cache-info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheInfo {
    /// `StoreDir:`, the store directory of the paths in the cache.
    pub store_dir: String,
    /// `WantMassQuery: 1`: the cache may be queried for many paths at once.
    pub want_mass_query: bool,
    /// Lower is preferred; Nix's default is 50.
    pub priority: u64,
    /// `SluiceBatch: 1`: the cache answers `sluice serve`'s batch endpoints, version 1.
    pub batch: bool,
}

/// The key advertising `sluice serve`'s batch endpoints.
pub const BATCH_KEY: &str = "SluiceBatch";

impl Default for CacheInfo {
    fn default() -> Self { CacheInfo { store_dir: "/nix/store".into(), want_mass_query: false, priority: 50, batch: false } }
}

/// A malformed line (1-based) and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("nix-cache-info line {line}: {what}")]
pub struct CacheInfoError { pub line: usize, pub what: String }

impl CacheInfo {
    /// Parses the file; `line` in errors is 1-based.
    pub fn parse(text: &str) -> Result<Self, CacheInfoError> {
        let mut info = CacheInfo::default();
        for (i, raw) in text.lines().enumerate() {
            let Some((key, value)) = raw.split_once(':') else { continue };
            let (key, value) = (key.trim(), value.trim());
            let err = |what: String| CacheInfoError { line: i + 1, what };
            match key {
                "StoreDir" => {
                    if !value.starts_with('/') {
                        return Err(err(format!("StoreDir {value:?} is not an absolute path")));
                    }
                    info.store_dir = value.to_owned();
                }
                "WantMassQuery" => info.want_mass_query = value == "1",
                "Priority" => {
                    info.priority = value.parse().map_err(|_| err(format!("Priority {value:?} is not a non-negative integer")))?
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
        format!(
            "StoreDir: {}\nWantMassQuery: {}\nPriority: {}\n{batch}",
            self.store_dir,
            u8::from(self.want_mass_query),
            self.priority
        )
    }
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
        assert_eq!(CacheInfo::parse("Priority: -1\n").unwrap_err().line, 1);
        assert!(CacheInfo::parse("\nStoreDir: rel\n").is_err());
        let corpus = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/corpus/cache-xz/nix-cache-info")).unwrap();
        assert_eq!(CacheInfo::parse(&corpus).unwrap(), CacheInfo::default());
    }
}
