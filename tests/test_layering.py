"""The package's layering, read from its import graph (every import, lazy ones inside functions too).

Layers, bottom up (docs/layout.md): errors; config, quant; parallel, spec; checkpoint, kernels;
model; convert, verify, bench; cli. A sub-package may import only what ALLOWED lists for it (and
itself), and no two modules may reach each other through imports: no cycle anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gptoss_fp8"

_BASE = {"errors", "__init__"}  # the package root holds only __version__
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "__init__": set(),
    "config": _BASE,
    "quant": _BASE,
    "tokenizer": _BASE,  # byte-level ids <-> text (the trained fixture's); pure Python
    "parallel": _BASE | {"config"},
    "spec": _BASE | {"config", "quant"},
    # files and shard plans; knows nothing of kernels or the model
    "checkpoint": _BASE | {"config", "quant", "parallel"},
    # kernels know nothing about files, checkpoints or the model
    "kernels": _BASE | {"config", "quant", "spec"},
    "model": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "tokenizer"},
    # the engine loop: token ids, never JSON (design.md section 6)
    "runtime": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "model", "tokenizer"},
    "convert": _BASE | {"config", "quant", "parallel", "checkpoint", "tokenizer"},
    "verify": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "model", "convert", "runtime",
                       "tokenizer", "__init__"},
    # HTTP, the OpenAI schema and Harmony over the runtime; reuses verify's tokenizer setup
    "serve": _BASE | {"config", "parallel", "checkpoint", "model", "runtime", "verify", "tokenizer"},
    "bench": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "model", "verify", "runtime",
                      "serve", "tokenizer", "__init__"},
    # transformers' loader for a converted checkpoint (import gptoss_fp8.hf): files and codecs; nothing imports it
    "hf": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "model", "hf_attention", "__init__"},
    "hf_attention": _BASE | {"config", "kernels", "model", "__init__"},
    "cli": _BASE | {"config", "quant", "parallel", "spec", "checkpoint", "kernels", "model", "convert", "verify",
                    "bench", "runtime", "serve", "tokenizer", "__init__"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph() -> dict[str, set[str]]:
    """module -> the gptoss_fp8 modules it imports (anywhere in its body)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                # the longest prefix that is one of our modules
                parts = t.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and parts[0] == "gptoss_fp8" and ".".join(parts) != mod:
                    deps.add(".".join(parts))
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_imports():
    """The parser finds real edges (a broken parser would pass every check below)."""
    g = import_graph()
    assert "gptoss_fp8.quant.fp8" in g["gptoss_fp8.quant.mxfp4"]
    assert "gptoss_fp8.errors" in g["gptoss_fp8.config"]
    assert any(d.startswith("gptoss_fp8.checkpoint") for d in g["gptoss_fp8.model.load"])


def test_layers_import_downward_only():
    bad = []
    for mod, deps in import_graph().items():
        pkg = _package_of(mod)
        assert pkg in ALLOWED, f"{mod}: package {pkg} has no place in the layering (add it to ALLOWED and docs/layout.md)"
        for d in sorted(deps):
            dp = _package_of(d)
            if dp != pkg and dp not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {d} ({pkg} may not import {dp})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected
