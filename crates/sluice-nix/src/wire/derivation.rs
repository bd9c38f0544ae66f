//! Derivations on the wire: a `BasicDerivation` as BuildDerivation sends it (Nix
//! `derivations.cc`, `readDerivation`/`writeDerivation`, and `parseDerivationOutput` for the
//! kinds of output) and derivation output ids (`DrvOutput`, `realisation.cc`).
//!
//! A basic derivation is: a count of outputs, each (name, path, hash algorithm, hash); the
//! input sources as a store path set; platform; builder; arguments (a string list); and the
//! environment (a count of string pairs). Its name is not sent: it is the `.drv` path's name
//! without the extension.

use std::collections::BTreeSet;
use std::io::{Read, Write};

use super::primitives::{
    read_count, read_string, read_string_pairs, read_strings, write_bytes, write_string_pairs, write_strings, write_u64,
};
use super::types::{read_store_path_set, write_store_path_set, MAX_PATH_LEN};
use super::WireError;
use crate::content_address::ContentAddress;
use crate::hash::{Hash, HashAlgo};
use crate::store_path::{check_name, StoreDir, StorePath, StorePathError};

/// Most outputs, arguments or environment variables accepted in one derivation.
const MAX_ITEMS: u64 = 1 << 20;
/// Longest argument or environment string accepted, in bytes.
const MAX_VALUE_LEN: u64 = 64 << 20;
/// Longest output name, hash algorithm, hash or platform accepted, in bytes.
const MAX_FIELD_LEN: u64 = 4096;

/// How one output's path is determined (`DerivationOutput` in Nix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputKind {
    /// Input-addressed: the path is given.
    InputAddressed(StorePath),
    /// Fixed-output: the path follows from the content address (the path the client sent is
    /// not trusted, as in Nix, and not kept).
    Fixed(ContentAddress),
    /// Floating content-addressed (`ca-derivations`): method and algorithm (`r:sha256`), no
    /// path before it is built.
    Floating(String),
    /// Input-addressed but not yet known (it depends on a floating output): no path.
    Deferred,
    /// Impure (`impure-derivations`): method and algorithm, no path.
    Impure(String),
}

/// One output of a basic derivation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivationOutput {
    pub name: String,
    pub kind: OutputKind,
}

/// A derivation as BuildDerivation carries it (Nix's `BasicDerivation` without its name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BasicDerivation {
    /// The outputs, in the order sent (names are unique).
    pub outputs: Vec<DerivationOutput>,
    pub input_srcs: BTreeSet<StorePath>,
    pub platform: String,
    pub builder: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl BasicDerivation {
    /// Whether every output is content-addressed (fixed, floating or impure), so that the
    /// derivation's claim on its output paths needs no trust (Nix's `DerivationType::isCA`).
    pub fn is_content_addressed(&self) -> bool {
        !self.outputs.is_empty()
            && self.outputs.iter().all(|o| matches!(o.kind, OutputKind::Fixed(_) | OutputKind::Floating(_) | OutputKind::Impure(_)))
    }
}

impl DerivationOutput {
    /// [`OutputKind::path`] of this output.
    pub fn path(&self, dir: &StoreDir, drv_name: &str) -> Result<Option<StorePath>, StorePathError> {
        self.kind.path(dir, drv_name, &self.name)
    }
}

/// Nix's `outputPathName`: `<drv name>` for the output `out`, else `<drv name>-<output>`.
pub fn output_path_name(drv_name: &str, output: &str) -> String {
    if output == "out" {
        drv_name.to_owned()
    } else {
        format!("{drv_name}-{output}")
    }
}

impl OutputKind {
    /// The path of the output `output` of the derivation named `drv_name` (the `.drv` name
    /// without the extension), if it is known before building: given for input-addressed
    /// outputs, computed for fixed ones ([`output_path_name`]; Nix's
    /// `DerivationOutput::path`).
    pub fn path(&self, dir: &StoreDir, drv_name: &str, output: &str) -> Result<Option<StorePath>, StorePathError> {
        match self {
            OutputKind::InputAddressed(p) => Ok(Some(p.clone())),
            OutputKind::Fixed(ca) => ca.store_path(dir, &output_path_name(drv_name, output), &[], false).map(Some),
            OutputKind::Floating(_) | OutputKind::Deferred | OutputKind::Impure(_) => Ok(None),
        }
    }

