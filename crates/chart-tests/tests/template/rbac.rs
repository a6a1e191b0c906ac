//! The guide's RBAC tables against the chart. docs/operator-guide.md ("What the service accounts
//! may do") has one table per account; for every set of values below, the rules the rendered
//! Roles and ClusterRoles grant each account through their bindings must be exactly the rows of
//! its table whose values hold. The guide is the expectation: nothing here lists a right.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::{Map, Value};
use stowage_chart_tests::{Helm, chart_dir, documents, repo_root};

use crate::render;

/// The release and namespace `render` uses.
const RELEASE: &str = "st";
const NAMESPACE: &str = "stowage-system";

const GUIDE: &str = "docs/operator-guide.md";
const SECTION: &str = "### What the service accounts may do";
const HEADER: &str = "| API group | resources | verbs | names | namespace | values | why |";

/// The scraper the cases with readers bind; the guide calls whoever is listed `metrics.readers`.
const READERS: &str =
    "metrics:\n  readers:\n    - {kind: ServiceAccount, name: prometheus, namespace: monitoring}\n";

/// The renderings compared: the defaults and every value some rule depends on. `--set` values,
/// and whether `metrics.readers` names a scraper. A row of the guide that no case turns on fails
/// the test, so a new conditional rule needs a case here.
const CASES: &[(&[&str], bool)] = &[
    (&[], false),
    (&[], true),
    (&["controller.securePort=0"], true),
    (&["controller.enabled=false"], true),
    // Without leader election only one replica is allowed.
    (
        &["controller.leaderElection.enabled=false", "controller.replicas=1"],
        false,
    ),
    (&["agent.mode=standalone"], false),
    (&["imageStore.mode=shared"], false),
    (&["agent.mode=standalone", "agent.registerNode=true"], false),
    (&["rbac.create=false"], true),
    (&["storageClass.create=true"], false),
    (
        &["tests.storageClassName=other", "metrics.service.enabled=false"],
        false,
    ),
    (
        &[
            "metrics.service.enabled=false",
            "metrics.serviceMonitor.enabled=true",
            "controller.securePort=0",
        ],
        false,
    ),
    (&["tests.enabled=false", "storageClass.create=true"], false),
];

#[tokio::test]
async fn the_guides_rbac_tables_are_what_the_chart_grants() {
    let rows = guide_rows();
    let values = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let helm = Helm::new(None);
    let readers = helm.values("readers.yaml", READERS);
    let readers = readers.to_str().unwrap();

    // Each difference, with the cases that show it.
    let mut problems: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut applied = vec![false; rows.len()];
    for (sets, with_readers) in CASES {
        let mut args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
        if *with_readers {
            args.extend(["-f", readers]);
        }
        let mut case: Vec<&str> = sets.to_vec();
        if *with_readers {
            case.push("metrics.readers=[ServiceAccount monitoring/prometheus]");
        }
        let case = if case.is_empty() {
            "the defaults".to_string()
        } else {
            case.join(", ")
        };
        let manifest = render(&helm, &args).await.unwrap();
        let granted = rendered_grants(&manifest);

        // Which row grants what under these values.
        let value = |key: &str| {
            sets.iter()
                .find_map(|s| s.strip_prefix(key)?.strip_prefix('='))
                .map(str::to_string)
                .or_else(|| default_value(&values, key))
                .unwrap_or_else(|| panic!("{GUIDE} names the value {key}, which values.yaml lacks"))
        };
        let mut expected: BTreeMap<&str, BTreeMap<&Grant, Vec<usize>>> = BTreeMap::new();
        for (i, row) in rows.iter().enumerate() {
            if row
                .conditions
                .iter()
                .all(|any| any.iter().any(|c| c.holds(&value)))
            {
                applied[i] = true;
                for g in &row.grants {
                    let by = expected.entry(&row.account).or_default();
                    by.entry(g).or_default().push(row.line);
                }
            }
        }

        // The guide's `metrics.readers` is whoever that value lists: nobody without readers.
        if !with_readers {
            expected.remove("metrics.readers");
        }
        let accounts: BTreeSet<&str> = expected
            .keys()
            .copied()
            .chain(granted.keys().map(String::as_str))
            .collect();
        let none = BTreeSet::new();
        for account in accounts {
            let got = granted.get(account).unwrap_or(&none);
            let want = expected.get(account).cloned().unwrap_or_default();
            for g in got.iter().filter(|g| !want.contains_key(g)) {
                problems
                    .entry(format!(
                        "{account}: the chart grants {g}, which no row of the guide lists"
                    ))
                    .or_default()
                    .push(case.clone());
            }
            for (g, lines) in want.iter().filter(|(g, _)| !got.contains(g)) {
                let lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
                problems
                    .entry(format!(
                        "{account}: {GUIDE}:{} lists {g}, which the chart does not grant",
                        lines.join(",")
                    ))
                    .or_default()
                    .push(case.clone());
            }
        }
    }
    let mut report: Vec<String> = problems
        .into_iter()
        .map(|(p, cases)| format!("{p}\n    with {}", cases.join("; ")))
        .collect();
    for (row, _) in rows.iter().zip(applied).filter(|(_, a)| !a) {
        report.push(format!(
            "{GUIDE}:{}: no case renders the values this row needs; add one to CASES",
            row.line
        ));
    }
    assert!(
        report.is_empty(),
        "the RBAC tables of {GUIDE} and the chart differ:\n{}",
        report.join("\n")
    );
}

