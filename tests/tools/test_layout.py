"""The shape of the house: every module documented and no longer than a reader can hold (800
lines: a guard against a module that does too much, not a budget to split classes by), and no
import cycle between pydflash modules, not even one that only type checking follows."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pydflash"
MODULES = {
    ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
    for p in PKG.rglob("*.py")
}


def imports_of(name: str, path: Path) -> set[str]:
    """pydflash modules `name` imports anywhere in its file (TYPE_CHECKING blocks and
    function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    # importing a.b.c runs the __init__ of a.b first
    found |= {m.rpartition(".")[0] for m in found if m.rpartition(".")[0] in MODULES}
    return {m for m in found if m in MODULES and m != name and not name.startswith(m + ".")}


def test_every_module_is_documented_and_small():
    for name, path in MODULES.items():
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{name} has no docstring"
        assert len(text.splitlines()) <= 800, f"{name}: {len(text.splitlines())} lines"


def test_no_import_cycle():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
