//! A value quoted in an error message, cut to a bounded length. Nix quotes the whole value
//! (`fmt("path '%s' is not in the Nix store", path)` in `src/libstore/store-api.cc` and the
//! like); a value from a hostile cache or client may be megabytes long (a narinfo line of
//! 64 MiB), and every copy of the message would hold it.

use std::fmt;

/// The most bytes of a value an error message quotes: any store path, hash or key is shorter.
pub const QUOTED_MAX: usize = 512;

/// `value` as error messages quote it: Rust's debug quoting; a value longer than
/// [`QUOTED_MAX`] bytes is cut there (at a character boundary), followed by `…` and its length.
#[derive(Debug, Clone, Copy)]
pub struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = self.0;
        if value.len() <= QUOTED_MAX {
            return write!(f, "{value:?}");
        }
        let end = (0..=QUOTED_MAX).rev().find(|&i| value.is_char_boundary(i)).unwrap_or(0);
        write!(f, "{:?}… ({} bytes in all)", &value[..end], value.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_value_is_cut_and_its_length_said() {
        assert_eq!(Quoted("abc\n").to_string(), "\"abc\\n\"");
        let long = format!("é{}", "a".repeat(QUOTED_MAX));
        let shown = Quoted(&long).to_string();
        assert_eq!(shown, format!("\"é{}\"… ({} bytes in all)", "a".repeat(QUOTED_MAX - 2), QUOTED_MAX + 2));
    }
}
