//! Pure Nix formats: no network, no filesystem access beyond `Read`/`Write`, no panics on input.
//!
//! Every parser takes bytes or a reader and returns a value or a typed error naming what was
//! wrong; none allocates by a length read from its input without a bound.

pub mod base32;
pub mod cache_info;
pub mod content_address;
pub mod derivation;
pub mod hash;
pub mod hash_modulo;
pub mod nar;
pub mod narinfo;
pub mod path_info;
pub mod quoted;
pub mod signature;
pub mod store_params;
pub mod store_path;
pub mod wire;

/// The start of `text`, shown, when it is an HTML (or XML) page: its first character other
/// than white space is `<`, where a cache's files (`nix-cache-info`, narinfos) start with a
/// `Key:`. A parked domain or a captive portal answers every URL with such a page and `200`.
pub(crate) fn html_page(text: &str) -> Option<String> {
    let page = text.trim_start_matches(['\u{feff}', ' ', '\t', '\r', '\n']);
    if !page.starts_with('<') {
        return None;
    }
    let page = page.trim_end();
    let first: String = page.chars().take(60).map(|c| if c.is_control() { ' ' } else { c }).collect();
    Some(if page.chars().nth(60).is_some() { format!("'{first}…'") } else { format!("'{first}'") })
}
