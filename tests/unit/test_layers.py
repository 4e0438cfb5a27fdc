"""The may-import rules of :mod:`neighbor_ckpt.layers`, checked on every module of the checkout.

Every ``.py`` file of ``neighbor_ckpt``, ``megatron_patches`` and ``tools`` is parsed with :mod:`ast`; every import
in it (module top, inside functions and classes, under ``TYPE_CHECKING`` or ``try``, relative ones,
``importlib.import_module`` of a literal name) is resolved to the module it names and that module's unit. A
failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from neighbor_ckpt.layers import EXCEPTIONS, LAYERS, LIBRARY_ROOTS, OUTSIDE_ROOTS, Layer

REPO = Path(__file__).resolve().parents[2]
SCANNED = (*LIBRARY_ROOTS, "tools")  # tests may import anything: not scanned
TABLE = "neighbor_ckpt/layers.py"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def module_name(rel: Path) -> tuple[str, bool]:
    """``neighbor_ckpt/snapshot/store.py`` -> (``neighbor_ckpt.snapshot.store``, False); a package's ``__init__``
    -> (the package, True)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def unit_of(module: str) -> str:
    """``neighbor_ckpt.snapshot.store`` -> ``neighbor_ckpt.snapshot``; ``neighbor_ckpt`` -> ``neighbor_ckpt``;
    ``tools.bench.plots`` -> ``tools``."""
    parts = module.split(".")
    if parts[0] == "neighbor_ckpt" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _is_module(root: Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imported_modules(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import anywhere in ``tree``. ``from X import name`` names ``X.name``
    when that is a module of the checkout (``from neighbor_ckpt import lightning``, ``from . import moe``), else
    ``X``. ``importlib.import_module`` with a literal name counts; a name computed at run time cannot be seen."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if a.name != "*" and _is_module(root, sub) else base))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _dotted(node.func) in _IMPORT_CALLS):
            found.append((node.lineno, node.args[0].value))  # importlib.import_module("a.b") with a literal name
    return found


_IMPORT_CALLS = {"importlib.import_module", "import_module", "__import__"}


def _dotted(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _ours(root: Path) -> set[str]:
    """Top-level names that are code of this checkout (a package or module at its root), links included."""
    names = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    names |= {p.stem for p in root.glob("*.py")}
    return names | set(LIBRARY_ROOTS) | set(OUTSIDE_ROOTS)


def check(root: Path, layers: tuple[Layer, ...] = LAYERS,
          exceptions: dict[tuple[str, str], str] | None = None, scanned: tuple[str, ...] = SCANNED) -> list[Finding]:
    """Every broken rule under ``root``: imports of a unit a module may not import, units the table lacks, unknown
    top-level packages. An exception that matched nothing is reported too."""
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    table = {layer.unit: layer for layer in layers}
    ours = _ours(root)
    findings: list[Finding] = []
    used: set[tuple[str, str]] = set()
    for top in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                      and (p / "__init__.py").is_file() and p.name not in table):
        findings.append(Finding(f"{top.name}/__init__.py", 1, f"top-level package {top.name!r} is not in the layer "
                                f"table: add {top.name} to LAYERS in {TABLE} (what it is, what it may import)"))
    for top in scanned:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part == "__pycache__" for part in rel.parts) or any(
                    (root / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts) + 1)):
                continue
            module, is_package = module_name(rel)
            unit = unit_of(module)
            own = table.get(unit)
            if own is None:
                findings.append(Finding(str(rel), 1, f"{unit} is not in the layer table: add {unit} to LAYERS in "
                                        f"{TABLE} (what it is, what it may import)"))
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
            for line, target in imported_modules(tree, module, is_package, root):
                if target.split(".")[0] not in ours:
                    continue  # the standard library or a third party
                target_unit = unit_of(target)
                if target_unit == unit:
                    continue
                if target_unit not in table:
                    findings.append(Finding(str(rel), line, f"imports {target}: {target_unit} is not in the layer "
                                            f"table: add {target_unit} to LAYERS in {TABLE}"))
                    continue
                if target_unit in own.may_import:
                    continue
                if (module, target) in exceptions:
                    used.add((module, target))
                    continue
                where = "above it" if unit in below(table, target_unit) else "not below it"
                findings.append(Finding(str(rel), line, f"{unit} imports {target} ({target_unit}, {where}); {unit} "
                                        f"may import only {', '.join(sorted(own.may_import)) or 'nothing of ours'} "
                                        f"({TABLE})"))
    for key in sorted(set(exceptions) - used):
        findings.append(Finding(TABLE, 1, f"the exception {key[0]} -> {key[1]} matched no import: remove it from "
                                f"EXCEPTIONS"))
    return findings


