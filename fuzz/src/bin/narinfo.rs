//! AFL++ entry point of the `narinfo` target (see `sluice_fuzz::narinfo`).

fn main() {
    afl::fuzz!(|data: &[u8]| sluice_fuzz::narinfo(data));
}
