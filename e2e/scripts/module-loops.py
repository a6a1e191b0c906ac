#!/usr/bin/env python3
"""Fails when the top-level modules of a crate import each other in a loop.

Usage: module-loops.py <crate src dir>...

A module is a top-level `mod` of the crate (a file `x.rs` or a dir `x/`); module A imports B when
code of A (its tests and comments left out) names `crate::B`, alone or in a `use crate::{…}`
group. The house rule (docs/architecture.md) is that these edges point one way in every
controller crate and in common; `make lint` runs this over them. Prints each crate's module and
edge count, and each loop found."""

import os
import re
import sys

NAME = re.compile(r"[a-z_][a-z0-9_]*")


def top_names(text):
    """The top-level modules named right after one `crate::`: one, or a `{…}` group's."""
    text = text.strip()
    if not text.startswith("{"):
        m = NAME.match(text)
        return [m.group(0)] if m else []
    depth, item, items = 0, "", []
    for ch in text[1:]:
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    return [m.group(0) for m in (NAME.match(i.strip()) for i in items) if m]


def code_of(path):
    """A file's code without its `#[cfg(test)]` tail and its comments."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    return re.sub(r"//[^\n]*", "", text)


def edges_of(src):
    edges = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, name), src)[:-3].split(os.sep)
            if "tests" in rel or rel[0] in ("lib", "main"):
                continue
            me = rel[0]
            for m in re.finditer(r"crate::(\{[^;]*|[a-z_][a-z0-9_]*)", code_of(os.path.join(root, name)), re.S):
                for target in top_names(m.group(1)):
                    if target != me:
                        edges.setdefault(me, set()).add(target)
    return edges


def loops(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    nodes = set(edges) | {w for ws in edges.values() for w in ws}
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main(dirs):
    bad = False
    for src in dirs:
        edges = edges_of(src)
        found = loops(edges)
        modules = len(set(edges) | {w for ws in edges.values() for w in ws})
        print(f"module-loops: {src}: {modules} modules, {sum(map(len, edges.values()))} edges, "
              f"{'loops: ' + '; '.join(' <-> '.join(c) for c in found) if found else 'no loop'}")
        bad = bad or bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
