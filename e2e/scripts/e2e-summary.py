#!/usr/bin/env python3
"""Markdown summary of ginkgo JSON reports of the storage e2e suite (a parallel pass and a serial
one): per suite (provisioning, volumes, subPath, …, PV Protection, StatefulSet) how many tests
ran, passed, failed and were skipped, and their time; then per suite and test pattern (or the
controller test's group) the same with why tests were skipped; then each failure with the first
lines of its message. The last line is the plain count.

    e2e-summary.py [--scope REGEX]... [--wall SECONDS] <report.json>...
    e2e-summary.py [--scope REGEX]... --compare <name>=<results dir>...

--compare sets runs of the same tests side by side (stowage's controllers and
kube-controller-manager's on one cluster): each run's counts, then every test whose ending differs.

Only tests whose full name matches a --scope expression count (the binary also registers tests
of in-tree drivers and areas no run selects); without --scope, only the External Storage ones.
A test that passed or failed in one report counts once, as it ended there.
"""
import argparse
import glob
import json
import re
import sys
from collections import defaultdict

# "[Testpattern: Dynamic PV (xfs)] [Slow] volumes": the suite is the first word after the pattern
# and any tags.
PATTERN = re.compile(r"\[Testpattern: ([^\]]*)\]\s*(?:\[[^\]]*\]\s*)*([^\s\[]+)")


SIG = re.compile(r"^\[sig-[^\]]*\]\s*")


def full_name(spec):
    return " ".join((spec.get("ContainerHierarchyTexts") or []) + [spec.get("LeafNodeText", "")])


def suite_and_pattern(spec):
    """The External Storage suite and test pattern; for a controller test, its top-level
    Describe (without the SIG) and the groups under it."""
    texts = spec.get("ContainerHierarchyTexts") or []
    for text in texts:
        m = PATTERN.search(text)
        if m:
            return m.group(2), m.group(1)
    if texts and SIG.match(texts[0]):
        return SIG.sub("", texts[0]), " ".join(texts[1:]) or "-"
    return None, None


def unselected_reason(spec):
    """Why the run's filter left a test out, from its labels, most telling first."""
    name = full_name(spec)
    labels = set(spec.get("LeafNodeLabels") or [])
    for level in spec.get("ContainerHierarchyLabels") or []:
        labels.update(level or [])
    has = lambda label: label in labels or f"[{label}]" in name
    if has("Flaky"):
        return "[Flaky]: left out, as upstream's own jobs leave it out"
    if any(label.startswith("Feature:") for label in labels) or "[Feature:" in name:
        return "[Feature:…]: a feature this cluster does not enable"
    if has("Disruptive") and name.startswith("External Storage"):
        return "[Disruptive]: left out of the disruptive pass by the run's focus"
    if has("Serial"):
        return "[Serial]: the External suites' [Serial] tests (limits, stress) are not run here"
    return "not selected by the run's focus"


def said_why(spec):
    """A skip the test itself explained (a capability, a volume type, a node count)."""
    return bool(((spec.get("Failure") or {}).get("Message") or "").strip())


def skip_reason(spec):
    """Why a test was skipped, in a few words: the suite's own skip message (driver capability,
    volume type, node count), or why the run's filter left it out."""
    msg = ((spec.get("Failure") or {}).get("Message") or "").strip().splitlines()
    if not msg:
        return unselected_reason(spec)
    text = re.sub(r"\s+", " ", msg[0])
    text = re.sub(r"Driver \"?loop\.stowage\.dev\"? ", "", text)
    return text[:110].replace("|", "/")


def ending(spec):
    """passed, skipped (or pending), or failed (failed, timed out, panicked, interrupted, …)."""
    state = spec.get("State")
    if state in ("skipped", "pending"):
        return "skipped"
    return "passed" if state == "passed" else "failed"


def specs_in_scope(paths, scope):
    """Each test in scope once: its ending in the report where it ran (passed or failed), else
    where it skipped itself (saying why), else where the run left it out. Set-up and tear-down
    nodes count only when they fail."""
    chosen = {}
    setup_failures = []
    for path in paths:
        with open(path) as f:
            reports = json.load(f)
        for report in reports:
            for spec in report.get("SpecReports") or []:
                if spec.get("LeafNodeType") != "It":
                    if spec.get("State") not in ("passed", "skipped"):
                        setup_failures.append(spec)
                    continue
                name = full_name(spec)
                if not any(r.search(name) for r in scope):
                    continue
                if name not in chosen or ending(spec) != "skipped" or said_why(spec):
                    chosen[name] = spec
    return list(chosen.values()), setup_failures




