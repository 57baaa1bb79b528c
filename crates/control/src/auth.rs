//! The control plane's side of TLS and bearer tokens: the server certificate, an
//! optional client CA (client certificates then required), and JWT verification with
//! pinned asymmetric algorithms (never `none`, never HMAC).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{ServerConfig, crypto::ring};
use tonic::service::Interceptor;
use tonic::{Request, Status};
use valet_proto::auth::{CredentialError, pem_certificates_valid_now, pem_private_key, pem_roots};
use valet_proto::reload::Reloading;

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY: Duration = Duration::from_secs(30);

/// What the control plane's server requires of its clients. Both are rebuilt when their
/// files change (see [`valet_proto::reload`]); each new connection takes the current
/// TLS configuration, each call the current verification keys.
#[derive(Debug, Clone, Default)]
pub struct ServerSecurity {
    /// TLS (server certificate, optional client CA); plaintext h2c when `None`.
    pub tls: Option<Reloading<ServerConfig>>,
    /// Bearer-token verification; none when `None`.
    pub jwt: Option<Reloading<JwtVerifier>>,
}

/// Why the security settings could not be built: the flag, the file, what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {flag}={}: {why}", path.display())]
pub struct SecurityError {
    /// The flag.
    pub flag: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub why: String,
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|e| SecurityError {
        flag,
        path: path.to_owned(),
        why: e.to_string(),
    })
}

/// `e` (about one of the files) as the error of its flag.
fn flagged(flag: &'static str) -> impl Fn(CredentialError) -> SecurityError {
    move |e| SecurityError {
        flag,
        path: e.path,
        why: e.why,
    }
}

/// The server's TLS from PEM files: certificate chain, key, and (optionally) the CA
/// client certificates must chain to, which makes them required. Read now, and again
/// whenever one of them changes.
///
/// # Errors
/// A file that cannot be read or holds no usable PEM of its kind.
pub fn server_tls(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Reloading<ServerConfig>, SecurityError> {
    let (cert, key, ca) = (
        cert.to_owned(),
        key.to_owned(),
        client_ca.map(Path::to_owned),
    );
    let mut files = vec![cert.clone(), key.clone()];
    files.extend(ca.clone());
    Reloading::new("control-plane server TLS", files, move || {
        server_config(&cert, &key, ca.as_deref())
    })
}

/// Checks `ca` (`--client-ca-file`) as [`server_tls`] reads it: PEM certificates a
/// client verifier can be built from.
///
/// # Errors
/// A file that cannot be read or holds no usable CA.
pub fn check_client_ca(ca: &Path) -> Result<(), SecurityError> {
    let roots = pem_roots(ca).map_err(flagged("--client-ca-file"))?;
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::new(ring::default_provider()))
        .build()
        .map(|_| ())
        .map_err(|e| SecurityError {
            flag: "--client-ca-file",
            path: ca.to_owned(),
            why: e.to_string(),
        })
}

fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerConfig, SecurityError> {
    let chain = pem_certificates_valid_now(cert).map_err(flagged("--tls-cert-file"))?;
    let key_der = pem_private_key(key).map_err(flagged("--tls-key-file"))?;
    let provider = Arc::new(ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| SecurityError {
            flag: "--tls-cert-file",
            path: cert.to_owned(),
            why: e.to_string(),
        })?;
    let builder = match client_ca {
        Some(ca) => {
            let roots = pem_roots(ca).map_err(flagged("--client-ca-file"))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| SecurityError {
                    flag: "--client-ca-file",
                    path: ca.to_owned(),
                    why: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key_der)
        .map_err(|e| SecurityError {
            flag: "--tls-key-file",
            path: key.to_owned(),
            why: format!("does not match the certificate ({e})"),
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Where bearer tokens' verification keys come from.
#[derive(Debug, Clone)]
pub enum JwtKeys {
    /// One PEM public key (`--jwt-public-key-file`).
    PublicKeyFile(PathBuf),
    /// A JWKS document (`--jwt-jwks-file`).
    JwksFile(PathBuf),
}

/// A verifier of `keys`, rebuilt whenever the key file changes.
///
/// # Errors
/// The key file cannot be read or used.
pub fn jwt_verifier(
    keys: JwtKeys,
    audience: Option<String>,
    issuer: Option<String>,
) -> Result<Reloading<JwtVerifier>, SecurityError> {
    let file = match &keys {
        JwtKeys::PublicKeyFile(p) | JwtKeys::JwksFile(p) => p.clone(),
    };
    Reloading::new("JWT verification keys", vec![file], move || match &keys {
        JwtKeys::PublicKeyFile(p) => {
            JwtVerifier::from_public_key_file(p, audience.clone(), issuer.clone())
        }
        JwtKeys::JwksFile(p) => JwtVerifier::from_jwks_file(p, audience.clone(), issuer.clone()),
    })
}

/// The PEM blocks of `text`, each from its `-----BEGIN` line to the end of its
/// `-----END …-----` marker.
fn pem_blocks(text: &str) -> Vec<&str> {
    const BEGIN: &str = "-----BEGIN ";
    const END: &str = "-----END ";
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let from = &rest[start..];
        let Some(end) = from.find(END) else { break };
        let after = &from[end + END.len()..];
        let len = end + END.len() + after.find("-----").map_or(after.len(), |i| i + 5);
        blocks.push(&from[..len]);
        rest = &from[len..];
    }
    blocks
}

/// One verification key and the algorithms it may verify.
struct Key {
    kid: Option<String>,
    key: DecodingKey,
    algorithms: Vec<Algorithm>,
}

const RSA: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];
const EC: &[Algorithm] = &[Algorithm::ES256, Algorithm::ES384];
const ED: &[Algorithm] = &[Algorithm::EdDSA];

/// Verifies bearer tokens: signature by one of the pinned public keys with an
/// asymmetric algorithm that key allows, `exp` (required), `nbf`, and `aud` and `iss`
/// when configured.
pub struct JwtVerifier {
    keys: Vec<Key>,
    audience: Option<String>,
    issuer: Option<String>,
    leeway: Duration,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("keys", &self.keys.len())
            .field("audience", &self.audience)
            .field("issuer", &self.issuer)
            .field("leeway", &self.leeway)
            .finish()
    }
}

impl JwtVerifier {
    /// From a PEM public key (RSA, EC P-256/P-384 or Ed25519).
    ///
    /// # Errors
    /// A file that cannot be read, or no public key of those kinds in it.
    pub fn from_public_key_file(
        path: &Path,
        audience: Option<String>,
        issuer: Option<String>,
    ) -> Result<Self, SecurityError> {
        let flag = "--jwt-public-key-file";
        let bytes = read(flag, path)?;
        let refused = |why: String| SecurityError {
            flag,
            path: path.to_owned(),
            why,
        };
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| refused("no RSA, EC or Ed25519 public key in PEM".into()))?;
        let blocks = pem_blocks(text);
        if blocks.is_empty() {
            return Err(refused("no RSA, EC or Ed25519 public key in PEM".into()));
        }
        // Every block is a key (several: a rotation's overlap); one that is not is an
        // error, never skipped.
        let keys = blocks
            .iter()
            .enumerate()
            .map(|(i, block)| {
                let pem = block.as_bytes();
                DecodingKey::from_rsa_pem(pem)
                    .map(|k| (k, RSA))
                    .or_else(|_| DecodingKey::from_ec_pem(pem).map(|k| (k, EC)))
                    .or_else(|_| DecodingKey::from_ed_pem(pem).map(|k| (k, ED)))
                    .map(|(key, algorithms)| Key {
                        kid: None,
                        key,
                        algorithms: algorithms.to_vec(),
                    })
                    .map_err(|_| {
                        refused(format!(
                            "PEM block {} of {} is not an RSA, EC or Ed25519 public key",
                            i + 1,
                            blocks.len()
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            keys,
            audience,
            issuer,
            leeway: LEEWAY,
        })
    }

    /// From a JWKS document; symmetric (`oct`) keys are refused.
    ///
    /// # Errors
    /// A file that cannot be read, is not a JWKS, holds a symmetric key or no key.
    pub fn from_jwks_file(
        path: &Path,
        audience: Option<String>,
        issuer: Option<String>,
    ) -> Result<Self, SecurityError> {
        let flag = "--jwt-jwks-file";
        let err = |why: String| SecurityError {
            flag,
            path: path.to_owned(),
            why,
        };
        let bytes = read(flag, path)?;
        let doc: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| err(format!("not a JWKS: {e}")))?;
        let entries = doc
            .get("keys")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| err("not a JWKS: no \"keys\" array".into()))?;
        // A key this verifier cannot or must not use is skipped, not fatal: a rotated
        // JWKS may add keys of other kinds beside the signing keys in use.
        let mut keys = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            let skip = |why: String| {
                tracing::warn!(file = %path.display(), key = i, %why, "JWKS key skipped");
            };
            let jwk: Jwk = match serde_json::from_value(entry.clone()) {
                Ok(j) => j,
                Err(e) => {
                    skip(format!("not a key this verifier reads: {e}"));
                    continue;
                }
            };
            if matches!(&jwk.common.public_key_use, Some(u) if *u != PublicKeyUse::Signature) {
                skip("not a signature key (use is not \"sig\")".into());
                continue;
            }
            let family: &[Algorithm] = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => RSA,
                // An EC key verifies the one algorithm of its curve.
                AlgorithmParameters::EllipticCurve(p) => match p.curve {
                    jsonwebtoken::jwk::EllipticCurve::P256 => &[Algorithm::ES256],
                    jsonwebtoken::jwk::EllipticCurve::P384 => &[Algorithm::ES384],
                    ref other => {
                        skip(format!(
                            "an EC key on {other:?}: only P-256 and P-384 verify tokens"
                        ));
                        continue;
                    }
                },
                AlgorithmParameters::OctetKeyPair(_) => ED,
                AlgorithmParameters::OctetKey(_) => {
                    skip("a symmetric (oct) key: only asymmetric keys verify tokens".into());
                    continue;
                }
            };
            // A key that names its algorithm verifies that one only (RFC 8725 §3.1).
            let algorithms = match &jwk.common.key_algorithm {
                None => family.to_vec(),
                Some(declared) => match declared.to_string().parse::<Algorithm>() {
                    Ok(a) if family.contains(&a) => vec![a],
                    _ => {
                        skip(format!(
                            "its \"alg\" {declared} is not a signature algorithm of this key"
                        ));
                        continue;
                    }
                },
            };
            match DecodingKey::from_jwk(&jwk) {
                Ok(key) => keys.push(Key {
                    kid: jwk.common.key_id.clone(),
                    key,
                    algorithms,
                }),
                Err(e) => skip(format!("cannot be used: {e}")),
            }
        }
        if keys.is_empty() {
            return Err(err(
                "holds no usable signature key (RSA, EC P-256/P-384 or Ed25519)".into(),
            ));
        }
        Ok(Self {
            keys,
            audience,
            issuer,
            leeway: LEEWAY,
        })
    }

    /// The same verifier tolerating `leeway` of clock skew on `exp` and `nbf` instead of
    /// 30 s (tests use zero, to see a token expire soon).
    #[must_use]
    pub fn with_leeway(mut self, leeway: Duration) -> Self {
        self.leeway = leeway;
        self
    }

    /// Checks `token`: when it stops being accepted (its `exp` plus the tolerated skew),
    /// or the reason it is refused (never the token itself).
    ///
    /// # Errors
    /// Why the token is not accepted.
    pub fn verify(&self, token: &str) -> Result<SystemTime, String> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| format!("malformed token: {e}"))?;
        let mut last = String::from("no key verifies the token's algorithm");
        let mut signed_by_a_key = false;
        for k in &self.keys {
            if header.kid.is_some() && k.kid.is_some() && header.kid != k.kid {
                continue;
            }
            if !k.algorithms.contains(&header.alg) {
                if !signed_by_a_key {
                    last = format!("algorithm {:?} is not accepted", header.alg);
                }
                continue;
            }
            let mut v = Validation::new(header.alg);
            v.algorithms = vec![header.alg];
            v.leeway = self.leeway.as_secs();
            v.validate_exp = true;
            v.validate_nbf = true;
            // A configured audience or issuer must be present, not only match when it is.
            let mut required = vec!["exp"];
            if self.audience.is_some() {
                required.push("aud");
            }
            if self.issuer.is_some() {
                required.push("iss");
            }
            v.set_required_spec_claims(&required);
            match &self.audience {
                Some(aud) => v.set_audience(&[aud]),
                None => v.validate_aud = false,
            }
            if let Some(iss) = &self.issuer {
                v.set_issuer(&[iss]);
            }
            match jsonwebtoken::decode::<serde_json::Value>(token, &k.key, &v) {
                Ok(t) => {
                    // Validated: `exp` is there and a number of seconds, in the
                    // future; capped at 2106, and the leeway added only where the
                    // sum can be represented.
                    let exp = t.claims["exp"].as_f64().unwrap_or_default();
                    let exp = Duration::from_secs_f64(exp.clamp(0.0, f64::from(u32::MAX)));
                    let until = UNIX_EPOCH.checked_add(exp.saturating_add(self.leeway));
                    return Ok(until.unwrap_or(UNIX_EPOCH + exp));
                }
                // A key whose signature checked out says best why the token is
                // refused (expired, wrong audience): later keys' "invalid signature"
                // does not replace it.
                Err(e) => {
                    let bad_signature =
                        *e.kind() == jsonwebtoken::errors::ErrorKind::InvalidSignature;
                    if !(bad_signature && signed_by_a_key) {
                        last = e.to_string();
                    }
                    signed_by_a_key |= !bad_signature;
                }
            }
        }
        Err(last)
    }
}

