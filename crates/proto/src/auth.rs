//! How clients of the control plane (router, workers, `valet ctl`) reach it: plaintext
//! h2c for `http://` URLs; for `https://`, TLS verified against a pinned CA (never
//! skipped), an optional client certificate, and an optional bearer token read from
//! its file for every call (Kubernetes rotates projected tokens by swapping a
//! symlink).

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};
use tokio_util::either::Either;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Status};

use crate::reload::Reloading;

/// A channel to the control plane with its credentials: every client of
/// `ateapi.Control`, `valet.worker.Workers` and `valet.leases.Leases` uses this type.
pub type CpChannel = InterceptedService<Channel, BearerToken>;

/// What a client presents to, and checks of, the control plane.
#[derive(Clone, Default)]
pub struct ClientCredentials {
    tls: Option<ClientTls>,
    token: BearerToken,
}

/// The TLS side: the rustls configuration (rebuilt when its files change; each new
/// connection takes the current one) and the name to check.
#[derive(Clone)]
struct ClientTls {
    config: Reloading<ClientConfig>,
    server_name: Option<String>,
}

/// Never the key material.
impl std::fmt::Debug for ClientCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCredentials")
            .field("tls", &self.tls.is_some())
            .field("token_file", &self.token.0)
            .finish()
    }
}

/// The PEM files of a TLS client.
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

/// PEM certificates from `path`: at least one, all readable.
///
/// # Errors
/// An unreadable file, or no readable PEM certificate in it.
pub fn pem_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, CredentialError> {
    let bytes = read(path)?;
    match CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>() {
        Ok(c) if !c.is_empty() => Ok(c),
        _ => Err(CredentialError {
            path: path.to_owned(),
            why: "no readable PEM certificate in it".into(),
        }),
    }
}

/// How far in the future a server certificate's `notBefore` may be (clock skew).
pub const NOT_BEFORE_SKEW: std::time::Duration = std::time::Duration::from_secs(300);

/// The PEM certificate chain in `path` that a server (or a client) presents, its first (leaf)
/// certificate valid now (up to [`NOT_BEFORE_SKEW`] early): an expired or not-yet-valid
/// certificate swapped in would
/// fail every new handshake, so it is refused like an unreadable one (a reload keeps
/// the last good one).
///
/// # Errors
/// As [`pem_certificates`], and a leaf outside its validity period.
pub fn pem_certificates_valid_now(
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, CredentialError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let chain = pem_certificates(path)?;
    let refused = |why: String| CredentialError {
        path: path.to_owned(),
        why,
    };
    let (_, leaf) = X509Certificate::from_der(&chain[0])
        .map_err(|e| refused(format!("unreadable certificate ({e})")))?;
    let validity = leaf.validity();
    if let Some(why) = outside_validity(
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
        x509_parser::time::ASN1Time::now().timestamp(),
    ) {
        return Err(refused(why));
    }
    Ok(chain)
}

/// Why a certificate valid from `not_before` to `not_after` (Unix seconds) is not
/// usable at `now`, if it is not: expired, or not valid before a time more than
/// [`NOT_BEFORE_SKEW`] ahead (a certificate issued a moment ago by a clock a little
/// ahead is used at once; a refused one is tried again at every poll).
fn outside_validity(not_before: i64, not_after: i64, now: i64) -> Option<String> {
    let at = |t: i64| {
        x509_parser::time::ASN1Time::from_timestamp(t)
            .map_or_else(|_| t.to_string(), |a| a.to_string())
    };
    let skew = i64::try_from(NOT_BEFORE_SKEW.as_secs()).unwrap_or(i64::MAX);
    if now > not_after {
        Some(format!("the certificate expired at {}", at(not_after)))
    } else if now.saturating_add(skew) < not_before {
        Some(format!(
            "the certificate is not valid before {}",
            at(not_before)
        ))
    } else {
        None
    }
}

