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
}

/// `valet.leases`: route leases between routers and the control plane.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
pub mod leases {
    tonic::include_proto!("valet.leases");
}

pub mod auth;
pub mod reload;
