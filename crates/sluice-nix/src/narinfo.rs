//! `.narinfo` files: parse and print (Nix's field order; nixbase32 hashes), and the signature
//! fingerprint. Source: Nix `src/libstore/nar-info.cc`, `path-info.cc`.
//!
//! Format: one `Key: value` per line, each line ending in `\n` (the key is everything before
//! the first `:`, the value everything after the `": "` that follows it). Parsing follows Nix
//! 2.26 (`NarInfo::NarInfo`) with these rules (see also shared case 02):
//! - required: `StorePath` (full path), `URL` (non-empty), `NarHash`, `NarSize` (non-zero);
//! - `Compression` defaults to `bzip2`; `FileHash`/`FileSize` are optional for every
//!   compression (absent means unknown);
//! - hashes may be `algo:` + base16 / nixbase32 / base64, or SRI `algo-base64`;
//! - `References` and `Deriver` are base names validated as store paths; `Deriver:
//!   unknown-deriver` means none;
//! - `FileSize`/`NarSize` are decimal digits with an optional `+` (boost's `lexical_cast`);
//! - a second non-empty `References` and a `CA` after a non-empty one are rejected (Nix's
//!   "extra References", "extra CA"); any other field given twice takes its last value, as in
//!   Nix; `Sig` lines accumulate (a repeated one counts once, as in Nix's set); an empty `CA`
//!   means none;
//! - unknown fields are ignored, whatever follows their `:` (a `\r` too);
//! - refused where Nix would lose data: a known field whose `:` is not followed by a space
//!   (Nix drops the value's first character), a known field's line ending in `\r\n` (Nix keeps
//!   the `\r` in the value), a line without `:` (Nix joins it to the next), and a line ending
//!   at its `:` that is a known field's, the last, or followed by a known field's (Nix reads
//!   the next line as its value: that field is lost);
//! - a last line without `\n` is rejected (Nix too: it may be truncated).

use crate::content_address::ContentAddress;
use crate::hash::Hash;
use crate::quoted::Quoted;
use crate::store_path::{StoreDir, StorePath};

/// A parsed narinfo. `references` and `deriver` are store paths (written as base names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NarInfo {
    /// `StorePath:` (a full path in the file).
    pub store_path: StorePath,
    /// The NAR's URL, relative to the cache (usually `nar/<filehash>.nar.xz`).
    pub url: String,
    /// `Compression:`; Nix's default when absent is `bzip2`.
    pub compression: String,
    /// `FileHash:`, hash of the compressed NAR; `None` when absent (unknown).
    pub file_hash: Option<Hash>,
    /// Bytes of the compressed NAR.
    pub file_size: Option<u64>,
    /// `NarHash:`, hash of the uncompressed NAR (any encoding on input, nixbase32 on output).
    pub nar_hash: Hash,
    /// Bytes of the uncompressed NAR.
    pub nar_size: u64,
    /// `References:` in file order (may include the path itself).
    pub references: Vec<StorePath>,
    /// `Deriver:`; `None` when absent or `unknown-deriver`.
    pub deriver: Option<StorePath>,
    /// `Sig:` lines verbatim (`keyname:base64`).
    pub signatures: Vec<String>,
    /// `CA:` (`fixed:r:sha256:…`, `text:sha256:…`), parsed; printed back in Nix's form
    /// (nixbase32) whatever encoding the file used.
    pub ca: Option<ContentAddress>,
    /// `System:` (old Nix versions), verbatim.
    pub system: Option<String>,
}

/// Why a narinfo was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NarInfoError {
    #[error("narinfo line {line}: {what}")]
    Line { line: usize, what: String },
    #[error("narinfo lacks the required field {0}")]
    Missing(&'static str),
    #[error("narinfo field {field}: {what}")]
    Field { field: &'static str, what: String },
    /// The body is an HTML page ([`crate::html_page`]; `start` is its beginning): the URL is
    /// answered by something other than a binary cache.
    #[error("the body is not a narinfo but an HTML page ({start}): a parked domain or a captive portal answers every URL with one")]
    HtmlPage { start: String },
}

/// The known fields, in Nix's print order (`System` is parsed, printed when set).
const FIELDS: [&str; 12] =
    ["StorePath", "URL", "Compression", "FileHash", "FileSize", "NarHash", "NarSize", "References", "Deriver", "System", "Sig", "CA"];

/// The `&'static str` name of a known field.
fn known_field(name: &str) -> Option<&'static str> {
    FIELDS.iter().copied().find(|f| *f == name)
}

fn field_err(field: &'static str, what: impl Into<String>) -> NarInfoError {
    NarInfoError::Field { field, what: what.into() }
}

fn parse_hash(field: &'static str, value: &str) -> Result<Hash, NarInfoError> {
    Hash::parse(value).map_err(|e| field_err(field, e.to_string()))
}

