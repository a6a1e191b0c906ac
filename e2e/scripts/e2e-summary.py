#!/usr/bin/env python3
"""Markdown summary of a ginkgo JSON report of the storage e2e suite: per suite (provisioning,
volumes, subPath, …) how many tests ran, passed, failed and were skipped, and their time; then
per suite and test pattern the same with why tests were skipped; then each failure with the first
lines of its message. The last line is the plain count.

    e2e-summary.py <report.json> [wall seconds]
"""
import json
import re
import sys
from collections import defaultdict

# "[Testpattern: Dynamic PV (xfs)] [Slow] volumes": the suite is the first word after the pattern
# and any tags.
PATTERN = re.compile(r"\[Testpattern: ([^\]]*)\]\s*(?:\[[^\]]*\]\s*)*([^\s\[]+)")


def suite_and_pattern(spec):
    for text in spec.get("ContainerHierarchyTexts") or []:
        m = PATTERN.search(text)
        if m:
            return m.group(2), m.group(1)
    return None, None


def skip_reason(spec):
    """Why a test was skipped, in a few words: the suite's own skip message (driver capability,
    volume type, node count), or the run's filter for tests it did not select."""
    msg = ((spec.get("Failure") or {}).get("Message") or "").strip().splitlines()
    if not msg:
        return "not selected ([Serial], [Disruptive], [Feature:…] or [Flaky])"
    text = re.sub(r"\s+", " ", msg[0])
    text = re.sub(r"Driver \"?loop\.stowage\.dev\"? ", "", text)
    return text[:110].replace("|", "/")


def main():
    with open(sys.argv[1]) as f:
        reports = json.load(f)
    wall = int(sys.argv[2]) if len(sys.argv) > 2 else None
    rows = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    by_pattern = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "why": defaultdict(int)})
    failures = []
    for report in reports:
        for spec in report.get("SpecReports") or []:
            if spec.get("LeafNodeType") != "It":
                # Suite set-up and tear-down count only when they fail.
                if spec.get("State") not in ("passed", "skipped"):
                    failures.append((spec.get("LeafNodeType"), "", spec))
                continue
            suite, pattern = suite_and_pattern(spec)
            if suite is None:
                continue
            state = spec.get("State")
            row = rows[suite]
            cell = by_pattern[(suite, pattern)]
            row["seconds"] += spec.get("RunTime", 0) / 1e9
            if state == "passed":
                row["passed"] += 1
                cell["passed"] += 1
            elif state in ("skipped", "pending"):
                row["skipped"] += 1
                cell["skipped"] += 1
                cell["why"][skip_reason(spec)] += 1
            else:
                row["failed"] += 1
                cell["failed"] += 1
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
