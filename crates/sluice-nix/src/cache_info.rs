//! `nix-cache-info`: `StoreDir`, `WantMassQuery`, `Priority`. Source: Nix
//! `src/libstore/binary-cache-store.cc`.
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
}

impl Default for CacheInfo {
    fn default() -> Self { CacheInfo { store_dir: "/nix/store".into(), want_mass_query: false, priority: 50 } }
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
                _ => {}
            }
        }
        Ok(info)
    }

    /// Prints all three fields, one per line.
    pub fn to_text(&self) -> String {
        format!(
            "StoreDir: {}\nWantMassQuery: {}\nPriority: {}\n",
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
        assert_eq!(c, CacheInfo { store_dir: "/gnu/store".into(), want_mass_query: true, priority: 40 });
        assert_eq!(CacheInfo::parse(&c.to_text()).unwrap(), c);
        assert_eq!(CacheInfo::parse("Priority: -1\n").unwrap_err().line, 1);
        assert!(CacheInfo::parse("\nStoreDir: rel\n").is_err());
        let corpus = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/corpus/cache-xz/nix-cache-info")).unwrap();
        assert_eq!(CacheInfo::parse(&corpus).unwrap(), CacheInfo::default());
    }
}
