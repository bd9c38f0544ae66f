//! NAR listings as `nix nar ls` prints them (text and `--json`, with `narOffset`). Source: Nix
//! `src/libutil/archive.cc`, `src/nix/ls.cc`, `src/libstore/nar-accessor.cc`.
//!
//! [`ListingBuilder`] is a [`NarVisitor`] that builds a [`NarEntry`] tree (file contents are
//! skipped, only sizes and offsets kept); [`list`] parses a NAR into one. The tree renders as
//! Nix prints it: [`NarEntry::to_json`] (`nix nar ls --json [-R]`, compact, no trailing
//! newline, keys in Nix 2.8's or Nix 2.26's order) and [`NarEntry::to_text`]
//! (`nix nar ls [-l] [-R] [-d]`, one line per entry, the same in both).
//! Output is bytes: names and targets are arbitrary bytes and Nix prints them unchanged.

use std::collections::BTreeMap;
use std::io::Write as _;

use super::reader::NarError;
use super::{NarPath, NarVisitor};

/// One node of a NAR, without file contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NarEntry {
    /// A regular file: `size` bytes starting at byte `nar_offset` of the NAR.
    Regular { executable: bool, size: u64, nar_offset: u64 },
    /// A symbolic link.
    Symlink { target: Vec<u8> },
    /// A directory; entries in NAR (byte) order.
    Directory { entries: BTreeMap<Vec<u8>, NarEntry> },
}

/// The order of the keys in a listing's JSON objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonKeys {
    /// Nix 2.8's (`JSONPlaceholder` in `listNar`, `src/libstore/nar-accessor.cc`): `type`,
    /// then `entries` / `size`, `executable`, `narOffset` / `target`. Also the `.ls` files
    /// Nix 2.8 writes into binary caches.
    Nix2_8,
    /// Nix 2.26's (`nlohmann::json` objects, whose keys are sorted).
    Sorted,
}

/// Parses a NAR into its listing (contents are read and discarded); the reader stops at the
/// NAR's end ([`super::reader::parse`]).
pub fn list<R: std::io::Read>(reader: R) -> Result<NarEntry, NarError> {
    build(|b| super::reader::parse(reader, b))
}

/// [`list`] of an input that is one NAR and nothing else: data after its end is refused
/// ([`super::reader::parse_whole`]).
pub fn list_whole<R: std::io::Read>(reader: R) -> Result<NarEntry, NarError> {
    build(|b| super::reader::parse_whole(reader, b))
}

fn build(parse: impl FnOnce(&mut ListingBuilder) -> Result<u64, NarError>) -> Result<NarEntry, NarError> {
    let mut b = ListingBuilder::default();
    let len = parse(&mut b)?;
    b.finish().ok_or(NarError::Invalid { offset: len, what: "NAR has no root node".into() })
}

/// A visitor that builds a [`NarEntry`] tree.
#[derive(Debug, Default)]
pub struct ListingBuilder {
    root: Option<NarEntry>,
    /// Open directories, innermost last.
    open: Vec<BTreeMap<Vec<u8>, NarEntry>>,
}

impl ListingBuilder {
    /// The tree, once the root node has been visited completely.
    pub fn finish(self) -> Option<NarEntry> {
        self.root
    }

    fn add(&mut self, path: &NarPath, entry: NarEntry) {
        match (path.last(), self.open.last_mut()) {
            (Some(name), Some(dir)) => {
                dir.insert(name.clone(), entry);
            }
            _ => self.root = Some(entry),
        }
    }
}

impl NarVisitor for ListingBuilder {
    fn regular(&mut self, path: &NarPath, executable: bool, size: u64, offset: u64, _: &mut dyn std::io::Read) -> std::io::Result<()> {
        self.add(path, NarEntry::Regular { executable, size, nar_offset: offset });
        Ok(())
    }
    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> std::io::Result<()> {
        self.add(path, NarEntry::Symlink { target: target.to_vec() });
        Ok(())
    }
    fn directory_start(&mut self, _: &NarPath) -> std::io::Result<()> {
        self.open.push(BTreeMap::new());
        Ok(())
    }
    fn directory_end(&mut self, path: &NarPath) -> std::io::Result<()> {
        let entries = self.open.pop().unwrap_or_default();
        self.add(path, NarEntry::Directory { entries });
        Ok(())
    }
}

