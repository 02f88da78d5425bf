//! QUIC + TLS 1.3 configuration with the cluster certificate pinned on both sides.
//!
//! A peer is accepted only if it presents exactly the cluster certificate and proves it holds
//! the key (the TLS 1.3 handshake signature, checked with ring). No CA, no hostname games: a
//! process with another certificate fails the handshake, whichever side it is on.

use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::credentials::Credentials;

/// ALPN protocol of Duet's link layer.
pub const ALPN: &[u8] = b"duet-link/1";

/// Builds the endpoint's server and client configurations from the cluster credentials.
pub fn endpoint_configs(
    creds: &Credentials,
    keep_alive: Duration,
    idle_timeout: Duration,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let pinned = Arc::new(PinnedCert {
        cert: creds.cert.clone(),
        algorithms: provider.signature_verification_algorithms,
    });

    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(pinned.clone())
        .with_single_cert(vec![creds.cert.clone()], creds.key.clone_key())?;
    server.alpn_protocols = vec![ALPN.to_vec()];

    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(pinned)
        .with_client_auth_cert(vec![creds.cert.clone()], creds.key.clone_key())?;
    client.alpn_protocols = vec![ALPN.to_vec()];

    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(keep_alive));
    transport.max_idle_timeout(Some(
        idle_timeout
            .try_into()
            .map_err(|_| rustls::Error::General("idle timeout out of range".into()))?,
    ));
    let transport = Arc::new(transport);

    let server_crypto = QuicServerConfig::try_from(server)
        .map_err(|e| rustls::Error::General(format!("QUIC server config: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());

    let client_crypto = QuicClientConfig::try_from(client)
        .map_err(|e| rustls::Error::General(format!("QUIC client config: {e}")))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);
    Ok((server, client))
}

/// Accepts exactly one certificate, in either direction.
#[derive(Debug)]
struct PinnedCert {
    cert: CertificateDer<'static>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl PinnedCert {
    fn check(&self, presented: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if presented.as_ref() == self.cert.as_ref() {
            Ok(())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }
}

/// The handshake-signature checks both verifier traits require: ring's, for the pinned key.
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ServerCertVerified::assertion())
    }

    handshake_signatures!();
}

impl ClientCertVerifier for PinnedCert {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ClientCertVerified::assertion())
    }

    handshake_signatures!();
}
