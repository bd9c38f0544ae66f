//! `builtin:fetchurl`: downloads the derivation's `url` into its fixed output, as Nix 2.8/2.26
//! `src/libstore/builtins/fetchurl.cc` does: with `unpack = "1"` the download is a NAR (xz-
//! compressed if the URL ends in `.xz`) that becomes the output; otherwise it is the output
//! file, executable with `executable = "1"`. HTTP(S) goes through sluice's HTTP client
//! (`binary_cache::http`: retries, stall timeout, `netrc-file` credentials for the URL's
//! host, TLS checked as Nix 2.26 does), `file://` URLs are read from the file system when the
//! caller allows it. The hash is not checked here: the verification boundary checks the
//! output's content address. `hashed-mirrors` and `impureEnvVars` (proxies) are not used: sluice's client
//! connects directly.

use std::io::{self, Read, Seek, Write};

use sluice_nix::content_address::ContentAddress;
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::nar::NarVisitor;

use super::{BuiltinDerivation, BuiltinError, Context, Spool};
use sluice_binary_cache::http::{client, HttpTransport};
use sluice_binary_cache::transfer::TransferProbe;
use sluice_compress::Compression;

/// Downloads `drv`'s URL into `spool` as the NAR of its output, whose content address is `ca`
/// (`None`: not a fixed output, which is refused in Nix 2.26's words; an impure one, which
/// Nix 2.26 fetches, does not get here: see [`super::build`]).
pub(super) fn build(
    cx: &mut Context<'_>,
    drv: &BuiltinDerivation,
    ca: Option<&ContentAddress>,
    spool: &mut Spool,
) -> Result<(), BuiltinError> {
    let failed = BuiltinError::Failed;
    let Some(ca) = ca else {
        return Err(failed("'builtin:fetchurl' must be a fixed-output or impure derivation".into()));
    };
    let url = drv.attr("url")?;
    let unpack = drv.env.get("unpack").is_some_and(|v| v == "1");
    let executable = drv.env.get("executable").is_some_and(|v| v == "1");
    let recursive = matches!(ca, ContentAddress::Fixed { recursive: true, .. });
    if !recursive && (unpack || executable) {
        return Err(failed(format!(
            "output path '{}' should be a non-executable regular file since recursive hashing is not enabled (outputHashMode=flat)",
            drv.name
        )));
    }
    let download = |e: &dyn std::fmt::Display| failed(format!("unable to download '{url}': {e}"));
    let (source, probe) = open(cx, url)?;
    let mut source = match unpack && url.ends_with(".xz") {
        true => Compression::Xz.decoder(source).map_err(|e| download(&e))?,
        false => source,
    };
    if unpack {
        io::copy(&mut source, spool).map_err(|e| download(&e))?;
    } else {
        let mut file =
            tempfile::tempfile().map_err(|e| failed(format!("creating a temporary file in {}: {e}", std::env::temp_dir().display())))?;
        let size = io::copy(&mut source, &mut file).map_err(|e| download(&e))?;
        file.rewind().map_err(|e| download(&e))?;
        let mut nar = NarWriter::new(&mut *spool).map_err(|e| download(&e))?;
        nar.regular(&[], executable, size, 0, &mut io::BufReader::new(file)).map_err(|e| download(&e))?;
    }
    spool.flush().map_err(|e| download(&e))?;
    if let Some(why) = probe.and_then(|p| p.broken()) {
        return Err(download(&why));
    }
    Ok(())
}

/// The body of `url`, and for HTTP the probe that tells whether it was cut short.
fn open(cx: &Context<'_>, url: &str) -> Result<(Box<dyn Read + Send>, Option<TransferProbe>), BuiltinError> {
    let download = |e: &dyn std::fmt::Display| BuiltinError::Failed(format!("unable to download '{url}': {e}"));
    let parsed = reqwest::Url::parse(url).map_err(|e| download(&e))?;
    match parsed.scheme() {
        "http" | "https" => {
            let options = cx.settings.http_options();
            let http = client(&options).map_err(|e| download(&e))?;
            let transport = HttpTransport::new(url.to_owned(), http, &options);
            match cx.runtime.block_on(transport.open(url)).map_err(|e| download(&e))? {
                Some((body, probe)) => Ok((body, Some(probe))),
                None => Err(download(&"HTTP error 404, 403 or 410 (not found)")),
            }
        }
        "file" if cx.local_files => {
            let path = parsed.to_file_path().map_err(|()| download(&"not a local file path"))?;
            let file = std::fs::File::open(&path).map_err(|e| download(&format!("{}: {e}", path.display())))?;
            Ok((Box::new(io::BufReader::new(file)), None))
        }
        "file" => Err(download(&"file:// URLs are read only for trusted clients (the daemon reads them as the store's owner)")),
        scheme => Err(download(&format!("unsupported URL scheme '{scheme}'"))),
    }
}
