//! Store paths (`/nix/store/<32-char nixbase32 hash part>-<name>`), validated by Nix's rules
//! 2.26 (`src/libstore/path.cc`): hash part of 32 nixbase32 characters, name of 1–211
//! characters from `[A-Za-z0-9+-._?=]` whose first dash-separated component is not `.` or `..`
//! (Nix 2.8 allowed those too; `.foo` and `...` are fine in both).

use crate::base32;
use crate::hash::{Hash, HashAlgo};
use crate::quoted::Quoted;

/// Length of a store path's hash part in characters.
pub const HASH_PART_LEN: usize = 32;

/// Longest name Nix allows after the hash part (`StorePath::MaxPathLen`).
pub(crate) const MAX_NAME_LEN: usize = 211;

/// A store path without its store directory: hash part and name. Ordered as Nix orders the full
/// paths within one store directory (byte order of the base name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorePath {
    base_name: String,
}

/// Errors validating a store path.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StorePathError {
    #[error("store path {} is too short", Quoted(.0))]
    TooShort(String),
    #[error("store path {} has an invalid hash part", Quoted(.0))]
    BadHashPart(String),
    #[error("store path {path} has an invalid name: {why}", path = Quoted(.0), why = .1)]
    BadName(String, String),
    #[error("path {} is not in the store directory {}", Quoted(.path), Quoted(.store_dir))]
    NotInStore { path: String, store_dir: String },
}

/// Why a base name without `-` after its hash part is refused. Nix 2.26's `StorePath` takes
/// any character there (`path.cc`), but every path it makes has a `-`, and a binary cache
/// keys narinfos by the hash part alone: `<hash>_x` would stand for `<hash>-x`'s narinfo.
const NO_DASH: &str = "no '-' after the hash part (Nix 2.26 does not check it, but every path Nix makes has it, and caches find paths by the hash part alone)";

/// Checks a store path name (the part after `<hash>-`); `path` is only for the error.
pub(crate) fn check_name(path: &str, name: &str) -> Result<(), StorePathError> {
    let bad = |why: &str| Err(StorePathError::BadName(path.to_owned(), why.to_owned()));
    if name.is_empty() {
        return bad("empty name");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("name longer than 211 characters");
    }
    match name.split('-').next() {
        Some(".") => return bad("the first dash-separated component must not be '.'"),
        Some("..") => return bad("the first dash-separated component must not be '..'"),
        _ => {}
    }
    // Named as Nix 2.26 names it ("contains illegal character"), with where it is.
    if let Some((at, c)) = name.char_indices().find(|&(_, c)| !(c.is_ascii_alphanumeric() || "+-._?=".contains(c))) {
        return bad(&format!("illegal character '{}' at byte {at} of the name (allowed: A-Z a-z 0-9 + - . _ ? =)", c.escape_debug()));
    }
    Ok(())
}

impl StorePath {
    /// Parses `<hash>-<name>`.
    pub fn from_base_name(s: &str) -> Result<Self, StorePathError> {
        if s.len() < HASH_PART_LEN + 2 {
            return Err(StorePathError::TooShort(s.to_owned()));
        }
        let (hash, rest) = match (s.get(..HASH_PART_LEN), s.get(HASH_PART_LEN..)) {
            (Some(h), Some(r)) => (h, r),
            _ => return Err(StorePathError::BadHashPart(s.to_owned())),
        };
        // 32 digits encode exactly 160 bits: any digits decode.
        if !base32::is_digits(hash) {
            return Err(StorePathError::BadHashPart(s.to_owned()));
        }
        let name = rest.strip_prefix('-').ok_or_else(|| StorePathError::BadName(s.to_owned(), NO_DASH.to_owned()))?;
        check_name(s, name)?;
        Ok(StorePath { base_name: s.to_owned() })
    }
    /// The 32-character hash part.
    pub fn hash_part(&self) -> &str {
        &self.base_name[..HASH_PART_LEN]
    }
    /// The name after the hash part and dash.
    pub fn name(&self) -> &str {
        &self.base_name[HASH_PART_LEN + 1..]
    }
    /// `<hash>-<name>`.
    pub fn base_name(&self) -> &str {
        &self.base_name
    }
    /// Whether the name ends in `.drv`.
    pub fn is_derivation(&self) -> bool {
        self.name().ends_with(".drv")
    }
    /// Builds a path from a 20-byte digest and a name (Nix's `StorePath(hash, name)`).
    pub fn from_digest(digest: &[u8; 20], name: &str) -> Result<Self, StorePathError> {
        let base_name = format!("{}-{}", base32::encode(digest), name);
        check_name(&base_name, name)?;
        Ok(StorePath { base_name })
    }
    /// The 20-byte digest the hash part encodes.
    pub fn digest(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        if let Ok(d) = base32::decode(self.hash_part()) {
            if d.len() == 20 {
                out.copy_from_slice(&d);
            }
        }
        out
    }
}

