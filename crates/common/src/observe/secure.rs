//! The secure port: `/metrics`, `/healthz`, `/readyz` over HTTPS with delegated authentication
//! and authorization, as kube-controller-manager serves them on 10257.
//!
//! A request's bearer token is checked with a TokenReview and the user it names with a
//! SubjectAccessReview for the request's path and verb (`get /metrics`), so the apiserver's RBAC
//! decides who may scrape: the same ClusterRole with `nonResourceURLs: ["/metrics"]` that lets
//! Prometheus scrape kube-controller-manager lets it scrape stowage. Paths in
//! `--authorization-always-allow-paths` (probes) need neither. Both answers are cached briefly,
//! as the apiserver's own delegating authenticator does, so a scrape every few seconds costs the
//! apiserver one review per interval, not one per request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::observe::serve::Health;

/// How long an allowed or denied review is reused (the apiserver's delegating authenticator
/// caches successes 10 s; denials are kept as briefly so a fixed RBAC rule shows quickly).
const CACHE_TTL: Duration = Duration::from_secs(10);
/// Reviews remembered at once; beyond it the cache starts over (bounded memory whatever the
/// tokens sent).
const CACHE_MAX: usize = 1024;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The secure-serving flags, named as kube-controller-manager's.
#[derive(Debug, Clone, clap::Args)]
pub struct SecureArgs {
    /// Serve /metrics, /healthz and /readyz over HTTPS on this port, with delegated
    /// authentication and authorization (kube-controller-manager uses 10257); 0 turns it off.
    #[arg(long, default_value_t = 0)]
    pub secure_port: u16,
    /// The address the secure port listens on.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: std::net::IpAddr,
    /// PEM certificate (chain) for the secure port; without it a self-signed one is made at start.
    #[arg(long, requires = "tls_private_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, requires = "tls_cert_file")]
    pub tls_private_key_file: Option<PathBuf>,
    /// Paths served without authentication or authorization (probes).
    #[arg(long, value_delimiter = ',', default_value = "/healthz,/readyz,/livez")]
    pub authorization_always_allow_paths: Vec<String>,
    /// kubeconfig for the TokenReviews; without it the binary's own API connection is used.
    #[arg(long)]
    pub authentication_kubeconfig: Option<PathBuf>,
    /// kubeconfig for the SubjectAccessReviews; without it the binary's own API connection is used.
    #[arg(long)]
    pub authorization_kubeconfig: Option<PathBuf>,
}

/// Who a token belongs to, as the TokenReview said.
#[derive(Debug, Clone, PartialEq, Eq)]
struct User {
    name: String,
    uid: Option<String>,
    groups: Vec<String>,
}

/// Answers reused for [`CACHE_TTL`], keyed by what was asked.
type Cache<K, V> = Arc<Mutex<HashMap<K, (Instant, V)>>>;

#[derive(Clone)]
struct Gate {
    authn: Client,
    authz: Client,
    allow: Arc<Vec<String>>,
    /// By the token's SHA-256 (the token itself is not kept).
    tokens: Cache<[u8; 32], Option<User>>,
    /// By user, verb and path.
    decisions: Cache<(String, String, String), bool>,
}

fn cached<K: std::hash::Hash + Eq, V: Clone>(map: &Mutex<HashMap<K, (Instant, V)>>, key: &K) -> Option<V> {
    let map = map.lock().unwrap_or_else(|e| e.into_inner());
    map.get(key)
        .filter(|(at, _)| at.elapsed() < CACHE_TTL)
        .map(|(_, v)| v.clone())
}

fn remember<K: std::hash::Hash + Eq, V>(map: &Mutex<HashMap<K, (Instant, V)>>, key: K, value: V) {
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if map.len() >= CACHE_MAX {
        map.clear();
    }
    map.insert(key, (Instant::now(), value));
}

impl Gate {
    async fn user(&self, token: &str) -> Result<Option<User>, kube::Error> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(u) = cached(&self.tokens, &key) {
            return Ok(u);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.into(),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<TokenReview>::all(self.authn.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let user = answer
            .status
            .filter(|s| s.authenticated == Some(true))
            .and_then(|s| s.user)
            .map(|u| User {
                name: u.username.unwrap_or_default(),
                uid: u.uid,
                groups: u.groups.unwrap_or_default(),
            });
        remember(&self.tokens, key, user.clone());
        Ok(user)
    }

    async fn allowed(&self, user: &User, verb: &str, path: &str) -> Result<bool, kube::Error> {
        let key = (user.name.clone(), verb.to_string(), path.to_string());
        if let Some(a) = cached(&self.decisions, &key) {
            return Ok(a);
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: user.uid.clone(),
                groups: Some(user.groups.clone()),
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.into()),
                    verb: Some(verb.into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<SubjectAccessReview>::all(self.authz.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let allowed = answer.status.is_some_and(|s| s.allowed);
        remember(&self.decisions, key, allowed);
        Ok(allowed)
    }
}

/// The verb RBAC uses for a non-resource request's method.
fn verb(method: &axum::http::Method) -> &'static str {
    match *method {
        axum::http::Method::POST => "post",
        axum::http::Method::PUT => "put",
        axum::http::Method::PATCH => "patch",
        axum::http::Method::DELETE => "delete",
        axum::http::Method::HEAD => "head",
        _ => "get",
    }
}

fn bearer(req: &Request) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty()).then(|| token.trim())
}

