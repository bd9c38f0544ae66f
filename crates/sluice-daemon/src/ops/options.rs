//! SetOptions (Nix `daemon.cc`, `wopSetOptions`): the client's settings for the rest of the
//! connection ([`ClientOptions::apply`]).

use sluice_nix::wire::ops::SetOptions;

use crate::conn::{Conn, Fail, OpResult};
use crate::options::ClientOptions;

/// SetOptions: the numeric settings, then (≥ 1.12) the overrides → the warnings about the
/// overrides refused as log lines, then `LAST` with no result.
pub(super) fn set_options(c: &mut Conn, request: SetOptions) -> OpResult {
    let (options, warnings) = ClientOptions::apply(c.daemon, c.peer.trusted, request);
    c.options = options;
    for w in warnings {
        c.log(&format!("warning: {w}")).map_err(Fail::Output)?;
    }
    c.reply(|_, _| Ok(()))
}
