"""The layers hold: the import graph of every file in grpo_lightning/, read from its source (ast, imports
inside functions included), and the tables of docs/architecture.md, checked against the tree.

- `grpo_lightning.core` is pure: no core file imports Lightning, directly or through another of our
  modules;
- no arrow runs up a layer (core < io < training, from_trl < demo, offline < the entry points): core
  imports nothing from io or training, io nothing from training, the library layers nothing from demo or
  offline, and only the entry points import `training.module`; the converter of TRL recipes (`from_trl`)
  and `training` stand side by side and never import each other;
- core is a stack: its files and subpackages in one order (`CORE_ORDER`), each importing only its own unit
  and the units below it, so no circle runs between them, at folder level either;
- no import circle among the package's files;
- docs/architecture.md's tables name every .py file of the package, and no file that is not there;
- its "Where each file is tested" table gives each file the tests that import or name it.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_lightning"
LIGHTNING = ("lightning", "pytorch_lightning")
ENTRY_POINTS = ("grpo_lightning.cli", "grpo_lightning.sagemaker")  # the CLI and the SageMaker job


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def imports(module: str) -> frozenset[str]:
    """Every module that `module`'s source imports, anywhere in the file (`from a import b` counts `a`, and
    `a.b` when that is one of our modules)."""
    found = set()
    for node in ast.walk(ast.parse(FILES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in FILES)
    return frozenset(found)


@cache
def reaches(module: str) -> frozenset[str]:
    """Every module that importing `module` imports, through our own modules (and their packages)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        for name in imports(current):
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
            for reached in [name, *parents]:
                if reached not in seen:
                    seen.add(reached)
                    if reached in FILES and reached != "grpo_lightning":  # the package's own lazy __init__
                        todo.append(reached)
    return frozenset(seen)


def is_lightning(name: str) -> bool:
    return name.split(".")[0] in LIGHTNING


def layer(module: str) -> str | None:
    parts = module.split(".")
    layers = ("core", "training", "from_trl", "io", "demo", "offline")
    return parts[1] if len(parts) > 2 and parts[1] in layers else None


CORE = [m for m in FILES if layer(m) == "core"]


def test_the_tree_has_three_layers_and_the_rule_sees_them():
    assert {layer(m) for m in FILES} == {"core", "training", "from_trl", "io", "demo", "offline", None}
    assert len(CORE) >= 10 and "grpo_lightning.core.algorithm.loss" in CORE
    # The rule can fail: the module reaches Lightning through our own files.
    assert any(is_lightning(m) for m in reaches("grpo_lightning.training.module"))


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_lightning_even_indirectly(module):
    direct = sorted(m for m in imports(module) if is_lightning(m))
    assert not direct, f"{module} imports {direct}"
    indirect = sorted(m for m in reaches(module) if is_lightning(m))
    assert not indirect, f"{module} reaches Lightning ({indirect}) through our modules"


@pytest.mark.parametrize("module", [m for m in FILES if not m.startswith(ENTRY_POINTS)])
def test_only_the_entry_points_import_the_module(module):
    if module == "grpo_lightning.training.module":
        return
    assert "grpo_lightning.training.module" not in imports(module)
    assert not [m for m in imports(module) if m.startswith(ENTRY_POINTS)]


# Core's units, bottom to top: the shared types and helpers; rewards (what a completion is worth), and the
# accuracy metrics that read their answer extraction; the tools a policy calls; generation (sampling and
# log-probs, the multi-turn loop over the tools); the algorithm's maths (advantages, loss, schedules); the
# group source, where an update's scored groups come from (sampling, rewards, dynamic sampling's buffer); the
# update of a rollout; and the config, which composes the options of the units below (their registries, the
# sampling settings).
CORE_ORDER = (
    "grpo_lightning.core",
    "grpo_lightning.core.types",
    "grpo_lightning.core.options",
    "grpo_lightning.core.flat_names",
    "grpo_lightning.core.stop_requests",
    "grpo_lightning.core.ranks",
    "grpo_lightning.core.rng",
    "grpo_lightning.core.memory",
    "grpo_lightning.core.rewards",
    "grpo_lightning.core.metrics",
    "grpo_lightning.core.chat_template",
    "grpo_lightning.core.tools",
    "grpo_lightning.core.generation",
    "grpo_lightning.core.algorithm",
    "grpo_lightning.core.async_group_source",
    "grpo_lightning.core.group_source",
    "grpo_lightning.core.update",
    "grpo_lightning.core.config",
)


def core_unit(module: str) -> str:
    """The unit of `CORE_ORDER` that holds the core module `module` (a file, or a file of a subpackage)."""
    units = [u for u in CORE_ORDER if module == u or module.startswith(u + ".")]
    return max(units, key=len)


def test_core_order_names_every_core_unit():
    top = {".".join(m.split(".")[:3]) for m in CORE}
    assert top | {"grpo_lightning.core"} == set(CORE_ORDER)
    assert core_unit("grpo_lightning.core.generation.sampling") == "grpo_lightning.core.generation"


@pytest.mark.parametrize("module", CORE)
def test_core_imports_only_its_own_unit_and_those_below(module):
    rank = CORE_ORDER.index(core_unit(module))
    above = sorted(
        m for m in own_imports(module) if layer(m) == "core" and CORE_ORDER.index(core_unit(m)) > rank
    )
    assert not above, f"{module} ({core_unit(module)}) imports {above} from a unit above it in CORE_ORDER"


