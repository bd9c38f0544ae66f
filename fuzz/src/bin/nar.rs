//! AFL++ entry point of the `nar` target (see `sluice_fuzz::nar`).

fn main() {
    afl::fuzz!(|data: &[u8]| sluice_fuzz::nar(data));
}
