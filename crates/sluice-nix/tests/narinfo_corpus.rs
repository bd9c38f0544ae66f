//! narinfo, signatures and content addresses against the real Nix 2.8 corpus and the cases.

use crate::common::{files, read_string, shared};
use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::Hash;
use sluice_nix::narinfo::{NarInfo, NarInfoError};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::{PublicKey, SecretKey, TrustedKeys};
use sluice_nix::store_path::StoreDir;

const CACHES: [&str; 7] = [
    "corpus/cache-xz",
    "corpus/cache-zstd",
    "corpus/cache-drv",
    "corpus/cache-subset-none",
    "corpus/cache-subset-bzip2",
    "corpus/cache-subset-gzip",
    "corpus/cache-subset-br",
];

fn corpus_key() -> PublicKey {
    PublicKey::parse(read_string(&shared("corpus/keys/cache-key.pub")).trim()).unwrap()
}

#[test]
fn every_corpus_narinfo_round_trips() {
    let dir = StoreDir::default();
    let mut n = 0;
    for cache in CACHES {
        for p in files(cache, ".narinfo") {
            let text = read_string(&p);
            let info = NarInfo::parse(&dir, &text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(info.to_text(&dir), text, "{}", p.display());
            n += 1;
        }
    }
    assert!(n > 3000, "only {n} narinfos");
}

/// The corpus's 1,056 signatures checked together ([`TrustedKeys::verify_together`]): the
/// batch holds under the corpus key, every item true; it does not under another key of the
/// same name, nor once one fingerprint is altered (its NarSize), where checking each alone
/// refuses that item only. A signature under a name that is not trusted makes its item false
/// without failing the batch.
#[test]
fn corpus_signatures_verify_together_as_alone() {
    let dir = StoreDir::default();
    let trusted = TrustedKeys::from_keys(vec![corpus_key()]);
    let wrong = TrustedKeys::from_keys(vec![SecretKey::from_seed(corpus_key().name(), &[3; 32]).to_public()]);
    let infos: Vec<NarInfo> =
        files("corpus/cache-zstd", ".narinfo").iter().map(|p| NarInfo::parse(&dir, &read_string(p)).unwrap()).collect();
    assert_eq!(infos.len(), 1056);
    let mut fingerprints: Vec<String> = infos.iter().map(|i| i.fingerprint(&dir)).collect();
    let mut sigs: Vec<Vec<String>> = infos.iter().map(|i| i.signatures.clone()).collect();
    let together = |keys: &TrustedKeys, f: &[String], s: &[Vec<String>]| {
        let items: Vec<(&str, &Vec<String>)> = f.iter().map(String::as_str).zip(s).collect();
        keys.verify_together(&items)
    };
    assert_eq!(together(&trusted, &fingerprints, &sigs), Some(vec![true; 1056]));
    assert_eq!(together(&wrong, &fingerprints, &sigs), None);
    sigs[7] = vec![sigs[7][0].replacen(corpus_key().name(), "other-1", 1)];
    let answers = together(&trusted, &fingerprints, &sigs).unwrap();
    assert_eq!(answers.iter().enumerate().filter(|(_, v)| !**v).map(|(i, _)| i).collect::<Vec<_>>(), [7]);
    fingerprints[500] = fingerprints[500].replacen(&format!(";{};", infos[500].nar_size), &format!(";{};", infos[500].nar_size + 1), 1);
    assert_eq!(together(&trusted, &fingerprints, &sigs), None);
    let alone: Vec<usize> =
        fingerprints.iter().zip(&sigs).enumerate().filter(|(_, (f, s))| !trusted.verifies_any(f, *s)).map(|(i, _)| i).collect();
    assert_eq!(alone, [7, 500]);
}

#[test]
fn corpus_signatures_verify_and_reproduce() {
    let dir = StoreDir::default();
    let key = corpus_key();
    let sk = SecretKey::parse(read_string(&shared("corpus/keys/cache-key.sec")).trim()).unwrap();
    assert_eq!(sk.to_public(), key);
    let trusted = TrustedKeys::from_keys(vec![key.clone()]);
    let wrong = TrustedKeys::from_keys(vec![SecretKey::from_seed(key.name(), &[3; 32]).to_public()]);
    let mut n = 0;
    for cache in ["corpus/cache-xz", "corpus/cache-zstd", "corpus/cache-drv"] {
        for p in files(cache, ".narinfo") {
            let info = NarInfo::parse(&dir, &read_string(&p)).unwrap();
            let fp = info.fingerprint(&dir);
            assert_eq!(info.signatures.len(), 1, "{}", p.display());
            assert_eq!(trusted.count_valid(&fp, &info.signatures), 1, "{}", p.display());
            assert_eq!(wrong.count_valid(&fp, &info.signatures), 0);
            assert_eq!(sk.sign(&fp), info.signatures[0], "{}", p.display());
            n += 1;
        }
    }
    assert!(n > 3000);
}

/// The 10 content-addressed paths of the corpus (and the `.drv` text paths of cache-drv)
/// recompute to their store paths.
#[test]
fn content_addressed_store_paths() {
    let dir = StoreDir::default();
    for (cache, expect) in [("corpus/cache-xz", 10), ("corpus/cache-drv", 1000)] {
        let mut n = 0;
        for p in files(cache, ".narinfo") {
            let text = read_string(&p);
            let info = NarInfo::parse(&dir, &text).unwrap();
            let Some(ca) = &info.ca else { continue };
            assert!(text.contains(&format!("\nCA: {ca}\n")), "{}: CA printed back as written", p.display());
            let got = ValidPathInfo::from_narinfo(&info, 0).content_addressed_path(&dir);
            assert_eq!(got.as_ref(), Some(&info.store_path), "{}", p.display());
            n += 1;
        }
        assert!(n >= expect, "{cache}: {n} CA paths");
    }
}

#[test]
fn case09_ca_unsigned_path_matches() {
    // make.py cross-checked this path with `nix store add-path`.
    let dir = StoreDir::default();
    let p = dir.parse_path("/nix/store/yv1hvbaf1xkpj4yn0vip0bkf3dy9459l-ca-unsigned").unwrap();
    let info = files("cases/09-signature-verification/cache", ".narinfo")
        .into_iter()
        .map(|f| NarInfo::parse(&dir, &read_string(&f)).unwrap())
        .find(|i| i.store_path == p)
        .expect("ca-unsigned narinfo");
    let ca = info.ca.clone().unwrap();
    assert!(matches!(ca, ContentAddress::Fixed { recursive: true, .. }));
    assert_eq!(ca.store_path(&dir, "ca-unsigned", &info.references, false).unwrap(), p);
}

fn case_variants(case: &str) -> Vec<(String, Result<NarInfo, NarInfoError>)> {
    let dir = StoreDir::default();
    read_string(&shared(&format!("cases/{case}/paths.txt")))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (variant, path) = l.split_once(char::is_whitespace).unwrap();
            let hash = path.trim().trim_start_matches("/nix/store/").get(..32).unwrap().to_owned();
            let text = read_string(&shared(&format!("cases/{case}/cache/{hash}.narinfo")));
            (variant.to_owned(), NarInfo::parse(&dir, &text))
        })
        .collect()
}

