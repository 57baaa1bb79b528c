//! `valet envoy-bootstrap`: an Envoy (v1.36+: ext_proc `status_on_error`) bootstrap wired to the router's ext_proc
//! server, derived from the same resolved configuration as the router, so Envoy's
//! timeouts and circuit breaker always agree with the parking budget and lot.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use valet_router::RouterConfig;

use crate::yaml::to_yaml;

/// Name of the ext_proc cluster (as upstream).
pub const EXTPROC_CLUSTER: &str = "ate-cluster";
/// Name of the dynamic forward proxy cluster.
pub const DFP_CLUSTER: &str = "dynamic_forward_proxy_cluster";
/// Shortest stream and route idle timeout.
const MIN_IDLE: Duration = Duration::from_secs(300);

/// Where Envoy listens, besides what the router's configuration says.
#[derive(Debug, Clone)]
pub struct EnvoyListeners {
    /// Envoy's HTTP listener.
    pub http: SocketAddr,
    /// Envoy's admin interface.
    pub admin: SocketAddr,
    /// Envoy's HTTPS listener, when on.
    pub https: Option<EnvoyHttps>,
}

/// Envoy's HTTPS listener: the same rules as the router's own HTTPS ingress.
#[derive(Debug, Clone)]
pub struct EnvoyHttps {
    /// Its address.
    pub addr: SocketAddr,
    /// PEM certificate chain and key files (Envoy reads them itself).
    pub cert_file: std::path::PathBuf,
    /// The key of `cert_file`.
    pub key_file: std::path::PathBuf,
    /// PEM CA client certificates must chain to (then required).
    pub client_ca_file: Option<std::path::PathBuf>,
    /// SPIFFE IDs admitted: exact, or (ending in `/`) as a prefix of whole segments.
    pub allowed_spiffe_ids: Vec<String>,
}

/// One SPIFFE path segment in RE2: not empty, not `.`, not `..`.
const SEGMENT: &str = r"(?:[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)";

/// `s` with every RE2 metacharacter escaped.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The DownstreamTlsContext of the HTTPS listener. Envoy cannot require exactly one
/// URI SAN; it admits a certificate with any URI SAN that matches.
fn downstream_tls(h: &EnvoyHttps) -> Value {
    let file = |p: &std::path::Path| json!({ "filename": p.display().to_string() });
    let mut common = json!({
        "alpn_protocols": ["h2", "http/1.1"],
        "tls_certificates": [{
            "certificate_chain": file(&h.cert_file),
            "private_key": file(&h.key_file),
        }],
    });
    if let Some(ca) = &h.client_ca_file {
        let mut validation = json!({ "trusted_ca": file(ca) });
        if !h.allowed_spiffe_ids.is_empty() {
            let matchers: Vec<Value> = h
                .allowed_spiffe_ids
                .iter()
                .map(|id| {
                    // An entry ending in `/` admits whole segments after it, as the
                    // router does: not the entry itself, no empty segment, no `.` or
                    // `..` segment (RE2 has no look-ahead: spelled out).
                    let m = if id.ends_with('/') {
                        json!({ "safe_regex": { "regex": format!("^{}{SEGMENT}(/{SEGMENT})*$", regex_escape(id)) } })
                    } else {
                        json!({ "exact": id })
                    };
                    json!({ "san_type": "URI", "matcher": m })
                })
                .collect();
            validation["match_typed_subject_alt_names"] = Value::Array(matchers);
        }
        common["validation_context"] = validation;
    }
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": h.client_ca_file.is_some(),
            "common_tls_context": common,
        }
    })
}

/// Why no bootstrap can be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapError(pub String);

/// The longest ext_proc `message_timeout` Envoy accepts.
const MAX_MESSAGE_TIMEOUT: Duration = Duration::from_secs(3600);

/// Envoy's own circuit-breaker thresholds, the least the workers' cluster gets.
const ENVOY_DEFAULT_BREAKER: u32 = 1024;

impl std::fmt::Display for BootstrapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn secs(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    }
}

fn socket(addr: SocketAddr) -> Value {
    json!({ "socket_address": { "address": addr.ip().to_string(), "port_value": addr.port() } })
}

