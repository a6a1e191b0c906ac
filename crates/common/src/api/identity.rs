//! Who a request comes from, as the apiserver records it: the User-Agent (audit logs, API
//! Priority and Fairness, `apiserver_request_total` by client) and the field manager of every
//! write (`metadata.managedFields`). Operators read both to see which controller changed an
//! object, and stowage's own conflict detector reads other controllers' managers the same way,
//! so stowage's writes must name stowage as kube-controller-manager's name it.
//!
//! The form is client-go's: `<binary>/<version> (<os>/<arch>) <project>`, with the binary's name
//! from `argv[0]` unless the binary names itself ([`set_component`]); the apiserver takes the part
//! before the first `/` as the field manager of a write that names none, and every write here
//! names one explicitly as well ([`with_field_manager`]).

use std::sync::OnceLock;

static COMPONENT: OnceLock<String> = OnceLock::new();

/// Names this process (`stowage-controller`, `stowage-agent`): its User-Agent and field manager.
/// The first call wins; clients built before it use `argv[0]`'s name.
pub fn set_component(name: &str) {
    let _ = COMPONENT.set(name.to_string());
}

/// The name requests carry: the one set, else the executable's file name (as client-go does).
pub fn component() -> String {
    if let Some(c) = COMPONENT.get() {
        return c.clone();
    }
    std::env::args_os()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
        })
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "stowage".into())
}

/// Go's names of the architectures Rust calls otherwise (what `kubectl version` users read).
fn go_arch(arch: &str) -> &str {
    match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// `stowage-controller/v0.1.0 (linux/amd64) stowage`.
pub fn user_agent() -> String {
    user_agent_of(&component())
}

fn user_agent_of(component: &str) -> String {
    format!(
        "{component}/v{} ({}/{}) stowage",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        go_arch(std::env::consts::ARCH)
    )
}

/// The apiserver's limit on a field manager's length.
const MANAGER_LIMIT: usize = 128;

/// The field manager of this process's writes: its component name, cut to the apiserver's limit.
pub fn field_manager() -> String {
    manager_of(component())
}

fn manager_of(mut m: String) -> String {
    while m.len() > MANAGER_LIMIT {
        m.pop();
    }
    m
}

/// A write (create, update, patch) that names no field manager gets `manager`; reads, deletes
/// and writes that name one (server-side apply must) are left as they are.
pub fn with_field_manager<B>(mut req: http::Request<B>, manager: &str) -> http::Request<B> {
    let writes = matches!(
        *req.method(),
        http::Method::POST | http::Method::PUT | http::Method::PATCH
    );
    if !writes || manager.is_empty() {
        return req;
    }
    let uri = req.uri();
    let query = uri.query().unwrap_or("");
    if query
        .split('&')
        .any(|kv| kv.split('=').next() == Some("fieldManager"))
    {
        return req;
    }
    let encoded: String = manager
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let path = uri.path();
    let pq = match query {
        "" => format!("{path}?fieldManager={encoded}"),
        q => format!("{path}?{q}&fieldManager={encoded}"),
    };
    let mut parts = uri.clone().into_parts();
    match pq.parse() {
        Ok(pq) => parts.path_and_query = Some(pq),
        Err(_) => return req,
    }
    if let Ok(u) = http::Uri::from_parts(parts) {
        *req.uri_mut() = u;
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: http::Method, uri: &str) -> http::Request<()> {
        http::Request::builder().method(method).uri(uri).body(()).unwrap()
    }

    #[test]
    fn the_user_agent_has_client_gos_form() {
        let ua = user_agent_of("stowage-controller");
        let (name, rest) = ua.split_once('/').unwrap();
        assert_eq!(
            name, "stowage-controller",
            "the apiserver's manager is the part before '/'"
        );
        assert!(
            rest.starts_with(&format!("v{} (", env!("CARGO_PKG_VERSION"))),
            "{ua}"
        );
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        assert!(ua.contains(" (linux/amd64) "), "{ua}");
    }

    #[test]
    fn every_write_names_the_manager_and_nothing_else_changes() {
        let m = "stowage-controller";
        for method in [http::Method::POST, http::Method::PUT, http::Method::PATCH] {
            let r = with_field_manager(req(method.clone(), "/api/v1/persistentvolumes/pv-1"), m);
            assert_eq!(
                r.uri().to_string(),
                "/api/v1/persistentvolumes/pv-1?fieldManager=stowage-controller",
                "{method}"
            );
        }
        let r = with_field_manager(
            req(
                http::Method::PATCH,
                "https://h:6443/api/v1/nodes/n/status?dryRun=All",
            ),
            m,
        );
        assert_eq!(
            r.uri().to_string(),
            "https://h:6443/api/v1/nodes/n/status?dryRun=All&fieldManager=stowage-controller"
        );
        let apply = "/apis/storage.k8s.io/v1/volumeattachments/a?fieldManager=other&force=true";
        assert_eq!(
            with_field_manager(req(http::Method::PATCH, apply), m)
                .uri()
                .to_string(),
            apply,
            "a write that names its manager keeps it"
        );
        for method in [http::Method::GET, http::Method::DELETE] {
            let r = with_field_manager(req(method, "/api/v1/pods?watch=true"), m);
            assert_eq!(r.uri().to_string(), "/api/v1/pods?watch=true");
        }
        let r = with_field_manager(req(http::Method::POST, "/api/v1/namespaces"), "a b/c");
        assert_eq!(r.uri().to_string(), "/api/v1/namespaces?fieldManager=a%20b%2Fc");
    }

    #[test]
    fn the_manager_fits_the_apiservers_limit() {
        assert_eq!(manager_of("x".repeat(300)).len(), MANAGER_LIMIT);
        assert_eq!(manager_of("stowage-agent".into()), "stowage-agent");
    }
}
