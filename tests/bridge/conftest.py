"""The Megatron-Bridge tier: tests that need megatron-bridge 0.6 on megatron-core 0.19, Python 3.12
(``.venv-bridge``, made by ``scripts/setup --bridge``; run by ``scripts/test --bridge`` and, after the other tiers,
``scripts/test --all``).

Every test here is marked ``bridge``. Where megatron-bridge is not installed (the NeMo environment ``.venv``) they are
deselected, and the summary says so. Under ``scripts/test --bridge`` (:data:`REQUIRED_ENV` set) nothing here may be
left out: a test that is skipped, or that runs where megatron-bridge is missing, fails instead."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

REQUIRED_ENV = "NEIGHBOR_CKPT_BRIDGE_REQUIRED"
"""``NEIGHBOR_CKPT_BRIDGE_REQUIRED=1`` (scripts/test --bridge): a skipped Bridge test fails, none is deselected."""

HERE = Path(__file__).parent
_DESELECTED: list[int] = []


def bridge_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def _required() -> bool:
    return os.environ.get(REQUIRED_ENV) == "1"


def _here(item: pytest.Item) -> bool:
    return HERE in item.path.resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _here(item)]
    for item in ours:
        item.add_marker(pytest.mark.bridge)
    if bridge_version() is not None or _required() or not ours:
        return
    config.hook.pytest_deselected(items=ours)
    items[:] = [item for item in items if not _here(item)]
    _DESELECTED.append(len(ours))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if _required() and _here(item) and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped in the Bridge tier, where every test must run ({REQUIRED_ENV}=1, "
                           f"scripts/test --bridge): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped at import (``pytest.importorskip``) fails too."""
    outcome = yield
    report = outcome.get_result()
    if _required() and report.skipped and HERE in Path(str(collector.path)).resolve().parents:
        report.outcome = "failed"
        report.longrepr = f"skipped at collection in the Bridge tier ({REQUIRED_ENV}=1): {report.longrepr}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _required() and _here(item) and bridge_version() is None:
        pytest.fail(f"megatron-bridge is not installed in {sys.executable}: the Bridge tier runs in .venv-bridge "
                    f"(scripts/setup --bridge)", pytrace=False)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _DESELECTED:
        terminalreporter.write_line(f"bridge tier: {sum(_DESELECTED)} tests deselected here (no megatron-bridge); "
                                    f"scripts/test --bridge runs them in .venv-bridge")