/// Options of the text listing (`nix nar ls` flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TextOptions {
    /// `-l`: type/permissions column and size, and ` -> target` for symlinks.
    pub long: bool,
    /// `-R`: list subdirectories recursively.
    pub recursive: bool,
    /// `-d`: show a directory itself rather than its contents.
    pub directory: bool,
}

/// Appends `s` as a JSON string the way Nix 2.8's JSON writer does: `"` `\` and control
/// characters escaped, every other byte (including non-UTF-8) unchanged.
fn json_string(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    for &c in s {
        match c {
            b'"' | b'\\' => out.extend_from_slice(&[b'\\', c]),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..=0x1f => {
                let _ = write!(out, "\\u{:04x}", c);
            }
            _ => out.push(c),
        }
    }
    out.push(b'"');
}

impl NarEntry {
    /// The node at the end of `components` (names below the root, outermost first; none is
    /// the root), or `None` if a component is missing or below a non-directory.
    pub fn find<'a>(&self, components: impl IntoIterator<Item = &'a str>) -> Option<&NarEntry> {
        components.into_iter().try_fold(self, |node, name| match node {
            NarEntry::Directory { entries } => entries.get(name.as_bytes()),
            _ => None,
        })
    }

    /// The size column of `nix nar ls -l` (0 for directories and symlinks).
    pub fn size(&self) -> u64 {
        match self {
            NarEntry::Regular { size, .. } => *size,
            _ => 0,
        }
    }

    /// `nix nar ls --json` (with `-R` when `recursive`): compact JSON with `type`, `entries`
    /// (a directory's), `size`, `executable` (only when true), `narOffset` (a regular file's)
    /// and `target` (a symlink's), in the order `keys` gives. Without `recursive`, a
    /// directory's entries are shown as `{}`.
    pub fn to_json(&self, recursive: bool, keys: JsonKeys) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_json(&mut out, recursive, keys);
        out
    }

    /// Writes straight into `out`, keeping the open directories on a heap stack (a listing is
    /// rendered on a server's worker threads, whatever the depth of the tree).
    fn write_json(&self, out: &mut Vec<u8>, recursive: bool, keys: JsonKeys) {
        let mut open = Vec::new();
        if let Some(entries) = self.open_json(out, true, keys) {
            open.push((entries, true));
        }
        while let Some((entries, first)) = open.last_mut() {
            match entries.next() {
                Some((name, child)) => {
                    if !std::mem::take(first) {
                        out.push(b',');
                    }
                    json_string(out, name);
                    out.push(b':');
                    if let Some(entries) = child.open_json(out, recursive, keys) {
                        open.push((entries, true));
                    }
                }
                None => {
                    open.pop();
                    out.push(b'}');
                    Self::close_json(out, b"\"type\":\"directory\"", keys);
                }
            }
        }
    }

    /// Writes this node's JSON object, or only its head when it is a directory to `expand`
    /// (whose entries the caller writes, then closes it with [`NarEntry::close_json`]).
    fn open_json<'a>(
        &'a self,
        out: &mut Vec<u8>,
        expand: bool,
        keys: JsonKeys,
    ) -> Option<std::collections::btree_map::Iter<'a, Vec<u8>, NarEntry>> {
        if !expand {
            out.extend_from_slice(b"{}");
            return None;
        }
        let kind: &[u8] = match self {
            NarEntry::Regular { .. } => b"\"type\":\"regular\"",
            NarEntry::Symlink { .. } => b"\"type\":\"symlink\"",
            NarEntry::Directory { .. } => b"\"type\":\"directory\"",
        };
        out.push(b'{');
        if keys == JsonKeys::Nix2_8 {
            out.extend_from_slice(kind);
            out.push(b',');
        }
        match self {
            NarEntry::Regular { executable, size, nar_offset } => {
                let exec = if *executable { "\"executable\":true," } else { "" };
                let _ = match keys {
                    JsonKeys::Nix2_8 => write!(out, "\"size\":{size},{exec}\"narOffset\":{nar_offset}"),
                    JsonKeys::Sorted => write!(out, "{exec}\"narOffset\":{nar_offset},\"size\":{size}"),
                };
            }
            NarEntry::Symlink { target } => {
                out.extend_from_slice(b"\"target\":");
                json_string(out, target);
            }
            NarEntry::Directory { entries } => {
                out.extend_from_slice(b"\"entries\":{");
                return Some(entries.iter());
            }
        }
        Self::close_json(out, kind, keys);
        None
    }

    /// Ends a node's JSON object whose type member is `kind`.
    fn close_json(out: &mut Vec<u8>, kind: &[u8], keys: JsonKeys) {
        if keys == JsonKeys::Sorted {
            out.push(b',');
            out.extend_from_slice(kind);
        }
        out.push(b'}');
    }

    /// `nix nar ls` text output for this node, labelled `label` (Nix uses `.` for a directory
    /// root and the base name of the requested path otherwise). Lines end in `\n`; long lines
    /// are `<mode> <size right-aligned in 20> <path>[ -> <target>]`. Nix's `doPath` lists a
    /// directory's contents (or, with `-d`, the node itself) and its `showFile` one line per
    /// node, then with `-R` a directory's contents; the open directories are kept on a heap
    /// stack.
    pub fn to_text(&self, label: &str, opts: TextOptions) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rel = label.as_bytes().to_vec();
        let mut open = Vec::new();
        match self {
            NarEntry::Directory { entries } if !opts.directory => open.push((entries.iter(), rel.len())),
            _ => {
                self.text_line(&mut out, &rel, opts);
                if let (true, NarEntry::Directory { entries }) = (opts.recursive, self) {
                    open.push((entries.iter(), rel.len()));
                }
            }
        }
        while let Some((entries, len)) = open.last_mut() {
            rel.truncate(*len);
            let Some((name, child)) = entries.next() else {
                open.pop();
                continue;
            };
            rel.push(b'/');
            rel.extend_from_slice(name);
            child.text_line(&mut out, &rel, opts);
            if let (true, NarEntry::Directory { entries }) = (opts.recursive, child) {
                open.push((entries.iter(), rel.len()));
            }
        }
        out
    }

    /// One line of the text listing: this node at `rel`.
    fn text_line(&self, out: &mut Vec<u8>, rel: &[u8], opts: TextOptions) {
        if opts.long {
            let mode = match self {
                NarEntry::Regular { executable: true, .. } => "-r-xr-xr-x",
                NarEntry::Regular { .. } => "-r--r--r--",
                NarEntry::Symlink { .. } => "lrwxrwxrwx",
                NarEntry::Directory { .. } => "dr-xr-xr-x",
            };
            let _ = write!(out, "{mode} {:>20} ", self.size());
            out.extend_from_slice(rel);
            if let NarEntry::Symlink { target } = self {
                out.extend_from_slice(b" -> ");
                out.extend_from_slice(target);
            }
        } else {
            out.extend_from_slice(rel);
        }
        out.push(b'\n');
    }
}