/// One right: a verb on a resource (or a non-resource URL), perhaps limited to a name or to a
/// namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Grant {
    /// `None` for a non-resource URL; `""` is the core group.
    group: Option<String>,
    resource: String,
    verb: String,
    name: Option<String>,
    namespace: Option<String>,
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{} {}`", self.verb, self.resource)?;
        match self.group.as_deref() {
            None => write!(f, " (non-resource URL)")?,
            Some("") => write!(f, " (core)")?,
            Some(g) => write!(f, " ({g})")?,
        }
        if let Some(n) = &self.name {
            write!(f, " named {n}")?;
        }
        match &self.namespace {
            Some(ns) => write!(f, " in namespace {ns}"),
            None => write!(f, " cluster-wide"),
        }
    }
}

/// A policy rule, as a Role states it.
#[derive(Default)]
struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
    names: Vec<String>,
    urls: Vec<String>,
}

impl Rule {
    /// Every single right the rule gives when bound in `namespace` (`None`: cluster-wide).
    fn grants(&self, namespace: Option<&str>) -> Vec<Grant> {
        let namespace = namespace.map(str::to_string);
        let names: Vec<Option<String>> = if self.names.is_empty() {
            vec![None]
        } else {
            self.names.iter().cloned().map(Some).collect()
        };
        let mut out = Vec::new();
        for verb in &self.verbs {
            for url in &self.urls {
                out.push(Grant {
                    group: None,
                    resource: url.clone(),
                    verb: verb.clone(),
                    name: None,
                    namespace: namespace.clone(),
                });
            }
            for group in &self.groups {
                for resource in &self.resources {
                    for name in &names {
                        out.push(Grant {
                            group: Some(group.clone()),
                            resource: resource.clone(),
                            verb: verb.clone(),
                            name: name.clone(),
                            namespace: namespace.clone(),
                        });
                    }
                }
            }
        }
        out
    }
}

/// The built-in ClusterRoles the chart binds but does not render, with their rules from
/// Kubernetes' bootstrap policy (plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go).
fn built_in(name: &str) -> Option<Vec<Rule>> {
    let rule = |group: &str, resource: &str, verb: &str| Rule {
        groups: vec![group.into()],
        resources: vec![resource.into()],
        verbs: vec![verb.into()],
        ..Rule::default()
    };
    match name {
        "system:auth-delegator" => Some(vec![
            rule("authentication.k8s.io", "tokenreviews", "create"),
            rule("authorization.k8s.io", "subjectaccessreviews", "create"),
        ]),
        _ => None,
    }
}

/// What the rendered bindings give each account: a service account of the release namespace by
/// its name, the scraper of `READERS` as `metrics.readers`, anyone else as `<kind> <ns>/<name>`.
fn rendered_grants(manifest: &str) -> BTreeMap<String, BTreeSet<Grant>> {
    let objects: Vec<Value> = documents(manifest)
        .into_iter()
        .filter(|d| {
            d.lines().any(|l| {
                matches!(
                    l.strip_prefix("kind: "),
                    Some("Role" | "ClusterRole" | "RoleBinding" | "ClusterRoleBinding")
                )
            })
        })
        .map(yaml)
        .collect();
    let text = |v: &Value, path: &[&str]| -> String {
        path.iter()
            .try_fold(v, |v, k| v.get(k))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };

    let mut roles: BTreeMap<(String, String, String), Vec<Rule>> = BTreeMap::new();
    for o in &objects {
        let kind = text(o, &["kind"]);
        if kind.ends_with("Binding") {
            continue;
        }
        let ns = text(o, &["metadata", "namespace"]);
        let name = text(o, &["metadata", "name"]);
        let rules = list(o, "rules")
            .iter()
            .map(|r| {
                let r = r.as_object().expect("a rule is a mapping");
                for key in r.keys() {
                    assert!(
                        [
                            "apiGroups",
                            "resources",
                            "verbs",
                            "resourceNames",
                            "nonResourceURLs"
                        ]
                        .contains(&key.as_str()),
                        "{kind}/{name}: a rule key this test does not know: {key}"
                    );
                }
                let strings = |key| {
                    r.get(key)
                        .and_then(Value::as_array)
                        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
                        .unwrap_or_default()
                };
                Rule {
                    groups: strings("apiGroups"),
                    resources: strings("resources"),
                    verbs: strings("verbs"),
                    names: strings("resourceNames"),
                    urls: strings("nonResourceURLs"),
                }
            })
            .collect();
        roles.insert((kind, ns, name), rules);
    }

    let mut grants: BTreeMap<String, BTreeSet<Grant>> = BTreeMap::new();
    for o in &objects {
        let kind = text(o, &["kind"]);
        if !kind.ends_with("Binding") {
            continue;
        }
        let name = text(o, &["metadata", "name"]);
        let role_kind = text(o, &["roleRef", "kind"]);
        let role = text(o, &["roleRef", "name"]);
        // A RoleBinding grants only in its namespace, even the rules of a ClusterRole.
        let scope = (kind == "RoleBinding").then(|| text(o, &["metadata", "namespace"]));
        let role_ns = if role_kind == "Role" {
            scope.clone().unwrap_or_default()
        } else {
            String::new()
        };
        let built_in_rules;
        let rules = match roles.get(&(role_kind.clone(), role_ns, role.clone())) {
            Some(rules) => rules,
            None => {
                built_in_rules = (role_kind == "ClusterRole")
                    .then(|| built_in(&role))
                    .flatten()
                    .unwrap_or_else(|| {
                        panic!("{kind}/{name} binds {role_kind}/{role}, which is neither rendered nor a built-in role this test knows")
                    });
                &built_in_rules
            }
        };
        for s in list(o, "subjects") {
            let (kind, name, ns) = (text(s, &["kind"]), text(s, &["name"]), text(s, &["namespace"]));
            let account = match (kind.as_str(), ns.as_str(), name.as_str()) {
                ("ServiceAccount", NAMESPACE, _) => name,
                ("ServiceAccount", "monitoring", "prometheus") => "metrics.readers".to_string(),
                _ => format!("{kind} {ns}/{name}"),
            };
            let to = grants.entry(account).or_default();
            for r in rules {
                to.extend(r.grants(scope.as_deref()));
            }
        }
    }
    grants
}

/// The list under `key`; none when the key is missing or empty (`rules:` with nothing under it).
fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    match v.get(key) {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(other) => panic!("{key} is not a list: {other}"),
    }
}

/// One value a row depends on: `key=value`, or `key!=value`.
#[derive(Clone)]
struct Condition {
    key: String,
    value: String,
    negated: bool,
}

impl Condition {
    fn parse(s: &str) -> Self {
        let span = s
            .strip_prefix('`')
            .and_then(|s| s.strip_suffix('`'))
            .unwrap_or_else(|| panic!("a condition is one `key=value` or `key!=value`: {s:?}"));
        let (key, value, negated) = match span.split_once("!=") {
            Some((k, v)) => (k, v, true),
            None => {
                let (k, v) = span
                    .split_once('=')
                    .unwrap_or_else(|| panic!("not key=value: {span:?}"));
                (k, v, false)
            }
        };
        Self {
            key: key.to_string(),
            value: unquote(value),
            negated,
        }
    }

    fn holds(&self, value: &impl Fn(&str) -> String) -> bool {
        (value(&self.key) == self.value) != self.negated
    }
}

