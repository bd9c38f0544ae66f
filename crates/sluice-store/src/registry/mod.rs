//! The kinds of store, each in one file of this directory and one line of `kinds!`: a kind
//! says which URLs are its own, parses its own parameters into a [`StoreConfig`], and the
//! configuration opens the store and answers what callers ask of a store before opening it
//! (can it be a substituter, is it the local store). Nothing outside this directory matches
//! on kinds of store. As Nix's `Implementations::add` (`src/libstore/store-api.cc`,
//! `RegisterStoreImplementation`) and snix's store composition registry.
//!
//! Adding a kind: a file here with its [`StoreKind`] as `KIND` and its configuration
//! implementing [`StoreConfig`], and its module name in `kinds!`.

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

use crate::config::Settings;
use crate::store::{Store, StoreFuture};
use crate::store_url::{CacheUrl, CommonParams, LocalStoreConfig, Param, Query, StoreUrlError};

/// A kind of store: Nix's `StoreFactory` (`src/libstore/store-api.hh`).
#[derive(Debug)]
pub(crate) struct StoreKind {
    /// The kind as messages name it ("local store", "binary cache").
    pub name: &'static str,
    /// Its URL forms, for the message that lists what is supported ("file://, http://").
    pub forms: &'static str,
    /// Whether a URL without its `?` parameters is one of this kind's.
    pub claims: fn(&str) -> bool,
    /// The parameters the kind takes besides [`crate::store_url::COMMON`], with their types.
    pub params: &'static [&'static [Param]],
    /// Parses the URL (first argument; second: without its parameters) and takes its
    /// parameters from the query, which has only parameters the kind takes;
    /// [`Query::finish`] takes the common ones and validates the rest.
    pub parse: Parser,
}

/// A kind's parser (see [`StoreKind::parse`]).
pub(crate) type Parser = fn(&str, &str, Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError>;

/// A store's configuration, parsed from its URL: what opens it, and what callers ask of a
/// store before opening it. Nix's `StoreConfig` (`src/libstore/store-api.hh`).
pub(crate) trait StoreConfig: Debug + Send + Sync + Any {
    /// Opens the store `url` with `settings` (Nix's `StoreFactory::create`).
    fn open<'a>(&'a self, url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>>;

    /// The binary cache this is, for a kind that can be a substituter.
    fn as_cache(&self) -> Option<&CacheUrl> {
        None
    }

    /// For a kind that can be a substituter other than as a binary cache (read through the
    /// [`Store`] interface: Nix opens every substituter as a store, `getDefaultSubstituters`
    /// in `src/libstore/store-api.cc`), its common parameters (`priority`, `trusted`).
    fn as_substituter(&self) -> Option<&CommonParams> {
        None
    }

    /// The local store this is, for code that needs the local store itself (the daemon, the
    /// substitution pipeline's destination).
    fn as_local(&self) -> Option<&LocalStoreConfig> {
        None
    }
}

/// Declares each kind's module and lists its `KIND` in [`KINDS`].
macro_rules! kinds {
    ($($module:ident),* $(,)?) => {
        $(mod $module;)*
        /// Every kind of store, in the order they are offered a URL.
        static KINDS: &[&StoreKind] = &[$(&$module::KIND),*];
    };
}

kinds! {
    local,
    daemon,
    ssh_ng,
    binary_cache,
    s3,
    dummy,
    memory,
    ssh,
}

/// The kind whose URL `main` is.
pub(crate) fn kind_of(main: &str) -> Option<&'static StoreKind> {
    KINDS.iter().copied().find(|k| (k.claims)(main))
}

/// Whether some kind takes the parameter `name` (else it is unknown to every store).
pub(crate) fn is_known_param(name: &str) -> bool {
    KINDS.iter().flat_map(|k| k.params.iter().copied().flatten()).any(|(n, _)| *n == name)
}

/// Every kind's URL forms: "A, B or C".
pub(crate) fn forms() -> String {
    let forms: Vec<&str> = KINDS.iter().map(|k| k.forms).collect();
    match forms.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// For a kind whose URL is `form` alone with the common parameters (`dummy://`): refuses
/// anything after the scheme, as Nix's `DummyStoreConfig` refuses an authority.
fn scheme_only(url: &str, main: &str, form: &str, query: Query<'_>) -> Result<(), StoreUrlError> {
    if main != form {
        return Err(StoreUrlError::Unsupported(url.to_string()));
    }
    query.finish().map(drop)
}
