//! Fuzz targets for sluice's input parsers, one function per target, shared by the AFL++
//! binaries in `src/bin/` and by replaying findings. Every target must return normally on any
//! input: a panic, a hang or an allocation following a declared length is a finding.

use std::io::Read;

use sluice_nix::nar::{listing, reader};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::{self, FramedReader, ProtocolVersion};

/// NAR reader: validation, and listing (which builds the tree) of the same bytes.
pub fn nar(data: &[u8]) {
    let _ = reader::validate(data);
    let _ = listing::list(data);
}

/// narinfo parser for the default store directory, and re-rendering of what it accepts.
pub fn narinfo(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(info) = NarInfo::parse(&StoreDir::default(), text) {
        let _ = info.fingerprint(&StoreDir::default());
    }
}

/// Store-path parsing: base names, full paths, and paths below a store path.
pub fn store_path(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let dir = StoreDir::default();
    if let Ok(p) = StorePath::from_base_name(text) {
        assert_eq!(dir.parse_path(&dir.display_path(&p)).ok().as_ref(), Some(&p), "display/parse round trip of {text:?}");
    }
    let _ = dir.parse_path(text);
    let _ = dir.to_store_path(text);
    let _ = StoreDir::new(text);
}

/// Worker-protocol decoding: the first byte picks a decoder (and protocol minor version),
/// the rest is its input; decoding repeats until the input is used up or an error.
pub fn wire(data: &[u8]) {
    let Some((&choice, mut rest)) = data.split_first() else { return };
    let dir = StoreDir::default();
    let version = ProtocolVersion::new(1, 10 + (choice >> 3) % 28);
    for _ in 0..64 {
        if rest.is_empty() {
            return;
        }
        let r = &mut rest;
        let ok = match choice % 8 {
            0 => wire::read_u64(r, "n").is_ok(),
            1 => wire::read_string(r, 1 << 16, "s").is_ok(),
            2 => wire::read_strings(r, 1 << 10, 1 << 12, "ss").is_ok(),
            3 => wire::read_string_pairs(r, 1 << 10, 1 << 12, "pairs").is_ok(),
            4 => wire::read_store_path_set(r, &dir, "paths").is_ok(),
            5 => wire::read_content_address(r, "ca").is_ok(),
            6 => match wire::read_store_path(r, &dir, "path") {
                Ok(p) => wire::read_unkeyed_path_info(r, &dir, version, p).is_ok(),
                Err(_) => false,
            },
            _ => {
                let mut framed = FramedReader::new(&mut *r);
                let mut sink = Vec::new();
                let ok = (&mut framed).take(1 << 20).read_to_end(&mut sink).is_ok();
                ok && framed.is_done()
            }
        };
        if !ok {
            return;
        }
    }
}