/// A PEM private key from `path`.
///
/// # Errors
/// An unreadable file, or no PEM private key in it.
pub fn pem_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, CredentialError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| CredentialError {
        path: path.to_owned(),
        why: format!("no PEM private key in it ({e})"),
    })
}

/// A root store of the PEM certificates in `path`.
///
/// # Errors
/// An unreadable file, no PEM certificate in it, or one that cannot be a root.
pub fn pem_roots(path: &Path) -> Result<RootCertStore, CredentialError> {
    let mut roots = RootCertStore::empty();
    for c in pem_certificates(path)? {
        roots.add(c).map_err(|e| CredentialError {
            path: path.to_owned(),
            why: format!("not a usable CA certificate ({e})"),
        })?;
    }
    Ok(roots)
}

/// The rustls client configuration of `files`, read now: ALPN `h2`, the server
/// verified against the CA, the client certificate when given.
fn client_config(files: &ClientTlsFiles) -> Result<ClientConfig, CredentialError> {
    let roots = pem_roots(&files.ca)?;
    let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| CredentialError {
            path: files.ca.clone(),
            why: e.to_string(),
        })?
        .with_root_certificates(roots);
    let mut config = match &files.identity {
        Some((cert, key)) => {
            // Expired or not valid yet, it would fail every new handshake: refused
            // like an unreadable one (a reload keeps the last good one).
            let chain = pem_certificates_valid_now(cert)?;
            let key_der = pem_private_key(key)?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| CredentialError {
                    path: key.clone(),
                    why: format!("does not match the certificate ({e})"),
                })?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

impl ClientCredentials {
    /// Plaintext h2c, no token.
    pub fn plaintext() -> Self {
        Self::default()
    }

    /// TLS from `files` (read now, and again whenever they change: see
    /// [`crate::reload`]), with a bearer token from `token_file` for every call when
    /// given.
    ///
    /// # Errors
    /// A file that cannot be read, or is not PEM.
    pub fn tls(files: &ClientTlsFiles, token_file: Option<&Path>) -> Result<Self, CredentialError> {
        if let Some(t) = token_file {
            // Readable and not empty now; read again for every call.
            if String::from_utf8_lossy(&read(t)?).trim().is_empty() {
                return Err(CredentialError {
                    path: t.to_owned(),
                    why: "the file is empty: it must hold the token".into(),
                });
            }
        }
        let mut watched = vec![files.ca.clone()];
        if let Some((cert, key)) = &files.identity {
            watched.extend([cert.clone(), key.clone()]);
        }
        let owned = files.clone();
        let config = Reloading::new("control-plane client TLS", watched, move || {
            client_config(&owned)
        })?;
        Ok(Self {
            tls: Some(ClientTls {
                config,
                server_name: files.server_name.clone(),
            }),
            token: BearerToken(token_file.map(Arc::from)),
        })
    }

    /// The bearer token the calls carry: the one in the token file now.
    pub fn bearer_token(&self) -> &BearerToken {
        &self.token
    }

    /// Whether the channel uses TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// An endpoint for `url`. TLS is done by [`CpConnector`] (so that every new
    /// connection takes the current files), so for `https://` the endpoint tonic sees
    /// is `http://` and its origin (`:scheme` and `:authority`) the `https://` URL.
    ///
    /// # Errors
    /// When `url` is not a valid endpoint.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, tonic::transport::Error> {
        let endpoint = Endpoint::from_shared(url.to_owned())?;
        if self.tls.is_none() || endpoint.uri().scheme_str() != Some("https") {
            return Ok(endpoint);
        }
        let uri = endpoint.uri().clone();
        let mut parts = uri.clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        // The same authority and path under another scheme: always valid.
        Ok(match Uri::from_parts(parts) {
            Ok(plain) => Endpoint::from(plain).origin(uri),
            Err(_) => endpoint,
        })
    }

    /// The connector of these credentials over `http` (TCP settings).
    pub fn connector(&self, http: HttpConnector) -> CpConnector {
        CpConnector {
            http,
            tls: self.tls.clone(),
            to: None,
        }
    }

    /// A lazily connecting channel to `endpoint` (from [`Self::endpoint`]), with the
    /// bearer token (when any) added to every call.
    pub fn connect_lazy(&self, endpoint: &Endpoint, http: HttpConnector) -> CpChannel {
        self.intercept(endpoint.connect_with_connector_lazy(self.connector(http)))
    }

    /// As [`Self::connect_lazy`], but every connection goes to `to` (one address the
    /// endpoint's host name resolved to), while the name stays the endpoint's: its
    /// `:authority`, and the name checked in the server's certificate.
    pub fn connect_lazy_to(
        &self,
        endpoint: &Endpoint,
        http: HttpConnector,
        to: SocketAddr,
    ) -> CpChannel {
        let connector = CpConnector {
            to: Some(to),
            ..self.connector(http)
        };
        self.intercept(endpoint.connect_with_connector_lazy(connector))
    }

    /// A channel to `endpoint` (from [`Self::endpoint`]), connected now.
    ///
    /// # Errors
    /// When the connection (TCP, TLS or HTTP/2) cannot be made.
    pub async fn connect(
        &self,
        endpoint: &Endpoint,
        http: HttpConnector,
    ) -> Result<CpChannel, tonic::transport::Error> {
        let channel = endpoint
            .connect_with_connector(self.connector(http))
            .await?;
        Ok(self.intercept(channel))
    }

    fn intercept(&self, channel: Channel) -> CpChannel {
        InterceptedService::new(channel, self.token.clone())
    }
}