/// One row of the guide: the rights it lists for an account and the values it needs (the
/// account's and its own), each a list of alternatives.
struct Row {
    account: String,
    conditions: Vec<Vec<Condition>>,
    grants: Vec<Grant>,
    /// Its line in the guide, for the messages.
    line: usize,
}

/// The rows of the guide's RBAC tables. Each account is a `####` heading whose first code span
/// names it; the `key=value` code spans of the prose above its table are the account's
/// conditions.
fn guide_rows() -> Vec<Row> {
    let guide = std::fs::read_to_string(repo_root().join(GUIDE)).unwrap();
    let mut lines = guide.lines().enumerate().map(|(i, l)| (i + 1, l));
    lines
        .by_ref()
        .find(|(_, l)| *l == SECTION)
        .unwrap_or_else(|| panic!("{GUIDE} has no section {SECTION:?}"));
    let spans = |l: &str| -> Vec<String> { l.split('`').skip(1).step_by(2).map(str::to_string).collect() };
    let release = |s: &str| s.replace("<release>", RELEASE);

    let mut rows = Vec::new();
    // The current account, its conditions, and whether its table has begun / ended.
    let mut account: Option<(String, Vec<Vec<Condition>>)> = None;
    let mut table = (false, false);
    for (n, l) in lines.take_while(|(_, l)| !l.starts_with("## ") && !l.starts_with("### ")) {
        if let Some(heading) = l.strip_prefix("#### ") {
            let name = spans(heading)
                .into_iter()
                .next()
                .unwrap_or_else(|| panic!("{GUIDE}:{n}: the heading names no account in `…`"));
            account = Some((release(&name), Vec::new()));
            table = (false, false);
            continue;
        }
        let Some((name, conditions)) = account.as_mut() else {
            assert!(
                !l.starts_with('|'),
                "{GUIDE}:{n}: a table before any account heading"
            );
            continue;
        };
        if !l.starts_with('|') {
            if table.0 {
                table.1 = true;
            } else {
                conditions.extend(
                    spans(l)
                        .iter()
                        .filter(|s| s.contains('='))
                        .map(|s| vec![Condition::parse(&format!("`{s}`"))]),
                );
            }
            continue;
        }
        assert!(!table.1, "{GUIDE}:{n}: a second table for {name}");
        if !table.0 {
            assert_eq!(l, HEADER, "{GUIDE}:{n}: the table's columns");
            table.0 = true;
            continue;
        }
        if l.starts_with("| ---") {
            continue;
        }
        let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
        let [group, resources, verbs, names, namespace, values, why] = cells[..] else {
            panic!("{GUIDE}:{n}: a row has {} cells, not 7", cells.len());
        };
        assert!(!why.is_empty(), "{GUIDE}:{n}: a row says why");
        let code = |cell: &str| -> Vec<String> {
            cell.split(", ")
                .map(|c| {
                    c.strip_prefix('`')
                        .and_then(|c| c.strip_suffix('`'))
                        .unwrap_or_else(|| panic!("{GUIDE}:{n}: not in `…`: {c:?}"))
                        .to_string()
                })
                .collect()
        };
        let urls = group == "non-resource URL";
        let group = match group {
            "core" => String::new(),
            "non-resource URL" => String::new(),
            g => code(g).concat(),
        };
        let names = if names.is_empty() {
            Vec::new()
        } else {
            code(names).iter().map(|s| release(s)).collect()
        };
        let namespace = match namespace {
            "" => None,
            "release" => Some(NAMESPACE.to_string()),
            ns => Some(code(ns).concat()),
        };
        let rule = Rule {
            groups: if urls { Vec::new() } else { vec![group] },
            resources: if urls { Vec::new() } else { code(resources) },
            urls: if urls { code(resources) } else { Vec::new() },
            verbs: verbs.split(", ").map(str::to_string).collect(),
            names,
        };
        let mut all = conditions.clone();
        if !values.is_empty() {
            all.extend(
                values
                    .split(", ")
                    .map(|any| any.split(" or ").map(Condition::parse).collect()),
            );
        }
        rows.push(Row {
            account: name.clone(),
            conditions: all,
            grants: rule.grants(namespace.as_deref()),
            line: n,
        });
    }
    assert!(!rows.is_empty(), "{GUIDE}: no RBAC table under {SECTION:?}");
    rows
}

