//! Derivations (`.drv`, ATerm): parsing, Nix's re-serialisation, the hash modulo and the
//! check of the output paths a derivation claims. Source: Nix `src/libstore/derivations.cc`
//! (`parseDerivation`, `Derivation::unparse`, `BasicDerivation::type`,
//! `hashDerivationModulo`) and `local-store.cc` (`LocalStore::checkDerivationOutputs`), 2.8
//! and 2.26 (which agree on every derivation without experimental features; this follows
//! 2.26 for impure derivations, whose outputs are hashed like any other's).
//!
//! A derivation is `Derive([outputs],[input derivations],[input sources],"platform",
//! "builder",[args],[env])`: outputs are `("<name>","<path>","<hash algo>","<hash>")`, input
//! derivations `("<drv path>",["<output>",…])`. One that uses an output of an input's output
//! (`dynamic-derivations`) is `DrvWithVersion("xp-dyn-drv",[outputs],…)`, in which an input
//! derivation may also be `("<drv path>",(["<output>",…],[("<output>",<the same, nested>),…]))`
//! (Nix's `DerivedPathMap`). Strings are double-quoted with backslash
//! escapes: `\n`, `\r`, `\t`, and `\<c>` for any other character `c` (notably `\"` and `\\`).
//! As in Nix, sets and maps are sorted when read (a repeated environment variable or input
//! derivation takes its last value, a repeated set element counts once); a repeated output
//! name is refused.

use std::collections::{BTreeMap, BTreeSet};

use crate::hash::{Hash, HashAlgo};
use crate::store_path::{check_name, StoreDir, StorePath};
use crate::wire::{output_kind, output_path_name, OutputKind};

mod aterm;
use aterm::{comma, input_node, list, quoted, unquoted, Cursor};

/// Why a `.drv` could not be read, or why its outputs are refused (Nix's words).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct DerivationError(pub String);

/// A parsed derivation (Nix's `Derivation`). Strings other than names and paths are bytes,
/// as in Nix, so that re-serialising gives back exactly what was hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Derivation {
    /// The `.drv` path's name without the extension.
    pub name: String,
    pub outputs: BTreeMap<String, OutputKind>,
    /// Input derivations and the outputs of each used.
    pub input_drvs: BTreeMap<StorePath, InputOutputs>,
    pub input_srcs: BTreeSet<StorePath>,
    pub platform: Vec<u8>,
    pub builder: Vec<u8>,
    pub args: Vec<Vec<u8>>,
    pub env: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// What a derivation uses of one input derivation (Nix's `DerivedPathMap<StringSet>::ChildNode`):
/// some of its outputs, and with `dynamic-derivations`, outputs of the derivations that its
/// outputs are (output name → what is used of that derivation, to any depth).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InputOutputs {
    pub outputs: BTreeSet<String>,
    pub dynamic: BTreeMap<String, InputOutputs>,
}

/// The kind of a whole derivation, from its outputs (Nix's `DerivationType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DerivationType {
    /// Every output's path is given.
    InputAddressed,
    /// One fixed output, `out`.
    Fixed,
    /// Floating content-addressed outputs (`ca-derivations`).
    Floating,
    /// Input-addressed outputs whose paths are not known yet.
    Deferred,
    /// Impure outputs (`impure-derivations`).
    Impure,
}

/// A derivation's hash modulo, per output (Nix's `DrvHash::hashes`): what its dependents'
/// hashes include in place of its path.
pub type DrvHashes = BTreeMap<String, Hash>;

/// The derivation name of the `.drv` path `drv` (its name without `.drv`).
pub fn drv_name(drv: &StorePath) -> &str {
    drv.name().strip_suffix(".drv").unwrap_or(drv.name())
}

/// The outputs of the derivation `drv` in ATerm form, with their paths where known before
/// building (Nix's `outputsAndOptPaths`: given for input-addressed outputs, computed from the
/// hash for fixed ones, `None` for the others).
pub fn parse_outputs(store_dir: &StoreDir, drv: &StorePath, aterm: &[u8]) -> Result<Vec<(String, Option<StorePath>)>, DerivationError> {
    Derivation::parse(store_dir, drv_name(drv), aterm)?.output_paths(store_dir)
}

