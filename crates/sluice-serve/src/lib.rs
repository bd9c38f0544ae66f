//! `sluice serve`: any store of the [`sluice_store::store::Store`] interface served over HTTP as
//! a binary cache that unmodified Nix substitutes from (as nix-serve and harmonia do), plus
//! batch endpoints that give sluice's closure engine many narinfos, or a whole closure, in one
//! round trip. [`routes`] answers requests, [`batch`] the batch endpoints, [`narinfo`] renders
//! what both serve, [`conn`] accepts connections and bounds them ([`progress`] tells what moves, [`slots`] sheds idle ones), [`metrics`] counts. A binary cache is served as it is stored ([`stored`]; its
//! files sent with `sendfile` on plain HTTP/1.x, [`sendfile`]), and with upstreams ([`upstream`]) as a pull-through cache whose NARs are fetched once
//! ([`flight`]).

pub mod batch;
pub mod conn;
pub mod flight;
pub mod metrics;
pub mod narinfo;
pub mod progress;
pub mod routes;
pub mod sendfile;
pub mod slots;
pub mod stored;
pub mod upstream;

pub use conn::{run, tls_acceptor, Limits};
pub use routes::App;
