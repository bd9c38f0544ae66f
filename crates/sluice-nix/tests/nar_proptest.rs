//! Property: for any tree with valid, sorted, unique names, write → read → write is the
//! identity, and reading gives back the tree.

use std::collections::BTreeMap;

use proptest::prelude::*;
use sluice_nix::nar::reader::parse;
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::nar::{NarPath, NarVisitor};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tree {
    File { executable: bool, contents: Vec<u8> },
    Link(Vec<u8>),
    Dir(BTreeMap<Vec<u8>, Tree>),
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![Just(b'.'), Just(b'-'), Just(b'a'), Just(b'B'), Just(0xc3u8), 1u8..=255], 1..6)
        .prop_filter("valid NAR name", |n| n != b"." && n != b".." && !n.contains(&b'/'))
}

fn tree() -> impl Strategy<Value = Tree> {
    let leaf = prop_oneof![
        (any::<bool>(), prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(executable, contents)| Tree::File { executable, contents }),
        prop::collection::vec(1u8..=255, 1..20).prop_map(Tree::Link),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| prop::collection::btree_map(name(), inner, 0..6).prop_map(Tree::Dir))
}

fn write(t: &Tree, path: &mut Vec<Vec<u8>>, v: &mut dyn NarVisitor) {
    match t {
        Tree::File { executable, contents } => v.regular(path, *executable, contents.len() as u64, 0, &mut &contents[..]).unwrap(),
        Tree::Link(target) => v.symlink(path, target).unwrap(),
        Tree::Dir(entries) => {
            v.directory_start(path).unwrap();
            for (name, child) in entries {
                path.push(name.clone());
                write(child, path, v);
                path.pop();
            }
            v.directory_end(path).unwrap();
        }
    }
}

/// Rebuilds a [`Tree`] from visitor calls.
#[derive(Default)]
struct Collect {
    root: Option<Tree>,
    open: Vec<BTreeMap<Vec<u8>, Tree>>,
}

impl Collect {
    fn add(&mut self, path: &NarPath, t: Tree) {
        match (path.last(), self.open.last_mut()) {
            (Some(n), Some(d)) => {
                d.insert(n.clone(), t);
            }
            _ => self.root = Some(t),
        }
    }
}

impl NarVisitor for Collect {
    fn regular(&mut self, path: &NarPath, executable: bool, size: u64, _: u64, c: &mut dyn std::io::Read) -> std::io::Result<()> {
        let mut contents = Vec::new();
        c.read_to_end(&mut contents)?;
        assert_eq!(contents.len() as u64, size);
        self.add(path, Tree::File { executable, contents });
        Ok(())
    }
    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> std::io::Result<()> {
        self.add(path, Tree::Link(target.to_vec()));
        Ok(())
    }
    fn directory_start(&mut self, _: &NarPath) -> std::io::Result<()> {
        self.open.push(BTreeMap::new());
        Ok(())
    }
    fn directory_end(&mut self, path: &NarPath) -> std::io::Result<()> {
        let d = self.open.pop().unwrap();
        self.add(path, Tree::Dir(d));
        Ok(())
    }
}

proptest! {
    #[test]
    fn write_read_write_is_identity(t in tree()) {
        let mut w = NarWriter::new(Vec::new()).unwrap();
        write(&t, &mut Vec::new(), &mut w);
        let nar = w.into_inner();
        prop_assert_eq!(nar.len() % 8, 0);

        let mut w2 = NarWriter::new(Vec::new()).unwrap();
        prop_assert_eq!(parse(&nar[..], &mut w2).unwrap(), nar.len() as u64);
        prop_assert_eq!(&w2.into_inner(), &nar);

        let mut c = Collect::default();
        parse(&nar[..], &mut c).unwrap();
        prop_assert_eq!(c.root.as_ref(), Some(&t));

        // Every strict prefix is truncated input, never a panic or success.
        for cut in (0..nar.len()).step_by(7) {
            prop_assert!(sluice_nix::nar::reader::validate(&nar[..cut]).is_err());
        }
    }

    /// Arbitrary bytes after a valid header never panic the reader.
    #[test]
    fn garbage_never_panics(tail in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut nar = sluice_nix::nar::writer::regular_file_nar(b"", false);
        nar.truncate(24);
        nar.extend_from_slice(&tail);
        let _ = sluice_nix::nar::reader::validate(&nar[..]);
    }
}
