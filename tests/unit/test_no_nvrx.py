"""Nothing in the library imports NVIDIA resiliency-ext: in-process recovery runs on our own engine (issue 28). Only
the benchmark comparison with its local checkpointing (``tools/bench/compare``) may."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("import_module", "importorskip"):
            names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def test_no_library_module_nor_test_imports_nvidia_resiliency_ext() -> None:
    roots = [REPO / "neighbor_ckpt", REPO / "megatron_patches", REPO / "tests", REPO / "tools"]
    allowed = REPO / "tools" / "bench" / "compare"
    offenders = [str(p.relative_to(REPO)) for root in roots for p in sorted(root.rglob("*.py"))
                 if allowed not in p.parents and any(n.split(".")[0] == "nvidia_resiliency_ext" for n in _imports(p))]
    assert offenders == [], f"these import nvidia_resiliency_ext (or skip without it): {offenders}"