/// Whether `name` can be checked in a server's certificate and sent as SNI (a DNS
/// name or an IP address).
pub fn valid_server_name(name: &str) -> bool {
    ServerName::try_from(name).is_ok()
}

/// A TCP connector for [`ClientCredentials::connect_lazy`]: any scheme (TLS is done
/// above it), `TCP_NODELAY`.
pub fn tcp_connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http
}

/// Plain TCP (`TCP_NODELAY` and timeouts set by its [`HttpConnector`]), then TLS with
/// the configuration current when the connection is made.
#[derive(Clone)]
pub struct CpConnector {
    http: HttpConnector,
    tls: Option<ClientTls>,
    /// Connect here rather than to what the URI's host resolves to.
    to: Option<SocketAddr>,
}

impl std::fmt::Debug for CpConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpConnector")
            .field("tls", &self.tls.is_some())
            .field("to", &self.to)
            .finish_non_exhaustive()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Io = TokioIo<Either<TcpStream, tokio_rustls::client::TlsStream<TcpStream>>>;

impl tower_service::Service<Uri> for CpConnector {
    type Response = Io;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Io, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        tower_service::Service::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // Pinned: that address first; refused (or not a valid authority: an IPv6
        // address with a zone), the URI's host as resolved now.
        let pinned = self
            .to
            .and_then(|to| Uri::try_from(format!("http://{to}")).ok())
            .map(|to| tower_service::Service::call(&mut self.http, to));
        let mut http = self.http.clone();
        let by_name = uri.clone();
        let connect = async move {
            if let Some(pinned) = pinned {
                match pinned.await {
                    Ok(tcp) => return Ok(tcp),
                    Err(e) => {
                        tracing::debug!(error = %e, "pinned address refused; connecting by name")
                    }
                }
            }
            tower_service::Service::call(&mut http, by_name).await
        };
        let tls = self.tls.clone();
        Box::pin(async move {
            let tcp = connect.await?.into_inner();
            let Some(tls) = tls else {
                return Ok(TokioIo::new(Either::Left(tcp)));
            };
            let host = match &tls.server_name {
                Some(name) => name.clone(),
                None => uri
                    .host()
                    .unwrap_or_default()
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
            };
            let name = ServerName::try_from(host)?;
            let stream = TlsConnector::from(tls.config.load())
                .connect(name, tcp)
                .await?;
            Ok(TokioIo::new(Either::Right(stream)))
        })
    }
}

