//! Generates the CSI v1 gRPC code from `csi.proto` of the pinned CSI spec Go module.
//!
//! The proto is not copied into the repository: it comes from the Go module cache, at the version
//! `e2e/csi/go.mod` pins (the module csi-sanity is built with), found with `go mod download
//! -json`; or from `STOWAGE_CSI_PROTO` when the build has no Go toolchain.

use std::path::PathBuf;
use std::process::Command;

/// The CSI spec module; its version is the one `e2e/csi/go.mod` requires.
const SPEC_MODULE: &str = "github.com/container-storage-interface/spec";

fn main() {
    println!("cargo:rerun-if-env-changed=STOWAGE_CSI_PROTO");
    let proto = match std::env::var_os("STOWAGE_CSI_PROTO") {
        Some(p) => PathBuf::from(p),
        None => spec_dir().join("csi.proto"),
    };
    println!("cargo:rerun-if-changed={}", proto.display());
    let include = proto.parent().expect("csi.proto has a parent dir").to_path_buf();
    // protox compiles in Rust and carries the well-known types csi.proto imports.
    let fds = protox::compile([&proto], [&include])
        .unwrap_or_else(|e| panic!("cannot compile {}: {e}", proto.display()));
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("generate CSI gRPC code");
}

fn spec_dir() -> PathBuf {
    let pins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../e2e/csi");
    println!("cargo:rerun-if-changed={}", pins.join("go.mod").display());
    let out = Command::new("go")
        .args(["mod", "download", "-json", SPEC_MODULE])
        .env("GO111MODULE", "on")
        .current_dir(&pins)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `go mod download {SPEC_MODULE}` (set STOWAGE_CSI_PROTO to a csi.proto instead): {e}"));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "`go mod download {SPEC_MODULE}` printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    if let Some(err) = info.get("Error").and_then(|e| e.as_str()) {
        panic!("`go mod download {SPEC_MODULE}`: {err}");
    }
    PathBuf::from(
        info["Dir"]
            .as_str()
            .expect("go mod download -json names the module dir"),
    )
}
