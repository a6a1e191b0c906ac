//! docs/operator-guide.md's flag tables and the binaries' `--help` name the same flags with the
//! same defaults, so the guide cannot drift from the code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The rows under `### <section>` of `## Flags`: the `--flag` names of the first cell, and the
/// default cell.
fn rows(section: &str) -> Vec<(Vec<String>, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operator-guide.md");
    let doc = std::fs::read_to_string(path).expect("docs/operator-guide.md");
    let mut out = Vec::new();
    let mut in_flags = false;
    let mut inside = false;
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            in_flags = h.trim() == "Flags";
            inside = false;
        } else if let Some(h) = line.strip_prefix("### ") {
            inside = in_flags && h.trim() == section;
        } else if inside && let Some(row) = line.strip_prefix('|') {
            let mut cells = row.split(" | ").map(str::trim);
            let flags = flags_in(cells.next().unwrap_or(""));
            if !flags.is_empty() {
                out.push((flags, cells.next().unwrap_or("").to_string()));
            }
        }
    }
    assert!(!out.is_empty(), "no flags documented under {section}");
    out
}

/// Every `--name` in `text`.
fn flags_in(text: &str) -> Vec<String> {
    text.match_indices("--")
        .map(|(i, _)| {
            text[i + 2..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect::<String>()
        })
        .filter(|f| f.starts_with(|c: char| c.is_ascii_alphanumeric()))
        .collect()
}

fn help(bin: &Path) -> String {
    let out = Command::new(bin).arg("--help").output().expect("--help runs");
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// The long flags `--help` lists, each with its `[default: …]` if it shows one. An option starts
/// on a line indented less than its help text (`  -v, --v <LEVEL>`, `      --name <NAME>`) and
/// runs to the next such line.
fn in_help(help: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut current: Vec<String> = Vec::new();
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let text = line.trim_start();
        if text.starts_with('-') && indent < 8 {
            current = flags_in(text.split("  ").next().unwrap_or(""))
                .into_iter()
                .filter(|f| f != "help" && f != "version")
                .collect();
            for f in &current {
                out.insert(f.clone(), None);
            }
        }
        if let Some((_, rest)) = line.split_once("[default: ")
            && let Some((value, _)) = rest.split_once(']')
        {
            for f in &current {
                out.insert(f.clone(), Some(value.to_string()));
            }
        }
    }
    out
}

/// Whether the guide's default cell states `help`'s default: the value itself as the cell's
/// first code span; for a flag without one, words saying so (or a computed `<placeholder>`).
fn same_default(cell: &str, help: Option<&str>) -> bool {
    let code = cell.split('`').nth(1).filter(|_| cell.starts_with('`'));
    match (help, code) {
        (Some(d), Some(c)) => d == c,
        (Some("false"), None) => cell == "off",
        (Some(_), None) => false,
        (None, Some(c)) => c.starts_with('<'),
        (None, None) => ["none", "unset", "off", "required"].contains(&cell),
    }
}

fn check(bin: &Path, section: &str) {
    let mut table = rows("Shared API flags (both binaries)");
    table.extend(rows(section));
    let docs: BTreeSet<String> = table.iter().flat_map(|(f, _)| f.iter().cloned()).collect();
    let help = in_help(&help(bin));
    let flags: BTreeSet<String> = help.keys().cloned().collect();
    let undocumented: Vec<_> = flags.difference(&docs).collect();
    let stale: Vec<_> = docs.difference(&flags).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "{section}: flags missing from docs/operator-guide.md: {undocumented:?}; documented but not in --help: {stale:?}"
    );
    let wrong: Vec<String> = table
        .iter()
        .flat_map(|(flags, cell)| flags.iter().map(move |f| (f, cell)))
        .filter(|(f, cell)| !same_default(cell, help[*f].as_deref()))
        .map(|(f, cell)| format!("--{f}: guide says {cell:?}, --help {:?}", help[f]))
        .collect();
    assert!(
        wrong.is_empty(),
        "{section}: defaults in docs/operator-guide.md differ from --help:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_default_parser_reads_long_and_short_help() {
    let help = "Options:\n      --kube-api-burst <N>\n          Requests at once\n\n          [default: 100]\n\n  \
                -v, --v <LEVEL>  Verbosity [default: 2]\n      --log-format <F>\n          Possible values:\n          \
                - text: lines\n\n          [default: text]\n      --kubeconfig <K>  File\n";
    let got = in_help(help);
    assert_eq!(got["kube-api-burst"].as_deref(), Some("100"));
    assert_eq!(got["v"].as_deref(), Some("2"));
    assert_eq!(got["log-format"].as_deref(), Some("text"));
    assert_eq!(got["kubeconfig"], None);
    assert!(same_default("`0` (auto)", Some("0")));
    assert!(!same_default("`7` (auto)", Some("0")));
    assert!(same_default("off", Some("false")) && same_default("none", None));
    assert!(!same_default("`15s`", None));
}

#[test]
fn controller_flags_match_the_guide() {
    check(
        Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        "stowage-controller",
    );
}

#[test]
fn agent_flags_match_the_guide() {
    let agent = stowage_testkit::binary::sibling(
        Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        "stowage-agent",
        "stowage-agent",
    );
    check(&agent, "stowage-agent");
}
