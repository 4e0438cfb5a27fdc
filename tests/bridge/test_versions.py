"""megatron_patches on megatron-core 0.16 with Megatron-Bridge: the pairings refused by name, and the Bridge CPU patches
(applied as Bridge's modules are imported, undone exactly)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches import _versions, cpu
from megatron_patches._versions import _check
from neighbor_ckpt.errors import NeighborCkptError, UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]
NEMO_015 = {"megatron-core": "0.15.3", "nemo-toolkit": "2.7.3", "megatron-bridge": None}
BRIDGE_016 = {"megatron-core": "0.16.1", "nemo-toolkit": None, "megatron-bridge": "0.3.1"}


# -- the pairings (pure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("installed, require_nemo, require_bridge", [
    (NEMO_015, True, False),
    (BRIDGE_016, False, True),
    ({**BRIDGE_016, "megatron-core": "0.16.0"}, False, True),
    ({"megatron-core": "0.16.1", "nemo-toolkit": None, "megatron-bridge": None}, False, False),  # plain mcore loop
])
def test_supported_pairs_pass(installed: dict[str, str | None], require_nemo: bool, require_bridge: bool) -> None:
    _check(installed, require_nemo, require_bridge)


def test_nemo_with_mcore_016_is_refused_naming_both() -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({"megatron-core": "0.16.1", "nemo-toolkit": "2.7.3"}, require_nemo=True)
    msg = str(ei.value)
    assert "nemo-toolkit 2.7.3" in msg and "megatron-core 0.16.1" in msg and "0.15.x only" in msg, msg
    assert "neighbor-ckpt[megatron,nemo]" in msg and "enable_cpu(nemo=False)" in msg, msg
    assert isinstance(ei.value, NeighborCkptError)


def test_bridge_with_mcore_015_is_refused_naming_both() -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({**BRIDGE_016, "megatron-core": "0.15.3"}, require_bridge=True)
    msg = str(ei.value)
    assert "megatron-bridge 0.3.1" in msg and "megatron-core 0.15.3" in msg and "0.16.x only" in msg, msg
    assert "neighbor-ckpt[bridge]" in msg, msg


@pytest.mark.parametrize("release", ["0.3.0", "0.4.0", "0.6.0rc1"])
def test_unknown_bridge_release_is_refused(release: str) -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({**BRIDGE_016, "megatron-bridge": release}, require_bridge=True)
    msg = str(ei.value)
    assert f"megatron-bridge {release} is installed" in msg and "megatron-bridge 0.3.1 only" in msg, msg


def test_missing_bridge_says_how_to_install() -> None:
    with pytest.raises(UnsupportedVersionError, match="not installed") as ei:
        _check({**BRIDGE_016, "megatron-bridge": None}, require_bridge=True)
    assert "--no-deps megatron-bridge==0.3.1" in str(ei.value)


def test_unrequired_framework_mispaired_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    _check({"megatron-core": "0.16.1", "nemo-toolkit": "2.7.3", "megatron-bridge": "0.4.0"})
    assert "nemo-toolkit 2.7.3" in caplog.text and "megatron-bridge 0.4.0" in caplog.text


# -- enable_cpu refuses before patching anything ---------------------------------------------------------------

def _pretend(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
    """importlib.metadata answers ``versions`` (distribution names with '_' for '-'), the truth for the rest."""
    real = importlib.metadata.version
    fake = {k.replace("_", "-"): v for k, v in versions.items()}

    def version(name: str) -> str:
        if name in fake:
            if fake[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return fake[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize("versions, kwargs, expected", [
    ({"megatron_core": "0.15.3"}, {"nemo": False}, "megatron-core 0.15.3"),
    ({"megatron_bridge": "0.4.0"}, {"nemo": False}, "megatron-bridge 0.4.0"),
    ({"nemo_toolkit": "2.7.3"}, {}, "nemo-toolkit 2.7.3"),
], ids=["bridge-on-0.15", "unknown-bridge", "nemo-on-0.16"])
def test_enable_cpu_refuses_unsupported_pairings_and_patches_nothing(
        monkeypatch: pytest.MonkeyPatch, versions: dict[str, str], kwargs: dict[str, bool], expected: str) -> None:
    import torch

    _pretend(monkeypatch, **versions)
    meta_path, current_device = list(sys.meta_path), torch.cuda.current_device
    with pytest.raises(UnsupportedVersionError, match=expected.replace(".", r"\.")):
        cpu.enable_cpu(**kwargs)
    assert cpu.active_patch() is None
    assert sys.meta_path == meta_path and torch.cuda.current_device is current_device


def test_enable_cpu_without_bridge_leaves_bridge_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """bridge=False: no Bridge check (an unknown Bridge is not refused) and no import hook: a plain mcore loop."""
    _pretend(monkeypatch, megatron_bridge="0.4.0")
    patch = cpu.enable_cpu(nemo=False, bridge=False)
    try:
        assert patch._bridge is None
    finally:
        patch.disable()


def test_installed_pair_is_bridge_on_016() -> None:
    """This environment is the Bridge tier's: what the tests above pretend around."""
    installed = _versions.check_versions(require_bridge=True)
    assert installed["megatron-bridge"] == "0.3.1" and installed["megatron-core"].startswith("0.16.")
    assert installed["nemo-toolkit"] is None


# -- the Bridge CPU patches, in a fresh interpreter (Bridge's import is what they act on) --------------------------

_SCRIPT = r'''
import importlib, sys, torch
from megatron_patches import enable_cpu
from megatron_patches.bridge import PATCHES
from megatron_patches.cpu import PATCHED_ATTRIBUTES

MCORE = [a for a in PATCHED_ATTRIBUTES if a.framework != "nemo"]


def mcore_attributes():
    out = []
    for a in MCORE:
        owner = importlib.import_module(a.module)
        *path, leaf = a.name.split(".")
        for part in path:
            owner = getattr(owner, part)
        out.append(owner.__dict__.get(leaf, "<missing>"))
    return out


before = mcore_attributes()
patch = enable_cpu(nemo=False)
assert len(patch.replaced()) == len(MCORE), (len(patch.replaced()), len(MCORE))  # all exist on 0.16.1
assert patch._bridge is not None and patch._bridge.replaced() == [], patch._bridge.replaced()
import megatron.bridge  # the stand-in makes this import work
from megatron.bridge.peft import lora, lora_layers
from megatron.bridge.training import initialize, setup
import megatron.core.extensions.transformer_engine as mcore_te

# 1. the stand-in: served to Bridge's two LoRA modules only, and gone from sys.modules
assert lora_layers.te.__name__ == lora.te.__name__ == "transformer_engine.pytorch"
assert lora_layers.te.Linear.__module__ == "megatron_patches.bridge"
assert not [n for n in sys.modules if n.split(".")[0] == "transformer_engine"], "stand-in left in sys.modules"
assert mcore_te.HAVE_TE is False, "megatron-core must not see a Transformer Engine"
try:
    import transformer_engine  # noqa: F401
    raise SystemExit("transformer_engine importable outside Bridge's LoRA modules")
except ModuleNotFoundError:
    pass
# 2-4: patched once imported
assert sorted(patch._bridge.replaced()) == sorted((p.module, p.name) for p in PATCHES), patch._bridge.replaced()
assert setup.initialize_megatron is not initialize.initialize_megatron
assert setup.initialize_megatron.__wrapped__ is initialize.initialize_megatron
seed, helpers = initialize._set_random_seed.__wrapped__, initialize.compile_helpers.__wrapped__
initialize.compile_helpers()  # the wheel ships helpers_cpp: no make, no sys.exit

patch.disable()  # exact undo
assert setup.initialize_megatron is initialize.initialize_megatron
assert initialize._set_random_seed is seed and initialize.compile_helpers is helpers
assert not any(type(f).__module__ == "megatron_patches.bridge" for f in sys.meta_path)
assert all(x is y for x, y in zip(mcore_attributes(), before)), "a megatron-core attribute was not restored"
print("OK")
'''


def test_bridge_patches_apply_on_import_and_undo_exactly() -> None:
    """And the megatron-core part of the CPU shim on 0.16.1: every attribute it replaces exists, and comes back."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-3000:] + res.stderr[-6000:]


def test_every_mcore_patch_finds_its_target_on_016() -> None:
    """The megatron-core patches outside enable_cpu (each checks its own attributes when applied): applied and
    removed on the installed 0.16."""
    from megatron_patches import distopt_load, traffic

    patch = distopt_load.fix_fp32_distopt_load()
    patch.remove()
    cls = traffic._bucket_group_cls()
    assert all(name in cls.__dict__ for name in traffic._METHODS)
