//! Helpers shared by the integration tests: paths into the read-only `shared/` data.
#![allow(dead_code)]

use std::path::PathBuf;

/// `shared/<rel>`, next to the repository.
pub fn shared(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared").join(rel)
}

/// The files in `shared/<dir>` whose names end in `suffix`, sorted.
pub fn files(dir: &str, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(shared(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    v.sort();
    v
}

pub fn read_string(p: &std::path::Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}