    /// The hash algorithm and hash fields Nix writes for this kind (`writeDerivation`,
    /// `Derivation::unparse`): `r:`/`text:` method and algorithm, and the base16 hash of a
    /// fixed output; the method and algorithm of a floating or impure one (`impure` as hash).
    pub fn algo_and_hash(&self) -> (String, String) {
        match self {
            OutputKind::Fixed(ContentAddress::Text(h)) => (format!("text:{}", h.algo()), h.to_base16()),
            OutputKind::Fixed(ContentAddress::Fixed { recursive, hash }) => {
                (format!("{}{}", if *recursive { "r:" } else { "" }, hash.algo()), hash.to_base16())
            }
            OutputKind::Floating(a) => (a.clone(), String::new()),
            OutputKind::Impure(a) => (a.clone(), "impure".to_owned()),
            OutputKind::InputAddressed(_) | OutputKind::Deferred => (String::new(), String::new()),
        }
    }
}

/// Splits a hash algorithm field (`r:sha256`, `text:sha256`, `sha1`) into method prefix and
/// algorithm. `git:` (Nix's experimental git hashing) is not supported.
fn method_algo(s: &str) -> Result<(&str, HashAlgo), WireError> {
    let bad = |why: String| WireError::invalid("derivation output hash algorithm", format!("{s:?}: {why}"));
    let (method, algo) = match s.split_once(':') {
        Some((m @ ("r" | "text"), algo)) => (m, algo),
        Some((m, _)) => return Err(bad(format!("unknown content-address method {m:?}"))),
        None => ("", s),
    };
    Ok((method, HashAlgo::parse(algo).map_err(|e| bad(e.to_string()))?))
}

/// One output's kind from its fields (on the wire or in a `.drv`), by Nix's
/// `parseDerivationOutput` rules.
pub(crate) fn output_kind(dir: &StoreDir, path: &str, algo: &str, hash: &str) -> Result<OutputKind, WireError> {
    let path_of = |p: &str| dir.parse_path(p).map_err(|e| WireError::invalid("derivation output path", e));
    let no_path = |kind: &str| {
        if path.is_empty() {
            Ok(())
        } else {
            Err(WireError::invalid("derivation output path", format!("{path:?}: a {kind} output has no path before it is built")))
        }
    };
    if algo.is_empty() {
        if !hash.is_empty() {
            return Err(WireError::invalid("derivation output hash", format!("{hash:?} without a hash algorithm")));
        }
        return Ok(if path.is_empty() { OutputKind::Deferred } else { OutputKind::InputAddressed(path_of(path)?) });
    }
    let (method, hash_algo) = method_algo(algo)?;
    match hash {
        "impure" => no_path("impure").map(|()| OutputKind::Impure(algo.to_owned())),
        "" => no_path("floating content-addressed").map(|()| OutputKind::Floating(algo.to_owned())),
        _ => {
            path_of(path)?;
            let hash = Hash::parse_bare(hash, hash_algo).map_err(|e| WireError::invalid("derivation output hash", e))?;
            Ok(OutputKind::Fixed(match method {
                "text" if hash_algo == HashAlgo::Sha256 => ContentAddress::Text(hash),
                "text" => {
                    return Err(WireError::invalid("derivation output hash algorithm", format!("{algo:?}: text hashing is sha256 only")))
                }
                m => ContentAddress::Fixed { recursive: m == "r", hash },
            }))
        }
    }
}