/// A size as Nix's `string2Int<uint64_t>` reads it: decimal digits after an optional `+`.
fn parse_size(field: &'static str, value: &str) -> Result<u64, NarInfoError> {
    let digits = value.strip_prefix('+').unwrap_or(value);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(field_err(field, format!("{} is not a non-negative integer", Quoted(value))));
    }
    digits.parse().map_err(|_| field_err(field, format!("{} is out of range", Quoted(value))))
}

/// Whether the first line of `rest` is a known field's (or there is none: Nix then finds no
/// end of line).
fn next_is_known(rest: &str) -> bool {
    rest.is_empty() || rest.split_once(':').is_some_and(|(name, _)| !name.contains('\n') && known_field(name).is_some())
}

fn parse_base_name(field: &'static str, value: &str) -> Result<StorePath, NarInfoError> {
    StorePath::from_base_name(value).map_err(|e| field_err(field, e.to_string()))
}

impl NarInfo {
    /// Fails with [`NarInfoError::HtmlPage`] when `text` is an HTML page (checked before
    /// anything else: the first line of a page is no narinfo line either, but that says less).
    pub fn check_not_html(text: &str) -> Result<(), NarInfoError> {
        match crate::html_page(text) {
            Some(start) => Err(NarInfoError::HtmlPage { start }),
            None => Ok(()),
        }
    }

