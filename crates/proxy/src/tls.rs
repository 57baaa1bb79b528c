//! HTTPS ingress: the certificate (from PEM files, or self-signed at start), ALPN `h2`
//! and `http/1.1`, optional client certificates, and the SPIFFE-ID allowlist a client
//! certificate must match.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{ServerConfig, crypto::ring};
use valet_proto::auth::{CredentialError, pem_certificates_valid_now, pem_private_key, pem_roots};
use valet_proto::reload::Reloading;

/// The HTTPS listener's TLS settings. The configuration is rebuilt whenever one of its
/// files changes (see [`valet_proto::reload`]); each connection takes the one current
/// when it is accepted.
#[derive(Clone)]
pub struct IngressTls {
    pub(crate) config: Reloading<ServerConfig>,
    pub(crate) allowlist: Option<Arc<SpiffeAllowlist>>,
    checks_clients: bool,
}

impl std::fmt::Debug for IngressTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressTls")
            .field("allowlist", &self.allowlist)
            .finish_non_exhaustive()
    }
}

/// Where the ingress certificate comes from.
#[derive(Debug, Clone)]
pub enum IngressCert<'a> {
    /// PEM certificate chain and key files.
    Files { cert: &'a Path, key: &'a Path },
    /// A self-signed certificate generated now, for these names.
    SelfSigned(Vec<String>),
}

/// Why the ingress TLS could not be set up: the flag, and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {flag}: {why}")]
pub struct IngressTlsError {
    /// The flag.
    pub flag: &'static str,
    /// What went wrong.
    pub why: String,
}

fn err(flag: &'static str, why: impl std::fmt::Display) -> IngressTlsError {
    IngressTlsError {
        flag,
        why: why.to_string(),
    }
}

fn flagged(flag: &'static str) -> impl Fn(CredentialError) -> IngressTlsError {
    move |e| err(flag, e)
}

