//! Credentials for HTTP(S) caches from a netrc file (`netrc-file`), as Nix uses them: Nix
//! hands the file to curl with `CURLOPT_NETRC_FILE` and `CURL_NETRC_OPTIONAL`
//! (`src/libstore/filetransfer.cc`), so the first `machine` entry naming the URL's host (case
//! insensitively, without the port), else the `default` entry, gives the login and password,
//! sent as HTTP basic authentication unless the URL carries credentials itself. Tokens are
//! separated by white space; `account` is skipped, and a `macdef` runs to the next blank line
//! (curl's `lib/netrc.c`).

use std::path::Path;

/// A login and password for one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub login: String,
    pub password: String,
}

/// One `machine` (or `default`, with no name) entry.
#[derive(Debug, Default)]
struct Entry {
    machine: Option<String>,
    login: Option<String>,
    password: Option<String>,
}

/// The credentials for `host` in the netrc text, if any.
pub fn lookup(text: &str, host: &str) -> Option<Credentials> {
    let entries = parse(text);
    let named = entries.iter().find(|e| e.machine.as_deref().is_some_and(|m| m.eq_ignore_ascii_case(host)));
    let entry = named.or_else(|| entries.iter().find(|e| e.machine.is_none()))?;
    Some(Credentials { login: entry.login.clone().unwrap_or_default(), password: entry.password.clone().unwrap_or_default() })
}

/// The credentials for `host` in the netrc file `file`: `Ok(None)` when the file does not
/// exist or has no entry for it; an error naming the file when it cannot be read.
pub(crate) fn lookup_file(file: &Path, host: &str) -> Result<Option<Credentials>, String> {
    match std::fs::read_to_string(file) {
        Ok(text) => Ok(lookup(&text, host)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("netrc-file {}: {e}", file.display())),
    }
}

fn parse(text: &str) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let mut tokens = line.split_whitespace();
        while let Some(token) = tokens.next() {
            match token {
                "machine" => entries.push(Entry { machine: Some(tokens.next().unwrap_or("").to_owned()), ..Entry::default() }),
                "default" => entries.push(Entry::default()),
                "login" | "password" | "account" => {
                    let value = tokens.next().map(str::to_owned);
                    match (entries.last_mut(), token) {
                        (Some(e), "login") => e.login = value,
                        (Some(e), "password") => e.password = value,
                        _ => {}
                    }
                }
                "macdef" => {
                    for macro_line in lines.by_ref() {
                        if macro_line.trim().is_empty() {
                            break;
                        }
                    }
                    break;
                }
                _ => {}
            }
        }
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_then_default() {
        let text = "machine other.example login o password p\n\
                    macdef init\nmachine cache.example login no password no\n\n\
                    machine Cache.Example\n  login alice\n  password s3cret account x\n\
                    default login anon password guest\n";
        let alice = Credentials { login: "alice".into(), password: "s3cret".into() };
        assert_eq!(lookup(text, "cache.example"), Some(alice));
        assert_eq!(lookup(text, "elsewhere").map(|c| c.login), Some("anon".into()));
        assert_eq!(lookup("machine a login b password c", "z"), None);
    }
}
