//! `valet envoy-bootstrap`.

use std::process::ExitCode;

use valet_extproc::bootstrap::{EnvoyHttps, EnvoyListeners, bootstrap_yaml};

use crate::EXIT_CONFIG;
use crate::cli::EnvoyBootstrapArgs;

pub(crate) fn run(args: &EnvoyBootstrapArgs) -> ExitCode {
    let config = match args.router.resolve() {
        Ok(c) => c,
        Err(e) => {
            say_usage!("valet envoy-bootstrap: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let https = match envoy_https(args) {
        Ok(h) => h,
        Err(e) => {
            say_usage!("valet envoy-bootstrap: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let listeners = EnvoyListeners {
        http: args.envoy_listen,
        admin: args.envoy_admin,
        https,
    };
    match bootstrap_yaml(&config, listeners) {
        Ok(yaml) => {
            say_raw!("{yaml}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            say_usage!("valet envoy-bootstrap: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// Envoy's HTTPS listener from the ingress flags, checked as the router checks them
/// (but Envoy needs certificate files: it cannot use a generated one).
fn envoy_https(args: &EnvoyBootstrapArgs) -> Result<Option<EnvoyHttps>, String> {
    let i = &args.ingress;
    if i.listen_https.is_empty() {
        // Ingress flags without a listener are still an error.
        return i.resolve().map(|_| None);
    }
    let (Some(cert_file), Some(key_file)) = (&i.ingress_tls_cert_file, &i.ingress_tls_key_file)
    else {
        return Err(
            "invalid configuration: --ingress-tls-cert-file: Envoy's HTTPS listener needs certificate files".into(),
        );
    };
    // The same checks as the router's own HTTPS listener (files readable, allowlist).
    let Some((addr, _)) = i.resolve()? else {
        return Ok(None);
    };
    let allowed_spiffe_ids = match &i.ingress_allowed_spiffe_ids {
        Some(ids) => ids
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect(),
        None => Vec::new(),
    };
    Ok(Some(EnvoyHttps {
        addr,
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        client_ca_file: i.ingress_client_ca_file.clone(),
        allowed_spiffe_ids,
    }))
}