async fn guard(State(gate): State<Gate>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if gate.allow.iter().any(|p| p == &path) {
        return next.run(req).await;
    }
    let Some(token) = bearer(&req) else {
        return (StatusCode::UNAUTHORIZED, "Unauthorized").into_response();
    };
    let user = match gate.user(token).await {
        Ok(Some(u)) => u,
        Ok(None) => return (StatusCode::UNAUTHORIZED, "Unauthorized").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "TokenReview failed");
            return (StatusCode::INTERNAL_SERVER_ERROR, "authentication unavailable").into_response();
        }
    };
    let verb = verb(req.method());
    match gate.allowed(&user, verb, &path).await {
        Ok(true) => next.run(req).await,
        Ok(false) => (
            StatusCode::FORBIDDEN,
            format!("forbidden: user \"{}\" cannot {verb} path \"{path}\"", user.name),
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "SubjectAccessReview failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "authorization unavailable").into_response()
        }
    }
}

/// The certificate and key: the files given, or a self-signed pair for this host (scrapers then
/// skip verification, as they do for kube-controller-manager's own self-signed certificate).
fn certificate(args: &SecureArgs) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    if let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_private_key_file) {
        let certs = CertificateDer::pem_file_iter(cert)
            .with_context(|| format!("cannot read --tls-cert-file {}", cert.display()))?
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("--tls-cert-file {} is not PEM certificates", cert.display()))?;
        let key = PrivateKeyDer::from_pem_file(key).with_context(|| {
            format!(
                "--tls-private-key-file {} is not a PEM private key",
                key.display()
            )
        })?;
        return Ok((certs, key));
    }
    let host = std::env::var("POD_NAME")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "localhost".into());
    let signed = rcgen::generate_simple_self_signed(vec![host, "localhost".into()])
        .context("self-signed certificate")?;
    let key = PrivateKeyDer::try_from(signed.signing_key.serialize_der())
        .map_err(|e| anyhow::anyhow!("self-signed key: {e}"))?;
    Ok((vec![signed.cert.der().clone()], key))
}

/// The clients the secure port asks the apiserver with: TokenReviews (`authn`) and
/// SubjectAccessReviews (`authz`). The binary builds them (`--authentication-kubeconfig`,
/// `--authorization-kubeconfig`, or its own client), so this module builds no client.
pub struct Reviews {
    pub authn: Client,
    pub authz: Client,
}

/// A listener whose connections have finished their TLS handshake. Handshakes run in tasks of
/// their own, so a client that stalls in one never holds up the others.
struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<tokio::net::TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The acceptor ended (it never does while the process runs): serve nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

fn tls_listener(tcp: TcpListener, acceptor: TlsAcceptor) -> anyhow::Result<TlsListener> {
    let local = tcp.local_addr()?;
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match tcp.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::debug!(error = %e, "secure port: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send((tls, peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "secure port: TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "secure port: TLS handshake timed out"),
                }
            });
        }
    });
    Ok(TlsListener { ready: rx, local })
}

/// Binds the secure port (a taken port fails start-up) and serves in the background; returns the
/// bound address, or `None` when --secure-port is 0.
pub async fn spawn(
    args: &SecureArgs,
    health: Health,
    reviews: Reviews,
) -> anyhow::Result<Option<SocketAddr>> {
    if args.secure_port == 0 {
        return Ok(None);
    }
    let (certs, key) = certificate(args)?;
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .context("TLS certificate and key do not match")?;
    let addr = SocketAddr::new(args.bind_address, args.secure_port);
    let tcp = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr} (--secure-port): {e}"))?;
    let listener = tls_listener(tcp, TlsAcceptor::from(Arc::new(config)))?;
    let bound = axum::serve::Listener::local_addr(&listener)?;
    let gate = Gate {
        authn: reviews.authn,
        authz: reviews.authz,
        allow: Arc::new(args.authorization_always_allow_paths.clone()),
        tokens: Arc::default(),
        decisions: Arc::default(),
    };
    let app: Router =
        crate::observe::serve::router(health).layer(axum::middleware::from_fn_with_state(gate, guard));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "secure server stopped");
        }
    });
    tracing::info!(%bound, "serving /metrics, /healthz, /readyz over HTTPS with delegated authentication and authorization");
    Ok(Some(bound))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_case_insensitively_and_never_empty() {
        let req = |v: &str| {
            axum::http::Request::builder()
                .header(header::AUTHORIZATION, v)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        assert_eq!(bearer(&req("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&req("bearer abc")), Some("abc"));
        assert_eq!(bearer(&req("Basic abc")), None);
        assert_eq!(bearer(&req("Bearer  ")), None);
    }

    #[test]
    fn a_self_signed_certificate_is_made_without_files() {
        let args = SecureArgs {
            secure_port: 1,
            bind_address: [127, 0, 0, 1].into(),
            tls_cert_file: None,
            tls_private_key_file: None,
            authorization_always_allow_paths: vec![],
            authentication_kubeconfig: None,
            authorization_kubeconfig: None,
        };
        let (certs, _) = certificate(&args).unwrap();
        assert_eq!(certs.len(), 1);
    }
}