/// Reads a basic derivation (Nix's `readDerivation`): outputs (unique, valid names), input
/// sources, platform, builder, arguments, environment. Every count and string is bounded.
pub fn read_basic_derivation(r: &mut (impl Read + ?Sized), dir: &StoreDir) -> Result<BasicDerivation, WireError> {
    let n = read_count(r, MAX_ITEMS, "derivation outputs")?;
    let mut outputs: Vec<DerivationOutput> = Vec::new();
    // The names seen: a set, not a search of the outputs read (a request may hold a million).
    let mut names = std::collections::HashSet::new();
    for _ in 0..n {
        let name = read_string(r, MAX_FIELD_LEN, "derivation output name")?;
        let path = read_string(r, MAX_PATH_LEN, "derivation output path")?;
        let algo = read_string(r, MAX_FIELD_LEN, "derivation output hash algorithm")?;
        let hash = read_string(r, MAX_FIELD_LEN, "derivation output hash")?;
        check_name(&name, &name).map_err(|e| WireError::invalid("derivation output name", e))?;
        if !names.insert(name.clone()) {
            return Err(WireError::invalid("derivation output name", format!("{name:?} appears twice")));
        }
        outputs.push(DerivationOutput { kind: output_kind(dir, &path, &algo, &hash)?, name });
    }
    Ok(BasicDerivation {
        outputs,
        input_srcs: read_store_path_set(r, dir, "derivation input sources")?,
        platform: read_string(r, MAX_FIELD_LEN, "derivation platform")?,
        builder: read_string(r, MAX_PATH_LEN, "derivation builder")?,
        args: read_strings(r, MAX_ITEMS, MAX_VALUE_LEN, "derivation arguments")?,
        env: read_string_pairs(r, MAX_ITEMS, MAX_VALUE_LEN, "derivation environment")?,
    })
}

/// Writes `drv`, named `drv_name`, as Nix's `writeDerivation` does: fixed outputs with their
/// computed path, `r:`/`text:` method and algorithm, and base16 hash.
pub fn write_basic_derivation(w: &mut (impl Write + ?Sized), dir: &StoreDir, drv_name: &str, drv: &BasicDerivation) -> std::io::Result<()> {
    write_u64(w, drv.outputs.len() as u64)?;
    for o in &drv.outputs {
        let path = o
            .path(dir, drv_name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?
            .map(|p| dir.display_path(&p))
            .unwrap_or_default();
        let (algo, hash) = o.kind.algo_and_hash();
        for field in [o.name.as_str(), &path, &algo, &hash] {
            write_bytes(w, field.as_bytes())?;
        }
    }
    write_store_path_set(w, dir, drv.input_srcs.iter())?;
    write_bytes(w, drv.platform.as_bytes())?;
    write_bytes(w, drv.builder.as_bytes())?;
    write_strings(w, drv.args.iter())?;
    write_string_pairs(w, drv.env.iter().map(|(k, v)| (k, v)))
}

/// A derivation output id (`DrvOutput`): the derivation's hash modulo and an output name,
/// written `<algo>:<base16 hash>!<output>` (for example `sha256:15e3…d527!out`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DrvOutput {
    pub drv_hash: Hash,
    pub output: String,
}

impl DrvOutput {
    /// Parses `<hash>!<output>` where the hash has an algorithm prefix (`sha256:` with base16,
    /// nixbase32 or base64, or SRI), as Nix's `DrvOutput::parse`; the output must be a valid
    /// output name.
    pub fn parse(s: &str) -> Result<Self, WireError> {
        let bad = |why: &dyn std::fmt::Display| WireError::invalid("derivation output id", format!("{s:?}: {why}"));
        let (hash, output) = s.split_once('!').ok_or_else(|| bad(&"no '!' between the derivation hash and the output name"))?;
        let drv_hash = Hash::parse(hash).map_err(|e| bad(&e))?;
        check_name(output, output).map_err(|e| bad(&e))?;
        Ok(DrvOutput { drv_hash, output: output.to_owned() })
    }
}

