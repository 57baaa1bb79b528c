//! How clients of the control plane (router, workers, `valet ctl`) reach it: plaintext
//! h2c for `http://` URLs; for `https://`, TLS verified against a pinned CA (never
//! skipped), an optional client certificate, and an optional bearer token read from
//! its file for every call (Kubernetes rotates projected tokens by swapping a
//! symlink).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

/// A channel to the control plane with its credentials: every client of
/// `ateapi.Control`, `valet.worker.Workers` and `valet.leases.Leases` uses this type.
pub type CpChannel = InterceptedService<Channel, BearerToken>;

/// What a client presents to, and checks of, the control plane.
#[derive(Clone, Default)]
pub struct ClientCredentials {
    tls: Option<ClientTlsConfig>,
    token: BearerToken,
}

/// Never the key material (tonic's own `Debug` of an identity would print it).
impl std::fmt::Debug for ClientCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCredentials")
            .field("tls", &self.tls.is_some())
            .field("token_file", &self.token.0)
            .finish()
    }
}

/// The PEM files of a TLS client, read at start.
#[derive(Debug, Clone, Default)]
pub struct ClientTlsFiles {
    /// The CA the server's certificate must chain to.
    pub ca: PathBuf,
    /// A client certificate and its key (both or neither).
    pub identity: Option<(PathBuf, PathBuf)>,
    /// The name checked in the server's certificate and sent as SNI (default: the
    /// URL's host).
    pub server_name: Option<String>,
}

/// Why credentials could not be built: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {why}")]
pub struct CredentialError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub why: String,
}

fn read(path: &Path) -> Result<Vec<u8>, CredentialError> {
    std::fs::read(path).map_err(|e| CredentialError {
        path: path.to_owned(),
        why: e.to_string(),
    })
}

impl ClientCredentials {
    /// Plaintext h2c, no token.
    pub fn plaintext() -> Self {
        Self::default()
    }

    /// TLS from `files` (read now), with a bearer token from `token_file` for every
    /// call when given.
    ///
    /// # Errors
    /// A file that cannot be read, or is not PEM.
    pub fn tls(files: &ClientTlsFiles, token_file: Option<&Path>) -> Result<Self, CredentialError> {
        let ca = read(&files.ca)?;
        if !String::from_utf8_lossy(&ca).contains("-----BEGIN CERTIFICATE-----") {
            return Err(CredentialError {
                path: files.ca.clone(),
                why: "no PEM certificate in it".into(),
            });
        }
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((cert, key)) = &files.identity {
            use rustls_pki_types::pem::PemObject;
            use rustls_pki_types::{CertificateDer, PrivateKeyDer};
            let (cert_pem, key_pem) = (read(cert)?, read(key)?);
            // Checked now: a bad file is a configuration error, not a failed connection.
            let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&cert_pem).collect();
            if !certs.is_ok_and(|c| !c.is_empty()) {
                return Err(CredentialError {
                    path: cert.clone(),
                    why: "no readable PEM certificate in it".into(),
                });
            }
            if let Err(e) = PrivateKeyDer::from_pem_slice(&key_pem) {
                return Err(CredentialError {
                    path: key.clone(),
                    why: format!("no PEM private key in it ({e})"),
                });
            }
            tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
        }
        if let Some(name) = &files.server_name {
            tls = tls.domain_name(name.clone());
        }
        if let Some(t) = token_file {
            // Readable now; read again for every call.
            read(t)?;
        }
        Ok(Self {
            tls: Some(tls),
            token: BearerToken(token_file.map(Arc::from)),
        })
    }

    /// Whether the channel uses TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `endpoint` with these credentials' TLS settings.
    ///
    /// # Errors
    /// When TLS cannot be configured for the endpoint.
    pub fn endpoint(&self, endpoint: Endpoint) -> Result<Endpoint, tonic::transport::Error> {
        match &self.tls {
            Some(tls) => endpoint.tls_config(tls.clone()),
            None => Ok(endpoint),
        }
    }

    /// `channel` with the bearer token (when any) added to every call.
    pub fn intercept(&self, channel: Channel) -> CpChannel {
        InterceptedService::new(channel, self.token.clone())
    }
}

/// Adds `authorization: Bearer <token>` to every call, the token read from its file
/// each time; no token file: adds nothing.
#[derive(Debug, Clone, Default)]
pub struct BearerToken(Option<Arc<Path>>);

impl Interceptor for BearerToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let Some(path) = &self.0 else {
            return Ok(req);
        };
        // A small local file (a projected token). An unreadable one is a local failure,
        // not the server's answer: `Unavailable`, so a parked request retries.
        let token = std::fs::read_to_string(path).map_err(|e| {
            Status::unavailable(format!(
                "cannot read --ateapi-token-file {}: {e}",
                path.display()
            ))
        })?;
        let value = MetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
            Status::unavailable(format!(
                "--ateapi-token-file {} holds characters a header cannot carry",
                path.display()
            ))
        })?;
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }
}