    /// Parses narinfo text for `store_dir`.
    pub fn parse(store_dir: &StoreDir, text: &str) -> Result<Self, NarInfoError> {
        Self::check_not_html(text)?;
        let mut store_path = None;
        let mut url = None;
        let mut compression = None;
        let mut file_hash = None;
        let mut file_size = None;
        let mut nar_hash = None;
        let mut nar_size = None;
        let mut references = None;
        let mut deriver = None;
        let mut signatures = Vec::new();
        // Each once, in the order first given (a set, not a search of the list: a hostile
        // narinfo has millions of lines).
        let mut seen_signatures = std::collections::HashSet::new();
        let mut ca = None;
        let mut system = None;

        let mut rest = text;
        let mut line = 0usize;
        while !rest.is_empty() {
            line += 1;
            let line_err = |what: String| NarInfoError::Line { line, what };
            let (l, tail) = match rest.split_once('\n') {
                Some(x) => x,
                None => return Err(line_err(format!("{} does not end in \\n (truncated file?)", Quoted(rest)))),
            };
            rest = tail;
            let (name, after) = l.split_once(':').ok_or_else(|| {
                line_err(format!("{} is not of the form 'Key: value' (no ':'; Nix would join it to the next line)", Quoted(l)))
            })?;
            if after.is_empty() && (known_field(name).is_some() || next_is_known(rest)) {
                return Err(line_err(format!("{} has nothing after its ':' (Nix 2.26 would read the next line as its value)", Quoted(l))));
            }
            let Some(field) = known_field(name) else { continue };
            if l.ends_with('\r') {
                return Err(line_err(format!(
                    "{} ends in \\r (CRLF line endings are not allowed; Nix would keep the \\r in the value of {field})",
                    Quoted(l)
                )));
            }
            let Some(value) = after.strip_prefix(' ') else {
                return Err(line_err(format!("{}: the value of {field} must follow ': ' (Nix would drop its first character)", Quoted(l))));
            };
            match field {
                "StorePath" => store_path = Some(store_dir.parse_path(value).map_err(|e| field_err("StorePath", e.to_string()))?),
                "URL" => url = Some(value.to_owned()),
                "Compression" => compression = Some(value.to_owned()),
                "FileHash" => file_hash = Some(parse_hash("FileHash", value)?),
                "FileSize" => file_size = Some(parse_size("FileSize", value)?),
                "NarHash" => nar_hash = Some(parse_hash("NarHash", value)?),
                "NarSize" => nar_size = Some(parse_size("NarSize", value)?),
                "References" if references.as_ref().is_some_and(|r: &Vec<StorePath>| !r.is_empty()) => {
                    return Err(field_err("References", format!("given again on line {line} (extra References)")));
                }
                "References" => {
                    references = Some(
                        value
                            .split(' ')
                            .filter(|r| !r.is_empty())
                            .map(|r| parse_base_name("References", r))
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                }
                "Deriver" if value == "unknown-deriver" => {}
                "Deriver" => deriver = Some(parse_base_name("Deriver", value)?),
                "System" => system = Some(value.to_owned()),
                // A signature given again is left out (by the `_` arm).
                "Sig" if seen_signatures.insert(value) => signatures.push(value.to_owned()),
                "CA" if ca.is_some() => return Err(field_err("CA", format!("given again on line {line} (extra CA)"))),
                "CA" => {
                    ca = Some(value)
                        .filter(|v| !v.is_empty())
                        .map(ContentAddress::parse)
                        .transpose()
                        .map_err(|e| field_err("CA", e.to_string()))?;
                }
                _ => {}
            }
        }

        let store_path = store_path.ok_or(NarInfoError::Missing("StorePath"))?;
        let url = url.filter(|u| !u.is_empty()).ok_or(NarInfoError::Missing("URL"))?;
        let nar_hash = nar_hash.ok_or(NarInfoError::Missing("NarHash"))?;
        let nar_size = nar_size.ok_or(NarInfoError::Missing("NarSize"))?;
        if nar_size == 0 {
            return Err(field_err("NarSize", "must not be 0"));
        }
        let compression = compression.filter(|c| !c.is_empty()).unwrap_or_else(|| "bzip2".to_owned());
        Ok(NarInfo {
            store_path,
            url,
            compression,
            file_hash,
            file_size,
            nar_hash,
            nar_size,
            references: references.unwrap_or_default(),
            deriver,
            signatures,
            ca,
            system,
        })
    }

    /// The narinfo a cache writes for `info`, whose NAR it holds at `url` compressed with
    /// `compression` (`file_hash`, `file_size` of that file): `info`'s signatures, then one by
    /// each of `keys` over its fingerprint unless already there (Nix's
    /// `BinaryCacheStore::addToStoreCommon`, `ValidPathInfo::sign`).
    pub fn signed(
        info: &crate::path_info::ValidPathInfo,
        (url, compression, file_hash, file_size): (String, String, Hash, u64),
        keys: &[crate::signature::SecretKey],
        store_dir: &StoreDir,
    ) -> Self {
        let mut signatures: Vec<String> = info.sigs.iter().cloned().collect();
        if !keys.is_empty() {
            let fingerprint = info.fingerprint(store_dir);
            for key in keys {
                let sig = key.sign(&fingerprint);
                if !signatures.contains(&sig) {
                    signatures.push(sig);
                }
            }
        }
        NarInfo {
            store_path: info.path.clone(),
            url,
            compression,
            file_hash: Some(file_hash),
            file_size: Some(file_size),
            nar_hash: info.nar_hash.clone(),
            nar_size: info.nar_size,
            references: info.references.iter().cloned().collect(),
            deriver: info.deriver.clone(),
            signatures,
            ca: info.ca.clone(),
            system: None,
        }
    }

    /// Prints in Nix's form and field order (`References: ` always, with a trailing space when
    /// empty; hashes as `sha256:<nixbase32>`).
    pub fn to_text(&self, store_dir: &StoreDir) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(s, "StorePath: {}", store_dir.display_path(&self.store_path));
        let _ = writeln!(s, "URL: {}", self.url);
        let _ = writeln!(s, "Compression: {}", self.compression);
        if let Some(h) = &self.file_hash {
            let _ = writeln!(s, "FileHash: {}", h.to_nix32_prefixed());
        }
        if let Some(n) = self.file_size {
            let _ = writeln!(s, "FileSize: {n}");
        }
        let _ = writeln!(s, "NarHash: {}", self.nar_hash.to_nix32_prefixed());
        let _ = writeln!(s, "NarSize: {}", self.nar_size);
        let refs: Vec<&str> = self.sorted_references().into_iter().map(StorePath::base_name).collect();
        let _ = writeln!(s, "References: {}", refs.join(" "));
        if let Some(d) = &self.deriver {
            let _ = writeln!(s, "Deriver: {d}");
        }
        if let Some(sys) = &self.system {
            let _ = writeln!(s, "System: {sys}");
        }
        for sig in &self.signatures {
            let _ = writeln!(s, "Sig: {sig}");
        }
        if let Some(ca) = &self.ca {
            let _ = writeln!(s, "CA: {ca}");
        }
        s
    }

    /// The references sorted and without duplicates, as Nix holds them.
    pub(crate) fn sorted_references(&self) -> Vec<&StorePath> {
        let mut refs: Vec<&StorePath> = self.references.iter().collect();
        refs.sort();
        refs.dedup();
        refs
    }

