"""The package's shape: the planner and configuration work without torch; the packages import
one another only along the arrows of docs/architecture.md (the neutral layer at the bottom, the
planner beside the runtime, the trainer and CLI on top); no import cycle; modules are at most
600 lines and formatted as written. Each rule is shown to fail on a planted violation."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tetrad

PACKAGE = Path(tetrad.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_LINES = 600
RUNTIME = {
    "train",
    "parallel",
    "pipeline",
    "models",
    "comm",
    "data",
    "grid",
    "device",
    "dtypes",
    "torch_private",
}
"""The runtime's packages and top-level modules: the planner imports none of them."""

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
        "import tetrad.plan, tetrad.train.config, tetrad.spec.presets, tetrad.spec.precision\n"
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


def long_modules(package: Path = PACKAGE, limit: int = MAX_LINES) -> dict[str, int]:
    """The modules of ``package`` over ``limit`` lines, with their line counts."""
    return {
        str(p.relative_to(package)): n
        for p in package.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > limit
    }


def test_modules_are_at_most_600_lines():
    """A concept that outgrows a file becomes a package of sub-concepts (docs/architecture.md)."""
    assert not long_modules(), f"modules over {MAX_LINES} lines: {long_modules()}"


PRIVATE_MEMBERS = {
    "_flatten",
    "args_recv_info",
    "grad_recv_info",
    "_post_metadata_inference_cleanup",
    "_setup_forward_recv_info",
    "_setup_backward_recv_info",
}
"""Private members of torch objects (``DeviceMesh``, ``PipelineStage``) that only
``tetrad/torch_private.py`` may touch, besides every ``torch._x`` and ``dist._x``."""


