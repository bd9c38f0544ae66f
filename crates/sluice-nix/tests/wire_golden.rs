//! The worker-protocol serialisers against Nix's own golden files
//! (`src/libstore-tests/data/{worker,common}-protocol/*.bin`, each the encoding of the values
//! in the matching `.json`), byte for byte. The data directory is `SLUICE_CONFORMANCE_DIR`
//! or `../shared/conformance/nix` beside the repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::Value;
use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::*;

fn data(kind: &str, name: &str) -> (Vec<u8>, Value) {
    let root = std::env::var_os("SLUICE_CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/conformance/nix").into());
    let dir = root.join("libstore-tests/data").join(kind);
    let bin = std::fs::read(dir.join(format!("{name}.bin"))).unwrap_or_else(|e| panic!("{name}.bin in {}: {e}", dir.display()));
    let json = std::fs::read_to_string(dir.join(format!("{name}.json"))).map(|t| serde_json::from_str(&t).unwrap()).unwrap_or(Value::Null);
    (bin, json)
}

fn v(minor: u8) -> ProtocolVersion {
    ProtocolVersion::new(1, minor)
}

fn dir() -> StoreDir {
    StoreDir::default()
}

fn sp(s: &str) -> StorePath {
    StorePath::from_base_name(s).unwrap()
}

/// A content address from its JSON form `{"method": "text"|"flat"|"nar", "hash": SRI}`.
fn ca(j: &Value) -> Option<ContentAddress> {
    let hash = Hash::parse_sri(j.get("hash")?.as_str()?).unwrap();
    Some(match j["method"].as_str().unwrap() {
        "text" => ContentAddress::Text(hash),
        "flat" => ContentAddress::Fixed { recursive: false, hash },
        "nar" => ContentAddress::Fixed { recursive: true, hash },
        m => panic!("method {m}"),
    })
}

fn strings(j: &Value) -> Vec<&str> {
    j.as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect()
}

#[test]
fn strings_and_store_paths() {
    for kind in ["worker-protocol", "common-protocol"] {
        let (bin, json) = data(kind, "string");
        let mut out = Vec::new();
        for s in strings(&json) {
            write_bytes(&mut out, s.as_bytes()).unwrap();
        }
        assert_eq!(out, bin);
        let mut r = bin.as_slice();
        for s in strings(&json) {
            assert_eq!(read_string(&mut r, 100, "s").unwrap(), s);
        }

        let (bin, json) = data(kind, "store-path");
        let mut out = Vec::new();
        for s in strings(&json) {
            write_store_path(&mut out, &dir(), &sp(s)).unwrap();
        }
        assert_eq!(out, bin);
        let mut r = bin.as_slice();
        for s in strings(&json) {
            assert_eq!(read_store_path(&mut r, &dir(), "p").unwrap(), sp(s));
        }

        let (bin, json) = data(kind, "optional-store-path");
        let mut out = Vec::new();
        for s in json.as_array().unwrap() {
            write_optional_store_path(&mut out, &dir(), s.as_str().map(sp).as_ref()).unwrap();
        }
        assert_eq!(out, bin);
        let mut r = bin.as_slice();
        for s in json.as_array().unwrap() {
            assert_eq!(read_optional_store_path(&mut r, &dir(), "p").unwrap(), s.as_str().map(sp));
        }
    }
}

#[test]
fn content_addresses() {
    for kind in ["worker-protocol", "common-protocol"] {
        for name in ["content-address", "optional-content-address"] {
            let (bin, json) = data(kind, name);
            let mut out = Vec::new();
            for j in json.as_array().unwrap() {
                write_content_address(&mut out, ca(j).as_ref()).unwrap();
            }
            assert_eq!(out, bin, "{kind}/{name}");
            let mut r = bin.as_slice();
            for j in json.as_array().unwrap() {
                assert_eq!(read_content_address(&mut r, "ca").unwrap(), ca(j));
            }
            assert!(r.is_empty());
        }
    }
}

