//! NAR (Nix ARchive): the canonical serialisation of a file-system object. Format: Nix
//! `src/libutil/archive.cc` and Eelco Dolstra's thesis, fig. 5.2. Every token is a u64
//! little-endian length followed by the bytes, zero-padded to a multiple of 8.
//!
//! Reading and writing share one event model, [`NarVisitor`]: the reader ([`reader::parse`])
//! calls a visitor for each node in NAR order, and the writer ([`writer::NarWriter`]) is a
//! visitor, so `parse(nar, &mut NarWriter::new(out))` reproduces `nar` byte for byte.
//!
//! Grammar (each quoted word is one token):
//! ```text
//! nar       = "nix-archive-1" node
//! node      = "(" "type" ( regular | symlink | directory ) ")"
//! regular   = "regular" [ "executable" "" ] "contents" <u64 size> <size bytes, padded>
//! symlink   = "symlink" "target" <target>
//! directory = "directory" { "entry" "(" "name" <name> "node" node ")" }   (names ascending)
//! ```

pub mod listing;
pub mod reader;
pub mod writer;

/// The first token of every NAR.
pub(crate) const MAGIC: &str = "nix-archive-1";

/// Shows bytes of a NAR (a token, or what stands where a NAR should start) for an error
/// message: quoted, escaped, the first 40 of them.
pub fn show_bytes(bytes: &[u8]) -> String {
    let s: String = bytes.iter().take(40).flat_map(|&b| std::ascii::escape_default(b)).map(char::from).collect();
    if bytes.len() > 40 {
        format!("'{s}…'")
    } else {
        format!("'{s}'")
    }
}

/// A node's position in the NAR: the entry names from the root down (empty for the root).
/// Names are validated by the reader: non-empty, not `.` or `..`, no `/` or NUL.
pub type NarPath = [Vec<u8>];

/// Receives the nodes of a NAR in order: a directory's `directory_start`, then its entries
/// (sorted by name, recursively), then its `directory_end`.
pub trait NarVisitor {
    /// A regular file of `size` bytes whose contents start at byte `offset` of the NAR.
    /// `contents` yields exactly `size` bytes; the reader consumes whatever is not read.
    fn regular(
        &mut self,
        path: &NarPath,
        executable: bool,
        size: u64,
        offset: u64,
        contents: &mut dyn std::io::Read,
    ) -> std::io::Result<()>;
    /// A symbolic link with the given target (arbitrary bytes, not checked).
    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> std::io::Result<()>;
    /// The start of a directory; its entries follow.
    fn directory_start(&mut self, path: &NarPath) -> std::io::Result<()>;
    /// The end of a directory.
    fn directory_end(&mut self, path: &NarPath) -> std::io::Result<()>;
}

/// A visitor that ignores everything (the reader still checks the whole NAR).
#[derive(Debug, Default, Clone, Copy)]
pub struct Discard;

impl NarVisitor for Discard {
    fn regular(&mut self, _: &NarPath, _: bool, _: u64, _: u64, _: &mut dyn std::io::Read) -> std::io::Result<()> {
        Ok(())
    }
    fn symlink(&mut self, _: &NarPath, _: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
    fn directory_start(&mut self, _: &NarPath) -> std::io::Result<()> {
        Ok(())
    }
    fn directory_end(&mut self, _: &NarPath) -> std::io::Result<()> {
        Ok(())
    }
}

/// Checks a directory entry name as Nix does: not empty, `.` or `..`, no `/` or NUL, at most
/// [`reader::MAX_NAME_LEN`] bytes. The error says why.
pub(crate) fn check_name(name: &[u8]) -> Result<(), &'static str> {
    match name {
        [] => Err("empty name"),
        b"." | b".." => Err("'.' and '..' are not allowed"),
        _ if name.contains(&b'/') => Err("contains '/'"),
        _ if name.contains(&0) => Err("contains a NUL byte"),
        _ if name.len() > reader::MAX_NAME_LEN => Err("longer than 255 bytes"),
        _ => Ok(()),
    }
}

/// A NAR of `depth` nested directories `d`, a symlink `-> x` at the bottom: the deep input of
/// the reader's and the listing's tests.
#[cfg(test)]
pub(crate) fn nested_nar(depth: usize) -> Vec<u8> {
    let mut w = writer::NarWriter::new(Vec::new()).unwrap();
    let mut path: Vec<Vec<u8>> = Vec::new();
    for _ in 0..depth {
        w.directory_start(&path).unwrap();
        path.push(b"d".to_vec());
    }
    w.symlink(&path, b"x").unwrap();
    while path.pop().is_some() {
        w.directory_end(&path).unwrap();
    }
    w.into_inner()
}
