//! docs/metrics.md read as data. Each binary's section (`## stowage-controller`,
//! `## stowage-agent`, up to the next `## `) has tables whose rows start with the family name in
//! a code span, then its type, then its labels; [`check`] compares those rows with the families
//! the binary registers, so the reference can neither miss a family nor keep a removed one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use stowage_common::observe::metrics::Family;

/// One documented family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// First word of the type cell (`gauge (at scrape)` is a gauge).
    pub kind: String,
    pub labels: BTreeSet<String>,
}

pub fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md")
}

/// The rows under `## <binary>`, by family name; a family listed twice is an error.
pub fn documented(binary: &str) -> BTreeMap<String, Row> {
    let doc = std::fs::read_to_string(path()).expect("docs/metrics.md");
    let rows = parse(&doc, binary);
    assert!(
        !rows.is_empty(),
        "docs/metrics.md documents no metric for {binary}"
    );
    rows
}

fn parse(doc: &str, binary: &str) -> BTreeMap<String, Row> {
    let mut out = BTreeMap::new();
    let mut inside = false;
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            inside = h.trim() == binary;
            continue;
        }
        if !inside || !line.starts_with("| `") {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        let [name, kind, labels, ..] = cells[..] else {
            panic!("docs/metrics.md: a row with fewer than 3 cells under {binary}: {line}");
        };
        let row = Row {
            kind: kind.split_whitespace().next().unwrap_or("").to_string(),
            labels: label_names(labels),
        };
        let name = name.trim_matches('`').to_string();
        if out.insert(name.clone(), row).is_some() {
            panic!("docs/metrics.md lists {name} twice under {binary}");
        }
    }
    out
}

/// The label names of a labels cell: the code spans outside parentheses (inside them the doc
/// lists example values). `–` or any cell without code spans means no labels.
fn label_names(cell: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut depth = 0usize;
    let mut code: Option<String> = None;
    for c in cell.chars() {
        match (&mut code, c) {
            (Some(span), '`') => {
                let span = std::mem::take(span);
                if depth == 0 {
                    out.insert(span);
                }
                code = None;
            }
            (Some(span), c) => span.push(c),
            (None, '`') => code = Some(String::new()),
            (None, '(') => depth += 1,
            (None, ')') => depth = depth.saturating_sub(1),
            (None, _) => {}
        }
    }
    out
}

/// Fails, listing every difference, unless the section of `binary` documents exactly the
/// `registered` families with their types and label names. Undocumented families are printed
/// as rows to paste, their help text as a first draft of the meaning.
pub fn check(binary: &str, registered: &[Family]) {
    let docs = documented(binary);
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    for f in registered {
        names.insert(f.name.as_str());
        let labels: BTreeSet<String> = f.labels.iter().cloned().collect();
        let Some(kind) = f.kind else {
            problems.push(format!("{}: registered without a type (not collected)", f.name));
            continue;
        };
        match docs.get(&f.name) {
            None => {
                let cell = if labels.is_empty() {
                    "–".to_string()
                } else {
                    labels
                        .iter()
                        .map(|l| format!("`{l}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                problems.push(format!(
                    "undocumented: | `{}` | {kind} | {cell} | {} |",
                    f.name, f.help
                ));
            }
            Some(row) => {
                if row.kind != kind {
                    problems.push(format!(
                        "{}: documented as {}, registered as {kind}",
                        f.name, row.kind
                    ));
                }
                if row.labels != labels {
                    problems.push(format!(
                        "{}: documented labels {:?}, registered {:?}",
                        f.name, row.labels, labels
                    ));
                }
            }
        }
    }
    for name in docs.keys().filter(|n| !names.contains(n.as_str())) {
        problems.push(format!("documented but not registered: {name}"));
    }
    assert!(
        problems.is_empty(),
        "docs/metrics.md, section {binary}, does not match the registry:\n{}",
        problems.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_names_skip_the_values_in_parentheses() {
        let cell = "`state` (`desired`: wanted (by pods); `actual`), `driver`";
        assert_eq!(
            label_names(cell),
            BTreeSet::from(["state".to_string(), "driver".to_string()])
        );
        assert!(label_names("–").is_empty());
    }

    #[test]
    fn rows_are_read_from_the_binary_section_only() {
        let doc = "## a\n\n| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n\
                   | `x_total` | counter | `kind` (`claim`) | syncs |\n| `y` | gauge (at scrape) | – | n |\n\
                   ## b\n\n| `z` | gauge | – | other binary |\n";
        let rows = parse(doc, "a");
        assert_eq!(rows.keys().collect::<Vec<_>>(), ["x_total", "y"]);
        assert_eq!(rows["y"].kind, "gauge");
        assert_eq!(rows["x_total"].labels, BTreeSet::from(["kind".to_string()]));
    }
}