def below(table: dict[str, Layer], unit: str) -> set[str]:
    """Every unit ``unit`` may import, directly or through the units it may import."""
    seen: set[str] = set()
    todo = list(table[unit].may_import)
    while todo:
        u = todo.pop()
        if u not in seen:
            seen.add(u)
            todo += table[u].may_import if u in table else []
    return seen


def table_findings(layers: tuple[Layer, ...]) -> list[str]:
    """The table is ordered bottom up: an entry names only units listed before it (so no cycle), each unit once."""
    problems: list[str] = []
    seen: set[str] = set()
    for layer in layers:
        if layer.unit in seen:
            problems.append(f"{layer.unit} is listed twice")
        later = sorted(layer.may_import - seen)
        if later:
            problems.append(f"{layer.unit} may import {', '.join(later)}, listed after it (or not at all): the table "
                            f"is ordered bottom up")
        seen.add(layer.unit)
    return problems


# -- the checkout -------------------------------------------------------------------------------------------------


def test_no_module_imports_a_layer_above_it_or_a_unit_missing_from_the_table():
    findings = check(REPO)
    assert not findings, "may-import rules broken (neighbor_ckpt/layers.py):\n" + "\n".join(map(str, findings))


def test_the_table_is_ordered_bottom_up_without_cycles():
    assert not table_findings(LAYERS)


def test_the_library_never_imports_what_lies_outside_it():
    library = {layer.unit for layer in LAYERS if layer.unit.split(".")[0] in LIBRARY_ROOTS}
    for layer in LAYERS:
        if layer.unit in library:
            assert not layer.may_import & set(OUTSIDE_ROOTS), layer.unit


def test_megatron_patches_may_import_only_the_errors():
    [layer] = [la for la in LAYERS if la.unit == "megatron_patches"]
    assert layer.may_import == {"neighbor_ckpt.errors"}