def test_core_units_form_no_circle():
    graph: dict[str, set[str]] = {}
    for module in CORE:
        unit = core_unit(module)
        graph.setdefault(unit, set()).update(
            core_unit(m) for m in own_imports(module) if layer(m) == "core" and core_unit(m) != unit
        )
    assert circles(graph) == []


# Each layer may import its own and those below it: core < io < training, from_trl < demo, offline < the entry
# points.
LEVELS = {"core": 0, "io": 1, "training": 2, "from_trl": 2, "demo": 3, "offline": 3, None: 4}


def own_imports(module: str) -> set[str]:
    """The package's files that `module` imports (the package's own lazy `__init__` aside)."""
    return {m for m in imports(module) if m in FILES and m != "grpo_lightning"}


@pytest.mark.parametrize("module", list(FILES))
def test_no_arrow_runs_up_a_layer(module):
    upward = sorted(m for m in own_imports(module) if LEVELS[layer(m)] > LEVELS[layer(module)])
    assert not upward, f"{module} ({layer(module)}) imports {upward} from a layer above"
    beside = sorted(m for m in own_imports(module) if {layer(m), layer(module)} == {"demo", "offline"})
    assert not beside, f"{module} imports {beside}"


BESIDE = {"from_trl": "training", "training": "from_trl"}  # the two layers of level 2, side by side


@pytest.mark.parametrize("module", [m for m in FILES if layer(m) in BESIDE])
def test_from_trl_and_training_never_import_each_other(module):
    beside = sorted(m for m in imports(module) if layer(m) == BESIDE[layer(module)])
    assert not beside, f"{module} ({layer(module)}) imports {beside}"


def test_the_converter_has_its_layer_beside_training():
    assert layer("grpo_lightning.from_trl.converter") == "from_trl"  # the rule above sees its files
    assert LEVELS["from_trl"] == LEVELS["training"] > LEVELS["io"]
    assert len([m for m in FILES if layer(m) == "from_trl"]) >= 7


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` ({module: the modules it imports}): its strongly connected components of
    more than one module, and modules that import themselves (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_even_through_imports_inside_functions():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it can fail
    assert circles({"a": {"b"}, "b": set()}) == []
    assert circles({module: own_imports(module) for module in FILES}) == []


def architecture_paths() -> set[str]:
    tables = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(grpo_lightning/[\w/]+\.py)` \|", tables, re.M))


def test_architecture_tables_name_every_file_of_the_tree():
    in_tree = {str(p.relative_to(ROOT)) for p in FILES.values()}
    named = architecture_paths()
    assert in_tree - named == set(), "files missing from docs/architecture.md"
    assert named - in_tree == set(), "docs/architecture.md names files that do not exist"


def where_tested_table() -> dict[str, list[str]]:
    """docs/architecture.md's "Where each file is tested" table: package file -> its test files."""
    tables = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = tables.split("## Where each file is tested", 1)[1]
    rows = re.findall(r"^\| `(grpo_lightning/[\w/]+\.py)` \| (.+) \|$", section, re.M)
    return {path: re.findall(r"`(tests/(?:vllm_backend/)?test_\w+\.py)`", tests) for path, tests in rows}


def uses(test_file: str, module: str) -> bool:
    """Whether `test_file`'s code reaches `module`, as ast sees it: it imports the module or a name from it
    (anywhere, `from a import b` counting `a.b`), or a string of its code starts with its dotted path (a
    `monkeypatch.setattr` target, a `python -m` command), itself or through a `helpers` module it imports
    (`tests.vllm_backend.helpers`). A docstring or comment naming it does not count."""
    tree = ast.parse((ROOT / test_file).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    for helpers in sorted(m for m in imported if m.startswith("tests.") and m.endswith(".helpers")):
        if uses(str(Path(*helpers.split(".")).with_suffix(".py")), module):
            return True
    docstrings = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if module in (node.module, *(f"{node.module}.{a.name}" for a in node.names)):
                return True
        elif isinstance(node, ast.Import):
            if any(a.name == module or a.name.startswith(f"{module}.") for a in node.names):
                return True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if re.match(rf"{re.escape(module)}(\Z|[.:])", node.value):
                return True
    return False


def test_uses_sees_code_not_docstrings(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    target = "grpo_lightning.core.generation.packing"
    (tmp_path / "named.py").write_text(f'"""{target} and its tests."""\n# {target}\nx = 1\n')
    (tmp_path / "patched.py").write_text(f'def test(m):\n    m.setattr("{target}.pack", None)\n')
    (tmp_path / "imported.py").write_text("from grpo_lightning.core.generation import packing\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "helpers.py").write_text(f"from {target} import pack\n")
    (tmp_path / "helped.py").write_text("from tests.helpers import pack\n")
    assert not uses("named.py", target)  # the check can fail
    assert uses("patched.py", target) and uses("imported.py", target) and uses("helped.py", target)
    assert not uses("patched.py", "grpo_lightning.core.generation.pack")  # a prefix of a name is not it


TESTED_IN = [(path, test) for path, tests in where_tested_table().items() for test in tests or [None]]


def test_the_tested_in_table_names_every_file_of_the_package_and_only_those():
    files = {str(p.relative_to(ROOT)) for m, p in FILES.items() if p.name != "__init__.py"}
    assert set(where_tested_table()) == files


@pytest.mark.parametrize(("path", "test"), TESTED_IN, ids=[f"{p}-{t}" for p, t in TESTED_IN])
def test_each_file_is_tested_where_the_table_says(path, test):
    assert test is not None, f"{path}: no test named"
    assert (ROOT / test).is_file(), f"{test} does not exist"
    module = module_name(ROOT / path)
    assert uses(test, module), f"{test} neither imports {module} nor names it in its code"
