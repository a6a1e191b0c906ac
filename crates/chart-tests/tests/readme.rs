//! charts/stowage/README.md's values table is generated from values.yaml (keys, defaults and the
//! comments above them), so it cannot drift. `STOWAGE_BLESS=1 cargo test -p stowage-chart-tests
//! --test readme` rewrites it after a change to values.yaml.

use stowage_chart_tests::chart_dir;

/// One documented value: dotted path, default as written, the comment above it.
struct Row {
    path: String,
    default: String,
    comment: String,
}

fn indent(l: &str) -> usize {
    l.len() - l.trim_start().len()
}

/// Reads values.yaml's block structure: `key: value` leaves, `key:` maps (recursed into) and
/// `key:` lists (a leaf whose default is the list, flattened).
fn rows(yaml: &str) -> Vec<Row> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut comment: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        let t = l.trim();
        i += 1;
        if t.is_empty() {
            comment.clear();
            continue;
        }
        if let Some(c) = t.strip_prefix('#') {
            comment.push(c.trim().to_string());
            continue;
        }
        if t.starts_with("- ") {
            continue; // items of a list already shown with its key
        }
        let Some((key, value)) = t.split_once(':') else {
            continue;
        };
        let depth = indent(l);
        while stack.last().is_some_and(|(d, _)| *d >= depth) {
            stack.pop();
        }
        let path = stack
            .iter()
            .map(|(_, k)| k.as_str())
            .chain([key])
            .collect::<Vec<_>>()
            .join(".");
        let value = value.trim();
        let text = std::mem::take(&mut comment).join(" ");
        if !value.is_empty() {
            out.push(Row {
                path,
                default: value.to_string(),
                comment: text,
            });
            continue;
        }
        // A block: a list (its items are the default) or a map (its keys are rows of their own).
        let next = lines[i..]
            .iter()
            .find(|n| !n.trim().is_empty() && !n.trim().starts_with('#'));
        if next.is_some_and(|n| n.trim().starts_with("- ")) {
            let items: Vec<&str> = lines[i..]
                .iter()
                .take_while(|n| n.trim().is_empty() || indent(n) > depth || n.trim().starts_with("- "))
                .map(|n| n.trim())
                .filter(|n| !n.is_empty() && !n.starts_with('#'))
                .collect();
            out.push(Row {
                path,
                default: items.join(" "),
                comment: text,
            });
        } else {
            if !text.is_empty() {
                out.push(Row {
                    path: path.clone(),
                    default: String::new(),
                    comment: text,
                });
            }
            stack.push((depth, key.to_string()));
        }
    }
    out
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

fn generate(yaml: &str) -> String {
    let mut s = String::from(
        "# stowage Helm chart\n\n\
         Kubernetes storage controllers in Rust (binder, attach/detach, expansion, protection) and the\n\
         node agent of the built-in driver `loop.stowage.dev`. Installing, the image store, upgrades,\n\
         alerts and troubleshooting: [docs/operator-guide.md](../../docs/operator-guide.md).\n\n\
         ```sh\n\
         helm install stowage charts/stowage --namespace stowage-system --create-namespace\n\
         helm test stowage --namespace stowage-system   # controller /readyz; a claim of the chart's class, if any, binds\n\
         ```\n\n\
         Kubernetes v1.34 to v1.37 (`kubeVersion`); what is tested on each: [Supported Kubernetes\n\
         versions](../../docs/operator-guide.md#supported-kubernetes-versions).\n\n\
         `values.schema.json` refuses unknown keys. The table below is generated from `values.yaml`\n\
         by `crates/chart-tests/tests/readme.rs` (`STOWAGE_BLESS=1` rewrites it).\n\n\
         ## Values\n\n\
         | key | default | description |\n| --- | --- | --- |\n",
    );
    for r in rows(yaml) {
        let default = if r.default.is_empty() {
            String::new()
        } else {
            format!("`{}`", r.default)
        };
        s.push_str(&format!(
            "| `{}` | {} | {} |\n",
            r.path,
            cell(&default),
            cell(&r.comment)
        ));
    }
    s
}

#[test]
fn readme_values_table_matches_values_yaml() {
    let dir = chart_dir();
    let yaml = std::fs::read_to_string(dir.join("values.yaml")).unwrap();
    let want = generate(&yaml);
    let path = dir.join("README.md");
    if std::env::var_os("STOWAGE_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    let got = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        got == want,
        "{} is out of date with values.yaml: run STOWAGE_BLESS=1 cargo test -p stowage-chart-tests --test readme",
        path.display()
    );
}

#[test]
fn every_value_is_in_the_table() {
    let yaml = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let paths: Vec<String> = rows(&yaml).into_iter().map(|r| r.path).collect();
    for p in [
        "image.repository",
        "kubeApi.qps",
        "logFormat",
        "controller.replicas",
        "controller.leaderElection.leaseName",
        "controller.podDisruptionBudget.enabled",
        "agent.tolerations",
        "metrics.prometheusRule.pendingFor",
        "storageClass.volumeBindingMode",
        "tests.image.repository",
        "tests.storageClassName",
    ] {
        assert!(paths.iter().any(|x| x == p), "{p} missing from {paths:?}");
    }
}