/// When a call's bearer token stops being accepted (its `exp` plus the tolerated skew):
/// set by [`Authn`] on every call it lets through with a token. A stream outlives the
/// call that opened it, so a stream's server ends it then, unless it was handed a fresh
/// token meanwhile (workers renew theirs in band).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry(pub SystemTime);

impl Expiry {
    /// The call's, when it carried a token.
    pub fn of<T>(req: &Request<T>) -> Option<Self> {
        req.extensions().get::<Self>().copied()
    }

    /// Resolves at the expiry (on the runtime's clock, measured from the wall clock now).
    pub async fn passed(self) {
        let left = self.0.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::time::sleep(left).await;
    }
}

/// Resolves when `expiry` passes; never without one.
pub(crate) async fn expired(expiry: Option<Expiry>) {
    match expiry {
        Some(e) => e.passed().await,
        None => std::future::pending().await,
    }
}

/// Checks a token handed over on an open stream: its expiry, or why it is refused
/// (`None` when no verifier is configured: the stream has no expiry either).
pub(crate) fn refresh(
    verifier: Option<&Reloading<JwtVerifier>>,
    token: &str,
) -> Option<Result<Expiry, String>> {
    verifier.map(|v| v.load().verify(token).map(Expiry))
}

/// Refuses calls without a valid bearer token (`Unauthenticated`, which a router
/// answers 401 and does not retry); passes everything when no verifier is set.
#[derive(Debug, Clone, Default)]
pub struct Authn(pub Option<Reloading<JwtVerifier>>);