impl std::fmt::Display for DrvOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}!{}", self.drv_hash.to_base16_prefixed(), self.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(s: &str) -> StorePath {
        StorePath::from_base_name(s).unwrap()
    }

    fn sample() -> BasicDerivation {
        let sha256 = Hash::digest_bytes(HashAlgo::Sha256, b"x");
        BasicDerivation {
            outputs: vec![
                DerivationOutput { name: "out".into(), kind: OutputKind::InputAddressed(sp("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-foo")) },
                DerivationOutput { name: "src".into(), kind: OutputKind::Fixed(ContentAddress::Fixed { recursive: true, hash: sha256 }) },
                DerivationOutput { name: "dev".into(), kind: OutputKind::Floating("r:sha256".into()) },
                DerivationOutput { name: "doc".into(), kind: OutputKind::Deferred },
            ],
            input_srcs: [sp("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-bar")].into(),
            platform: "x86_64-linux".into(),
            builder: "/bin/sh".into(),
            args: vec!["-c".into(), "echo hi > $out".into()],
            env: vec![("out".into(), "/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-foo".into())],
        }
    }

    #[test]
    fn round_trip_and_paths() {
        let dir = StoreDir::default();
        let drv = sample();
        let mut buf = Vec::new();
        write_basic_derivation(&mut buf, &dir, "foo", &drv).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_basic_derivation(&mut r, &dir).unwrap(), drv);
        assert!(r.is_empty());
        assert!(!drv.is_content_addressed());
        let paths: Vec<Option<StorePath>> = drv.outputs.iter().map(|o| o.path(&dir, "foo").unwrap()).collect();
        assert_eq!(paths[0], Some(sp("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-foo")));
        assert!(paths[1].as_ref().unwrap().base_name().ends_with("-foo-src"));
        assert_eq!((paths[2].as_ref(), paths[3].as_ref()), (None, None));
        // Truncated anywhere: an error naming a field, never a panic.
        for cut in 0..buf.len() {
            assert!(read_basic_derivation(&mut &buf[..cut], &dir).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn bad_outputs_are_refused() {
        let dir = StoreDir::default();
        let one = |name: &str, path: &str, algo: &str, hash: &str| {
            let mut buf = Vec::new();
            write_u64(&mut buf, 1).unwrap();
            for f in [name, path, algo, hash] {
                write_bytes(&mut buf, f.as_bytes()).unwrap();
            }
            read_basic_derivation(&mut buf.as_slice(), &dir).unwrap_err().to_string()
        };
        let p = "/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-foo";
        assert!(one("out", "/elsewhere/x", "", "").contains("derivation output path"));
        assert!(one("out", p, "", "abc").contains("without a hash algorithm"));
        assert!(one("out", p, "r:sha3", "").contains("unknown hash algorithm"));
        assert!(one("out", p, "git:sha1", "").contains("unknown content-address method"));
        assert!(one("out", p, "r:sha256", "").contains("has no path before it is built"));
        assert!(one("out", p, "sha256", "xyz").contains("derivation output hash"));
        assert!(one("", p, "", "").contains("derivation output name"));
        let mut twice = Vec::new();
        write_u64(&mut twice, 2).unwrap();
        for _ in 0..2 {
            for f in ["out", p, "", ""] {
                write_bytes(&mut twice, f.as_bytes()).unwrap();
            }
        }
        assert!(read_basic_derivation(&mut twice.as_slice(), &dir).unwrap_err().to_string().contains("appears twice"));
    }

    #[test]
    fn drv_output_ids() {
        let text = format!("sha256:{}!out", "15e3c560894cbb27085cf65b5a2ecb18488c999497f4531b6907a7581ce6d527");
        let id = DrvOutput::parse(&text).unwrap();
        assert_eq!((id.drv_hash.algo(), id.output.as_str()), (HashAlgo::Sha256, "out"));
        assert_eq!(id.to_string(), text);
        for bad in [
            "sha256:abc!out",
            "no-bang",
            &format!("{}!out", "15e3c560894cbb27085cf65b5a2ecb18488c999497f4531b6907a7581ce6d527"),
            &text.replace("!out", "!"),
            &text.replace("!out", "!a/b"),
        ] {
            assert!(DrvOutput::parse(bad).unwrap_err().to_string().contains("derivation output id"), "{bad}");
        }
    }
}
