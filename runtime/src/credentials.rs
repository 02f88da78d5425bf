//! The cluster's credentials: one certificate and key shared by every node, and a token.
//!
//! Every node presents the cluster certificate and accepts only a peer that presents exactly
//! the same one (see `link::tls`), so holding the key is what makes a process a member. The
//! token is a second factor checked in the link handshake, and the bearer secret of the admin
//! API. `duet up` creates all three on first start; a multi-host deployment copies them.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rand::RngCore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::CredentialsConfig;

/// The DNS name in the cluster certificate; peers dial each other by it.
pub const CLUSTER_SERVER_NAME: &str = "duet-cluster";

/// Loaded credentials.
#[derive(Debug)]
pub struct Credentials {
    /// The cluster certificate (DER).
    pub cert: CertificateDer<'static>,
    /// Its private key.
    pub key: PrivateKeyDer<'static>,
    /// The cluster token.
    pub token: Token,
}

/// A bearer secret, compared in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// Wraps a token read from a file or the environment.
    pub fn new(token: impl Into<String>) -> Token {
        Token(token.into())
    }

    /// The token text, to send to a peer or an admin API.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this token, without leaking where they differ through timing.
    pub fn matches(&self, given: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), given.as_bytes());
        let mut diff = a.len() ^ b.len();
        for (i, x) in a.iter().enumerate() {
            diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
        }
        diff == 0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Credentials that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// A credentials file is missing; `duet up` creates them.
    #[error(
        "{path} is missing: run `duet up` once, or `duet credentials`, to create the cluster credentials"
    )]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file exists but cannot be used.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing new credentials failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Generating the certificate failed.
    #[error("cannot generate the cluster certificate: {0}")]
    Generate(String),
}

impl Credentials {
    /// Loads the credentials named in the config.
    pub fn load(cfg: &CredentialsConfig) -> Result<Credentials, CredentialsError> {
        for path in [&cfg.cert, &cfg.key, &cfg.token_file] {
            if !path.exists() {
                return Err(CredentialsError::Missing { path: path.clone() });
            }
        }
        let invalid = |path: &Path, reason: String| CredentialsError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let cert = CertificateDer::from_pem_file(&cfg.cert)
            .map_err(|e| invalid(&cfg.cert, format!("not a PEM certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_file(&cfg.key)
            .map_err(|e| invalid(&cfg.key, format!("not a PEM private key: {e}")))?;
        let token = fs::read_to_string(&cfg.token_file)
            .map_err(|e| invalid(&cfg.token_file, e.to_string()))?
            .trim()
            .to_string();
        if token.len() < 16 {
            return Err(invalid(
                &cfg.token_file,
                "the token is shorter than 16 characters".to_string(),
            ));
        }
        Ok(Credentials {
            cert,
            key,
            token: Token(token),
        })
    }

    /// Loads the credentials, creating all of them first if none exist. Returns whether they
    /// were created. A partial set is an error rather than silently replaced.
    pub fn ensure(cfg: &CredentialsConfig) -> Result<(Credentials, bool), CredentialsError> {
        let present = [&cfg.cert, &cfg.key, &cfg.token_file]
            .iter()
            .filter(|p| p.exists())
            .count();
        if present == 0 {
            Self::generate(cfg)?;
            return Ok((Self::load(cfg)?, true));
        }
        Ok((Self::load(cfg)?, false))
    }

    /// Writes a fresh certificate, key and token (key and token readable by the owner only).
    pub fn generate(cfg: &CredentialsConfig) -> Result<(), CredentialsError> {
        let certified = rcgen::generate_simple_self_signed(vec![CLUSTER_SERVER_NAME.to_string()])
            .map_err(|e| CredentialsError::Generate(e.to_string()))?;
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let token: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        write_file(&cfg.cert, certified.cert.pem().as_bytes(), 0o644)?;
        write_file(
            &cfg.key,
            certified.signing_key.serialize_pem().as_bytes(),
            0o600,
        )?;
        write_file(&cfg.token_file, format!("{token}\n").as_bytes(), 0o600)?;
        Ok(())
    }
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CredentialsError> {
    let err = |source| CredentialsError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(err)?;
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        let t = Token::new("0123456789abcdef");
        assert!(t.matches("0123456789abcdef"));
        assert!(!t.matches("0123456789abcdeX"));
        assert!(!t.matches("0123456789abcdef0"));
        assert!(!t.matches(""));
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
    }

    #[test]
    fn generates_once_and_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CredentialsConfig {
            cert: dir.path().join("c.crt"),
            key: dir.path().join("c.key"),
            token_file: dir.path().join("token"),
        };
        assert!(matches!(
            Credentials::load(&cfg),
            Err(CredentialsError::Missing { .. })
        ));
        let (a, created) = Credentials::ensure(&cfg).unwrap();
        assert!(created);
        let (b, created) = Credentials::ensure(&cfg).unwrap();
        assert!(!created);
        assert_eq!(a.cert, b.cert);
        assert_eq!(a.token, b.token);
        fs::remove_file(&cfg.key).unwrap();
        assert!(matches!(
            Credentials::ensure(&cfg),
            Err(CredentialsError::Missing { .. })
        ));
    }
}
