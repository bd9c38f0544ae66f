//! HTTPS with `ssl-cert-file`: the file's certificates are the trust anchors, as curl's
//! `CURLOPT_CAINFO` is for Nix (`filetransfer.cc`), and a server whose certificate is itself
//! one of them is accepted even when that certificate is a CA's: `openssl req -x509` makes
//! such a self-signed certificate by default, which curl and Nix accept (OpenSSL and GnuTLS
//! trust a certificate found in the bundle as it is) and webpki refuses as a server's
//! (`CaUsedAsEndEntity`).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

/// The TLS configuration of a client that trusts the certificates of the PEM bundle `pem`
/// (read from `file`, named in errors) and nothing else ([`crate::client::Client::new`] sets the
/// ALPN protocols).
pub(crate) fn client_config(pem: &[u8], file: &std::path::Path) -> Result<rustls::ClientConfig, String> {
    let err = |e: &dyn std::fmt::Display| format!("ssl-cert-file {}: {e}", file.display());
    let anchors = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| err(&e))?;
    let mut roots = RootCertStore::empty();
    for cert in &anchors {
        roots.add(cert.clone()).map_err(|e| err(&e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build().map_err(|e| err(&e))?;
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(&e))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(BundleVerifier { webpki, anchors }))
        .with_no_client_auth();
    Ok(config)
}

/// webpki's verification, and a server certificate that is byte for byte one of the trust
/// anchors accepted when webpki refuses it only for being a CA's (its validity period was
/// checked before that, and its name is checked here).
#[derive(Debug)]
struct BundleVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    anchors: Vec<CertificateDer<'static>>,
}

impl ServerCertVerifier for BundleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            // webpki's own error, which rustls passes on as an opaque `Other`.
            Err(e) if e.to_string().contains("CaUsedAsEndEntity") && self.anchors.iter().any(|a| a.as_ref() == end_entity.as_ref()) => {
                let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
                rustls::client::verify_server_name(&parsed, server_name)?;
                Ok(ServerCertVerified::assertion())
            }
            verified => verified,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