/// The bootstrap as a structured value.
///
/// # Errors
/// When the router has no ext_proc listener Envoy could reach.
pub fn bootstrap(config: &RouterConfig, envoy: EnvoyListeners) -> Result<Value, BootstrapError> {
    let mut extproc = config.extproc_listen().ok_or_else(|| {
        BootstrapError("invalid configuration: --extproc-listen is empty: Envoy needs the router's ext_proc server".into())
    })?;
    if extproc.port() == 0 {
        return Err(BootstrapError(format!(
            "invalid configuration: --extproc-listen={extproc}: Envoy needs a fixed port"
        )));
    }
    if extproc.ip().is_unspecified() {
        extproc.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let decision = config.decision_timeout();
    // Envoy refuses an ext_proc message_timeout past an hour (its proto's bound).
    if decision > MAX_MESSAGE_TIMEOUT {
        return Err(BootstrapError(format!(
            "invalid configuration: --parked-request-budget={}: Envoy's ext_proc message_timeout (budget + 5s) can be at most {}, so the budget at most {}",
            secs(config.parking().budget()),
            secs(MAX_MESSAGE_TIMEOUT),
            secs(MAX_MESSAGE_TIMEOUT - (decision - config.parking().budget())),
        )));
    }
    let idle = MIN_IDLE.max(decision * 2);
    let dns_cache = json!({
        "name": "dynamic_forward_proxy_cache_config",
        "dns_lookup_family": "V4_ONLY",
        "typed_dns_resolver_config": {
            "name": "envoy.network.dns_resolver.getaddrinfo",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig"
            }
        }
    });
    let max_requests = config.extproc_max_requests();
    let worker_breaker = max_requests.max(ENVOY_DEFAULT_BREAKER);
    let mut doc = json!({
        "admin": { "address": socket(envoy.admin) },
        "static_resources": {
            "listeners": [{
                "name": "ingress_http_listener",
                "address": socket(envoy.http),
                "filter_chains": [{
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "ingress_http",
                            // An edge proxy: the peer is the client (appended to
                            // x-forwarded-for), and a client's own x-envoy-* headers
                            // (retry policies among them) are not trusted.
                            "use_remote_address": true,
                            "generate_request_id": true,
                            "stream_idle_timeout": secs(idle),
                            "upgrade_configs": [{ "upgrade_type": "websocket" }],
                            // A worker Envoy cannot reach (connection refused, no
                            // host), or that closes or resets the connection before it
                            // answers (its process died mid-request), gets the
                            // router's own verdict, as the built-in data plane answers
                            // it, not Envoy's "upstream connect error or
                            // disconnect/reset before headers" text. (A local reply
                            // only: an answer already begun is not replaced.)
                            "local_reply_config": {
                                "mappers": [{
                                    "filter": {
                                        "response_flag_filter": { "flags": ["UF", "UH", "URX", "UC", "UR"] }
                                    },
                                    "status_code": 502,
                                    "body_format_override": {
                                        "text_format_source": {
                                            "inline_string": "actor %REQ(x-actor-ref)% unreachable"
                                        },
                                        "content_type": "text/plain; charset=utf-8",
                                    }
                                }]
                            },
                            "route_config": {
                                "name": "substrate_routes",
                                "virtual_hosts": [{
                                    "name": "local_service",
                                    "domains": ["*"],
                                    "routes": [{
                                        "match": { "prefix": "/" },
                                        "route": {
                                            "cluster": DFP_CLUSTER,
                                            // The decision is bounded by message_timeout; the
                                            // actor's answer (streams, WebSockets) is not.
                                            "timeout": "0s",
                                            "idle_timeout": secs(idle),
                                        }
                                    }]
                                }]
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.ext_proc",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                                        "grpc_service": {
                                            "envoy_grpc": { "cluster_name": EXTPROC_CLUSTER },
                                            "timeout": secs(decision),
                                        },
                                        "failure_mode_allow": false,
                                        // A stream the router ends with an error (it
                                        // shuts down) is a 503, as parking.md's verdict
                                        // for a router shutting down, not Envoy's 500.
                                        // (Envoy 1.36 added this field; older versions
                                        // refuse the whole bootstrap.)
                                        "status_on_error": { "code": 503 },
                                        "message_timeout": secs(decision),
                                        "processing_mode": {
                                            "request_header_mode": "SEND",
                                            "response_header_mode": "SKIP",
                                            "request_body_mode": "NONE",
                                            "response_body_mode": "NONE",
                                            "request_trailer_mode": "SKIP",
                                            "response_trailer_mode": "SKIP",
                                        },
                                        "mutation_rules": { "allow_all_routing": true },
                                    }
                                },
                                {
                                    "name": "envoy.filters.http.dynamic_forward_proxy",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_forward_proxy.v3.FilterConfig",
                                        "dns_cache_config": dns_cache.clone(),
                                    }
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    }
                                }
                            ]
                        }
                    }]
                }]
            }],
            "clusters": [
                {
                    "name": EXTPROC_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "0.25s",
                    "lb_policy": "ROUND_ROBIN",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": { "http2_protocol_options": {} }
                        }
                    },
                    // Every parked request holds one ext_proc stream: the breaker fits the
                    // lot with an equal share left for requests to running actors.
                    "circuit_breakers": {
                        "thresholds": [{
                            "priority": "DEFAULT",
                            "max_requests": max_requests,
                            "max_pending_requests": max_requests,
                        }]
                    },
                    "load_assignment": {
                        "cluster_name": EXTPROC_CLUSTER,
                        "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": socket(extproc) } }] }]
                    }
                },
                {
                    "name": DFP_CLUSTER,
                    "lb_policy": "CLUSTER_PROVIDED",
                    // Envoy's default breakers (1024 each) would answer its own 503
                    // (no verdict text, no Retry-After) when a freed worker routes a
                    // lot's worth of parked requests at once beside live traffic; a
                    // smaller ext_proc breaker never lowers them (each proxied request
                    // or open WebSocket holds one of these).
                    "circuit_breakers": {
                        "thresholds": [{
                            "priority": "DEFAULT",
                            "max_connections": worker_breaker,
                            "max_requests": worker_breaker,
                            "max_pending_requests": worker_breaker,
                        }]
                    },
                    // Idle connections to workers are let go well before a worker
                    // closes them itself (WORKER_APP_HEADER_TIMEOUT): Envoy's default
                    // (1 h) would send requests on connections the worker is closing.
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "common_http_protocol_options": {
                                "idle_timeout": secs(valet_proto::WORKER_POOL_IDLE),
                            },
                            "explicit_http_config": { "http_protocol_options": {} },
                        }
                    },
                    "cluster_type": {
                        "name": "envoy.clusters.dynamic_forward_proxy",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.clusters.dynamic_forward_proxy.v3.ClusterConfig",
                            "dns_cache_config": dns_cache,
                        }
                    }
                }
            ]
        }
    });
    if let Some(h) = &envoy.https {
        // The HTTP listener's filters, behind TLS.
        let mut https = doc["static_resources"]["listeners"][0].clone();
        https["name"] = json!("ingress_https_listener");
        https["address"] = socket(h.addr);
        https["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"] =
            json!("ingress_https");
        https["filter_chains"][0]["transport_socket"] = downstream_tls(h);
        if let Some(listeners) = doc["static_resources"]["listeners"].as_array_mut() {
            listeners.push(https);
        }
    }
    Ok(doc)
}

/// The bootstrap as YAML, with a header saying what it was derived from.
///
/// # Errors
/// As [`bootstrap`].
pub fn bootstrap_yaml(
    config: &RouterConfig,
    envoy: EnvoyListeners,
) -> Result<String, BootstrapError> {
    let doc = bootstrap(config, envoy)?;
    Ok(format!(
        "# Envoy bootstrap generated by valet envoy-bootstrap (Envoy v1.36 or later).\n\
         # budget {}, lot {}, ext_proc message_timeout {}, ext_proc max_requests {}{}\n{}",
        secs(config.parking().budget()),
        config.parking().max_parked(),
        secs(config.decision_timeout()),
        config.extproc_max_requests(),
        if config.extproc_max_requests_derived() {
            " (derived)"
        } else {
            ""
        },
        to_yaml(&doc)
    ))
}
