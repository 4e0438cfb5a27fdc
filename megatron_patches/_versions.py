"""Which megatron-core / NeMo / Megatron-Bridge releases ``megatron_patches`` was written against, and the check that
enforces it.

Everything in ``megatron_patches`` reaches into private names of megatron-core (and, for the NeMo and Bridge parts,
nemo-toolkit and megatron-bridge): module globals such as ``megatron.core.optimizer.USING_PYTORCH_OPTIMIZER``,
attributes of ``DistributedOptimizer`` such as ``gbuf_ranges``. Those move between minor releases, so a version we
have not read is refused up front with a message saying what to pin, instead of failing somewhere deep inside a
training step.

megatron-core 0.15 and 0.19 are both read, but each framework runs on one of them (:data:`MCORE_FOR`): NeMo 2.7.3
(the last NeMo with the LLM collection) on 0.15 (Python 3.11), Megatron-Bridge 0.6 on 0.19 (Python 3.12: every Bridge
from 0.4 and megatron-core from 0.17 require it). Any other pairing is refused by name; the two live in separate
environments (``.venv`` and ``.venv-bridge``, ``scripts/setup``).

Installed versions are read from package metadata (:mod:`importlib.metadata`), never by importing the
packages: ``import nemo`` alone takes seconds and pulls in Lightning.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from typing import Mapping

from neighbor_ckpt.errors import UnsupportedVersionError

__all__ = ["MCORE_FOR", "SUPPORTED", "check_versions", "installed_versions"]

logger = logging.getLogger(__name__)

#: distribution name -> supported release prefixes. "0.15" accepts every 0.15.x; "2.7.3" only 2.7.3.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "megatron-core": ("0.15", "0.19"),
    "nemo-toolkit": ("2.7.3",),
    "megatron-bridge": ("0.6",),
}

#: framework distribution -> the megatron-core releases it runs on (the pairings tested here).
MCORE_FOR: dict[str, tuple[str, ...]] = {
    "nemo-toolkit": ("0.15",),
    "megatron-bridge": ("0.19",),
}

_FRAMEWORK = {"nemo-toolkit": "NeMo 2", "megatron-bridge": "Megatron-Bridge"}

#: What to install when a distribution is missing or unsupported.
_INSTALL_HINT: dict[str, str] = {
    "megatron-core": ("pip install 'neighbor-ckpt[megatron]' (pins megatron-core>=0.15,<0.16, for NeMo 2) or "
                      "'neighbor-ckpt[bridge]' (pins megatron-core>=0.19,<0.20, for Megatron-Bridge; Python 3.12)"),
    "nemo-toolkit": "pip install 'neighbor-ckpt[nemo]' (pins nemo-toolkit[llm]==2.7.3)",
    "megatron-bridge": ("on Python 3.12: pip install 'neighbor-ckpt[bridge]' and then pip install --no-deps "
                        "megatron-bridge==0.6.2 (its metadata requires CUDA-only packages); scripts/setup --bridge "
                        "does both"),
}

#: What to install when a framework meets a megatron-core it does not run on.
_PAIR_HINT: dict[str, str] = {
    "nemo-toolkit": ("keep NeMo in an environment with megatron-core 0.15: pip install "
                     "'neighbor-ckpt[megatron,nemo]'; for Megatron-Bridge on megatron-core 0.19 (an environment "
                     "without NeMo), call enable_cpu(nemo=False)"),
    "megatron-bridge": ("pip install 'neighbor-ckpt[bridge]' (pins megatron-core>=0.19,<0.20) in Bridge's environment "
                        "(Python 3.12)"),
}

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def _release(version: str) -> tuple[int, ...] | None:
    """The numeric release part of a version string: "0.15.3rc1+local" -> (0, 15, 3)."""
    m = _RELEASE.match(version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _matches(version: str, prefixes: tuple[str, ...]) -> bool:
    rel = _release(version)
    if rel is None:
        return False
    for prefix in prefixes:
        want = _release(prefix)
        if want is not None and rel[: len(want)] == want:
            return True
    return False


def _describe(prefixes: tuple[str, ...]) -> str:
    return ", ".join(p + (".x" if p.count(".") < 2 else "") for p in prefixes)


def _problem(dist: str, version: str | None) -> str | None:
    """A message if ``dist`` at ``version`` (None: not installed) is unusable, else None."""
    prefixes = SUPPORTED[dist]
    if version is None:
        return (f"{dist} is not installed; megatron_patches needs {dist} {_describe(prefixes)}. "
                f"Install it: {_INSTALL_HINT[dist]}.")
    if not _matches(version, prefixes):
        return (f"{dist} {version} is installed, but megatron_patches supports {dist} {_describe(prefixes)} only "
                f"(it patches internals that change between releases). Pin a supported version: "
                f"{_INSTALL_HINT[dist]}.")
    return None


def _pairing_problem(framework: str, installed: Mapping[str, str | None]) -> str | None:
    """A message if the installed ``framework`` and megatron-core (both supported) are not a pair it runs on."""
    version, mcore = installed.get(framework), installed.get("megatron-core")
    if version is None or mcore is None or _matches(mcore, MCORE_FOR[framework]):
        return None
    return (f"{_FRAMEWORK[framework]} ({framework} {version}) runs on megatron-core {_describe(MCORE_FOR[framework])} "
            f"only, and megatron-core {mcore} is installed: {_PAIR_HINT[framework]}.")


def _check(installed: Mapping[str, str | None], require_nemo: bool = False, require_bridge: bool = False) -> None:
    """Pure version check over ``{distribution: version or None}``; raises :class:`UnsupportedVersionError`.

    megatron-core is always required. nemo-toolkit is required when ``require_nemo``, megatron-bridge when
    ``require_bridge``: installed, a supported release, and paired with a megatron-core it runs on
    (:data:`MCORE_FOR`). A framework that is installed but not required and fails that only logs a warning (the
    megatron-core patches do not touch it).
    """
    problems = []
    mcore = _problem("megatron-core", installed.get("megatron-core"))
    if mcore:
        problems.append(mcore)
    for framework, required in (("nemo-toolkit", require_nemo), ("megatron-bridge", require_bridge)):
        version = installed.get(framework)
        problem = _problem(framework, version) or (None if mcore else _pairing_problem(framework, installed))
        if problem and required:
            problems.append(problem)
        elif problem and version is not None:
            logger.warning("%s The megatron-core patches still apply; %s integration will refuse to start.",
                           problem, _FRAMEWORK[framework])
    if problems:
        raise UnsupportedVersionError(" ".join(problems))


def installed_versions() -> dict[str, str | None]:
    """``{distribution: installed version or None}`` for every distribution in :data:`SUPPORTED`."""
    out: dict[str, str | None] = {}
    for dist in SUPPORTED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def check_versions(require_nemo: bool = False, require_bridge: bool = False) -> dict[str, str | None]:
    """Raise :class:`UnsupportedVersionError` unless the installed megatron-core (and NeMo if ``require_nemo``,
    Megatron-Bridge if ``require_bridge``) are supported and paired. Returns the installed versions."""
    installed = installed_versions()
    _check(installed, require_nemo, require_bridge)
    return installed
