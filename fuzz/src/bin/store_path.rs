//! AFL++ entry point of the `store_path` target (see `sluice_fuzz::store_path`).

fn main() {
    afl::fuzz!(|data: &[u8]| sluice_fuzz::store_path(data));
}