def private_torch_uses(package: Path = PACKAGE) -> list[str]:
    """Where a module other than ``torch_private.py`` uses a private torch API: ``torch._x``
    or ``dist._x`` (an underscore name anywhere in an attribute chain from ``torch`` or
    ``dist``), an import of such a name or module, or a member of :data:`PRIVATE_MEMBERS`
    (read, or defined as an override)."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(package))
        if rel == "torch_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            what = None
            if isinstance(node, ast.Attribute):
                chain, root = [node.attr], node.value
                while isinstance(root, ast.Attribute):
                    chain.append(root.attr)
                    root = root.value
                from_torch = isinstance(root, ast.Name) and root.id in ("torch", "dist")
                if node.attr in PRIVATE_MEMBERS or (
                    from_torch and any(a.startswith("_") for a in chain)
                ):
                    what = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [*node.module.split("."), *(a.name for a in node.names)]
                what = next((n for n in names if n.startswith("_")), None)
            elif isinstance(node, ast.Import):
                names = [
                    n for a in node.names if a.name.startswith("torch") for n in a.name.split(".")
                ]
                what = next((n for n in names if n.startswith("_")), None)
            elif isinstance(node, ast.FunctionDef) and node.name in PRIVATE_MEMBERS:
                what = node.name
            if what:
                bad.append(f"{rel}:{node.lineno} {what}")
    return bad


def test_private_torch_apis_only_in_torch_private():
    """Every private torch API sits behind tetrad/torch_private.py, the one module whose tests
    ``make test-torch-min`` runs on the minimum torch."""
    assert not private_torch_uses(), private_torch_uses()


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


# ---- package layering ----------------------------------------------------------------------


def _unit(module: str) -> str:
    """The package (or top-level module) of ``tetrad.X.Y``: ``X``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_imports(package: Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """For each package (or top-level module) of ``package``, the other ones it imports, each
    with the modules that do so: every ``import`` in the file, module level or inside a
    function (a lazy import is still an arrow)."""
    name = package.name
    out: dict[str, dict[str, list[str]]] = {}
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package.parent)
        if module == name:  # the package's own __init__
            continue
        inner = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out.setdefault(_unit(module), {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = inner.split(".")[: len(inner.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in names:
                if target.startswith(name + ".") and _unit(target) != _unit(module):
                    users = out[_unit(module)].setdefault(_unit(target), [])
                    if module not in users:
                        users.append(module)
    return out


def package_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Every set of two or more packages that import one another round a cycle."""
    graph = package_imports(package)
    reach = {a: set(targets) for a, targets in graph.items()}
    changed = True
    while changed:  # transitive closure (a dozen packages)
        changed = False
        for a in reach:
            more = set().union(*(reach.get(b, set()) for b in reach[a])) - reach[a]
            if more:
                reach[a] |= more
                changed = True
    cycles = {frozenset({a} | {b for b in reach[a] if a in reach.get(b, set())}) for a in reach}
    return sorted(sorted(c) for c in cycles if len(c) > 1)


def layering_violations(package: Path = PACKAGE) -> list[str]:
    """The arrows the layering forbids, whatever the architecture document says: ``models``
    imports no planner; the planner imports no runtime package (:data:`RUNTIME`), no trainer
    and no CLI; ``pipeline`` does not import ``train``; the neutral ``spec`` imports nothing
    of tetrad's; and in the runtime only ``train.auto`` imports the planner (its one door)."""
    graph = package_imports(package)
    rules = [
        ("models", {"plan"}),
        ("plan", RUNTIME | {"train", "cli", "calibrate"}),
        ("pipeline", {"train"}),
        ("spec", set(graph.get("spec", {}))),  # anything of tetrad's
    ]
    bad = [
        f"{a} imports {b} ({', '.join(graph[a][b])})"
        for a, forbidden in rules
        for b in sorted(forbidden & set(graph.get(a, {})))
    ]
    door = f"{package.name}.train.auto"
    bad += [
        f"{m} imports plan: the runtime asks the planner through {door} only"
        for a in sorted(RUNTIME)
        for m in graph.get(a, {}).get("plan", [])
        if m != door
    ]
    return bad


def documented_arrows(doc: Path = ARCHITECTURE) -> dict[str, set[str]]:
    """The allowed arrows of docs/architecture.md: the lines ``    package -> a, b, c`` of its
    fenced block that follows the line ``Allowed arrows``."""
    text = doc.read_text()
    block = text[text.index("Allowed arrows") :].split("```")[1]
    arrows = {}
    for line in block.splitlines():
        m = re.match(r"\s*([a-z_]+)\s+->\s+(.*?)\s*(?:\(|$)", line)
        if m:
            targets = {t.strip() for t in m.group(2).split(",") if t.strip() not in ("", "-")}
            arrows[m.group(1)] = targets
    return arrows


def test_no_package_cycles():
    assert not package_cycles(), f"packages importing one another: {package_cycles()}"


def test_layering():
    assert not layering_violations(), layering_violations()


def test_architecture_document_matches_the_imports():
    """docs/architecture.md's arrows are exactly the imports: every arrow the code has is
    documented, and every documented arrow is used."""
    actual = {a: set(b) for a, b in package_imports().items()}
    documented = documented_arrows()
    missing = {a: sorted(b - documented.get(a, set())) for a, b in actual.items()}
    unused = {a: sorted(b - actual.get(a, set())) for a, b in documented.items()}
    assert not any(missing.values()), f"arrows missing from docs/architecture.md: {missing}"
    assert not any(unused.values()), f"arrows docs/architecture.md has but the code lacks: {unused}"
    assert set(documented) == set(actual), set(documented) ^ set(actual)


# ---- each rule fails on a planted violation ------------------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``tetrad`` under ``tmp_path`` made of ``files`` (path -> source), with the
    ``__init__.py`` files its folders need."""
    root = tmp_path / "tetrad"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    "files, words",
    [
        ({"models/llama.py": "from tetrad.plan.search import plan\n"}, "models imports plan"),
        (
            {"plan/cost.py": "def f():\n    from tetrad.parallel import x\n"},
            "plan imports parallel",
        ),
        ({"plan/cost.py": "from tetrad.train.config import C\n"}, "plan imports train"),
        ({"plan/cost.py": "import tetrad.comm\n"}, "plan imports comm"),
        ({"pipeline/step.py": "from tetrad.train.step import f\n"}, "pipeline imports train"),
        ({"spec/model.py": "from tetrad.plan.errors import E\n"}, "spec imports plan"),
        ({"train/peak.py": "from tetrad.plan.machine import m\n"}, "through tetrad.train.auto"),
    ],
)
def test_layering_fails_on_a_planted_violation(tmp_path, files, words):
    root = _plant(tmp_path, {"train/auto.py": "from tetrad.plan import search\n", **files})
    bad = layering_violations(root)
    assert any(words in b for b in bad), bad
    assert not layering_violations(_plant(tmp_path / "clean", {"train/auto.py": "import os\n"}))


def test_package_cycle_fails_on_a_planted_one(tmp_path):
    root = _plant(
        tmp_path,
        {
            "train/trainer.py": "from tetrad.pipeline.step import f\n",
            "pipeline/step.py": "def g():\n    from tetrad.train.step import h\n",
        },
    )
    assert package_cycles(root) == [["pipeline", "train"]]


def test_module_length_fails_on_a_planted_long_module(tmp_path):
    root = _plant(tmp_path, {"plan/long.py": "x = 1\n" * (MAX_LINES + 1), "plan/ok.py": "y = 2\n"})
    assert long_modules(root) == {"plan/long.py": MAX_LINES + 1}


def test_architecture_check_fails_on_an_undocumented_arrow(tmp_path):
    doc = tmp_path / "architecture.md"
    doc.write_text(
        "Allowed arrows:\n\n```\n    train -> spec, plan  (the door)\n    plan  -> spec\n```\n"
    )
    assert documented_arrows(doc) == {"train": {"spec", "plan"}, "plan": {"spec"}}
    root = _plant(tmp_path, {"train/auto.py": "from tetrad.models import x\n"})
    actual = {a: set(b) for a, b in package_imports(root).items()}
    assert actual["train"] - documented_arrows(doc)["train"] == {"models"}


@pytest.mark.parametrize(
    "source, what",
    [
        ("import torch\nn = torch._foreach_norm([])\n", "_foreach_norm"),
        ("from torch._dynamo.utils import counters\n", "_dynamo"),
        ("import torch.distributed as dist\ndist.distributed_c10d._world\n", "_world"),
        ("def f(mesh):\n    return mesh._flatten('a')\n", "_flatten"),
        ("class S:\n    def _setup_forward_recv_info(self):\n        pass\n", "_setup_forward"),
    ],
)
def test_private_torch_check_fails_on_a_planted_use(tmp_path, source, what):
    root = _plant(tmp_path, {"parallel/x.py": source, "torch_private.py": source})
    bad = private_torch_uses(root)
    assert len(bad) == 1 and bad[0].startswith("parallel/x.py:") and what in bad[0], bad
    assert not private_torch_uses(_plant(tmp_path / "ok", {"parallel/x.py": "x = self._y\n"}))