/// Adds `authorization: Bearer <token>` to every call, the token read from its file
/// each time; no token file: adds nothing.
#[derive(Debug, Clone, Default)]
pub struct BearerToken(Option<Arc<Path>>);

impl BearerToken {
    /// The token read from `path` for every call.
    pub fn file(path: &Path) -> Self {
        Self(Some(Arc::from(path)))
    }

    /// The token file, if any.
    pub fn path(&self) -> Option<&Path> {
        self.0.as_deref()
    }

    /// The token in the file now; `None` without a token file.
    ///
    /// # Errors
    /// An unreadable or empty file (one being rewritten in place, say): `Unavailable`,
    /// a local failure, not the server's answer (so a parked request retries).
    pub fn current(&self) -> Option<Result<String, Status>> {
        let path = self.0.as_ref()?;
        // A small local file (a projected token), read for every call so that a
        // rotated one is used at once.
        let read = std::fs::read_to_string(path).map_err(|e| {
            Status::unavailable(format!(
                "cannot read --ateapi-token-file {}: {e}",
                path.display()
            ))
        });
        Some(read.and_then(|t| match t.trim() {
            "" => Err(Status::unavailable(format!(
                "--ateapi-token-file {} is empty",
                path.display()
            ))),
            token => Ok(token.to_owned()),
        }))
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = self.current() else {
            return Ok(req);
        };
        let token = token?;
        let path = self.0.as_deref().expect("a token was read from it");
        let mut value = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| {
            Status::unavailable(format!(
                "--ateapi-token-file {} holds characters a header cannot carry",
                path.display()
            ))
        })?;
        // Never indexed by HPACK, never printed by a `Debug` of the metadata.
        value.set_sensitive(true);
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    /// Expired is refused at once; a start a little ahead (clock skew) is not.
    #[test]
    fn certificate_validity_allows_a_little_skew() {
        use super::{NOT_BEFORE_SKEW, outside_validity};
        let now = 1_800_000_000;
        let skew = NOT_BEFORE_SKEW.as_secs() as i64;
        assert_eq!(outside_validity(now - 10, now + 10, now), None);
        assert!(
            outside_validity(now - 20, now - 1, now)
                .unwrap()
                .contains("expired at")
        );
        assert_eq!(
            outside_validity(now + 60, now + 1000, now),
            None,
            "60 s ahead"
        );
        assert_eq!(outside_validity(now + skew, now + 1000, now), None);
        assert!(
            outside_validity(now + skew + 1, now + 1000, now)
                .unwrap()
                .contains("not valid before")
        );
    }

    use super::*;

    /// An empty token file is refused at start, naming the file; one emptied later (a
    /// rewrite in place) is a local `Unavailable`, retried, and never sent as
    /// `Bearer ` (which the control plane would answer `Unauthenticated`, failing the
    /// request at once).
    #[test]
    fn an_empty_token_file_is_refused_at_start_and_unavailable_later() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, " \n").unwrap();
        let files = ClientTlsFiles {
            ca: dir.path().join("ca.pem"),
            identity: None,
            server_name: None,
        };
        let e = ClientCredentials::tls(&files, Some(&token)).unwrap_err();
        assert_eq!(
            (e.path.as_path(), e.why.as_str()),
            (token.as_path(), "the file is empty: it must hold the token")
        );

        let bearer = BearerToken::file(&token);
        let status = bearer.current().unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            status.message().ends_with("is empty"),
            "{}",
            status.message()
        );
        std::fs::write(&token, "abc.def.ghi\n").unwrap();
        assert_eq!(bearer.current().unwrap().unwrap(), "abc.def.ghi");
    }
}