/// A deep tree is dropped from a heap stack: the derived drop would recurse once per level.
impl Drop for NarEntry {
    fn drop(&mut self) {
        let NarEntry::Directory { entries } = self else { return };
        let mut pending = vec![std::mem::take(entries)];
        while let Some(dir) = pending.pop() {
            for (_, mut child) in dir {
                if let NarEntry::Directory { entries } = &mut child {
                    pending.push(std::mem::take(entries));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nar::writer::NarWriter;

    /// A small tree: `a` (exec, "hi"), `b/` with `c -> a`, and `q"\n`.
    fn sample() -> Vec<u8> {
        let mut w = NarWriter::new(Vec::new()).unwrap();
        let n = |s: &str| s.as_bytes().to_vec();
        w.directory_start(&[]).unwrap();
        w.regular(&[n("a")], true, 2, 0, &mut &b"hi"[..]).unwrap();
        w.directory_start(&[n("b")]).unwrap();
        w.symlink(&[n("b"), n("c")], b"../a").unwrap();
        w.directory_end(&[n("b")]).unwrap();
        w.regular(&[n("q\"\n")], false, 0, 0, &mut &b""[..]).unwrap();
        w.directory_end(&[]).unwrap();
        w.into_inner()
    }

    #[test]
    fn json_and_text() {
        let tree = list(&sample()[..]).unwrap();
        assert_eq!(
            String::from_utf8(tree.to_json(true, JsonKeys::Nix2_8)).unwrap(),
            r#"{"type":"directory","entries":{"a":{"type":"regular","size":2,"executable":true,"narOffset":264},"b":{"type":"directory","entries":{"c":{"type":"symlink","target":"../a"}}},"q\"\n":{"type":"regular","size":0,"narOffset":816}}}"#
        );
        assert_eq!(
            String::from_utf8(tree.to_json(true, JsonKeys::Sorted)).unwrap(),
            r#"{"entries":{"a":{"executable":true,"narOffset":264,"size":2,"type":"regular"},"b":{"entries":{"c":{"target":"../a","type":"symlink"}},"type":"directory"},"q\"\n":{"narOffset":816,"size":0,"type":"regular"}},"type":"directory"}"#
        );
        assert_eq!(
            String::from_utf8(tree.to_json(false, JsonKeys::Nix2_8)).unwrap(),
            r#"{"type":"directory","entries":{"a":{},"b":{},"q\"\n":{}}}"#
        );
        let long = TextOptions { long: true, recursive: true, directory: false };
        assert_eq!(
            String::from_utf8(tree.to_text(".", long)).unwrap(),
            "-r-xr-xr-x                    2 ./a\n\
             dr-xr-xr-x                    0 ./b\n\
             lrwxrwxrwx                    0 ./b/c -> ../a\n\
             -r--r--r--                    0 ./q\"\n\n"
        );
        let short = TextOptions::default();
        assert_eq!(String::from_utf8(tree.to_text(".", short)).unwrap(), "./a\n./b\n./q\"\n\n");
        let dir = TextOptions { directory: true, ..short };
        assert_eq!(String::from_utf8(tree.to_text(".", dir)).unwrap(), ".\n");
        assert_eq!(tree.find(["b", "c"]), Some(&NarEntry::Symlink { target: b"../a".to_vec() }));
        assert_eq!(tree.find(["a", "x"]), None);
        assert_eq!(tree.find(["b", ""]), None);
        assert_eq!(tree.find([]), Some(&tree));
        let leaf = tree.find(["a"]).unwrap();
        assert_eq!(String::from_utf8(leaf.to_text("a", long)).unwrap(), "-r-xr-xr-x                    2 a\n");
    }

    /// The deepest NAR the reader accepts is listed, rendered both ways and dropped on a
    /// thread whose stack is a 32nd of a default thread's: nothing recurses per level.
    #[test]
    fn the_deepest_listing_renders_and_drops_on_a_small_stack() {
        let depth = crate::nar::reader::MAX_DEPTH;
        let nar = crate::nar::nested_nar(depth);
        let rendered = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                let tree = list(&nar[..]).unwrap();
                let json = [JsonKeys::Nix2_8, JsonKeys::Sorted].map(|k| String::from_utf8(tree.to_json(true, k)).unwrap());
                (json, String::from_utf8(tree.to_text(".", TextOptions { long: false, recursive: true, directory: false })).unwrap())
            })
            .unwrap()
            .join()
            .unwrap();
        let ([nix2_8, sorted], text) = rendered;
        let nested = |open: &str, leaf: &str, close: &str| format!("{}{leaf}{}", open.repeat(depth), close.repeat(depth));
        assert_eq!(nix2_8, nested(r#"{"type":"directory","entries":{"d":"#, r#"{"type":"symlink","target":"x"}"#, "}}"));
        assert_eq!(sorted, nested(r#"{"entries":{"d":"#, r#"{"target":"x","type":"symlink"}"#, r#"},"type":"directory"}"#));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), depth);
        assert_eq!(lines[depth - 1].len(), 1 + 2 * depth);
    }

    #[test]
    fn json_escapes_control_bytes() {
        let mut out = Vec::new();
        json_string(&mut out, b"\x01\t\\\xff");
        assert_eq!(out, b"\"\\u0001\\t\\\\\xff\"");
    }
}
