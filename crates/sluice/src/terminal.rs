//! What Nix's loggers do to text before it reaches standard error (`src/libutil/terminal.cc`:
//! `isTTY`, `filterANSIEscapes`; `src/libutil/logging.cc`: `SimpleLogger::log` filters every
//! line). Messages from elsewhere (a daemon's errors, which Nix colours) then show on a
//! terminal as Nix shows them and reach a pipe or a log file without escape sequences.

use std::io::IsTerminal;
use std::sync::OnceLock;

/// Whether standard error is a terminal that takes colour: a tty, `TERM` set and not `dumb`,
/// neither `NO_COLOR` nor `NOCOLOR` set (Nix's `isTTY`).
pub fn is_tty() -> bool {
    static TTY: OnceLock<bool> = OnceLock::new();
    *TTY.get_or_init(|| {
        std::io::stderr().is_terminal()
            && std::env::var("TERM").is_ok_and(|t| t != "dumb")
            && std::env::var_os("NO_COLOR").is_none()
            && std::env::var_os("NOCOLOR").is_none()
    })
}

/// `text` as Nix's `SimpleLogger` writes it: escape sequences removed (CSI `ESC [ … final`,
/// OSC `ESC ] … ESC \`, and two-byte `ESC X`), except colours (`ESC [ … m`) on a terminal
/// ([`is_tty`]); tabs expanded to the next multiple of 8 columns (counted in characters);
/// `\r` and `\a` dropped.
pub fn for_stderr(text: &str) -> String {
    filter_ansi_escapes(text, !is_tty())
}

/// Nix's `filterANSIEscapes(s, filterAll)` without a width limit: see [`for_stderr`]; with
/// `filter_all` colours go too.
fn filter_ansi_escapes(text: &str, filter_all: bool) -> String {
    let mut out = String::with_capacity(text.len());
    let mut column = 0usize;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                let mut escape = String::from(c);
                let mut last = None;
                match chars.peek() {
                    Some('[') => {
                        escape.extend(chars.next());
                        while let Some(p) = chars.next_if(|c| ('\x30'..='\x3f').contains(c)) {
                            escape.push(p);
                        }
                        while let Some(i) = chars.next_if(|c| ('\x20'..='\x2f').contains(c)) {
                            escape.push(i);
                        }
                        if let Some(f) = chars.next_if(|c| ('\x40'..='\x7e').contains(c)) {
                            escape.push(f);
                            last = Some(f);
                        }
                    }
                    Some(']') => {
                        escape.extend(chars.next());
                        // Up to the ESC of the terminator `ESC \`, which then goes as a
                        // two-byte escape.
                        while let Some(o) = chars.next_if(|c| *c != '\x1b') {
                            escape.push(o);
                        }
                    }
                    _ => {
                        if let Some(x) = chars.next_if(|c| ('\x40'..='\x5f').contains(c)) {
                            escape.push(x);
                        }
                    }
                }
                if !filter_all && last == Some('m') {
                    out.push_str(&escape);
                }
            }
            '\t' => {
                // To the next tab stop, every 8 columns.
                let stop = (column / 8 + 1) * 8;
                out.extend(std::iter::repeat_n(' ', stop - column));
                column = stop;
            }
            '\r' | '\x07' => {}
            c => {
                out.push(c);
                column = if c == '\n' { 0 } else { column + 1 };
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::filter_ansi_escapes;

    /// Nix 2.8's nix-daemon's refusal as it reaches the client (its `hintfmt` colours the
    /// path magenta), and the other kinds of sequence.
    #[test]
    fn escapes_go_as_nix_filters_them() {
        let refusal = "cannot add path '\x1b[35;1m/nix/store/py14wj21zshnib43vh5f66ihm7rx610h-x\x1b[0m' because it lacks a valid signature";
        assert_eq!(
            filter_ansi_escapes(refusal, true),
            "cannot add path '/nix/store/py14wj21zshnib43vh5f66ihm7rx610h-x' because it lacks a valid signature"
        );
        assert_eq!(filter_ansi_escapes(refusal, false), refusal, "colours stay on a terminal");
        assert_eq!(filter_ansi_escapes("a\x1b[2Kb\x1b]0;title\x1b\\c\x1bMd", false), "abcd");
        assert_eq!(filter_ansi_escapes("ab\tc\r\x07\n\td", true), "ab      c\n        d");
    }
}
