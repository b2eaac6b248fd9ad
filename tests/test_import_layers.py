"""The import graph of `supervisor/`, `policies/` and `flows/` (issue 15): no cycles, and no module imports
from a layer above its own. Built with `ast` from every import statement, function-level ones included (a
lazy import is still a dependency); imports under `if TYPE_CHECKING:` are left out (they never run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("supervisor", "policies", "flows")
#: Bottom to top. A module may import from its own layer and the ones below; the longest prefix that matches
#: a module's name gives its layer.
LAYERS: list[tuple[str, ...]] = [
    (
        "supervisor.errors", "supervisor.exitcodes", "supervisor.events", "supervisor.command",
        "supervisor.layout", "supervisor.spool", "supervisor.flatten", "supervisor.rng",
        "supervisor.stateful", "supervisor.dtypes", "supervisor.smallfile", "supervisor.cgroup", "supervisor.__init__",
        "supervisor.lazy",
        # Pure, standard library only: the policy schema validates script-mode patterns and templates with them.
        "supervisor.script.template", "supervisor.script.output",
    ),
    ("supervisor.data",),
    ("supervisor.state", "supervisor.sharded_state"),
    ("supervisor.checkpoint",),
    ("policies",),
    ("supervisor.monitor", "supervisor.tracking", "supervisor.mlflow_seed", "supervisor.lineage", "supervisor.launcher"),
    ("supervisor.runtime",),
    # Framework callbacks (Lightning, Transformers) drive the runtime's TrainingCore.
    ("supervisor.integrations",),
    ("supervisor.report", "supervisor.orchestrator", "supervisor.script"),
    ("flows",),
    # Commands: each mounts a package's verbs on the CLI and may use anything below.
    (
        "supervisor.cli", "supervisor.demo", "supervisor.drill", "supervisor.checkpoint.cli", "supervisor.commands",
    ),
]  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name] = path
    return out


def _layer(module: str) -> int:
    name = module.removesuffix(".__init__") if module != "supervisor.__init__" else module
    found = [
        (len(p), index)
        for index, prefixes in enumerate(LAYERS)
        for p in prefixes
        if name == p or name.startswith(p + ".")
    ]
    assert found, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return max(found)[1]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside `if TYPE_CHECKING:` blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = {m.removesuffix(".__init__") for m in modules} | set(modules)

    def owner(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if not target:
            return None
        return target if target in modules else target + ".__init__"

    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = (
            module.rpartition(".")[0] if not module.endswith(".__init__") else module[: -len(".__init__")]
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                found = owner(target)
                if found and found != module:
                    edges[module].add(found)
    return edges


def test_every_module_has_a_layer():
    missing = []
    for module in _modules():
        try:
            _layer(module)
        except AssertionError:
            missing.append(module)
    assert missing == [], f"add these to LAYERS: {missing}"


def test_no_import_runs_upward():
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in sorted(_graph().items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert upward == []


def test_no_import_cycles():
    edges = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(_modules()):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a planted upward import and a planted cycle are both reported."""
    fake = {"supervisor.errors": "import supervisor.cli\n", "supervisor.cli": "import supervisor.errors\n"}
    real = _modules()
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: fake.get(_name_of(self, real), _read(self)), raising=True
    )
    assert any("supervisor.errors" in a and "supervisor.cli" in b for a, bs in _graph().items() for b in bs)
    assert _layer("supervisor.cli") > _layer("supervisor.errors")


def _name_of(path: Path, modules: dict[str, Path]) -> str | None:
    return next((name for name, p in modules.items() if p == path), None)


def _read(path: Path) -> str:
    with open(path) as fh:
        return fh.read()
