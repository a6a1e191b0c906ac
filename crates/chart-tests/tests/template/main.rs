//! `helm lint` and `helm template` of charts/stowage, with the defaults and with every optional
//! feature on, plus the values the chart must refuse. No cluster needed. The rendering helpers are
//! here; the cases by subject: `objects.rs` (what the defaults and every option render),
//! `agent.rs` (the agent's two modes and the CSIDriver), `refused.rs` (values the chart refuses),
//! `helm_test.rs` (the `helm test` hooks), `rbac.rs` (the guide's RBAC tables against the rendered
//! Roles and bindings).

use stowage_chart_tests::{Helm, chart_dir, document, kinds_and_names};

mod agent;
mod helm_test;
mod objects;
mod rbac;
mod refused;

/// The entry named `name` of the first list `section` (e.g. `volumeMounts`, `volumes`) of a
/// rendered document: its lines after `- name: <name>`, trimmed, without comments. `None` when
/// the section has no such entry.
pub(crate) fn list_entry(doc: &str, section: &str, name: &str) -> Option<Vec<String>> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let significant = |l: &&str| !l.trim().is_empty() && !l.trim_start().starts_with('#');
    let mut lines = doc.lines().skip_while(|l| l.trim() != format!("{section}:"));
    let section_indent = indent(lines.next()?);
    let mut lines = lines.filter(significant);
    while let Some(l) = lines.next() {
        if indent(l) <= section_indent {
            return None;
        }
        if l.trim() == format!("- name: {name}") {
            let entry_indent = indent(l);
            return Some(
                lines
                    .take_while(|l| indent(l) > entry_indent)
                    .map(|l| l.trim().to_string())
                    .collect(),
            );
        }
    }
    None
}

/// Asserts the entry `name` of `section` in `doc` is exactly `want`.
#[track_caller]
pub(crate) fn assert_entry(doc: &str, section: &str, name: &str, want: &[&str]) {
    let got = list_entry(doc, section, name);
    assert_eq!(
        got.as_deref(),
        Some(&want.iter().map(|w| w.to_string()).collect::<Vec<_>>()[..]),
        "{section} entry {name}:\n{doc}"
    );
}

pub(crate) async fn render(helm: &Helm, extra: &[&str]) -> Result<String, String> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        "st",
        chart.to_str().unwrap(),
        "--namespace",
        "stowage-system",
    ];
    args.extend_from_slice(extra);
    helm.run(&args).await
}

pub(crate) fn doc<'a>(manifest: &'a str, kind: &str, name: &str) -> &'a str {
    document(manifest, kind, name).unwrap_or_else(|| {
        panic!(
            "no {kind}/{name} in the manifest; it has {:?}",
            kinds_and_names(manifest)
        )
    })
}

/// Asserts that `doc` (described as `what` in the failure) contains every one of `needles`.
#[track_caller]
pub(crate) fn assert_has(doc: &str, what: &str, needles: &[&str]) {
    for needle in needles {
        assert!(doc.contains(needle), "{what} lacks {needle:?}:\n{doc}");
    }
}

/// `pod` runs in the host's network namespace with cluster DNS, and its container reaches the
/// apiserver at `host`:`port`.
#[track_caller]
pub(crate) fn assert_host_network_and_apiserver(pod: &str, what: &str, host: &str, port: &str) {
    assert_has(
        pod,
        what,
        &[
            "\n      hostNetwork: true\n",
            "\n      dnsPolicy: ClusterFirstWithHostNet\n",
        ],
    );
    assert_entry(
        pod,
        "env",
        "KUBERNETES_SERVICE_HOST",
        &[&format!("value: \"{host}\"")],
    );
    assert_entry(
        pod,
        "env",
        "KUBERNETES_SERVICE_PORT",
        &[&format!("value: \"{port}\"")],
    );
}
