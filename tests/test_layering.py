"""The packages import one way: data <- model <- parallel <- run <- train / eval <- plan <- commands <- cli
(`genomelm/__init__.py`).

Every module under genomelm/ is parsed (not imported) and every import in it is checked, at module level and
inside functions alike: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "genomelm"

LAYERS = ("data", "model", "parallel", "run", "train", "eval", "plan", "commands", "cli")


def above(layer: str) -> tuple[str, ...]:
    """The packages after `layer` in LAYERS, which it must not import."""
    return tuple(f"genomelm.{name}" for name in LAYERS[LAYERS.index(layer) + 1 :])


# package -> (what it must not import, the exceptions to that)
FORBIDDEN: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "genomelm.data": (above("data"), ()),
    "genomelm.model": (("genomelm.data", *above("model")), ("genomelm.data.vocab",)),
    "genomelm.parallel": (above("parallel"), ()),
    "genomelm.run": (above("run"), ()),
    # training and evaluation sit side by side on the run core: neither imports the other
    "genomelm.train": (above("train"), ()),
    "genomelm.eval": (("genomelm.train", *above("eval")), ()),
    # the planner traces the training step (its memory stack and optimizer), nothing else of training
    "genomelm.plan": (
        ("genomelm.train", *above("plan")),
        ("genomelm.train.step", "genomelm.train.memory", "genomelm.train.optimizer"),
    ),
    "genomelm.commands": (above("commands"), ()),
}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = PACKAGE) -> list[tuple[int, str, str]]:
    """(line, dotted name, the statement) of every import in the file; `from a import b` gives `a.b` (b may be
    a module or a name in `a`), relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}", ast.unparse(node)))
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(path: Path, root: Path = PACKAGE) -> list[str]:
    module = module_name(path, root)
    rules = [rule for package, rule in FORBIDDEN.items() if within(module, package)]
    found = []
    for line, name, statement in imported_names(path, root):
        for forbidden, allowed in rules:
            if any(within(name, f) for f in forbidden) and not any(within(name, a) for a in allowed):
                found.append(f"{path.relative_to(root.parent)}:{line}: {statement}")
    return found


def test_packages_import_one_way() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40  # the walk found the package
    problems = [problem for path in files for problem in violations(path)]
    rules = "; ".join(
        f"{package} must not import {', '.join(forbidden)}"
        + (f" (except {', '.join(allowed)})" if allowed else "")
        for package, (forbidden, allowed) in FORBIDDEN.items()
    )
    assert not problems, f"imports against the layering ({rules}):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("from genomelm.train import checkpoints\n", "parallel/x.py", ["genomelm.train.checkpoints"]),
        ("def f():\n    import genomelm.eval.score\n", "parallel/x.py", ["genomelm.eval.score"]),
        ("from ..train.loop import train\n", "parallel/x.py", ["genomelm.train.loop.train"]),
        ("from . import mesh\n", "parallel/__init__.py", ["genomelm.parallel.mesh"]),
        ("from .vocab import IGNORE_INDEX\n", "data/x.py", ["genomelm.data.vocab.IGNORE_INDEX"]),
    ],
)
def test_imports_are_resolved(tmp_path, source: str, where: str, expected: list[str]) -> None:
    """Module-level, function-level and relative imports all count."""
    root = tmp_path / "genomelm"
    path = root / where
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert [name for _, name, _ in imported_names(path, root)] == expected


def test_a_violation_names_the_file_line_and_import(tmp_path) -> None:
    root = tmp_path / "genomelm"
    (root / "model").mkdir(parents=True)
    (root / "model" / "x.py").write_text(
        "from genomelm.data.vocab import IGNORE_INDEX\nfrom genomelm.data.tokens import labels_for\n"
    )
    assert violations(root / "model" / "x.py", root) == [
        "genomelm/model/x.py:2: from genomelm.data.tokens import labels_for"
    ]


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the genomelm modules it imports (module level or inside functions; a package's
    `__init__` counts as the package)."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, imported, _ in imported_names(path, root):
            if imported in modules:
                targets.add(imported)
            elif imported.rpartition(".")[0] in modules:
                targets.add(imported.rpartition(".")[0])
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle (modules that reach themselves through others), once, from its least name; a
    package importing its own modules (its `__init__` re-exporting them) does not count."""
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for following in sorted(graph.get(path[-1], ())):
            if following == path[0]:
                found.add(tuple(path))
            elif following not in path and following > path[0]:
                walk([*path, following])

    for start in sorted(graph):
        walk([start])
    return [list(c) for c in sorted(found) if not any(within(m, c[0]) and m != c[0] for m in c)]


def test_no_module_reaches_itself_through_others() -> None:
    """The data stage's former circles (augment <-> prepare <-> windows; fasta <-> flatfile / twobit) and any
    new one."""
    graph = module_graph()
    assert graph["genomelm.data.windows"] and graph["genomelm.data.streams"]  # the walk sees imports
    assert cycles(graph) == []


def test_a_circle_is_found_once_and_a_package_init_is_not_one() -> None:
    graph = {
        "genomelm.data.fasta": {"genomelm.data.twobit"},
        "genomelm.data.twobit": {"genomelm.data.fasta"},
        "genomelm.parallel": {"genomelm.parallel.launch"},
        "genomelm.parallel.launch": {"genomelm.parallel"},
    }
    assert cycles(graph) == [["genomelm.data.fasta", "genomelm.data.twobit"]]