/// The certificate and key, as files (read at every build) or generated once.
enum Identity {
    Files { cert: PathBuf, key: PathBuf },
    Generated(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
}

impl IngressTls {
    /// Builds the listener's TLS: the certificate, client certificates required and
    /// verified against `client_ca` when given, and `allowlist` checked on them.
    ///
    /// # Errors
    /// A file that cannot be read or used, naming its flag; an allowlist without a
    /// client CA.
    pub fn new(
        cert: IngressCert<'_>,
        client_ca: Option<&Path>,
        allowlist: Option<SpiffeAllowlist>,
    ) -> Result<Self, IngressTlsError> {
        if client_ca.is_none() && allowlist.is_some() {
            return Err(err(
                "--ingress-allowed-spiffe-ids",
                "needs --ingress-client-ca-file: only verified client certificates are checked",
            ));
        }
        let identity = match cert {
            IngressCert::Files { cert, key } => Identity::Files {
                cert: cert.to_owned(),
                key: key.to_owned(),
            },
            IngressCert::SelfSigned(names) => {
                let c = rcgen::generate_simple_self_signed(names).map_err(|e| {
                    err(
                        "--listen-https",
                        format!("cannot generate a certificate: {e}"),
                    )
                })?;
                let key = PrivateKeyDer::Pkcs8(c.signing_key.serialize_der().into());
                Identity::Generated(vec![c.cert.der().clone()], key)
            }
        };
        let mut files = match &identity {
            Identity::Files { cert, key } => vec![cert.clone(), key.clone()],
            Identity::Generated(..) => Vec::new(),
        };
        files.extend(client_ca.map(Path::to_owned));
        let ca = client_ca.map(Path::to_owned);
        let config = Reloading::new("ingress TLS", files, move || {
            server_config(&identity, ca.as_deref())
        })?;
        Ok(Self {
            config,
            allowlist: allowlist.map(Arc::new),
            checks_clients: client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate verified against a client CA.
    pub fn checks_client_certificates(&self) -> bool {
        self.checks_clients
    }
}

fn server_config(
    identity: &Identity,
    client_ca: Option<&Path>,
) -> Result<ServerConfig, IngressTlsError> {
    let (chain, key) = match identity {
        Identity::Files { cert, key } => (
            pem_certificates_valid_now(cert).map_err(flagged("--ingress-tls-cert-file"))?,
            pem_private_key(key).map_err(flagged("--ingress-tls-key-file"))?,
        ),
        Identity::Generated(chain, key) => (chain.clone(), key.clone_key()),
    };
    let provider = Arc::new(ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| err("--listen-https", e))?;
    let builder = match client_ca {
        Some(ca) => {
            let roots = pem_roots(ca).map_err(flagged("--ingress-client-ca-file"))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| err("--ingress-client-ca-file", e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| err("--ingress-tls-key-file", e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// SPIFFE IDs admitted: an entry admits the ID equal to it, or, for an entry ending in
/// `/`, every ID that extends it by whole path segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpiffeAllowlist(Vec<String>);

impl SpiffeAllowlist {
    /// From the flag's comma-separated value.
    ///
    /// # Errors
    /// An entry that is not a `spiffe://` ID, or an empty list.
    pub fn parse(value: &str) -> Result<Self, String> {
        let entries: Vec<String> = value
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect();
        if entries.is_empty() {
            return Err("needs at least one spiffe:// ID".into());
        }
        for e in &entries {
            let rest = e
                .strip_prefix("spiffe://")
                .ok_or_else(|| format!("`{e}` is not a spiffe:// ID"))?;
            if rest.is_empty() || rest.starts_with('/') || rest.contains("//") {
                return Err(format!(
                    "`{e}` has no trust domain or an empty path segment"
                ));
            }
            if rest.split('/').skip(1).any(|s| s == "." || s == "..") {
                return Err(format!("`{e}` has a `.` or `..` path segment"));
            }
        }
        Ok(Self(entries))
    }

    /// Whether `id` is admitted.
    pub fn admits(&self, id: &str) -> bool {
        self.0.iter().any(|entry| {
            if entry.ends_with('/') {
                id.strip_prefix(entry.as_str()).is_some_and(|rest| {
                    !rest.is_empty()
                        && rest
                            .split('/')
                            .all(|segment| !matches!(segment, "" | "." | ".."))
                })
            } else {
                id == entry
            }
        })
    }

    /// Whether the client certificate `der` is admitted: exactly one URI SAN, admitted.
    /// The reason when it is not.
    ///
    /// # Errors
    /// Why the certificate is refused.
    pub fn check(&self, der: &[u8]) -> Result<(), String> {
        use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|_| "unreadable client certificate".to_owned())?;
        let uris: Vec<&str> = cert
            .subject_alternative_name()
            .ok()
            .flatten()
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .filter_map(|n| match n {
                        GeneralName::URI(u) => Some(*u),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        match uris.as_slice() {
            [id] if self.admits(id) => Ok(()),
            [id] => Err(format!("SPIFFE ID {id} is not allowed")),
            [] => Err("the client certificate has no URI SAN".into()),
            _ => Err("the client certificate has more than one URI SAN".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SpiffeAllowlist;

    #[test]
    fn entries_admit_exact_ids_and_whole_segment_extensions() {
        let a = SpiffeAllowlist::parse(
            "spiffe://cluster.local/ns/apps/, spiffe://cluster.local/ns/ops/sa/admin",
        )
        .unwrap();
        assert!(a.admits("spiffe://cluster.local/ns/apps/sa/x"));
        assert!(a.admits("spiffe://cluster.local/ns/apps/sa"));
        assert!(a.admits("spiffe://cluster.local/ns/ops/sa/admin"));
        assert!(
            !a.admits("spiffe://cluster.local/ns/apps-evil/sa/x"),
            "look-alike prefix"
        );
        assert!(
            !a.admits("spiffe://cluster.local/ns/apps/"),
            "the prefix itself"
        );
        assert!(
            !a.admits("spiffe://cluster.local/ns/apps//x"),
            "empty segment"
        );
        assert!(
            !a.admits("spiffe://cluster.local/ns/ops/sa/admin2"),
            "exact entries are exact"
        );
        assert!(!a.admits("spiffe://cluster.local/ns/ops/sa/admin/x"));
        assert!(
            !a.admits("spiffe://cluster.local/ns/apps/../ops/sa/admin"),
            "dot-dot"
        );
        assert!(!a.admits("spiffe://cluster.local/ns/apps/./x"), "dot");
        assert!(a.admits("spiffe://cluster.local/ns/apps/.hidden/..."));
    }

    #[test]
    fn bad_entries_are_refused() {
        assert!(SpiffeAllowlist::parse("").is_err());
        assert!(SpiffeAllowlist::parse("https://x/y").is_err());
        assert!(SpiffeAllowlist::parse("spiffe://").is_err());
        assert!(SpiffeAllowlist::parse("spiffe://td//x").is_err());
        assert!(SpiffeAllowlist::parse("spiffe://td/ns/../x/").is_err());
    }
}
