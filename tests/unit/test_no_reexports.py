"""Every name is imported from the module that defines it; a package ``__init__`` re-exports only README's API.

A re-export hides where a name lives: a reader who follows ``from neighbor_ckpt.snapshot.store import SlotFile``
lands in a module that only passes the name on. So, over the library, the tools and the tests (parsed, nothing
imported):

* ``from M import name`` of a module of ours names the module that defines ``name`` (a ``def``, a ``class``, an
  assignment, or a submodule of that name), except the names a package ``__init__`` offers as public API;
* a package ``__init__``'s public API (its ``__all__`` and lazy ``__getattr__`` names) is :data:`PUBLIC_API`, and every
  name of it is shown in README.md or docs/; a tool package offers only its entry point (:data:`ENTRY_POINTS`);
* a module's ``__all__`` lists only what the module defines.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("neighbor_ckpt", "megatron_patches", "tools")
"""The top-level packages whose names are checked: the library and the tools around it."""
SCANNED = ("neighbor_ckpt", "megatron_patches", "tools", "tests")
"""The folders whose imports are checked."""

PUBLIC_API: dict[str, frozenset[str]] = {
    "neighbor_ckpt": frozenset({"NeighborCheckpoint", "NeighborCheckpointer", "NeighborCkptConfig",
                                "prepare_torchrun_restart"}),
    "neighbor_ckpt.adapters": frozenset({"TorchOptimizerAdapter", "MegatronOptimizerAdapter", "pin_bucket_layout",
                                         "declare_buffers", "classify_buffers"}),
    "neighbor_ckpt.bridge": frozenset({"NeighborCheckpoint"}),
    "neighbor_ckpt.lightning": frozenset({"NeighborCheckpoint"}),
    "neighbor_ckpt.inprocess": frozenset({"InprocessRecovery"}),
    "megatron_patches": frozenset({"enable_cpu", "mcore_groups", "install_hooks"}),
}
"""What each package ``__init__`` of the library offers: the names README shows imported from the package."""
ENTRY_POINTS: dict[str, frozenset[str]] = {
    "tools.bench.micro": frozenset({"main"}),
    "tools.bench.compare": frozenset({"main"}),
}
"""What a tool package offers: the entry point ``tools/bench/__main__.py`` calls. The tools are no API."""



def _offered(package: str) -> frozenset[str]:
    return PUBLIC_API.get(package, frozenset()) | ENTRY_POINTS.get(package, frozenset())


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def _module(dotted: str) -> Module | None:
    base = ROOT.joinpath(*dotted.split("."))
    if (base / "__init__.py").is_file():
        return Module(dotted, base / "__init__.py", True)
    if base.with_suffix(".py").is_file():
        return Module(dotted, base.with_suffix(".py"), False)
    return None


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module's statements, including those inside top-level ``if`` / ``try`` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@lru_cache(maxsize=None)
def _defined(path: Path) -> frozenset[str]:
    """The names a module binds itself: ``def``, ``class``, assignments (imports excluded)."""
    names: set[str] = set()
    for node in _top_level(_tree(path).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _all(path: Path) -> list[str]:
    for node in _top_level(_tree(path).body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def _lazy(path: Path) -> set[str]:
    """The names a package's ``__getattr__`` hands out (``if name == "X"`` / ``if name in ("X", ...)``)."""
    names: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            for cmp in ast.walk(node):
                if isinstance(cmp, ast.Compare):
                    names.update(c.value for c in ast.walk(cmp) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def _where_defined(name: str, module: Module, seen: frozenset[str] = frozenset()) -> str | None:
    """The module that defines ``name`` when ``module`` only imports it (followed through imports)."""
    for node in _top_level(_tree(module.path).body):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(node, module.path)
                    target = _module(source) if source else None
                    if target is None or source in seen:
                        return source
                    if alias.name in _defined(target.path) or _module(f"{source}.{alias.name}"):
                        return source
                    return _where_defined(alias.name, target, seen | {module.name}) or source
    return None


def _absolute(node: ast.ImportFrom, path: Path) -> str | None:
    if not node.level:
        return node.module
    package = path.relative_to(ROOT).parent.parts
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ((node.module,) if node.module else ()))


def _scanned_files() -> list[Path]:
    files: list[Path] = []
    for folder in SCANNED:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    problems: list[str] = []
    for path in _scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(node, path)
            if source is None or source.split(".")[0] not in OURS:
                continue
            module = _module(source)
            if module is None:
                continue  # not a file of this checkout (an optional module): the import itself would fail
            for alias in node.names:
                name = alias.name
                if name == "*":
                    problems.append(f"{rel}:{node.lineno}: `from {source} import *`: import each name from the "
                                    "module that defines it")
                    continue
                if name in _defined(module.path) or _module(f"{source}.{name}") is not None:
                    continue
                if module.is_package and name in _offered(source):
                    continue
                home = _where_defined(name, module) or "(not found: a lazy name?)"
                problems.append(f"{rel}:{node.lineno}: `{name}` imported from {source}, which does not define it: "
                                f"import it from {home}")
    assert not problems, "re-exported names imported:\n" + "\n".join(problems)


def _packages() -> list[Module]:
    out: list[Module] = []
    for top in OURS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            dotted = ".".join(init.relative_to(ROOT).parent.parts)
            out.append(Module(dotted, init, True))
    return out


def test_a_package_init_offers_only_the_public_api_readme_shows() -> None:
    problems: list[str] = []
    for package in _packages():
        offered = set(_all(package.path)) | _lazy(package.path)
        extra = offered - _offered(package.name)
        extra -= _defined(package.path)  # what the __init__ defines itself (neighbor_ckpt.recipes' paths)
        missing = _offered(package.name) - offered
        rel = package.path.relative_to(ROOT).as_posix()
        if extra:
            problems.append(f"{rel}: offers {sorted(extra)}, which README does not show as {package.name}'s API: "
                            "take them out of __all__ (and their users import them from the defining module)")
        if missing:
            problems.append(f"{rel}: PUBLIC_API / ENTRY_POINTS say it offers {sorted(missing)}, but its __all__ "
                            "does not")
    assert not problems, "\n".join(problems)


def test_every_public_name_is_shown_in_readme_or_docs() -> None:
    text = (ROOT / "README.md").read_text()
    if (ROOT / "docs").is_dir():
        text += "".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    unshown = sorted(f"{package}.{name}" for package, names in PUBLIC_API.items() for name in names
                     if not re.search(rf"\b{re.escape(name)}\b", text))
    assert not unshown, f"public API that neither README.md nor docs/ shows: {unshown}"


def test_a_module_all_lists_only_what_it_defines() -> None:
    problems: list[str] = []
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            foreign = set(_all(path)) - _defined(path)
            if foreign:
                module = Module(dotted, path, False)
                homes = ", ".join(f"{n} (from {_where_defined(n, module)})" for n in sorted(foreign))
                problems.append(f"{path.relative_to(ROOT).as_posix()}: __all__ re-exports {homes}: take them out; "
                                "users import them from there")
    assert not problems, "\n".join(problems)
