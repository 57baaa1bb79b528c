//! Generates the `ateapi.Control` bindings with the protoc that `protoc-bin-vendored`
//! ships, so a fresh machine needs no system protoc.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    // It carries a bearer token: its `Debug` (in `lib.rs`) leaves the token out.
    config.skip_debug(["valet.worker.Renew"]);

    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("ateapi_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                PathBuf::from("proto/ateapi.proto"),
                PathBuf::from("proto/worker.proto"),
                PathBuf::from("proto/leases.proto"),
            ],
            &[PathBuf::from("proto"), well_known],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
