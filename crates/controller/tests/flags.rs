//! docs/operator-guide.md's flag tables and the binaries' `--help` name the same flags, so the
//! guide cannot drift from the code.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// `--flag` names in the first cell of the table rows under `### <section>` of `## Flags`.
fn documented(section: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operator-guide.md");
    let doc = std::fs::read_to_string(path).expect("docs/operator-guide.md");
    let mut out = BTreeSet::new();
    let mut in_flags = false;
    let mut inside = false;
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            in_flags = h.trim() == "Flags";
            inside = false;
        } else if let Some(h) = line.strip_prefix("### ") {
            inside = in_flags && h.trim() == section;
        } else if inside && let Some(first) = line.strip_prefix('|').and_then(|l| l.split('|').next()) {
            out.extend(flags_in(first));
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

/// The long flags `bin --help` lists (option lines start with `-x, --name` or `--name`).
fn in_help(bin: &Path) -> BTreeSet<String> {
    let out = Command::new(bin).arg("--help").output().expect("--help runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| flags_in(l.split("  ").next().unwrap_or("")))
        .filter(|f| f != "help" && f != "version")
        .collect()
}

fn check(bin: &Path, section: &str) {
    let mut docs = documented("Shared API flags (both binaries)");
    docs.extend(documented(section));
    let help = in_help(bin);
    let undocumented: Vec<_> = help.difference(&docs).collect();
    let stale: Vec<_> = docs.difference(&help).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "{section}: flags missing from docs/operator-guide.md: {undocumented:?}; documented but not in --help: {stale:?}"
    );
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