impl Interceptor for Authn {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(verifier) = &self.0 else {
            return Ok(req);
        };
        let token = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or_else(|| Status::unauthenticated("a bearer token is required"))?;
        match verifier.load().verify(token.trim()) {
            Ok(expires) => {
                let mut req = req;
                req.extensions_mut().insert(Expiry(expires));
                Ok(req)
            }
            Err(why) => {
                tracing::debug!(%why, "bearer token refused");
                Err(Status::unauthenticated(format!(
                    "bearer token refused: {why}"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};

    fn ec_key() -> EncodingKey {
        let pair = rcgen::KeyPair::generate().unwrap();
        EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap()
    }

    fn jwk(key: &EncodingKey, kid: &str, use_: &str) -> serde_json::Value {
        let mut v =
            serde_json::to_value(Jwk::from_encoding_key(key, Algorithm::ES256).unwrap()).unwrap();
        v["kid"] = kid.into();
        v["use"] = use_.into();
        v
    }

    fn token(key: &EncodingKey, kid: &str) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(kid.into());
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600;
        let claims = serde_json::json!({"aud": "valet", "iss": "test", "exp": exp});
        jsonwebtoken::encode(&header, &claims, key).unwrap()
    }

    fn write(dir: &Path, doc: &serde_json::Value) -> PathBuf {
        let path = dir.join("jwks.json");
        std::fs::write(&path, doc.to_string()).unwrap();
        path
    }

    #[test]
    fn a_jwks_verifies_with_its_signature_keys_and_skips_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let (signing, encryption) = (ec_key(), ec_key());
        let doc = serde_json::json!({"keys": [
            {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"},
            jwk(&encryption, "enc", "enc"),
            {"kty": "XYZ", "kid": "future"},
            jwk(&signing, "sig", "sig"),
        ]});
        let v = JwtVerifier::from_jwks_file(
            &write(dir.path(), &doc),
            Some("valet".into()),
            Some("test".into()),
        )
        .unwrap();
        assert_eq!(v.keys.len(), 1, "only the signature key is kept");
        v.verify(&token(&signing, "sig")).unwrap();
        assert!(v.verify(&token(&encryption, "enc")).is_err());
        assert!(
            v.verify(&token(&encryption, "sig")).is_err(),
            "kid names the key, not the signer"
        );
    }

    #[test]
    fn a_token_is_accepted_until_its_exp_plus_the_leeway() {
        let dir = tempfile::tempdir().unwrap();
        let key = ec_key();
        let path = write(
            dir.path(),
            &serde_json::json!({"keys": [jwk(&key, "k", "sig")]}),
        );
        let exp = std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600;
        let claims = serde_json::json!({"aud": "valet", "iss": "test", "exp": exp});
        let token = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &claims, &key).unwrap();
        let v =
            JwtVerifier::from_jwks_file(&path, Some("valet".into()), Some("test".into())).unwrap();
        let until = UNIX_EPOCH + Duration::from_secs(exp);
        assert_eq!(v.verify(&token), Ok(until + LEEWAY));
        let v = v.with_leeway(Duration::ZERO);
        assert_eq!(v.verify(&token), Ok(until));
    }

    /// A public key file may hold several keys (a rotation's overlap): a token
    /// signed by any of them verifies; a block that is no key refuses the file.
    #[test]
    fn every_key_of_a_public_key_file_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (
            rcgen::KeyPair::generate().unwrap(),
            rcgen::KeyPair::generate().unwrap(),
        );
        let path = dir.path().join("keys.pem");
        std::fs::write(
            &path,
            format!("{}\n{}", old.public_key_pem(), new.public_key_pem()),
        )
        .unwrap();
        let v = JwtVerifier::from_public_key_file(&path, Some("valet".into()), Some("test".into()))
            .unwrap();
        for pair in [&old, &new] {
            let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
            v.verify(&token(&key, "any")).unwrap();
        }
        assert!(
            v.verify(&token(&ec_key(), "any")).is_err(),
            "an unknown key"
        );

        std::fs::write(
            &path,
            format!(
                "{}-----BEGIN NONSENSE-----\nAAAA\n-----END NONSENSE-----\n",
                old.public_key_pem()
            ),
        )
        .unwrap();
        let e = JwtVerifier::from_public_key_file(&path, None, None).unwrap_err();
        assert!(e.why.contains("PEM block 2 of 2"), "{e}");
        std::fs::write(&path, "no pem here").unwrap();
        let e = JwtVerifier::from_public_key_file(&path, None, None).unwrap_err();
        assert!(e.why.contains("no RSA, EC or Ed25519 public key"), "{e}");
    }

    /// A JWK that names its algorithm verifies that one only (RFC 8725 §3.1), and an
    /// EC key the algorithm of its curve: a P-256 key declared ES384 is no usable key.
    #[test]
    fn a_jwk_verifies_only_the_algorithm_it_names() {
        let dir = tempfile::tempdir().unwrap();
        let (good, mislabelled) = (ec_key(), ec_key());
        let mut wrong = jwk(&mislabelled, "wrong", "sig");
        wrong["alg"] = "ES384".into();
        let mut right = jwk(&good, "right", "sig");
        right["alg"] = "ES256".into();
        let v = JwtVerifier::from_jwks_file(
            &write(dir.path(), &serde_json::json!({"keys": [wrong, right]})),
            Some("valet".into()),
            Some("test".into()),
        )
        .unwrap();
        assert_eq!(v.keys.len(), 1, "the mislabelled key is skipped");
        assert_eq!(v.keys[0].algorithms, [Algorithm::ES256]);
        v.verify(&token(&good, "right")).unwrap();
        assert!(v.verify(&token(&mislabelled, "wrong")).is_err());
    }

    /// With several keys, a token whose signature one key verified is refused for
    /// that key's reason (here: expired), not for the next key's invalid signature.
    #[test]
    fn a_refusal_names_the_reason_of_the_key_that_signed() {
        let dir = tempfile::tempdir().unwrap();
        let (signer, other) = (ec_key(), ec_key());
        let doc = serde_json::json!({"keys": [jwk(&signer, "a", "sig"), jwk(&other, "b", "sig")]});
        let v = JwtVerifier::from_jwks_file(&write(dir.path(), &doc), Some("valet".into()), None)
            .unwrap()
            .with_leeway(Duration::ZERO);
        let claims = serde_json::json!({"aud": "valet", "exp": 1_000_000});
        let expired =
            jsonwebtoken::encode(&Header::new(Algorithm::ES256), &claims, &signer).unwrap();
        let why = v.verify(&expired).unwrap_err();
        assert!(why.contains("ExpiredSignature"), "{why}");

        // A next key of another curve (which verifies another algorithm) does not
        // replace the reason either.
        let p384 = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let p384 = EncodingKey::from_ec_pem(p384.serialize_pem().as_bytes()).unwrap();
        let mut other_curve =
            serde_json::to_value(Jwk::from_encoding_key(&p384, Algorithm::ES384).unwrap()).unwrap();
        other_curve["use"] = "sig".into();
        let doc = serde_json::json!({"keys": [jwk(&signer, "a", "sig"), other_curve]});
        let v = JwtVerifier::from_jwks_file(&write(dir.path(), &doc), Some("valet".into()), None)
            .unwrap()
            .with_leeway(Duration::ZERO);
        assert_eq!(v.keys[1].algorithms, [Algorithm::ES384]);
        let why = v.verify(&expired).unwrap_err();
        assert!(why.contains("ExpiredSignature"), "{why}");
    }

    #[test]
    fn a_jwks_without_a_usable_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let doc = serde_json::json!({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]});
        let e = JwtVerifier::from_jwks_file(&write(dir.path(), &doc), None, None).unwrap_err();
        assert_eq!(e.flag, "--jwt-jwks-file");
        assert!(e.why.contains("no usable signature key"), "{e}");
        let e = JwtVerifier::from_jwks_file(&write(dir.path(), &serde_json::json!({})), None, None)
            .unwrap_err();
        assert!(e.why.contains("not a JWKS"), "{e}");
    }
}