/// `set.json`/`vector.json`: lists of strings, then a list of lists of strings.
#[test]
fn sets_and_vectors() {
    for kind in ["worker-protocol", "common-protocol"] {
        for name in ["set", "vector"] {
            let (bin, json) = data(kind, name);
            let mut out = Vec::new();
            for j in json.as_array().unwrap() {
                let items = j.as_array().unwrap();
                if items.first().is_some_and(Value::is_array) {
                    write_u64(&mut out, items.len() as u64).unwrap();
                    for inner in items {
                        write_strings(&mut out, strings(inner).into_iter()).unwrap();
                    }
                } else {
                    write_strings(&mut out, strings(j).into_iter()).unwrap();
                }
            }
            assert_eq!(out, bin, "{kind}/{name}");
            let mut r = bin.as_slice();
            for j in json.as_array().unwrap().iter().take(3) {
                assert_eq!(read_strings(&mut r, 10, 10, "l").unwrap(), strings(j));
            }
        }
    }
}

#[test]
fn build_mode_and_trusted_flag() {
    let (bin, json) = data("worker-protocol", "build-mode");
    let mut r = bin.as_slice();
    let modes: Vec<BuildMode> = json.as_array().unwrap().iter().map(|_| BuildMode::read(&mut r).unwrap()).collect();
    assert_eq!(modes, [BuildMode::Normal, BuildMode::Repair, BuildMode::Check]);
    assert!(BuildMode::read(&mut 3u64.to_le_bytes().as_slice()).is_err());

    let (bin, json) = data("worker-protocol", "optional-trusted-flag");
    let mut out = Vec::new();
    for j in json.as_array().unwrap() {
        write_trusted_flag(&mut out, j.as_bool()).unwrap();
    }
    assert_eq!(out, bin);
    let r = &mut bin.as_slice();
    let back: Vec<Option<bool>> = json.as_array().unwrap().iter().map(|_| read_trusted_flag(r, "trusted flag").unwrap()).collect();
    assert_eq!(back, json.as_array().unwrap().iter().map(Value::as_bool).collect::<Vec<_>>());
    assert!(read_trusted_flag(&mut 3u64.to_le_bytes().as_slice(), "trusted flag").is_err());
}

#[test]
fn handshake() {
    let (bin, _) = data("worker-protocol", "handshake-to-client");
    let mut out = Vec::new();
    write_u64(&mut out, WORKER_MAGIC_2).unwrap();
    write_u64(&mut out, ProtocolVersion::new(1, 10).to_wire()).unwrap();
    assert_eq!(out, bin);
    // The client-info part: version string (≥ 1.33), trusted flag (≥ 1.35).
    for (name, minor) in [("client-handshake-info_1_33", 33), ("client-handshake-info_1_35", 35)] {
        let (bin, _) = data("worker-protocol", name);
        let mut out = Vec::new();
        for (version, trusted) in [("foo", Some(false)), ("bar", Some(true))] {
            write_bytes(&mut out, version.as_bytes()).unwrap();
            if v(minor).at_least(35) {
                write_trusted_flag(&mut out, trusted).unwrap();
            }
        }
        assert_eq!(out, bin, "{name}");
    }
}

