#!/usr/bin/env python3
"""Which of the control plane's modules call which, and whether any call cycles.

Usage: tools/plane-calls.py [crates/control/src/plane] [--why]

Reads the plane's sources as text (comments and tests left out). A module calls
another when it calls a function defined only there (`.name(` or `Type::name(`), or
the plane's state accessors (`lock`, `config`, ...: the root module). Names defined
in several modules, and a few common ones (`new`, `run`, `get`, ...), are not
attributed. Types named in signatures are not calls. Exits 1 when there is a cycle.
"""

import collections
import os
import re
import sys

COMMON = {
    "new", "run", "get", "spawn", "start", "drop", "fmt", "from", "default", "iter",
    "len", "remove", "insert", "contains", "clone", "deref", "deref_mut", "next",
    "read", "take", "on", "push", "pop", "all", "is_empty", "name", "id", "key",
    "keys", "values", "range", "has", "live", "written", "join", "eq", "hash",
    "write", "apply", "extend", "record", "call", "open", "close", "lock", "config",
    "template", "metrics", "status", "wait", "until", "hand", "stopped", "renewed",
    "depart",
}
ROOT_CALLS = re.compile(
    r"\.(lock|config|template|metrics|is_shutting_down|detached|wait_until|wake_policies)\("
)


def modules(top):
    found = {}
    for dirpath, _, names in os.walk(top):
        for n in names:
            if not n.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, n), top)[:-3]
            if rel.endswith("/mod"):
                rel = rel[: -len("/mod")]
            text = open(os.path.join(dirpath, n)).read()
            cut = text.find("#[cfg(test)]")
            if cut >= 0:
                text = text[:cut]
            found[rel] = re.sub(r"//[^\n]*", "", text)
    return found


def graph(mods):
    types, fns = {}, collections.defaultdict(set)
    for m, s in mods.items():
        for t in re.findall(r"^\s*(?:pub(?:\([a-z:]+\))? )?(?:struct|enum|trait) ([A-Z]\w*)", s, re.M):
            types.setdefault(t, m)
        for f in re.findall(r"\bfn ([a-z_]\w*)", s):
            fns[f].add(m)
    edges, why = collections.defaultdict(set), collections.defaultdict(set)

    def edge(a, b, reason):
        if a != b:
            edges[a].add(b)
            why[(a, b)].add(reason)

    for m, s in mods.items():
        if m != "mod" and ROOT_CALLS.search(s):
            edge(m, "mod", "lock/config/...")
        for t, f in set(re.findall(r"\b([A-Z]\w*)::([a-z_]\w*)\(", s)):
            if t in types:
                edge(m, types[t], f"{t}::{f}")
        for f in set(re.findall(r"(?:\.|::)([a-z_]\w*)\(", s)):
            owners = fns.get(f, set())
            if f not in COMMON and len(owners) == 1:
                edge(m, next(iter(owners)), f)
    return edges, why


def cycles(mods, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    top = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "crates/control/src/plane")
    mods = modules(top)
    if not mods:
        print(f"no Rust sources under {top}", file=sys.stderr)
        sys.exit(2)
    edges, why = graph(mods)
    for m in sorted(mods):
        print(f"{m:16} -> {', '.join(sorted(edges[m]))}")
        if "--why" in sys.argv:
            for b in sorted(edges[m]):
                print(f"{'':20}{b}: {', '.join(sorted(why[(m, b)]))}")
    found = cycles(mods, edges)
    print("call cycles:", found if found else "none")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
