"""Which megatron-core / NeMo releases ``megatron_patches`` was written against, and the check that enforces it.

Everything in ``megatron_patches`` reaches into private names of megatron-core (and, for the NeMo parts,
nemo-toolkit): module globals such as ``megatron.core.optimizer.USING_PYTORCH_OPTIMIZER``, attributes of
``DistributedOptimizer`` such as ``gbuf_ranges``. Those move between minor releases, so a version we have not
read is refused up front with a message saying what to pin, instead of failing somewhere deep inside a
training step.

Installed versions are read from package metadata (:mod:`importlib.metadata`), never by importing the
packages: ``import nemo`` alone takes seconds and pulls in Lightning.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from typing import Mapping

from neighbor_ckpt.errors import UnsupportedVersionError

__all__ = ["SUPPORTED", "check_versions", "installed_versions"]

logger = logging.getLogger(__name__)

#: distribution name -> supported release prefixes. "0.15" accepts every 0.15.x; "2.7.3" only 2.7.3.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "megatron-core": ("0.15",),
    "nemo-toolkit": ("2.7.3",),
}

#: What to install when a distribution is missing or unsupported.
_INSTALL_HINT: dict[str, str] = {
    "megatron-core": "pip install 'neighbor-ckpt[megatron]' (pins megatron-core>=0.15,<0.16)",
    "nemo-toolkit": "pip install 'neighbor-ckpt[nemo]' (pins nemo-toolkit[llm]==2.7.3)",
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


def _check(installed: Mapping[str, str | None], require_nemo: bool = False) -> None:
    """Pure version check over ``{distribution: version or None}``; raises :class:`UnsupportedVersionError`.

    megatron-core is always required. nemo-toolkit is required when ``require_nemo``; otherwise an installed
    but unsupported NeMo only logs a warning (the megatron-core patches do not touch NeMo).
    """
    problems = []
    mcore = _problem("megatron-core", installed.get("megatron-core"))
    if mcore:
        problems.append(mcore)
    nemo_version = installed.get("nemo-toolkit")
    nemo = _problem("nemo-toolkit", nemo_version)
    if nemo and require_nemo:
        problems.append(nemo)
    elif nemo and nemo_version is not None:
        logger.warning("%s The megatron-core patches still apply; NeMo integration will refuse to start.", nemo)
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


def check_versions(require_nemo: bool = False) -> dict[str, str | None]:
    """Raise :class:`UnsupportedVersionError` unless the installed megatron-core (and NeMo if ``require_nemo``)
    are supported. Returns the installed versions."""
    installed = installed_versions()
    _check(installed, require_nemo)
    return installed