impl std::fmt::Display for StorePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.base_name)
    }
}

impl std::str::FromStr for StorePath {
    type Err = StorePathError;
    /// Parses a base name `<hash>-<name>`.
    fn from_str(s: &str) -> Result<Self, StorePathError> {
        StorePath::from_base_name(s)
    }
}

/// Folds a digest to `n` bytes by XOR, as Nix's `compressHash`.
pub(crate) fn compress_hash(digest: &[u8], n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    if n == 0 {
        return out;
    }
    for (i, b) in digest.iter().enumerate() {
        if let Some(o) = out.get_mut(i % n) {
            *o ^= b;
        }
    }
    out
}

/// A store directory such as `/nix/store` (the logical one, as written in paths).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreDir(String);

impl Default for StoreDir {
    fn default() -> Self {
        StoreDir("/nix/store".into())
    }
}

impl StoreDir {
    /// A store directory: absolute, no trailing slash.
    pub fn new(dir: &str) -> Result<Self, StorePathError> {
        let bad = || StorePathError::NotInStore { path: dir.to_owned(), store_dir: "an absolute directory without trailing slash".into() };
        if !dir.starts_with('/') || dir.ends_with('/') || dir.contains("//") || dir.contains('\0') {
            return Err(bad());
        }
        Ok(StoreDir(dir.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The part of `path` after `<dir>/`.
    fn strip<'a>(&self, path: &'a str) -> Result<&'a str, StorePathError> {
        path.strip_prefix(self.0.as_str())
            .and_then(|r| r.strip_prefix('/'))
            .ok_or_else(|| StorePathError::NotInStore { path: path.to_owned(), store_dir: self.0.clone() })
    }
    /// Parses a full path `<dir>/<hash>-<name>` (no trailing components).
    pub fn parse_path(&self, path: &str) -> Result<StorePath, StorePathError> {
        StorePath::from_base_name(self.strip(path)?)
    }
    /// Parses a path inside a store path (`<dir>/<hash>-<name>/sub/dir`) to its store path.
    pub fn to_store_path(&self, path: &str) -> Result<StorePath, StorePathError> {
        let rest = self.strip(path)?;
        StorePath::from_base_name(rest.split('/').next().unwrap_or(rest))
    }
    /// `<dir>/<base name>`.
    pub fn display_path(&self, path: &StorePath) -> String {
        // Not `format!`: this runs for every path of every daemon reply and registry look-up.
        let mut s = String::with_capacity(self.0.len() + 1 + path.base_name().len());
        s.push_str(&self.0);
        s.push('/');
        s.push_str(path.base_name());
        s
    }
    /// Nix's `makeStorePath(type, hash, name)`: sha256 of `type:sha256:<base16>:<dir>:<name>`
    /// folded to 20 bytes. `type` includes any `:<ref>` suffixes.
    pub fn make_store_path(&self, ty: &str, hash: &crate::hash::Hash, name: &str) -> Result<StorePath, StorePathError> {
        let s = format!("{}:{}:{}:{}", ty, hash.to_base16_prefixed(), self.0, name);
        let h = Hash::digest_bytes(HashAlgo::Sha256, s.as_bytes());
        let mut d = [0u8; 20];
        d.copy_from_slice(&compress_hash(h.digest(), 20));
        StorePath::from_digest(&d, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "433r6hrfzj8vvazpcnl77q6m3lm3vw3g-nixos-system-nixos-23.05.20230726.b34b83f";

    #[test]
    fn parses_valid() {
        let p = StorePath::from_base_name(P).unwrap();
        assert_eq!(p.hash_part(), "433r6hrfzj8vvazpcnl77q6m3lm3vw3g");
        assert_eq!(p.name(), "nixos-system-nixos-23.05.20230726.b34b83f");
        assert!(!p.is_derivation());
        assert_eq!(StorePath::from_digest(&p.digest(), p.name()).unwrap(), p);
        let d = StoreDir::default();
        assert_eq!(d.parse_path(&format!("/nix/store/{P}")).unwrap(), p);
        assert_eq!(d.to_store_path(&format!("/nix/store/{P}/bin/sh")).unwrap(), p);
        assert_eq!(d.to_store_path(&format!("/nix/store/{P}")).unwrap(), p);
        assert_eq!(d.display_path(&p), format!("/nix/store/{P}"));
        assert!(StorePath::from_base_name("00000000000000000000000000000000-a+b-c._?=").is_ok());
    }

    #[test]
    fn rejects_invalid() {
        use StorePathError::*;
        assert!(matches!(StorePath::from_base_name("abc"), Err(TooShort(_))));
        assert!(matches!(StorePath::from_base_name("e33r6hrfzj8vvazpcnl77q6m3lm3vw3g-x"), Err(BadHashPart(_))));
        assert!(matches!(StorePath::from_base_name("433r6hrfzj8vvazpcnl77q6m3lm3vw3g_x"), Err(BadName(..))));
        assert!(matches!(StorePath::from_base_name("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-a/b"), Err(BadName(..))));
        assert!(matches!(StorePath::from_base_name("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-a\r"), Err(BadName(..))));
        assert!(StorePath::from_base_name("433r6hrfzj8vvazpcnl77q6m3lm3vw3é-a").is_err());
        assert_eq!(
            StorePath::from_base_name("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-hello world").unwrap_err().to_string(),
            "store path \"433r6hrfzj8vvazpcnl77q6m3lm3vw3g-hello world\" has an invalid name: illegal character ' ' at byte 5 of the name (allowed: A-Z a-z 0-9 + - . _ ? =)"
        );
        let long = format!("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-{}", "a".repeat(212));
        // Nix 2.26's rule for names beginning with a period.
        for name in [".", "..", ".-x", "..-x"] {
            assert!(StorePath::from_base_name(&format!("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-{name}")).is_err(), "{name}");
        }
        for name in [".foo", "...", "..x", "a-.-b"] {
            assert!(StorePath::from_base_name(&format!("433r6hrfzj8vvazpcnl77q6m3lm3vw3g-{name}")).is_ok(), "{name}");
        }
        assert!(matches!(StorePath::from_base_name(&long), Err(BadName(..))));
        assert!(StorePath::from_base_name(&long[..long.len() - 1]).is_ok());
        let d = StoreDir::default();
        assert!(matches!(d.parse_path(&format!("/nix/stor/{P}")), Err(NotInStore { .. })));
        assert!(d.parse_path(&format!("/nix/store/{P}/bin")).is_err());
        assert!(StoreDir::new("nix/store").is_err());
        assert!(StoreDir::new("/nix/store/").is_err());
        assert_eq!(StoreDir::new("/nix/store").unwrap(), d);
    }

    #[test]
    fn make_store_path_matches_nix() {
        // The corpus' `udev-rules.conf` (`builtins.toFile`, CA `text:sha256:1r8m…`), which
        // references `…-udev-rules-src`.
        let h = Hash::parse("sha256:1r8mc7ks9pkafbawdam8151k6c6pbcr7a7r75nf57pwbwzj3x79n").unwrap();
        let ty = "text:/nix/store/0za6hhg5kdh6vk2ds8m40snyz7aar7a1-udev-rules-src";
        let p = StoreDir::default().make_store_path(ty, &h, "udev-rules.conf").unwrap();
        assert_eq!(p.base_name(), "2bvi3293ai6jdq2fbcix6d4xchrsw3a1-udev-rules.conf");
        assert_eq!(compress_hash(&[1, 2, 3], 2), [1 ^ 3, 2]);
    }
}
