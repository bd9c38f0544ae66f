//! AFL++ entry point of the `wire` target (see `sluice_fuzz::wire`).

fn main() {
    afl::fuzz!(|data: &[u8]| sluice_fuzz::wire(data));
}
