//! The ATerm text of a derivation: the printing helpers of Nix's `Derivation::unparse` and the
//! reading cursor of its `parseDerivation` (`src/libstore/derivations.cc`).

use std::collections::{BTreeMap, BTreeSet};

use super::{DerivationError, InputOutputs};
use crate::store_path::{StoreDir, StorePath};

/// How deep outputs of outputs of an input derivation may nest (Nix sets no bound; each level
/// is a derivation built by the one above, and the parser recurses once per level).
pub(super) const MAX_DYNAMIC_DEPTH: usize = 64;

/// A `,` before every list element but the first.
pub(super) fn comma(s: &mut Vec<u8>, index: usize) {
    if index > 0 {
        s.push(b',');
    }
}

/// Nix's `printUnquotedString`: quoted, not escaped.
pub(super) fn unquoted(s: &mut Vec<u8>, value: &[u8]) {
    s.push(b'"');
    s.extend_from_slice(value);
    s.push(b'"');
}

/// Nix's `printString`: quoted, with `"`, `\\`, newline, carriage return and tab escaped.
pub(super) fn quoted(s: &mut Vec<u8>, value: &[u8]) {
    s.push(b'"');
    for &c in value {
        match c {
            b'"' | b'\\' => s.extend_from_slice(&[b'\\', c]),
            b'\n' => s.extend_from_slice(b"\\n"),
            b'\r' => s.extend_from_slice(b"\\r"),
            b'\t' => s.extend_from_slice(b"\\t"),
            c => s.push(c),
        }
    }
    s.push(b'"');
}

/// `[e1,e2,…]` with each element printed by `print`.
pub(super) fn list<'a>(s: &mut Vec<u8>, items: impl Iterator<Item = &'a [u8]>, print: fn(&mut Vec<u8>, &[u8])) {
    s.push(b'[');
    for (i, item) in items.enumerate() {
        comma(s, i);
        print(s, item);
    }
    s.push(b']');
}

/// Nix's `unparseDerivedPathMapNode`: `,` and what is used of an input derivation, `[outputs]`,
/// or with outputs of its outputs, `([outputs],[("<output>",<the same>),…])`.
pub(super) fn input_node(s: &mut Vec<u8>, node: &InputOutputs) {
    s.push(b',');
    if node.dynamic.is_empty() {
        list(s, node.outputs.iter().map(|o| o.as_bytes()), unquoted);
        return;
    }
    s.push(b'(');
    list(s, node.outputs.iter().map(|o| o.as_bytes()), unquoted);
    s.extend_from_slice(b",[");
    for (i, (output, child)) in node.dynamic.iter().enumerate() {
        comma(s, i);
        s.push(b'(');
        unquoted(s, output.as_bytes());
        input_node(s, child);
        s.push(b')');
    }
    s.extend_from_slice(b"])");
}

/// A position in the ATerm text.
pub(super) struct Cursor<'a> {
    pub(super) input: &'a [u8],
    pub(super) pos: usize,
}

impl Cursor<'_> {
    pub(super) fn error(&self, what: &str) -> DerivationError {
        DerivationError(format!("{what} at byte {}", self.pos))
    }

    /// Consumes the header, `Derive(` or `DrvWithVersion("xp-dyn-drv",` (the only version
    /// Nix knows): true for the versioned form, whose input derivations may use outputs of
    /// their outputs.
    pub(super) fn header(&mut self) -> Result<bool, DerivationError> {
        if self.input.starts_with(b"Derive(") {
            self.pos += b"Derive(".len();
            return Ok(false);
        }
        if !self.input.starts_with(b"DrvWithVersion(") {
            return Err(self.error("expected \"Derive(\" or \"DrvWithVersion(\""));
        }
        self.pos += b"DrvWithVersion(".len();
        let start = self.pos;
        let version = self.string()?;
        if version != b"xp-dyn-drv" {
            let shown = String::from_utf8_lossy(&version);
            return Err(DerivationError(format!("unknown derivation ATerm format version '{shown}' at byte {start}")));
        }
        self.expect(b",")?;
        Ok(true)
    }

    /// Nix's `parseDerivedPathMapNode`: what is used of an input derivation, `[outputs]`, or
    /// in the versioned form also `([outputs],[("<output>",<the same>),…])`, `depth` levels
    /// below the input derivation.
    pub(super) fn input_node(&mut self, versioned: bool, depth: usize) -> Result<InputOutputs, DerivationError> {
        if !versioned || self.input.get(self.pos) == Some(&b'[') {
            return Ok(InputOutputs { outputs: self.names()?, dynamic: BTreeMap::new() });
        }
        if depth >= MAX_DYNAMIC_DEPTH {
            return Err(self.error(&format!("outputs of input derivation outputs nested deeper than {MAX_DYNAMIC_DEPTH}")));
        }
        self.expect(b"(")?;
        let outputs = self.names()?;
        self.expect(b",[")?;
        let mut dynamic = BTreeMap::new();
        while !self.end_of_list()? {
            self.expect(b"(")?;
            let output = self.utf8_string("input derivation output")?;
            self.expect(b",")?;
            dynamic.insert(output, self.input_node(true, depth + 1)?);
            self.expect(b")")?;
        }
        self.expect(b")")?;
        Ok(InputOutputs { outputs, dynamic })
    }

    /// `[…]` of output names of an input derivation.
    fn names(&mut self) -> Result<BTreeSet<String>, DerivationError> {
        self.expect(b"[")?;
        let mut names = BTreeSet::new();
        while !self.end_of_list()? {
            names.insert(self.utf8_string("input derivation output")?);
        }
        Ok(names)
    }

    /// Consumes `token`, which must come next.
    pub(super) fn expect(&mut self, token: &[u8]) -> Result<(), DerivationError> {
        if !self.input[self.pos..].starts_with(token) {
            return Err(self.error(&format!("expected {:?}", String::from_utf8_lossy(token))));
        }
        self.pos += token.len();
        Ok(())
    }

    /// Nix's `endOfList`: consumes a `]` (true) or a `,` between elements (false) if it
    /// comes next.
    pub(super) fn end_of_list(&mut self) -> Result<bool, DerivationError> {
        match self.input.get(self.pos) {
            Some(b']') => {
                self.pos += 1;
                Ok(true)
            }
            Some(b',') => {
                self.pos += 1;
                Ok(false)
            }
            Some(_) => Ok(false),
            None => Err(self.error("unexpected end of derivation")),
        }
    }

    /// Consumes a quoted string and returns its unescaped bytes.
    pub(super) fn string(&mut self) -> Result<Vec<u8>, DerivationError> {
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

    /// Consumes `,` and a quoted UTF-8 string (an output's path, hash algorithm or hash).
    pub(super) fn field(&mut self) -> Result<String, DerivationError> {
        self.expect(b",")?;
        self.utf8_string("output field")
    }

    /// Consumes a quoted store path (`what` names it in errors).
    pub(super) fn store_path(&mut self, dir: &StoreDir, what: &str) -> Result<StorePath, DerivationError> {
        let path = self.utf8_string(what)?;
        dir.parse_path(&path).map_err(|e| DerivationError(format!("{what} {path:?}: {e}")))
    }

    /// Consumes a quoted string that must be UTF-8 (`what` names it in errors).
    pub(super) fn utf8_string(&mut self, what: &str) -> Result<String, DerivationError> {
        let start = self.pos;
        String::from_utf8(self.string()?).map_err(|_| DerivationError(format!("{what} at byte {start} is not UTF-8")))
    }
}
