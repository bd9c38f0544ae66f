//! NAR reader, writer and listing against Nix's conformance vectors, the cases and the corpus.

use crate::common::{files, read_string, shared};
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::nar::listing::{list, JsonKeys, TextOptions};
use sluice_nix::nar::reader::{parse, validate, NarError};
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::store_path::StoreDir;

fn read(p: &std::path::Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Parses `nar` followed by trailing bytes: checks that exactly the NAR was consumed and that
/// writing it back gives the same bytes.
fn round_trip(nar: &[u8], what: &str) {
    let mut input = nar.to_vec();
    input.extend_from_slice(b"TRAILING");
    let mut rest = &input[..];
    let mut w = NarWriter::new(Vec::new()).unwrap();
    let len = parse(&mut rest, &mut w).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(len, nar.len() as u64, "{what}");
    assert_eq!(rest, b"TRAILING", "{what}: read beyond the NAR");
    assert_eq!(w.position(), len);
    assert!(w.into_inner() == nar, "{what}: writer output differs");
}

fn reject(nar: &[u8]) -> NarError {
    validate(nar).expect_err("should be rejected")
}

#[test]
fn conformance_vectors() {
    let valid = ["simple", "case", "case-collision", "empty-dir", "empty-subdir", "regular-one-byte-zero-padding"];
    let mut seen = 0;
    for dir in ["conformance/nix/libutil-tests/data/nars", "conformance/nix/libutil-tests/fuzz/data/nars"] {
        for p in files(dir, ".nar") {
            let stem = p.file_stem().unwrap().to_str().unwrap().to_owned();
            let nar = read(&p);
            seen += 1;
            if valid.contains(&stem.as_str()) {
                round_trip(&nar, &stem);
                continue;
            }
            let err = reject(&nar);
            let msg = err.to_string();
            let ok = match stem.as_str() {
                "invalid-tag-instead-of-contents" => msg.contains("expected 'contents'"),
                "nul-character" => msg.contains("invalid file name") && msg.contains("NUL"),
                "dot" | "dotdot" => msg.contains("invalid file name") && msg.contains("'.' and '..'"),
                "slash" => msg.contains("invalid file name") && msg.contains("'/'"),
                "empty" => msg.contains("empty name"),
                "executable-after-contents" => msg.contains("'executable' must come before 'contents'"),
                "name-after-node" => msg.contains("'node' before 'name'"),
                "regular-one-byte-non-zero-padding" => msg.contains("non-zero padding"),
                "regular-truncated-large-contents" | "regular-truncated-padding" => matches!(err, NarError::Truncated { .. }),
                other => panic!("unexpected vector {other}: {msg}"),
            };
            assert!(ok, "{stem}: {msg}");
        }
    }
    assert_eq!(seen, 12 + 17);
}

#[test]
fn case04_bogus_lengths() {
    let dir = "cases/04-nar-bogus-lengths";
    for (file, want) in [
        ("no-magic", "bad magic"),
        ("huge-token", "too long"),
        ("big-token", "too long"),
        ("huge-contents", "unexpected end"),
        ("truncated", "unexpected end"),
    ] {
        let start = std::time::Instant::now();
        let err = reject(&read(&shared(&format!("{dir}/{file}.nar"))));
        assert!(err.to_string().contains(want), "{file}: {err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }
}

#[test]
fn case06_directory_entries() {
    let dir = "cases/06-nar-directory-entries";
    let ok = read(&shared(&format!("{dir}/ok-prefix-names.nar")));
    round_trip(&ok, "ok-prefix-names");
    let tree = list(&ok[..]).unwrap();
    let text = tree.to_text(".", TextOptions { recursive: true, ..Default::default() });
    assert_eq!(String::from_utf8(text).unwrap(), "./foo\n./foo/bar.h\n./foo-\n./foo.h\n");
    for (file, want) in [
        ("unsorted", "not sorted"),
        ("duplicate-file", "duplicate"),
        ("dup-symlink-then-dir", "duplicate"),
        ("dup-symlink-then-file", "duplicate"),
        ("name-dot", "invalid file name"),
        ("name-dotdot", "invalid file name"),
        ("name-slash", "invalid file name"),
        ("name-nul", "invalid file name"),
        ("name-empty", "invalid file name"),
        ("name-traversal", "invalid file name"),
    ] {
        let nar = read(&shared(&format!("{dir}/{file}.nar")));
        let err = reject(&nar);
        assert!(err.to_string().contains(want), "{file}: {err}");
        assert!(list(&nar[..]).is_err());
    }
}

#[test]
fn fixtures_round_trip_hash_and_list() {
    let tsv = read_string(&shared("corpus/fixtures/fixtures.tsv"));
    let mut n = 0;
    for line in tsv.lines().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        let [file, _path, size, hash] = cols[..] else { panic!("bad line {line}") };
        let nar = read(&shared(&format!("corpus/fixtures/{file}")));
        round_trip(&nar, file);
        assert_eq!(nar.len().to_string(), size, "{file}");
        assert_eq!(Hash::digest_bytes(HashAlgo::Sha256, &nar).to_nix32(), hash, "{file}");
        let json = read(&shared(&format!("corpus/fixtures/{}", file.replace(".nar", ".ls.json"))));
        let tree = list(&nar[..]).unwrap();
        assert!(
            tree.to_json(true, JsonKeys::Nix2_8) == json,
            "{file}: listing differs:\n{}",
            String::from_utf8_lossy(&tree.to_json(true, JsonKeys::Nix2_8))
        );
        n += 1;
    }
    assert_eq!(n, 4);
}

#[test]
fn subset_none_nars_match_narinfo() {
    let dir = StoreDir::default();
    let mut n = 0;
    for p in files("corpus/cache-subset-none", ".narinfo") {
        let info = NarInfo::parse(&dir, &read_string(&p)).unwrap();
        let nar = read(&shared(&format!("corpus/cache-subset-none/{}", info.url)));
        assert_eq!(nar.len() as u64, info.nar_size);
        let mut r = sluice_nix::hash::HashingReader::new(&nar[..], HashAlgo::Sha256);
        let mut w = NarWriter::new(sluice_nix::hash::Hasher::new(HashAlgo::Sha256)).unwrap();
        assert_eq!(parse(&mut r, &mut w).unwrap(), info.nar_size);
        assert_eq!(r.finish().0, info.nar_hash);
        assert_eq!(w.into_inner().finish(), info.nar_hash, "{}", info.store_path);
        n += 1;
    }
    assert_eq!(n, 25);
}

/// Every path of `truth/nar-hashes.tsv`, decompressed from cache-xz.
#[test]
fn xz_nars_match_truth() {
    let dir = StoreDir::default();
    let tsv = read_string(&shared("corpus/truth/nar-hashes.tsv"));
    let mut n = 0;
    for line in tsv.lines().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        let [path, nar_size, hash32, hex, bytes] = cols[..] else { panic!("bad line {line}") };
        let sp = dir.parse_path(path).unwrap();
        let info = NarInfo::parse(&dir, &read_string(&shared(&format!("corpus/cache-xz/{}.narinfo", sp.hash_part())))).unwrap();
        let xz = read(&shared(&format!("corpus/cache-xz/{}", info.url)));
        let mut nar = Vec::new();
        std::io::Read::read_to_end(&mut liblzma::read::XzDecoder::new(&xz[..]), &mut nar).unwrap();
        let h = Hash::digest_bytes(HashAlgo::Sha256, &nar);
        assert_eq!((h.to_nix32(), h.to_base16()), (hash32.to_owned(), hex.to_owned()), "{path}");
        assert_eq!((nar.len().to_string(), nar.len().to_string()), (nar_size.to_owned(), bytes.to_owned()));
        assert_eq!((h, nar.len() as u64), (info.nar_hash.clone(), info.nar_size));
        round_trip(&nar, path);
        n += 1;
    }
    assert_eq!(n, 92);
}