def compare(sides, scope):
    """Each side's counts, then the tests whose ending differs between the sides."""
    endings = {}
    for side in sides:
        name, _, path = side.partition("=")
        specs, setup = specs_in_scope(sorted(glob.glob(f"{path}/report*.json")), scope)
        endings[name] = {full_name(s): ending(s) for s in specs}
        if setup:
            endings[name]["(set-up or tear-down)"] = "failed"
    names = list(endings)
    print("| run | ran | passed | failed | skipped |")
    print("| --- | --- | --- | --- | --- |")
    for n in names:
        c = defaultdict(int)
        for e in endings[n].values():
            c[e] += 1
        print(f"| {n} | {c['passed'] + c['failed']} | {c['passed']} | {c['failed']} | {c['skipped']} |")
    tests = sorted(set().union(*(endings[n] for n in names)))
    differ = [t for t in tests if len({endings[n].get(t, "absent") for n in names}) > 1]
    if differ:
        print("\n| test | " + " | ".join(names) + " |")
        print("| --- | " + " | ".join("---" for _ in names) + " |")
        for t in differ:
            print(f"| {SIG.sub('', t)[:160].replace('|', '/')} | " + " | ".join(endings[n].get(t, "absent") for n in names) + " |")
    print(f"\nstorage-e2e compare: {len(tests)} tests, {len(differ)} ending differently")
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scope", action="append", default=[])
    parser.add_argument("--wall", type=int)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args()
    scope = [re.compile(r) for r in (args.scope or [r"External Storage"])]
    if args.compare:
        return compare(args.reports, scope)
    wall = args.wall
    specs, setup_failures = specs_in_scope(args.reports, scope)
    rows = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    by_pattern = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "why": defaultdict(int)})
    failures = []
    for spec in setup_failures:
        failures.append((spec.get("LeafNodeType"), "", spec))
    for spec in specs:
        suite, pattern = suite_and_pattern(spec)
        if suite is None:
            continue
        end = ending(spec)
        row = rows[suite]
        cell = by_pattern[(suite, pattern)]
        row["seconds"] += spec.get("RunTime", 0) / 1e9
        row[end] += 1
        cell[end] += 1
        if end == "skipped":
            cell["why"][skip_reason(spec)] += 1
        elif end == "failed":
            failures.append((suite, pattern, spec))
    total = {k: sum(r[k] for r in rows.values()) for k in ("passed", "failed", "skipped")}
    print("| suite | ran | passed | failed | skipped | time (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for suite in sorted(rows):
        r = rows[suite]
        print(f"| {suite} | {r['passed'] + r['failed']} | {r['passed']} | {r['failed']} | "
              f"{r['skipped']} | {r['seconds']:.0f} |")
    print(f"| **all** | {total['passed'] + total['failed']} | {total['passed']} | {total['failed']} | "
          f"{total['skipped']} | {sum(r['seconds'] for r in rows.values()):.0f} |")
    print("\n| suite | pattern | passed | failed | skipped | why skipped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (suite, pattern) in sorted(by_pattern):
        c = by_pattern[(suite, pattern)]
        why = "; ".join(f"{w} ({n})" for w, n in sorted(c["why"].items()))
        print(f"| {suite} | {pattern} | {c['passed']} | {c['failed']} | {c['skipped']} | {why} |")
    if wall is not None:
        print(f"\nWall time {wall} s (build, cluster up, suite, summary).")
    if failures:
        print("\n## Failed\n")
        for suite, pattern, spec in failures:
            name = " ".join((spec.get("ContainerHierarchyTexts") or [])[1:] + [spec.get("LeafNodeText", "")])
            msg = ((spec.get("Failure") or {}).get("Message") or "").strip().splitlines()[:3]
            print(f"- **{suite}** [{pattern}] {name}")
            for line in msg:
                print(f"  > {line[:300]}")
    print(f"\nstorage-e2e: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