#[test]
fn case02_field_validation() {
    let dir = StoreDir::default();
    let key = PublicKey::parse(read_string(&shared("cases/02-narinfo-field-validation/trusted-public-key.txt")).trim()).unwrap();
    let plain = Hash::parse("sha256:0b3v1wdsz9144w0dq1r0ys0bw55ycjn9l2x4njymrj59zfhkg5rm").unwrap();
    let variants = case_variants("02-narinfo-field-validation");
    assert_eq!(variants.len(), 16);
    for (variant, result) in variants {
        let must_mention = match variant.as_str() {
            "ok-baseline" | "unknown-fields" | "narhash-base16" | "narhash-sri" | "deriver-unknown" | "compression-absent" => {
                let info = result.unwrap_or_else(|e| panic!("{variant}: {e}"));
                assert_eq!(info.nar_hash, plain, "{variant}");
                assert_eq!(info.nar_size, 136);
                assert_eq!(info.deriver, None);
                assert!(key.verify(&info.fingerprint(&dir), &info.signatures[0]), "{variant}");
                if variant == "compression-absent" {
                    assert_eq!(info.compression, "bzip2");
                } else {
                    assert_eq!(info.compression, "none");
                }
                continue;
            }
            "narsize-zero" | "narsize-missing" | "narsize-negative" => "NarSize",
            "narhash-missing" | "narhash-bad-b32" => "NarHash",
            "url-missing" => "URL",
            "storepath-missing" => "StorePath",
            "references-twice" => "References",
            "no-final-newline" => "\\n",
            "crlf" => "\\r",
            other => panic!("unknown variant {other}"),
        };
        let err = result.expect_err(&variant).to_string();
        assert!(err.contains(must_mention), "{variant}: {err}");
    }
}

#[test]
fn case01_file_hash_optional() {
    let dir = StoreDir::default();
    let key = PublicKey::parse(read_string(&shared("cases/01-narinfo-compressed-without-filehash/trusted-public-key.txt")).trim()).unwrap();
    let infos = files("cases/01-narinfo-compressed-without-filehash/cache", ".narinfo");
    assert_eq!(infos.len(), 2);
    for p in infos {
        let text = read_string(&p);
        let info = NarInfo::parse(&dir, &text).unwrap();
        assert_eq!((info.file_hash.as_ref(), info.file_size), (None, None));
        assert_eq!(info.nar_size, 1808);
        assert_eq!(info.nar_hash.to_nix32_prefixed(), "sha256:15bz31488rh4v6mi43l6pf8n6mdzcljlcpv3s1y5gy1yc910gcc8");
        assert!(TrustedKeys::from_keys(vec![key.clone()]).count_valid(&info.fingerprint(&dir), &info.signatures) == 1);
        let out = info.to_text(&dir);
        assert!(!out.contains("FileSize") && !out.contains("FileHash"));
        assert_eq!(out, text);
    }
}

/// Formats-level part of case 09: which `Sig` lines count for the trusted key.
#[test]
fn case09_signature_rules() {
    let dir = StoreDir::default();
    let trusted = TrustedKeys::parse(read_string(&shared("cases/09-signature-verification/trusted-public-key.txt")).trim()).unwrap();
    let untrusted = PublicKey::parse(read_string(&shared("cases/09-signature-verification/untrusted-public-key.txt")).trim()).unwrap();
    for (variant, result) in case_variants("09-signature-verification") {
        let info = result.unwrap_or_else(|e| panic!("{variant}: {e}"));
        let valid = trusted.count_valid(&info.fingerprint(&dir), &info.signatures);
        let expect = match variant.as_str() {
            "trusted" | "untrusted-then-trusted" | "bad-base64-plus-good" | "truncated-plus-good" | "no-colon-sig" => 1,
            "dep-helper" => 1,
            _ => 0,
        };
        assert_eq!(valid, expect, "{variant}");
        if variant == "untrusted-only" {
            assert!(untrusted.verify(&info.fingerprint(&dir), &info.signatures[0]));
        }
    }
}
