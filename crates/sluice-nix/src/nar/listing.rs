//! NAR listings as `nix nar ls` prints them (text and `--json`, with `narOffset`). Source: Nix
//! `src/libutil/archive.cc`, `src/nix/ls.cc`, `src/libstore/nar-accessor.cc`.
