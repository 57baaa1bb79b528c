//! Generated bindings of the control-plane API `ateapi.Control`, with valet's
//! extensions (field numbers from 1001 up), built from `proto/ateapi.proto` at
//! build time. Envoy's ext_proc types come from `envoy-types` in the ext_proc crate.

#![forbid(unsafe_code)]

/// The `ateapi` protobuf package: messages, the `Control` client and server.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
pub mod ateapi {
    tonic::include_proto!("ateapi");

    /// The encoded `FileDescriptorSet` of `ateapi.proto`, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ateapi_descriptor");
}

/// `valet.worker`: how reference workers attach to the reference control plane.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
pub mod worker {
    tonic::include_proto!("valet.worker");

    /// Never the token: whether one is carried.
    impl std::fmt::Debug for Renew {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Renew")
                .field("seq", &self.seq)
                .field("bearer_token", &!self.bearer_token.is_empty())
                .finish()
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_renewal_never_prints_its_token() {
            let r = super::Renew {
                seq: 7,
                bearer_token: "secret.jwt.value".into(),
            };
            let printed = format!(
                "{r:?} {:?}",
                super::WorkerEvent {
                    event: Some(super::worker_event::Event::Renew(r.clone())),
                }
            );
            assert!(!printed.contains("secret"), "{printed}");
            assert!(printed.contains("seq: 7"), "{printed}");
        }
    }
}

/// `valet.leases`: route leases between routers and the control plane.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
pub mod leases {
    tonic::include_proto!("valet.leases");
}

pub mod auth;
pub mod hop;
pub mod reload;
pub mod units;

/// How long a worker's app keeps a connection that sends no request head, an idle
/// keep-alive connection between requests included (then it closes it, silently).
pub const WORKER_APP_HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);

/// How long the clients of a worker's app (the built-in data plane's pool, Envoy's
/// worker cluster) keep an idle connection to it: well below
/// [`WORKER_APP_HEADER_TIMEOUT`], so that a client never sends a request on a
/// connection the worker is closing that moment (it would fail as a 502).
pub const WORKER_POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// `e` and every error under it, joined by `": "`: a transport error's own text is
/// often only `transport error`, its cause (a refused connection, an unknown issuer)
/// is in its sources.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        // Some errors repeat their source's text in their own.
        if !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_chain_names_every_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(super::error_chain(&Outer(io)), "transport error: refused");
    }
}