    /// The signature fingerprint ([`crate::path_info::fingerprint`]): the hash is always
    /// printed as `sha256:<nixbase32>` whatever encoding the file used.
    pub fn fingerprint(&self, store_dir: &StoreDir) -> String {
        crate::path_info::fingerprint(store_dir, &self.store_path, &self.nar_hash, self.nar_size, self.references.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "StorePath: /nix/store/2bvi3293ai6jdq2fbcix6d4xchrsw3a1-udev-rules.conf\n\
URL: nar/x.nar.xz\n\
Compression: xz\n\
NarHash: sha256:1082vds2vznpw83g7s5pg2xa6h9xa6zr409nx35h853nqdl0qml5\n\
NarSize: 632\n";

    fn parse(text: &str) -> Result<NarInfo, NarInfoError> {
        NarInfo::parse(&StoreDir::default(), text)
    }

    #[test]
    fn references_are_sorted_for_print_and_fingerprint() {
        let text = format!(
            "{BASE}References: zzbi3293ai6jdq2fbcix6d4xchrsw3a1-b 0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a  0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a\nDeriver: unknown-deriver\nSig: k:x\nSig: k:y\n"
        );
        let info = parse(&text).unwrap();
        assert_eq!(info.references.len(), 3);
        assert_eq!(info.deriver, None);
        assert_eq!(info.signatures, ["k:x", "k:y"]);
        let d = StoreDir::default();
        assert!(info.to_text(&d).contains("References: 0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a zzbi3293ai6jdq2fbcix6d4xchrsw3a1-b\n"));
        assert_eq!(
            info.fingerprint(&d),
            "1;/nix/store/2bvi3293ai6jdq2fbcix6d4xchrsw3a1-udev-rules.conf;sha256:1082vds2vznpw83g7s5pg2xa6h9xa6zr409nx35h853nqdl0qml5;632;\
/nix/store/0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a,/nix/store/zzbi3293ai6jdq2fbcix6d4xchrsw3a1-b"
        );
    }

    #[test]
    fn an_html_page_is_named() {
        let start = "'<!doctype html> <p>Buy this domain</p>'".to_owned();
        assert_eq!(parse("\n<!doctype html>\n<p>Buy this domain</p>\n"), Err(NarInfoError::HtmlPage { start }));
        assert!(parse(&format!("{BASE}X-Note: <b>\n")).is_ok());
    }

    #[test]
    fn field_errors() {
        let field = |text: String| match parse(&text) {
            Err(NarInfoError::Field { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field(format!("{BASE}References: 0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a\nReferences: 0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a\n")),
            "References"
        );
        assert_eq!(field(format!("{BASE}CA: fixed:r:sha256:1082vds2vznpw83g7s5pg2xa6h9xa6zr409nx35h853nqdl0qml5\nCA: \n")), "CA");
        assert!(matches!(parse(&format!("{BASE}NarSize:9\n")), Err(NarInfoError::Line { line: 6, .. })));
        assert_eq!(field(format!("{BASE}FileSize: 99999999999999999999999\n")), "FileSize");
        assert_eq!(field(format!("{BASE}FileHash: md5:abc\n")), "FileHash");
        assert_eq!(field(format!("{BASE}CA: fixed:sha256:nope\n")), "CA");
        assert_eq!(field(format!("{BASE}Deriver: not-a-path\n")), "Deriver");
        assert_eq!(field(format!("{BASE}References: /nix/store/0za6hhg5kdh6vk2ds8m40snyz7aar7a1-a\n")), "References");
        assert_eq!(field(BASE.replace("/nix/store/", "/gnu/store/")), "StorePath");
        assert!(matches!(parse(&format!("{BASE}no colon here\n")), Err(NarInfoError::Line { line: 6, .. })));
        assert!(matches!(parse(&BASE.replace("URL: nar/x.nar.xz", "URL: ")), Err(NarInfoError::Missing("URL"))));
        assert!(parse(&format!("{BASE}Unknown:\nOther: a: b\nX-Cache:HIT\nX-Served-By: edge\r\n")).is_ok());
        // A line ending at its ':' makes Nix read the next line as its value.
        for text in [format!("{BASE}References:\nSig: k:x\n"), format!("{BASE}X-A:\nSig: k:x\n"), format!("{BASE}X-A:\n")] {
            assert!(matches!(parse(&text), Err(NarInfoError::Line { line: 6, .. })), "{text}");
        }
        assert!(matches!(parse(&format!("{BASE}Sig: k:x\r\n")), Err(NarInfoError::Line { line: 6, .. })));
        // As Nix 2.26: a field given again takes its last value; empty References lines and
        // empty CAs are nothing; a repeated Sig counts once; sizes may have a '+'.
        let again =
            parse(&format!("{BASE}URL: nar/y.nar.xz\nReferences: \nReferences: \nCA: \nCA: \nSig: k:x\nSig: k:x\nNarSize: +0632\n"))
                .unwrap();
        assert_eq!(
            (again.url.as_str(), again.references.len(), again.ca, again.signatures, again.nar_size),
            ("nar/y.nar.xz", 0, None, vec!["k:x".to_owned()], 632)
        );
        assert_eq!(field(format!("{BASE}NarSize: ++1\n")), "NarSize");
        assert_eq!(field(format!("{BASE}NarSize: -1\n")), "NarSize");
        assert_eq!(parse(BASE).unwrap().to_text(&StoreDir::default()), format!("{BASE}References: \n"));
    }
}
