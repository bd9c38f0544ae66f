//! Content addresses (`CA:` in narinfo, `ca` in the database): `fixed:<r:>?<algo>:<hash>` and
//! `text:sha256:<hash>`, and the store paths they imply. Source: Nix
//! `src/libstore/content-address.cc`, `store-api.cc` (`makeFixedOutputPath`, `makeTextPath`).
//!
//! Parsing accepts the digest in base16, nixbase32 or base64 (not SRI); printing uses
//! nixbase32, as Nix does.

use crate::hash::{Hash, HashAlgo};
use crate::quoted::Quoted;
use crate::store_path::{StoreDir, StorePath, StorePathError};

/// How a content-addressed path's hash was computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentAddress {
    /// `text:sha256:…`: the hash of a flat text file (`builtins.toFile`).
    Text(Hash),
    /// `fixed:…`: a fixed-output path; `recursive` means the hash is over the NAR.
    Fixed { recursive: bool, hash: Hash },
}

/// A string that is not a content address (the string itself).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid content address {}", Quoted(.0))]
pub struct ContentAddressError(pub String);

impl ContentAddress {
    /// Parses `text:sha256:<hash>`, `fixed:r:<algo>:<hash>` or `fixed:<algo>:<hash>`.
    pub fn parse(s: &str) -> Result<Self, ContentAddressError> {
        let err = || ContentAddressError(s.to_owned());
        let algo_hash = |rest: &str| -> Result<Hash, ContentAddressError> {
            let (algo, digest) = rest.split_once(':').ok_or_else(err)?;
            Hash::parse_bare(digest, HashAlgo::parse(algo).map_err(|_| err())?).map_err(|_| err())
        };
        if let Some(rest) = s.strip_prefix("text:") {
            let hash = algo_hash(rest)?;
            if hash.algo() != HashAlgo::Sha256 {
                return Err(err());
            }
            Ok(ContentAddress::Text(hash))
        } else if let Some(rest) = s.strip_prefix("fixed:") {
            match rest.strip_prefix("r:") {
                Some(rest) => Ok(ContentAddress::Fixed { recursive: true, hash: algo_hash(rest)? }),
                None => Ok(ContentAddress::Fixed { recursive: false, hash: algo_hash(rest)? }),
            }
        } else {
            Err(err())
        }
    }

    /// The hash this content address carries.
    pub fn hash(&self) -> &Hash {
        match self {
            ContentAddress::Text(h) | ContentAddress::Fixed { hash: h, .. } => h,
        }
    }

    /// The store path this content address implies for `name` with `references`
    /// (`self_ref`: the path references itself). Nix's `makeFixedOutputPathFromCA`.
    ///
    /// Errors (as [`StorePathError::BadName`]) when the combination is impossible in Nix: a
    /// text path referencing itself, or a flat / non-sha256 fixed path with references.
    pub fn store_path(
        &self,
        store_dir: &StoreDir,
        name: &str,
        references: &[StorePath],
        self_ref: bool,
    ) -> Result<StorePath, StorePathError> {
        let impossible = |why: &str| Err(StorePathError::BadName(name.to_owned(), why.to_owned()));
        match self {
            ContentAddress::Text(hash) => {
                if self_ref {
                    return impossible("a text content address cannot reference itself");
                }
                store_dir.make_store_path(&make_type(store_dir, "text", references, false), hash, name)
            }
            ContentAddress::Fixed { recursive: true, hash } if hash.algo() == HashAlgo::Sha256 => {
                store_dir.make_store_path(&make_type(store_dir, "source", references, self_ref), hash, name)
            }
            ContentAddress::Fixed { recursive, hash } => {
                if self_ref || !references.is_empty() {
                    return impossible("a flat or non-sha256 fixed output cannot have references");
                }
                let inner = format!("fixed:out:{}{}:", if *recursive { "r:" } else { "" }, hash.to_base16_prefixed());
                let inner = Hash::digest_bytes(HashAlgo::Sha256, inner.as_bytes());
                store_dir.make_store_path("output:out", &inner, name)
            }
        }
    }
}

/// Nix's `makeType`: `ty`, then `:<full path>` for each reference in sorted order, then
/// `:self` for a self-reference.
fn make_type(store_dir: &StoreDir, ty: &str, references: &[StorePath], self_ref: bool) -> String {
    let mut refs: Vec<&StorePath> = references.iter().collect();
    refs.sort();
    refs.dedup();
    let mut s = ty.to_owned();
    for r in refs {
        s.push(':');
        s.push_str(&store_dir.display_path(r));
    }
    if self_ref {
        s.push_str(":self");
    }
    s
}

impl std::fmt::Display for ContentAddress {
    /// `text:sha256:<nix32>` / `fixed:r:<algo>:<nix32>` / `fixed:<algo>:<nix32>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ContentAddress::Text(h) => write!(f, "text:{}", h.to_nix32_prefixed()),
            ContentAddress::Fixed { recursive, hash } => {
                write!(f, "fixed:{}{}", if *recursive { "r:" } else { "" }, hash.to_nix32_prefixed())
            }
        }
    }
}

impl std::str::FromStr for ContentAddress {
    type Err = ContentAddressError;
    fn from_str(s: &str) -> Result<Self, ContentAddressError> {
        ContentAddress::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_print() {
        for s in [
            "fixed:r:sha256:0ldmcjxf2xlmr1i9p8cxglag3pnxk2rxxnwhd0z3psi0rzfr4h9l",
            "fixed:sha256:0zsrj1mh10ncradsx995y07mdi67kq8dfbd65kh0ypnp8zqsl2r0",
            "text:sha256:1r8mc7ks9pkafbawdam8151k6c6pbcr7a7r75nf57pwbwzj3x79n",
        ] {
            assert_eq!(ContentAddress::parse(s).unwrap().to_string(), s);
        }
        let hex = Hash::digest_bytes(HashAlgo::Sha1, b"x").to_base16();
        let ca = ContentAddress::parse(&format!("fixed:r:sha1:{hex}")).unwrap();
        assert_eq!(ca, ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha1, b"x") });
        for bad in [
            "",
            "text:",
            "text:sha1:".to_owned().as_str(),
            "fixed:r:",
            "fixed:sha256:abc",
            "blob:sha256:x",
            "text:sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=",
        ] {
            assert!(ContentAddress::parse(bad).is_err(), "{bad}");
        }
        let sha1_text = format!("text:sha1:{hex}");
        assert!(ContentAddress::parse(&sha1_text).is_err());
    }

    #[test]
    fn impossible_combinations() {
        let d = StoreDir::default();
        let h = Hash::digest_bytes(HashAlgo::Sha256, b"x");
        let r = StorePath::from_base_name("0za6hhg5kdh6vk2ds8m40snyz7aar7a1-udev-rules-src").unwrap();
        assert!(ContentAddress::Text(h.clone()).store_path(&d, "a", &[], true).is_err());
        assert!(ContentAddress::Fixed { recursive: false, hash: h }.store_path(&d, "a", &[r], false).is_err());
    }
}