impl Derivation {
    /// Parses the ATerm `aterm` of a derivation named `name` (Nix's `parseDerivation`), in
    /// either form (`Derive(…)`, or `DrvWithVersion("xp-dyn-drv",…)`, whose input derivations
    /// may use outputs of their outputs). Errors name what was expected and the byte offset;
    /// nothing may follow the final `)`.
    pub fn parse(dir: &StoreDir, name: &str, aterm: &[u8]) -> Result<Self, DerivationError> {
        let mut c = Cursor { input: aterm, pos: 0 };
        let versioned = c.header()?;
        c.expect(b"[")?;
        let mut outputs = BTreeMap::new();
        while !c.end_of_list()? {
            c.expect(b"(")?;
            let (id, path, algo, hash) = (c.utf8_string("output name")?, c.field()?, c.field()?, c.field()?);
            c.expect(b")")?;
            check_name(&id, &id).map_err(|e| DerivationError(format!("output name {id:?}: {e}")))?;
            let kind = output_kind(dir, &path, &algo, &hash).map_err(|e| DerivationError(format!("output {id:?}: {e}")))?;
            if outputs.insert(id.clone(), kind).is_some() {
                return Err(DerivationError(format!("output {id:?} appears twice")));
            }
        }
        c.expect(b",[")?;
        let mut input_drvs = BTreeMap::new();
        while !c.end_of_list()? {
            c.expect(b"(")?;
            let path = c.store_path(dir, "input derivation")?;
            c.expect(b",")?;
            let node = c.input_node(versioned, 0)?;
            c.expect(b")")?;
            input_drvs.insert(path, node);
        }
        c.expect(b",[")?;
        let mut input_srcs = BTreeSet::new();
        while !c.end_of_list()? {
            input_srcs.insert(c.store_path(dir, "input source")?);
        }
        c.expect(b",")?;
        let platform = c.string()?;
        c.expect(b",")?;
        let builder = c.string()?;
        c.expect(b",[")?;
        let mut args = Vec::new();
        while !c.end_of_list()? {
            args.push(c.string()?);
        }
        c.expect(b",[")?;
        let mut env = BTreeMap::new();
        while !c.end_of_list()? {
            c.expect(b"(")?;
            let key = c.string()?;
            c.expect(b",")?;
            env.insert(key, c.string()?);
            c.expect(b")")?;
        }
        c.expect(b")")?;
        if c.pos != aterm.len() {
            return Err(c.error("trailing data after the derivation"));
        }
        Ok(Derivation { name: name.to_owned(), outputs, input_drvs, input_srcs, platform, builder, args, env })
    }

    /// The outputs with their paths where known before building (see [`parse_outputs`]).
    pub fn output_paths(&self, dir: &StoreDir) -> Result<Vec<(String, Option<StorePath>)>, DerivationError> {
        self.outputs
            .iter()
            .map(|(id, kind)| Ok((id.clone(), kind.path(dir, &self.name, id).map_err(|e| DerivationError(format!("output {id:?}: {e}")))?)))
            .collect()
    }

    /// The experimental features it needs, as Nix's `parseDerivation` and
    /// `parseDerivationOutput` require them (`src/libstore/derivations.cc`): `ca-derivations`
    /// for a floating content-addressed output, `impure-derivations` for an impure one,
    /// `dynamic-derivations` for an output hashed as text or an input derivation's output
    /// used as a derivation.
    pub fn required_experimental_features(&self) -> BTreeSet<&'static str> {
        let mut features: BTreeSet<&'static str> = self
            .outputs
            .values()
            .flat_map(|k| {
                let (algo, _) = k.algo_and_hash();
                let kind = match k {
                    OutputKind::Floating(_) => Some("ca-derivations"),
                    OutputKind::Impure(_) => Some("impure-derivations"),
                    _ => None,
                };
                kind.into_iter().chain(algo.starts_with("text:").then_some("dynamic-derivations"))
            })
            .collect();
        if self.has_dynamic_inputs() {
            features.insert("dynamic-derivations");
        }
        features
    }

    /// Whether an input derivation's output is used as a derivation (Nix's
    /// `hasDynamicDrvDep`): such a derivation is written `DrvWithVersion("xp-dyn-drv",…)`.
    pub fn has_dynamic_inputs(&self) -> bool {
        self.input_drvs.values().any(|node| !node.dynamic.is_empty())
    }

    /// The derivation's type (Nix's `BasicDerivation::type`), refusing the combinations Nix
    /// refuses, in its words.
    pub(crate) fn derivation_type(&self) -> Result<DerivationType, DerivationError> {
        let err = |m: &str| Err(DerivationError(m.to_owned()));
        let kinds: BTreeSet<u8> = self
            .outputs
            .values()
            .map(|k| match k {
                OutputKind::InputAddressed(_) => 0,
                OutputKind::Fixed(_) => 1,
                OutputKind::Floating(_) => 2,
                OutputKind::Deferred => 3,
                OutputKind::Impure(_) => 4,
            })
            .collect();
        let floating_algos: BTreeSet<&str> = self
            .outputs
            .values()
            .filter_map(|k| match k {
                OutputKind::Floating(a) => Some(a.rsplit(':').next().unwrap_or(a)),
                _ => None,
            })
            .collect();
        if floating_algos.len() > 1 {
            return err("all floating outputs must use the same hash type");
        }
        match kinds.iter().copied().collect::<Vec<u8>>()[..] {
            [] => err("must have at least one output"),
            [0] => Ok(DerivationType::InputAddressed),
            [1] if self.outputs.len() > 1 => err("only one fixed output is allowed for now"),
            [1] if !self.outputs.contains_key("out") => err("single fixed output must be named \"out\""),
            [1] => Ok(DerivationType::Fixed),
            [2] => Ok(DerivationType::Floating),
            [3] => Ok(DerivationType::Deferred),
            [4] => Ok(DerivationType::Impure),
            _ => err("can't mix derivation output types"),
        }
    }

    /// The ATerm Nix writes for this derivation (`Derivation::unparse`): with `mask_outputs`,
    /// output paths and the environment variables named like outputs are empty; with
    /// `actual_inputs`, the input derivations are replaced by those (hash modulo → outputs).
    /// The versioned form only when [`has_dynamic_inputs`](Self::has_dynamic_inputs).
    pub(crate) fn unparse(&self, dir: &StoreDir, mask_outputs: bool, actual_inputs: Option<&BTreeMap<String, InputOutputs>>) -> Vec<u8> {
        let mut s = if self.has_dynamic_inputs() { b"DrvWithVersion(\"xp-dyn-drv\",[".to_vec() } else { b"Derive([".to_vec() };
        for (i, (id, kind)) in self.outputs.iter().enumerate() {
            comma(&mut s, i);
            let path = match (mask_outputs, kind.path(dir, &self.name, id)) {
                (false, Ok(Some(p))) => dir.display_path(&p),
                _ => String::new(),
            };
            let (algo, hash) = kind.algo_and_hash();
            s.push(b'(');
            unquoted(&mut s, id.as_bytes());
            for field in [&path, &algo, &hash] {
                s.push(b',');
                unquoted(&mut s, field.as_bytes());
            }
            s.push(b')');
        }
        s.extend_from_slice(b"],[");
        let shown_drvs: BTreeMap<String, &InputOutputs> = match actual_inputs {
            Some(inputs) => inputs.iter().map(|(k, v)| (k.clone(), v)).collect(),
            None => self.input_drvs.iter().map(|(k, v)| (dir.display_path(k), v)).collect(),
        };
        for (i, (drv, node)) in shown_drvs.iter().enumerate() {
            comma(&mut s, i);
            s.push(b'(');
            unquoted(&mut s, drv.as_bytes());
            input_node(&mut s, node);
            s.push(b')');
        }
        s.extend_from_slice(b"],");
        let srcs: BTreeSet<String> = self.input_srcs.iter().map(|p| dir.display_path(p)).collect();
        list(&mut s, srcs.iter().map(|p| p.as_bytes()), unquoted);
        s.push(b',');
        unquoted(&mut s, &self.platform);
        s.push(b',');
        quoted(&mut s, &self.builder);
        s.push(b',');
        list(&mut s, self.args.iter().map(Vec::as_slice), quoted);
        s.extend_from_slice(b",[");
        for (i, (key, value)) in self.env.iter().enumerate() {
            comma(&mut s, i);
            s.push(b'(');
            quoted(&mut s, key);
            s.push(b',');
            let masked = mask_outputs && std::str::from_utf8(key).is_ok_and(|k| self.outputs.contains_key(k));
            quoted(&mut s, if masked { b"" } else { value });
            s.push(b')');
        }
        s.extend_from_slice(b"])");
        s
    }

    /// The hash modulo of this derivation (Nix's `hashDerivationModulo`): for a fixed-output
    /// derivation, the hash of `fixed:out:<method algo>:<base16 hash>:<path>`; otherwise the
    /// sha256 of [`unparse`](Self::unparse) with each input derivation replaced by its own
    /// hash modulo (base16), which `input_hashes` gives (Nix's memoised
    /// `pathDerivationModulo`, reading the input from the store with `mask_outputs` off).
    /// Only the outputs of the inputs count, as in Nix: not outputs of their outputs
    /// (`dynamic-derivations`), and an input of which only those are used is left out.
    pub fn hash_modulo(
        &self,
        dir: &StoreDir,
        mask_outputs: bool,
        input_hashes: &mut dyn FnMut(&StorePath) -> Result<DrvHashes, DerivationError>,
    ) -> Result<DrvHashes, DerivationError> {
        if self.derivation_type()? == DerivationType::Fixed {
            return self
                .outputs
                .iter()
                .map(|(id, kind)| {
                    let (algo, hash) = kind.algo_and_hash();
                    let path = kind
                        .path(dir, &self.name, id)
                        .ok()
                        .flatten()
                        .ok_or_else(|| DerivationError(format!("fixed output {id:?} has no valid path")))?;
                    let text = format!("fixed:out:{algo}:{hash}:{}", dir.display_path(&path));
                    Ok((id.clone(), Hash::digest_bytes(HashAlgo::Sha256, text.as_bytes())))
                })
                .collect();
        }
        let mut inputs: BTreeMap<String, InputOutputs> = BTreeMap::new();
        for (drv, wanted) in &self.input_drvs {
            let hashes = input_hashes(drv)?;
            for output in &wanted.outputs {
                let h = hashes
                    .get(output)
                    .ok_or_else(|| DerivationError(format!("no hash for output '{output}' of derivation '{}'", self.name)))?;
                inputs.entry(h.to_base16()).or_default().outputs.insert(output.clone());
            }
        }
        let hash = Hash::digest_bytes(HashAlgo::Sha256, &self.unparse(dir, mask_outputs, Some(&inputs)));
        Ok(self.outputs.keys().map(|id| (id.clone(), hash.clone())).collect())
    }

    /// Nix's `LocalStore::checkDerivationOutputs` for this derivation stored at `drv`: its type
    /// is one Nix accepts; every input-addressed output has the path `makeOutputPath` gives for
    /// the hash modulo (outputs masked), and the environment variable named like each
    /// input-addressed or fixed output holds that output's path. Errors in Nix's words.
    pub fn check_outputs(
        &self,
        dir: &StoreDir,
        drv: &StorePath,
        input_hashes: &mut dyn FnMut(&StorePath) -> Result<DrvHashes, DerivationError>,
    ) -> Result<(), DerivationError> {
        let shown = dir.display_path(drv);
        self.derivation_type()?;
        let mut hashes: Option<DrvHashes> = None;
        for (id, kind) in &self.outputs {
            let expected = match kind {
                OutputKind::InputAddressed(claimed) => {
                    let hashes = match &mut hashes {
                        Some(h) => h,
                        None => hashes.insert(self.hash_modulo(dir, true, input_hashes)?),
                    };
                    let hash = hashes.get(id).ok_or_else(|| {
                        DerivationError(format!("derivation '{shown}' has unexpected output '{}' named '{id}'", dir.display_path(claimed)))
                    })?;
                    let recomputed = dir
                        .make_store_path(&format!("output:{id}"), hash, &output_path_name(&self.name, id))
                        .map_err(|e| DerivationError(format!("derivation '{shown}', output '{id}': {e}")))?;
                    if *claimed != recomputed {
                        return Err(DerivationError(format!(
                            "derivation '{shown}' has incorrect output '{}', should be '{}'",
                            dir.display_path(claimed),
                            dir.display_path(&recomputed)
                        )));
                    }
                    recomputed
                }
                OutputKind::Fixed(_) => match kind.path(dir, &self.name, id) {
                    Ok(Some(path)) => path,
                    _ => return Err(DerivationError(format!("derivation '{shown}': fixed output '{id}' has no valid path"))),
                },
                OutputKind::Floating(_) | OutputKind::Deferred | OutputKind::Impure(_) => continue,
            };
            let in_env = self.env.get(id.as_bytes()).and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| dir.parse_path(v).ok());
            if in_env.as_ref() != Some(&expected) {
                return Err(DerivationError(format!(
                    "derivation '{shown}' has incorrect environment variable '{id}', should be '{}'",
                    dir.display_path(&expected)
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nar::{reader, NarPath, NarVisitor};
    use std::io::Read;

    const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/corpus");

    fn store_dir() -> StoreDir {
        StoreDir::default()
    }

    fn path(base: &str) -> StorePath {
        StorePath::from_base_name(base).unwrap()
    }

    #[test]
    fn outputs_with_escapes_and_floating_paths() {
        let aterm = br#"Derive([("bin","/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a-bin","",""),("dev","","r:sha256",""),("out","/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a","","")],[],[],"x","\"b\\n\t\r",[],[("a\"\\\n","\t")])"#;
        let drv = Derivation::parse(&store_dir(), "a", aterm).unwrap();
        assert_eq!(
            drv.output_paths(&store_dir()).unwrap(),
            vec![
                ("bin".into(), Some(path("ljrz8i16r1xwav3skkm86kifcf6cfbph-a-bin"))),
                ("dev".into(), None),
                ("out".into(), Some(path("ljrz8i16r1xwav3skkm86kifcf6cfbph-a"))),
            ]
        );
        assert_eq!(drv.builder, b"\"b\\n\t\r");
        assert_eq!(drv.env[b"a\"\\\n".as_slice()], b"\t");
        // Nix writes back exactly what it read.
        assert_eq!(drv.unparse(&store_dir(), false, None), aterm);
        assert_eq!(drv.derivation_type().unwrap_err().0, "can't mix derivation output types");
    }

    #[test]
    fn escaped_quote_does_not_end_a_string() {
        let mut cursor = Cursor { input: br#""a\"b\\\nc\td\re\x""#, pos: 0 };
        assert_eq!(cursor.string().unwrap(), b"a\"b\\\nc\td\rex");
        assert_eq!(cursor.pos, cursor.input.len());
    }

    #[test]
    fn malformed_derivations_are_errors() {
        let cases: &[&[u8]] = &[
            b"",
            b"Derive(",
            b"Derive([",
            b"Derive([(\"out\"",
            b"Derive([(\"out\",\"/nix/store/x\",\"\",\"\")],[],[],\"\",\"\",[],[])",
            b"Derive([(\"out\",\"/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a\",\"\",\"\\",
            b"Derive([(\"out\",\"\",\"\",\"\"),(\"out\",\"\",\"\",\"\")],[],[],\"\",\"\",[],[])",
            b"Derive([(\"\xff\",\"\",\"\",\"\")],[],[],\"\",\"\",[],[])",
            b"Derive([],[(\"/nix/store/x.drv\",[\"out\"])],[],\"\",\"\",[],[])",
            b"Derive([],[],[],\"\",\"\",[],[]) ",
            b"DrvWithVersion(\"xp-dyn-drv\",[])",
            b"derive([])",
        ];
        for case in cases {
            assert!(Derivation::parse(&store_dir(), "a", case).is_err(), "{:?}", String::from_utf8_lossy(case));
        }
        let empty = Derivation::parse(&store_dir(), "a", b"Derive([],[],[],\"\",\"\",[],[])").unwrap();
        assert_eq!(empty.derivation_type().unwrap_err().0, "must have at least one output");
    }

    /// An input derivation `dep`, one of whose outputs is itself a derivation.
    const DEP: &str = "/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-dep.drv";

    /// `DrvWithVersion("xp-dyn-drv",…)` (`dynamic-derivations`): outputs of an input's outputs,
    /// nested, are read and written back byte for byte, and need the feature.
    #[test]
    fn dynamic_derivation_inputs_are_read_and_written_as_nix_does() {
        let aterm = format!(
            r#"DrvWithVersion("xp-dyn-drv",[("out","","","")],[("{DEP}",(["bin","out"],[("bin",["lib"]),("out",(["doc"],[("dev",["man","out"])]))]))],[],"x86_64-linux","/bin/sh",[],[("out","")])"#
        );
        let drv = Derivation::parse(&store_dir(), "a", aterm.as_bytes()).unwrap();
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<BTreeSet<String>>();
        let leaf = |n: &[&str]| InputOutputs { outputs: names(n), dynamic: BTreeMap::new() };
        let expected = InputOutputs {
            outputs: names(&["bin", "out"]),
            dynamic: BTreeMap::from([
                ("bin".to_string(), leaf(&["lib"])),
                (
                    "out".to_string(),
                    InputOutputs { outputs: names(&["doc"]), dynamic: BTreeMap::from([("dev".to_string(), leaf(&["man", "out"]))]) },
                ),
            ]),
        };
        assert_eq!(drv.input_drvs, BTreeMap::from([(store_dir().parse_path(DEP).unwrap(), expected)]));
        assert!(drv.has_dynamic_inputs());
        assert_eq!(drv.unparse(&store_dir(), false, None), aterm.as_bytes());
        assert_eq!(drv.required_experimental_features(), BTreeSet::from(["dynamic-derivations"]));

        // Without outputs of outputs, Nix writes the older form, whatever it read.
        let plain = format!(r#"("out","","","")],[("{DEP}",["out"])],[],"x86_64-linux","/bin/sh",[],[("out","")])"#);
        let drv = Derivation::parse(&store_dir(), "a", format!("DrvWithVersion(\"xp-dyn-drv\",[{plain}").as_bytes()).unwrap();
        assert!(!drv.has_dynamic_inputs());
        assert_eq!(drv.unparse(&store_dir(), false, None), format!("Derive([{plain}").as_bytes());
        assert_eq!(drv.required_experimental_features(), BTreeSet::new());

        // An output hashed as text (a derivation that outputs a derivation) needs the feature too.
        let text = br#"Derive([("out","","text:sha256","")],[],[],"x86_64-linux","/bin/sh",[],[("out","")])"#;
        let drv = Derivation::parse(&store_dir(), "a.drv", text).unwrap();
        assert_eq!(drv.required_experimental_features(), BTreeSet::from(["ca-derivations", "dynamic-derivations"]));
    }

    /// The hash modulo of a derivation with dynamic inputs is that of its versioned ATerm in
    /// which each input is its hash and the outputs used of it, without outputs of outputs; an
    /// input of which only outputs of outputs are used is left out (Nix's
    /// `hashDerivationModulo`).
    #[test]
    fn dynamic_inputs_are_hashed_by_their_own_outputs_only() {
        let other = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-other.drv";
        let aterm = format!(
            r#"DrvWithVersion("xp-dyn-drv",[("out","","","")],[("{DEP}",(["lib"],[("out",["out"])])),("{other}",([],[("out",["out"])]))],[],"x86_64-linux","/bin/sh",[],[("out","")])"#
        );
        let drv = Derivation::parse(&store_dir(), "a", aterm.as_bytes()).unwrap();
        let dep_hash = Hash::digest_bytes(HashAlgo::Sha256, b"dep");
        let mut asked = Vec::new();
        let hashes = drv
            .hash_modulo(&store_dir(), true, &mut |p| {
                asked.push(store_dir().display_path(p));
                Ok(BTreeMap::from([("lib".to_string(), dep_hash.clone()), ("out".to_string(), dep_hash.clone())]))
            })
            .unwrap();
        let text = format!(
            r#"DrvWithVersion("xp-dyn-drv",[("out","","","")],[("{}",["lib"])],[],"x86_64-linux","/bin/sh",[],[("out","")])"#,
            dep_hash.to_base16()
        );
        assert_eq!(hashes, BTreeMap::from([("out".to_string(), Hash::digest_bytes(HashAlgo::Sha256, text.as_bytes()))]));
        assert_eq!(asked, [other.to_string(), DEP.to_string()]);
    }

    /// Two derivations Nix 2.26 wrote (`nix derivation add`), the second using the output
    /// `out` of the first and the output `out` of the derivation that output is: Nix's output
    /// path passes the output check, a changed one is refused with the path Nix computed.
    #[test]
    fn a_dynamic_derivation_written_by_nix_passes_the_output_check() {
        let dep = path("pcisaphxap2980lbb8c6rc8gkn0jdbxw-dep.drv");
        let dep_aterm = br#"Derive([("out","/nix/store/qafjlr592an870y95xg454gfm3vhkz9g-dep","","")],[],[],"x86_64-linux","/bin/sh",[],[("out","/nix/store/qafjlr592an870y95xg454gfm3vhkz9g-dep")])"#;
        let wrap = path("2hqf6vvb2p9nz5agxn3hgg9188b1n1zk-wrap.drv");
        let wrap_aterm = r#"DrvWithVersion("xp-dyn-drv",[("out","/nix/store/a7ac6nqf61cg28qiqqgqg6j945fr2hx6-wrap","","")],[("/nix/store/pcisaphxap2980lbb8c6rc8gkn0jdbxw-dep.drv",(["out"],[("out",["out"])]))],[],"x86_64-linux","/bin/sh",[],[("out","/nix/store/a7ac6nqf61cg28qiqqgqg6j945fr2hx6-wrap")])"#;
        let drvs = BTreeMap::from([(dep, dep_aterm.to_vec()), (wrap.clone(), wrap_aterm.as_bytes().to_vec())]);
        let mut memo = BTreeMap::new();
        check(&drvs, &mut memo, &wrap, wrap_aterm.as_bytes()).unwrap();
        let parsed = Derivation::parse(&store_dir(), "wrap", wrap_aterm.as_bytes()).unwrap();
        assert_eq!(parsed.unparse(&store_dir(), false, None), wrap_aterm.as_bytes());
        let lie = wrap_aterm.replace("a7ac6nqf61cg28qiqqgqg6j945fr2hx6", "a7ac6nqf61cg28qiqqgqg6j945fr2hx7");
        assert_eq!(
            check(&drvs, &mut memo, &wrap, lie.as_bytes()).unwrap_err().0,
            "derivation '/nix/store/2hqf6vvb2p9nz5agxn3hgg9188b1n1zk-wrap.drv' has incorrect output \
             '/nix/store/a7ac6nqf61cg28qiqqgqg6j945fr2hx7-wrap', should be '/nix/store/a7ac6nqf61cg28qiqqgqg6j945fr2hx6-wrap'"
        );
    }

    /// Outputs of outputs only in the versioned form, under a known version, nested to a bound.
    #[test]
    fn malformed_dynamic_derivations_are_errors() {
        let body = format!(r#"[("out","","","")],[("{DEP}",(["out"],[("out",["out"])]))],[],"x","/bin/sh",[],[])"#);
        let err = |aterm: &str| Derivation::parse(&store_dir(), "a", aterm.as_bytes()).unwrap_err().0;
        assert_eq!(err(&format!("Derive({body}")), "expected \"[\" at byte 82");
        assert_eq!(
            err(&format!("DrvWithVersion(\"xp-dyn-drv2\",{body}")),
            "unknown derivation ATerm format version 'xp-dyn-drv2' at byte 15"
        );
        assert_eq!(err(&format!("DrvWithVersion(xp-dyn-drv,{body}")), "expected \"\\\"\" at byte 15");
        assert_eq!(err(&format!("Drv({body}")), "expected \"Derive(\" or \"DrvWithVersion(\" at byte 0");
        let nested = |depth: usize| {
            format!(
                r#"DrvWithVersion("xp-dyn-drv",[("out","","","")],[("{DEP}",{}["out"]{})],[],"x","/bin/sh",[],[])"#,
                r#"([],[("out","#.repeat(depth),
                ")])".repeat(depth)
            )
        };
        assert!(Derivation::parse(&store_dir(), "a", nested(aterm::MAX_DYNAMIC_DEPTH).as_bytes()).is_ok());
        assert_eq!(
            err(&nested(aterm::MAX_DYNAMIC_DEPTH + 1)),
            format!("outputs of input derivation outputs nested deeper than 64 at byte {}", 103 + 12 * aterm::MAX_DYNAMIC_DEPTH)
        );
    }

    /// Collects the contents of a NAR whose root is a regular file.
    #[derive(Default)]
    struct FileContents(Vec<u8>);

    impl NarVisitor for FileContents {
        fn regular(&mut self, _: &NarPath, _: bool, _: u64, _: u64, contents: &mut dyn Read) -> std::io::Result<()> {
            contents.read_to_end(&mut self.0).map(drop)
        }
        fn symlink(&mut self, _: &NarPath, _: &[u8]) -> std::io::Result<()> {
            Err(std::io::Error::other("symlink in a .drv NAR"))
        }
        fn directory_start(&mut self, _: &NarPath) -> std::io::Result<()> {
            Err(std::io::Error::other("directory in a .drv NAR"))
        }
        fn directory_end(&mut self, _: &NarPath) -> std::io::Result<()> {
            Err(std::io::Error::other("no directory starts"))
        }
    }

    /// Every `.drv` of `cache-drv` (written by real Nix): store path → its ATerm.
    fn corpus_derivations() -> BTreeMap<StorePath, Vec<u8>> {
        let dir = std::path::Path::new(CORPUS).join("cache-drv");
        let mut drvs = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).expect("the corpus in ../shared") {
            let file = entry.unwrap().path();
            if file.extension() != Some(std::ffi::OsStr::new("narinfo")) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).unwrap().to_owned();
            let store_path = store_dir().parse_path(&field("StorePath: ")).unwrap();
            if !store_path.is_derivation() {
                continue;
            }
            let compressed = std::fs::File::open(dir.join(field("URL: "))).unwrap();
            let mut contents = FileContents::default();
            reader::parse(liblzma::read::XzDecoder::new(compressed), &mut contents).unwrap();
            drvs.insert(store_path, contents.0);
        }
        drvs
    }

    /// The hash modulo of the corpus derivation `drv`, memoised in `memo` (Nix's
    /// `pathDerivationModulo`).
    fn corpus_hashes(
        drvs: &BTreeMap<StorePath, Vec<u8>>,
        memo: &mut BTreeMap<StorePath, DrvHashes>,
        drv: &StorePath,
    ) -> Result<DrvHashes, DerivationError> {
        if let Some(h) = memo.get(drv) {
            return Ok(h.clone());
        }
        let aterm = drvs.get(drv).ok_or_else(|| DerivationError(format!("{drv:?} is not in the corpus")))?;
        let parsed = Derivation::parse(&store_dir(), drv_name(drv), aterm)?;
        let h = parsed.hash_modulo(&store_dir(), false, &mut |p| corpus_hashes(drvs, memo, p))?;
        memo.insert(drv.clone(), h.clone());
        Ok(h)
    }

    /// [`Derivation::check_outputs`] of `aterm` at `drv` against the corpus.
    fn check(
        drvs: &BTreeMap<StorePath, Vec<u8>>,
        memo: &mut BTreeMap<StorePath, DrvHashes>,
        drv: &StorePath,
        aterm: &[u8],
    ) -> Result<(), DerivationError> {
        let parsed = Derivation::parse(&store_dir(), drv_name(drv), aterm)?;
        parsed.check_outputs(&store_dir(), drv, &mut |p| corpus_hashes(drvs, memo, p))
    }

    #[test]
    fn corpus_derivations_match_nix() {
        let drvs = corpus_derivations();
        let expected_count = std::fs::read_to_string(format!("{CORPUS}/truth/drv-closure-paths.txt"))
            .unwrap()
            .lines()
            .filter(|l| l.ends_with(".drv"))
            .count();
        assert_eq!(drvs.len(), expected_count);
        let outputs: BTreeMap<String, Vec<(String, Option<StorePath>)>> = drvs
            .iter()
            .map(|(p, aterm)| (store_dir().display_path(p), parse_outputs(&store_dir(), p, aterm).unwrap_or_else(|e| panic!("{p:?}: {e}"))))
            .collect();

        // The top-level derivation, as `nix show-derivation` printed it.
        let top: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{CORPUS}/truth/top-drv.json")).unwrap()).unwrap();
        for (drv, shown) in top.as_object().unwrap() {
            let expected: Vec<(String, Option<StorePath>)> = shown["outputs"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(name, o)| (name.clone(), o["path"].as_str().map(|p| store_dir().parse_path(p).unwrap())))
                .collect();
            assert_eq!(outputs[drv], expected, "{drv}");
        }

        // Every path's deriver lists it among its outputs (multi-output derivations included).
        let infos: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{CORPUS}/truth/path-info-local.json")).unwrap()).unwrap();
        let mut checked = 0;
        for info in infos.as_array().unwrap() {
            let Some(deriver) = info["deriver"].as_str() else { continue };
            let out = store_dir().parse_path(info["path"].as_str().unwrap()).unwrap();
            assert!(outputs[deriver].iter().any(|(_, p)| p.as_ref() == Some(&out)), "{deriver} lacks {out:?}");
            checked += 1;
        }
        assert!(checked > 1000, "only {checked} paths with derivers");
    }

    /// Every derivation real Nix wrote (fixed-output, multi-output, with deep input
    /// derivations) passes Nix's output check, and is written back byte for byte.
    #[test]
    fn corpus_derivations_pass_the_output_check() {
        let drvs = corpus_derivations();
        let mut memo = BTreeMap::new();
        let mut fixed = 0;
        for (drv, aterm) in &drvs {
            let parsed = Derivation::parse(&store_dir(), drv_name(drv), aterm).unwrap();
            assert_eq!(parsed.unparse(&store_dir(), false, None), *aterm, "{drv:?}");
            fixed += usize::from(parsed.derivation_type() == Ok(DerivationType::Fixed));
            check(&drvs, &mut memo, drv, aterm).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(fixed, 4);
    }

    /// A real derivation with an input-addressed output, and one with a fixed output.
    fn corpus_examples(drvs: &BTreeMap<StorePath, Vec<u8>>) -> (StorePath, StorePath) {
        let parsed = |p: &StorePath| Derivation::parse(&store_dir(), drv_name(p), &drvs[p]).unwrap();
        let ia = drvs
            .keys()
            .find(|p| parsed(p).derivation_type() == Ok(DerivationType::InputAddressed) && !parsed(p).input_drvs.is_empty())
            .unwrap();
        let fixed = drvs.keys().find(|p| parsed(p).derivation_type() == Ok(DerivationType::Fixed)).unwrap();
        (ia.clone(), fixed.clone())
    }

    /// Real derivations edited the ways an attacker would, each refused in Nix's words.
    #[test]
    fn lying_derivations_are_refused_as_nix_refuses_them() {
        let drvs = corpus_derivations();
        let mut memo = BTreeMap::new();
        let (ia, fixed) = corpus_examples(&drvs);
        let text = |p: &StorePath| String::from_utf8(drvs[p].clone()).unwrap();
        let shown = |p: &StorePath| store_dir().display_path(p);
        let out_of =
            |p: &StorePath| parse_outputs(&store_dir(), p, &drvs[p]).unwrap().into_iter().find(|(n, _)| n == "out").unwrap().1.unwrap();
        let victim = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.35-163";

        // Another package's output path claimed (in the outputs and the environment).
        let real = shown(&out_of(&ia));
        let lie = text(&ia).replace(&real, victim);
        let err = check(&drvs, &mut memo, &ia, lie.as_bytes()).unwrap_err().0;
        assert_eq!(err, format!("derivation '{}' has incorrect output '{victim}', should be '{real}'", shown(&ia)));

        // The environment changed (the builder would do something else): the hash changes.
        let lie = text(&ia).replacen("(\"system\",\"x86_64-linux\")", "(\"system\",\"x86_64-linux\"),(\"zz\",\"evil\")", 1);
        assert_ne!(lie, text(&ia));
        let err = check(&drvs, &mut memo, &ia, lie.as_bytes()).unwrap_err().0;
        assert!(err.starts_with(&format!("derivation '{}' has incorrect output '{real}', should be '/nix/store/", shown(&ia))), "{err}");

        // Only the environment's copy of the output path changed.
        let lie = text(&ia).replace(&format!("(\"out\",\"{real}\")"), &format!("(\"out\",\"{victim}\")"));
        let err = check(&drvs, &mut memo, &ia, lie.as_bytes()).unwrap_err().0;
        assert_eq!(err, format!("derivation '{}' has incorrect environment variable 'out', should be '{real}'", shown(&ia)));

        // A fixed output's hash changed: its path is another one, which the environment lacks.
        let parsed = Derivation::parse(&store_dir(), drv_name(&fixed), &drvs[&fixed]).unwrap();
        let (_, hash) = parsed.outputs["out"].algo_and_hash();
        let other = format!("{}{}", if hash.starts_with('0') { '1' } else { '0' }, &hash[1..]);
        let lie = text(&fixed).replace(&hash, &other);
        let err = check(&drvs, &mut memo, &fixed, lie.as_bytes()).unwrap_err().0;
        let moved = Derivation::parse(&store_dir(), drv_name(&fixed), lie.as_bytes()).unwrap().output_paths(&store_dir()).unwrap()[0]
            .1
            .clone()
            .unwrap();
        assert_eq!(err, format!("derivation '{}' has incorrect environment variable 'out', should be '{}'", shown(&fixed), shown(&moved)));

        // An input derivation's hash is what the output path depends on: one not found is an error.
        let input = Derivation::parse(&store_dir(), drv_name(&ia), &drvs[&ia]).unwrap().input_drvs.into_keys().next().unwrap();
        let mut without = drvs.clone();
        without.remove(&input);
        let err = check(&without, &mut BTreeMap::new(), &ia, &drvs[&ia]).unwrap_err().0;
        assert!(err.contains("is not in the corpus"), "{err}");
    }
}