fn path_info(j: &Value) -> ValidPathInfo {
    ValidPathInfo {
        path: j.get("path").and_then(Value::as_str).map(sp).unwrap_or_else(|| sp("00000000000000000000000000000000-unkeyed")),
        deriver: j["deriver"].as_str().map(sp),
        nar_hash: Hash::parse_sri(j["narHash"].as_str().unwrap()).unwrap(),
        references: strings(&j["references"]).into_iter().map(sp).collect(),
        registration_time: j["registrationTime"].as_i64().unwrap(),
        nar_size: j["narSize"].as_u64().unwrap(),
        ultimate: j["ultimate"].as_bool().unwrap(),
        sigs: j["signatures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| format!("{}:{}", s["keyName"].as_str().unwrap(), s["sig"].as_str().unwrap()))
            .collect(),
        ca: ca(&j["ca"]),
    }
}

#[test]
fn valid_path_infos() {
    for (name, minor, keyed) in
        [("valid-path-info-1.15", 15, true), ("valid-path-info-1.16", 16, true), ("unkeyed-valid-path-info-1.15", 15, false)]
    {
        let (bin, json) = data("worker-protocol", name);
        let infos: Vec<ValidPathInfo> = json
            .as_array()
            .unwrap()
            .iter()
            .map(path_info)
            .map(|mut i| {
                if minor < 16 {
                    (i.ultimate, i.sigs, i.ca) = (false, BTreeSet::new(), None);
                }
                i
            })
            .collect();
        let mut out = Vec::new();
        for i in &infos {
            if keyed {
                write_keyed_path_info(&mut out, &dir(), v(minor), i).unwrap();
            } else {
                write_unkeyed_path_info(&mut out, &dir(), v(minor), i).unwrap();
            }
        }
        assert_eq!(out, bin, "{name}");
        let mut r = bin.as_slice();
        for i in &infos {
            let back = if keyed {
                read_keyed_path_info(&mut r, &dir(), v(minor))
            } else {
                read_unkeyed_path_info(&mut r, &dir(), v(minor), i.path.clone())
            };
            assert_eq!(&back.unwrap(), i, "{name}");
        }
        assert!(r.is_empty());
    }
}

fn derived_path(j: &Value) -> DerivedPath {
    match j {
        Value::String(s) => DerivedPath::Opaque(sp(s)),
        _ => {
            let outs = strings(&j["outputs"]);
            let outputs = if outs == ["*"] { OutputsSpec::All } else { OutputsSpec::Names(outs.into_iter().map(String::from).collect()) };
            DerivedPath::Built { drv: sp(j["drvPath"].as_str().unwrap()), outputs }
        }
    }
}

#[test]
fn derived_paths() {
    // Before 1.30 a bare derivation path means all its outputs and the file itself cannot be
    // named: the 1.29 file has no opaque `.drv`.
    let drv = DerivedPath::Opaque(sp("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-foo.drv"));
    assert!(write_derived_path(&mut Vec::new(), &dir(), v(29), &drv).is_err());
    for (name, minor) in [("derived-path-1.29", 29u8), ("derived-path-1.30", 30)] {
        let (bin, json) = data("worker-protocol", name);
        let paths: Vec<DerivedPath> = json.as_array().unwrap().iter().map(derived_path).collect();
        let mut out = Vec::new();
        for p in &paths {
            write_derived_path(&mut out, &dir(), v(minor), p).unwrap();
        }
        assert_eq!(out, bin, "{name} (protocol 1.{minor})");
        let mut list = Vec::new();
        write_u64(&mut list, paths.len() as u64).unwrap();
        list.extend_from_slice(&bin);
        assert_eq!(read_derived_paths(&mut list.as_slice(), &dir(), v(minor)).unwrap(), paths);
    }
}

fn status(s: &str) -> BuildStatus {
    match s {
        "Built" => BuildStatus::Built,
        "OutputRejected" => BuildStatus::OutputRejected,
        "NotDeterministic" => BuildStatus::NotDeterministic,
        s => panic!("status {s}"),
    }
}

/// A build result from its JSON; `full_realisations`: the realisation JSON carries
/// `dependentRealisations`, `id` and `signatures` (the 1.28/1.29/1.37 files).
fn build_result(j: &Value, full_realisations: bool) -> BuildResult {
    let mut built_outputs = BTreeMap::new();
    for (out, r) in j.get("builtOutputs").and_then(Value::as_object).into_iter().flatten() {
        let id = r.get("id").and_then(Value::as_str).map(String::from).unwrap_or_else(|| format!("sha256:{}!{out}", "0".repeat(64)));
        let text = if full_realisations {
            format!(r#"{{"dependentRealisations":{{}},"id":"{id}","outPath":"{}","signatures":[]}}"#, r["outPath"].as_str().unwrap())
        } else {
            format!(r#"{{"id":"{id}","outPath":"{}"}}"#, r["outPath"].as_str().unwrap())
        };
        built_outputs.insert(id, text);
    }
    BuildResult {
        status: status(j["status"].as_str().unwrap()),
        error_msg: j.get("errorMsg").and_then(Value::as_str).unwrap_or("").to_owned(),
        times_built: j["timesBuilt"].as_u64().unwrap(),
        is_non_deterministic: j.get("isNonDeterministic").and_then(Value::as_bool).unwrap_or(false),
        start_time: j["startTime"].as_u64().unwrap(),
        stop_time: j["stopTime"].as_u64().unwrap(),
        cpu_user: j.get("cpuUser").and_then(Value::as_u64),
        cpu_system: j.get("cpuSystem").and_then(Value::as_u64),
        built_outputs,
    }
}

#[test]
fn build_results() {
    for (name, minor) in [("build-result-1.27", 27), ("build-result-1.28", 28), ("build-result-1.29", 29), ("build-result-1.37", 37)] {
        let (bin, json) = data("worker-protocol", name);
        let mut out = Vec::new();
        for j in json.as_array().unwrap() {
            write_build_result(&mut out, v(minor), &build_result(j, true)).unwrap();
        }
        assert_eq!(out, bin, "{name}");
        // Read back as a client of that version: the same results, nothing left over.
        let mut r = bin.as_slice();
        for j in json.as_array().unwrap() {
            let mut want = build_result(j, true);
            if minor < 29 {
                (want.times_built, want.is_non_deterministic, want.start_time, want.stop_time) = (0, false, 0, 0);
            }
            assert_eq!(read_build_result(&mut r, v(minor)).unwrap(), want, "{name}");
        }
        assert!(r.is_empty(), "{name}");
    }
    let (bin, json) = data("worker-protocol", "keyed-build-result-1.29");
    let mut out = Vec::new();
    for j in json.as_array().unwrap() {
        write_keyed_build_result(&mut out, &dir(), v(29), &derived_path(&j["path"]), &build_result(j, true)).unwrap();
    }
    assert_eq!(out, bin);
    let mut r = bin.as_slice();
    for j in json.as_array().unwrap() {
        assert_eq!(read_keyed_build_result(&mut r, &dir(), v(29)).unwrap(), (derived_path(&j["path"]), build_result(j, true)));
    }
    assert!(r.is_empty());
    // A status Nix does not have is refused, naming the field.
    let mut bad = Vec::new();
    write_u64(&mut bad, 15).unwrap();
    assert!(read_build_result(&mut bad.as_slice(), v(37)).unwrap_err().to_string().contains("build status"));
}

#[test]
fn nar_hash_forms_and_bad_input() {
    let info = path_info(&data("worker-protocol", "valid-path-info-1.16").1[0]);
    let mut out = Vec::new();
    write_keyed_path_info(&mut out, &dir(), v(16), &info).unwrap();
    // Truncated anywhere: an error naming a field, never a panic.
    for cut in 0..out.len() {
        let err = read_keyed_path_info(&mut &out[..cut], &dir(), v(16)).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
    assert_eq!(info.nar_hash.algo(), HashAlgo::Sha256);
}

/// `drv-output.json`: derivation output ids, each a string on the wire.
#[test]
fn drv_outputs() {
    for kind in ["worker-protocol", "common-protocol"] {
        let (bin, json) = data(kind, "drv-output");
        let mut r = bin.as_slice();
        let mut out = Vec::new();
        for s in strings(&json) {
            let id = DrvOutput::parse(&read_string(&mut r, 1000, "id").unwrap()).unwrap();
            assert_eq!(id.to_string(), s);
            write_bytes(&mut out, id.to_string().as_bytes()).unwrap();
        }
        assert!(r.is_empty());
        assert_eq!(out, bin, "{kind}");
    }
}
