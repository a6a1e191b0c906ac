//! Generates the gRPC code of the CSI v1 services (`csi.proto` of the CSI spec Go module) and of
//! the kubelet's plugin registration (`pluginregistration/v1/api.proto` of `k8s.io/kubelet`).
//!
//! The protos are not copied into the repository: they come from the Go module cache, at the
//! versions `e2e/csi/go.mod` pins (the modules csi-sanity and the kubelet are built with), found
//! with `go mod download -json`; or from `STOWAGE_CSI_PROTO` and `STOWAGE_REGISTRATION_PROTO`
//! when the build has no Go toolchain.

use std::path::PathBuf;
use std::process::Command;

/// The modules; their versions are the ones `e2e/csi/go.mod` requires.
const SPEC_MODULE: &str = "github.com/container-storage-interface/spec";
const KUBELET_MODULE: &str = "k8s.io/kubelet";

fn main() {
    let csi = proto("STOWAGE_CSI_PROTO", SPEC_MODULE, "csi.proto");
    let registration = proto(
        "STOWAGE_REGISTRATION_PROTO",
        KUBELET_MODULE,
        "pkg/apis/pluginregistration/v1/api.proto",
    );
    let dirs = [&csi, &registration].map(|p| p.parent().expect("a proto has a parent dir").to_path_buf());
    // protox compiles in Rust and carries the well-known types csi.proto imports.
    let fds = protox::compile([&csi, &registration], dirs).unwrap_or_else(|e| {
        panic!(
            "cannot compile {} and {}: {e}",
            csi.display(),
            registration.display()
        )
    });
    // `csi_methods.rs`: the full gRPC path of every method of every CSI v1 service, so the RPC
    // metrics label only methods the spec defines (a client's made-up path adds no series).
    let mut methods = Vec::new();
    for file in fds.file.iter().filter(|f| f.package() == "csi.v1") {
        for service in &file.service {
            for method in &service.method {
                methods.push(format!("/csi.v1.{}/{}", service.name(), method.name()));
            }
        }
    }
    assert!(!methods.is_empty(), "csi.proto defines no csi.v1 service");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(
        out.join("csi_methods.rs"),
        format!("pub const METHODS: &[&str] = &{methods:?};\n"),
    )
    .expect("write csi_methods.rs");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("generate gRPC code");
}

fn proto(env: &str, module: &str, file: &str) -> PathBuf {
    println!("cargo:rerun-if-env-changed={env}");
    let p = match std::env::var_os(env) {
        Some(p) => PathBuf::from(p),
        None => module_dir(module).join(file),
    };
    println!("cargo:rerun-if-changed={}", p.display());
    p
}

fn module_dir(module: &str) -> PathBuf {
    let pins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../e2e/csi");
    println!("cargo:rerun-if-changed={}", pins.join("go.mod").display());
    let out = Command::new("go")
        .args(["mod", "download", "-json", module])
        .env("GO111MODULE", "on")
        .current_dir(&pins)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `go mod download {module}` (set STOWAGE_CSI_PROTO / STOWAGE_REGISTRATION_PROTO instead): {e}")
        });
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "`go mod download {module}` printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    if let Some(err) = info.get("Error").and_then(|e| e.as_str()) {
        panic!("`go mod download {module}`: {err}");
    }
    PathBuf::from(
        info["Dir"]
            .as_str()
            .expect("go mod download -json names the module dir"),
    )
}