def units_imported_by(root: Path, unit: str) -> set[str]:
    """The units of ours the modules of ``unit`` import (its own not counted)."""
    ours, found = _ours(root), set()
    for path in sorted((root / Path(*unit.split("."))).rglob("*.py")):
        module, is_package = module_name(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found |= {unit_of(t) for _, t in imported_modules(tree, module, is_package, root) if t.split(".")[0] in ours}
    return found - {unit}


@pytest.mark.parametrize("unit", ["neighbor_ckpt.lightning", "neighbor_ckpt.bridge"])
def test_the_framework_glue_reaches_the_library_through_the_glue_only(unit):
    # Thin glue: a framework callback talks to the checkpointer, the shared glue, the in-process engine and the
    # megatron-core patches (plus the errors and the configuration); its row allows exactly what it imports.
    [layer] = [la for la in LAYERS if la.unit == unit]
    assert layer.may_import == {"neighbor_ckpt.errors", "neighbor_ckpt.config", "neighbor_ckpt.checkpointer",
                                "neighbor_ckpt.glue", "neighbor_ckpt.inprocess", "megatron_patches"}
    assert units_imported_by(REPO, unit) == layer.may_import


# -- the checker itself catches what it must ---------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


BASE = {
    "neighbor_ckpt/__init__.py": "",
    "neighbor_ckpt/errors.py": "",
    "neighbor_ckpt/snapshot/__init__.py": "",
    "neighbor_ckpt/snapshot/store.py": "from neighbor_ckpt.errors import X\nfrom . import slot\n",
    "neighbor_ckpt/snapshot/slot.py": "import os\nimport torch\n",
    "neighbor_ckpt/recovery/__init__.py": "",
    "neighbor_ckpt/recovery/flow.py": "from ..snapshot.store import Y\n",
    "neighbor_ckpt/cli/__init__.py": "",
    "neighbor_ckpt/cli/main.py": "from neighbor_ckpt.recovery import flow\n",
    "tools/__init__.py": "",
    "tools/bench.py": "from neighbor_ckpt.cli.main import main\n",
}


def test_a_clean_tree_passes(tmp_path):
    assert check(_tree(tmp_path, BASE), exceptions={}) == []


@pytest.mark.parametrize("rel, text, line, names", [
    ("neighbor_ckpt/snapshot/engine.py", "import os\n\ndef f():\n    from neighbor_ckpt.recovery import flow\n",
     4, "neighbor_ckpt.recovery.flow"),  # function-local, absolute
    ("neighbor_ckpt/snapshot/engine.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from ..recovery.flow import Z\n", 3, "neighbor_ckpt.recovery.flow"),  # relative, level 2
    ("neighbor_ckpt/snapshot/engine.py", "import neighbor_ckpt.cli.main as m\n", 1, "neighbor_ckpt.cli.main"),
    ("neighbor_ckpt/snapshot/engine.py", "from neighbor_ckpt import recovery\n", 1, "neighbor_ckpt.recovery"),
    ("neighbor_ckpt/snapshot/engine.py", "from neighbor_ckpt import NeighborCheckpointer\n", 1, "neighbor_ckpt "),
    ("neighbor_ckpt/recovery/x.py", "try:\n    import tools.bench\nexcept ImportError:\n    pass\n", 2,
     "tools.bench"),  # the library importing what lies outside it
    ("neighbor_ckpt/snapshot/engine.py", "import importlib\n\ndef f():\n"
     "    return importlib.import_module('neighbor_ckpt.cli.main')\n", 4, "neighbor_ckpt.cli.main"),
    ("neighbor_ckpt/errors.py", "class X(Exception):\n    def f(self):\n        from . import snapshot\n", 3,
     "neighbor_ckpt.snapshot"),  # `from . import` in a top-level module
])
def test_an_upward_import_is_named_with_its_file_and_line(tmp_path, rel, text, line, names):
    findings = check(_tree(tmp_path, {**BASE, rel: text}), exceptions={})
    assert len(findings) == 1, findings
    [f] = findings
    assert f.path == rel and f.line == line and names in f.text + " ", f
    assert "above it" in f.text and "may import only" in f.text and str(f).startswith(f"{rel}:{line}: ")


def test_siblings_of_one_layer_may_not_import_each_other(tmp_path):
    findings = check(_tree(tmp_path, {**BASE, "neighbor_ckpt/planning/__init__.py": "",
                                      "neighbor_ckpt/planning/p.py": "from neighbor_ckpt.report import status\n",
                                      "neighbor_ckpt/report/__init__.py": "",
                                      "neighbor_ckpt/report/status.py": ""}), exceptions={})
    assert [(f.path, f.line) for f in findings] == [("neighbor_ckpt/planning/p.py", 1)]
    assert "not below it" in findings[0].text


@pytest.mark.parametrize("rel", ["neighbor_ckpt/newthing/__init__.py", "neighbor_ckpt/newthing.py"])
def test_a_unit_missing_from_the_table_fails_saying_to_add_it(tmp_path, rel):
    findings = check(_tree(tmp_path, {**BASE, rel: "from neighbor_ckpt.errors import X\n"}), exceptions={})
    assert [f.path for f in findings] == [rel]
    assert "add neighbor_ckpt.newthing to LAYERS in neighbor_ckpt/layers.py" in findings[0].text


def test_an_import_of_a_unit_missing_from_the_table_fails(tmp_path):
    findings = check(_tree(tmp_path, {**BASE, "neighbor_ckpt/snapshot/e.py": "from neighbor_ckpt.ghost import g\n"}),
                     exceptions={})
    assert [(f.path, f.line) for f in findings] == [("neighbor_ckpt/snapshot/e.py", 1)]
    assert "add neighbor_ckpt.ghost" in findings[0].text


def test_a_new_top_level_package_fails_saying_to_add_it(tmp_path):
    findings = check(_tree(tmp_path, {**BASE, "benchmarks2/__init__.py": ""}), exceptions={})
    assert len(findings) == 1 and "add benchmarks2 to LAYERS" in findings[0].text


def test_an_exception_allows_exactly_its_import_and_a_stale_one_fails(tmp_path):
    upward = {**BASE, "neighbor_ckpt/snapshot/e.py": "from neighbor_ckpt.recovery.flow import Z\n"}
    key = ("neighbor_ckpt.snapshot.e", "neighbor_ckpt.recovery.flow")
    assert check(_tree(tmp_path / "a", upward), exceptions={key: "why"}) == []
    stale = check(_tree(tmp_path / "b", BASE), exceptions={key: "why"})
    assert len(stale) == 1 and "matched no import" in stale[0].text


def test_a_table_out_of_order_is_caught():
    bad = (Layer("neighbor_ckpt.snapshot", frozenset({"neighbor_ckpt.recovery"}), ""),
           Layer("neighbor_ckpt.recovery", frozenset({"neighbor_ckpt.snapshot"}), ""))
    assert table_findings(bad) == ["neighbor_ckpt.snapshot may import neighbor_ckpt.recovery, listed after it (or "
                                   "not at all): the table is ordered bottom up"]
