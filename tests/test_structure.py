"""The package's shape: the planner and configuration work without torch; modules stay short, import
no cycle and are formatted as written."""

import ast
import subprocess
import sys
from pathlib import Path

import tetrad

PACKAGE = Path(tetrad.__file__).parent

HIDE_TORCH = """
import sys

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, Hidden())
"""


def test_planner_and_config_import_without_torch():
    code = HIDE_TORCH + (
        "import tetrad.plan, tetrad.train.config, tetrad.spec\n"
        "import tetrad.plan.cli, tetrad.plan.search.plan, tetrad.plan.search.report\n"
        "import tetrad.plan.step_time\n"
        "from tetrad.train.config import load_config\n"
        "cfg = load_config(None, {'model': 'tiny', 'grid': '1,1,2,2', 'steps': 4})\n"
        "cfg.check()\n"
        "assert cfg.model_config(4096).vocab_size == 4096\n"
        "import tetrad.cli\n"
        "assert tetrad.cli.main(['memory', '--model', 'llama-1b', '--grid', '1,1,2,2']) == 0\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_modules_are_short():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports at module level (``TYPE_CHECKING``
    blocks included: a cycle hidden there is still a cycle between the concepts), with the
    packages that hold them (importing ``a.b.c`` runs ``a.b``'s ``__init__``) except its own
    enclosing packages (already importing when it runs)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):  # TYPE_CHECKING, version checks
            nodes += node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes += node.body + node.orelse + node.finalbody
            nodes += [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    own = name.split(".")
    enclosing = {".".join(own[:k]) for k in range(1, len(own))}
    out = set(found)
    for mod in found:
        parts = mod.split(".")
        out |= {".".join(parts[:k]) for k in range(1, len(parts))} - enclosing
    return (out & modules) - {name}


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Every strongly connected set of two or more modules in ``package``'s module-level import
    graph (Tarjan's algorithm), each sorted."""
    paths = {_module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {m: sorted(_imports(p, package.parent, set(paths))) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert not import_cycles(), f"import cycles in tetrad/: {import_cycles()}"


def test_import_cycle_finder_finds_one(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (pkg / "c.py").write_text("from .a import f\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.b"]]


def test_no_code_folded_past_the_formatter():
    """Code is split by concept, not squeezed to fit the line cap: no ``fmt: skip`` or
    ``fmt: off`` in the package."""
    folded = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not folded, f"formatter switched off at {folded}"
