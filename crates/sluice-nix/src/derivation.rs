//! Derivations (`.drv`, ATerm): the outputs and their paths, which the local store registers
//! in `DerivationOutputs`. Source: Nix `src/libstore/derivations.cc` (`parseDerivation`).
//!
//! A derivation starts `Derive([("<name>","<path>","<hash algo>","<hash>"),…],…`; only this
//! first list is read. Strings are double-quoted with backslash escapes: `\n`, `\r`, `\t`, and
//! `\<c>` for any other character `c` (notably `\"` and `\\`).

use crate::store_path::{StoreDir, StorePath};

/// Why a `.drv` could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("derivation: {0}")]
pub struct DerivationError(pub String);

/// The outputs of a derivation in ATerm form: `(output name, output path)`; the path is `None`
/// for floating content-addressed outputs (empty path in the ATerm).
pub fn parse_outputs(store_dir: &StoreDir, aterm: &[u8]) -> Result<Vec<(String, Option<StorePath>)>, DerivationError> {
    let mut cursor = Cursor { input: aterm, pos: 0 };
    cursor.expect(b"Derive([")?;
    let mut outputs = Vec::new();
    while !cursor.end_of_list()? {
        if !outputs.is_empty() {
            cursor.expect(b",")?;
        }
        cursor.expect(b"(")?;
        let name = cursor.utf8_string("output name")?;
        cursor.expect(b",")?;
        let path = cursor.utf8_string("output path")?;
        cursor.expect(b",")?;
        cursor.string()?; // hash algorithm
        cursor.expect(b",")?;
        cursor.string()?; // hash
        cursor.expect(b")")?;
        if name.is_empty() || outputs.iter().any(|(n, _)| *n == name) {
            return Err(DerivationError(format!("empty or duplicate output name {name:?}")));
        }
        let path = match path.as_str() {
            "" => None,
            p => Some(store_dir.parse_path(p).map_err(|e| DerivationError(format!("output {name:?}: {e}")))?),
        };
        outputs.push((name, path));
    }
    Ok(outputs)
}

/// A position in the ATerm text.
struct Cursor<'a> {
    input: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn error(&self, what: &str) -> DerivationError {
        DerivationError(format!("{what} at byte {}", self.pos))
    }

    /// Consumes `token`, which must come next.
    fn expect(&mut self, token: &[u8]) -> Result<(), DerivationError> {
        if !self.input[self.pos..].starts_with(token) {
            return Err(self.error(&format!("expected {:?}", String::from_utf8_lossy(token))));
        }
        self.pos += token.len();
        Ok(())
    }

    /// Consumes a `]` if it comes next.
    fn end_of_list(&mut self) -> Result<bool, DerivationError> {
        match self.input.get(self.pos) {
            Some(b']') => {
                self.pos += 1;
                Ok(true)
            }
            Some(_) => Ok(false),
            None => Err(self.error("unexpected end of derivation")),
        }
    }

    /// Consumes a quoted string and returns its unescaped bytes.
    fn string(&mut self) -> Result<Vec<u8>, DerivationError> {
        self.expect(b"\"")?;
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.input.get(self.pos) else {
                return Err(self.error("unterminated string"));
            };
            self.pos += 1;
            match c {
                b'"' => return Ok(out),
                b'\\' => {
                    let Some(&escaped) = self.input.get(self.pos) else {
                        return Err(self.error("unterminated string"));
                    };
                    self.pos += 1;
                    out.push(match escaped {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        other => other,
                    });
                }
                other => out.push(other),
            }
        }
    }

    /// Consumes a quoted string that must be UTF-8 (`what` names it in errors).
    fn utf8_string(&mut self, what: &str) -> Result<String, DerivationError> {
        let start = self.pos;
        String::from_utf8(self.string()?).map_err(|_| DerivationError(format!("{what} at byte {start} is not UTF-8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nar::{reader, NarPath, NarVisitor};
    use std::collections::BTreeMap;
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
        let aterm = br#"Derive([("bin","/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a-bin","",""),("dev","","sha256",""),("out","/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a","r:sha256","0a\"\\\n")],[],[],"x","\"b\\n\t\r",[],[])"#;
        let outputs = parse_outputs(&store_dir(), aterm).unwrap();
        assert_eq!(
            outputs,
            vec![
                ("bin".into(), Some(path("ljrz8i16r1xwav3skkm86kifcf6cfbph-a-bin"))),
                ("dev".into(), None),
                ("out".into(), Some(path("ljrz8i16r1xwav3skkm86kifcf6cfbph-a"))),
            ]
        );
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
            b"Derive([(\"out\",\"/nix/store/x\",\"\",\"\")])",
            b"Derive([(\"out\",\"/nix/store/ljrz8i16r1xwav3skkm86kifcf6cfbph-a\",\"\",\"\\",
            b"Derive([(\"out\",\"\",\"\",\"\")(\"dev\",\"\",\"\",\"\")])",
            b"Derive([(\"out\",\"\",\"\",\"\"),(\"out\",\"\",\"\",\"\")])",
            b"Derive([(\"\xff\",\"\",\"\",\"\")])",
            b"DrvWithVersion(\"xp-dyn-drv\",[])",
            b"derive([])",
        ];
        for case in cases {
            assert!(parse_outputs(&store_dir(), case).is_err(), "{:?}", String::from_utf8_lossy(case));
        }
        assert_eq!(parse_outputs(&store_dir(), b"Derive([],[],[],\"\",\"\",[],[])").unwrap(), vec![]);
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
            unreachable!("no directory starts")
        }
    }

    /// Every `.drv` of `cache-drv`: store path → its parsed outputs.
    fn corpus_derivations() -> BTreeMap<String, Vec<(String, Option<StorePath>)>> {
        let dir = std::path::Path::new(CORPUS).join("cache-drv");
        let mut drvs = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).expect("the corpus in ../shared") {
            let file = entry.unwrap().path();
            if file.extension() != Some(std::ffi::OsStr::new("narinfo")) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).unwrap().to_owned();
            let store_path = field("StorePath: ");
            if !store_path.ends_with(".drv") {
                continue;
            }
            let compressed = std::fs::File::open(dir.join(field("URL: "))).unwrap();
            let mut contents = FileContents::default();
            reader::parse(liblzma::read::XzDecoder::new(compressed), &mut contents).unwrap();
            let outputs = parse_outputs(&store_dir(), &contents.0).unwrap_or_else(|e| panic!("{store_path}: {e}"));
            drvs.insert(store_path, outputs);
        }
        drvs
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
            assert_eq!(drvs[drv], expected, "{drv}");
        }

        // Every path's deriver lists it among its outputs (multi-output derivations included).
        let infos: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{CORPUS}/truth/path-info-local.json")).unwrap()).unwrap();
        let mut checked = 0;
        for info in infos.as_array().unwrap() {
            let Some(deriver) = info["deriver"].as_str() else { continue };
            let out = store_dir().parse_path(info["path"].as_str().unwrap()).unwrap();
            assert!(drvs[deriver].iter().any(|(_, p)| p.as_ref() == Some(&out)), "{deriver} lacks {out}");
            checked += 1;
        }
        assert!(checked > 1000, "only {checked} paths with derivers");
    }
}