/// The default of `path` (e.g. `controller.securePort`) in the chart's values.yaml, a scalar.
fn default_value(values: &str, path: &str) -> Option<String> {
    // The keys enclosing the current line, with their indentation.
    let mut stack: Vec<(usize, &str)> = Vec::new();
    for l in values.lines() {
        let t = l.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with("- ") {
            continue;
        }
        let indent = l.len() - l.trim_start().len();
        stack.retain(|(i, _)| *i < indent);
        let Some((key, rest)) = key_value(t) else {
            continue;
        };
        let keys: Vec<&str> = stack.iter().map(|(_, k)| *k).chain([key]).collect();
        if keys.join(".") == path && !rest.is_empty() {
            return scalar(rest).as_str().map(str::to_string);
        }
        stack.push((indent, key));
    }
    None
}

/// The subset of YAML `helm template` makes of the chart's RBAC: block mappings and sequences,
/// flow sequences of scalars, plain and quoted scalars. Anything else fails loudly rather than
/// being misread.
fn yaml(doc: &str) -> Value {
    let mut lines: Vec<(usize, String)> = doc
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|l| (l.len() - l.trim_start().len(), l.trim().to_string()))
        .collect();
    let mut i = 0;
    let v = block(&mut lines, &mut i, 0);
    assert_eq!(i, lines.len(), "unparsed YAML from {:?}:\n{doc}", lines.get(i));
    v
}

/// The block at `indent` starting at line `i`: a sequence if it starts with `- `, else a mapping.
fn block(lines: &mut [(usize, String)], i: &mut usize, indent: usize) -> Value {
    let item = |l: &(usize, String)| l.0 == indent && (l.1.starts_with("- ") || l.1 == "-");
    if lines.get(*i).is_some_and(item) {
        let mut seq = Vec::new();
        while lines.get(*i).is_some_and(item) {
            let rest = lines[*i].1[1..].trim_start().to_string();
            if key_value(&rest).is_some() {
                // `- key: value`: a mapping whose keys stand two columns in.
                lines[*i] = (indent + 2, rest);
                seq.push(block(lines, i, indent + 2));
            } else {
                seq.push(scalar(&rest));
                *i += 1;
            }
        }
        return Value::Array(seq);
    }
    let mut map = Map::new();
    while let Some((n, text)) = lines.get(*i).cloned() {
        if n < indent || item(&(n, text.clone())) {
            break;
        }
        assert_eq!(n, indent, "unexpected indentation: {text:?}");
        let (key, rest) = key_value(&text).unwrap_or_else(|| panic!("not a key: {text:?}"));
        *i += 1;
        let value = if !rest.is_empty() {
            scalar(rest)
        } else {
            match lines.get(*i) {
                Some((m, t)) if *m > indent || (*m == indent && t.starts_with("- ")) => {
                    let m = *m;
                    block(lines, i, m)
                }
                _ => Value::Null,
            }
        };
        map.insert(key.to_string(), value);
    }
    Value::Object(map)
}

/// `key: rest` or `key:`; `None` for a scalar.
fn key_value(text: &str) -> Option<(&str, &str)> {
    if text.starts_with(['"', '\'', '[', '{']) {
        return None;
    }
    match text.split_once(": ") {
        Some((k, v)) => Some((k, v.trim())),
        None => text.strip_suffix(':').map(|k| (k, "")),
    }
}

/// A scalar or a flow sequence of scalars, every scalar as a string.
fn scalar(text: &str) -> Value {
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .unwrap_or_else(|| panic!("unsupported flow sequence: {text:?}"));
        let mut items = Vec::new();
        let (mut item, mut quote) = (String::new(), None);
        for c in inner.chars() {
            match (c, quote) {
                (',', None) => items.push(std::mem::take(&mut item)),
                ('"' | '\'', None) => {
                    quote = Some(c);
                    item.push(c);
                }
                (c, Some(q)) if c == q => {
                    quote = None;
                    item.push(c);
                }
                _ => item.push(c),
            }
        }
        if !item.trim().is_empty() || !items.is_empty() {
            items.push(item);
        }
        return Value::Array(items.iter().map(|s| scalar(s.trim())).collect());
    }
    assert!(
        text == "{}" || !text.starts_with(['{', '|', '>', '&', '*', '!']),
        "unsupported YAML: {text:?}"
    );
    if text == "{}" {
        return Value::Object(Map::new());
    }
    Value::String(unquote(text))
}

/// A double-quoted (with `\"` and `\\`), single-quoted or plain scalar's text.
fn unquote(s: &str) -> String {
    if let Some(inner) = s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
        inner.replace("\\\"", "\"").replace("\\\\", "\\")
    } else if let Some(inner) = s.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')) {
        inner.replace("''", "'")
    } else {
        // A plain scalar ends at a comment.
        s.split(" #").next().unwrap().trim().to_string()
    }
}
