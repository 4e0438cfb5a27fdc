"""megatron_patches on megatron-core 0.19 with Megatron-Bridge 0.6: the pairings refused by name, and the Bridge CPU
patches (applied as Bridge's modules are imported, undone exactly)."""

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
BRIDGE_019 = {"megatron-core": "0.19.2", "nemo-toolkit": None, "megatron-bridge": "0.6.2"}


# -- the pairings (pure) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("installed, require_nemo, require_bridge", [
    (NEMO_015, True, False),
    (BRIDGE_019, False, True),
    ({**BRIDGE_019, "megatron-core": "0.19.0", "megatron-bridge": "0.6.0"}, False, True),
    ({"megatron-core": "0.19.2", "nemo-toolkit": None, "megatron-bridge": None}, False, False),  # plain mcore loop
])
def test_supported_pairs_pass(installed: dict[str, str | None], require_nemo: bool, require_bridge: bool) -> None:
    _check(installed, require_nemo, require_bridge)


def test_nemo_with_mcore_019_is_refused_naming_both() -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({"megatron-core": "0.19.2", "nemo-toolkit": "2.7.3"}, require_nemo=True)
    msg = str(ei.value)
    assert "nemo-toolkit 2.7.3" in msg and "megatron-core 0.19.2" in msg and "0.15.x only" in msg, msg
    assert "neighbor-ckpt[megatron,nemo]" in msg and "enable_cpu(nemo=False)" in msg, msg
    assert isinstance(ei.value, NeighborCkptError)


def test_bridge_with_mcore_015_is_refused_naming_both() -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({**BRIDGE_019, "megatron-core": "0.15.3"}, require_bridge=True)
    msg = str(ei.value)
    assert "megatron-bridge 0.6.2" in msg and "megatron-core 0.15.3" in msg and "0.19.x only" in msg, msg
    assert "neighbor-ckpt[bridge]" in msg, msg


@pytest.mark.parametrize("release", ["0.3.1", "0.5.0", "0.7.0"])
def test_unknown_bridge_release_is_refused(release: str) -> None:
    """0.3.1 (on megatron-core 0.16, Python 3.11) is no longer supported: 0.6 is the supported line."""
    with pytest.raises(UnsupportedVersionError) as ei:
        _check({**BRIDGE_019, "megatron-bridge": release}, require_bridge=True)
    msg = str(ei.value)
    assert f"megatron-bridge {release} is installed" in msg and "megatron-bridge 0.6.x only" in msg, msg


@pytest.mark.parametrize("mcore", ["0.16.1", "0.17.0", "0.20.0"])
def test_untested_mcore_is_refused(mcore: str) -> None:
    with pytest.raises(UnsupportedVersionError, match=f"megatron-core {mcore} is installed"):
        _check({**BRIDGE_019, "megatron-core": mcore}, require_bridge=True)


def test_missing_bridge_says_how_to_install() -> None:
    with pytest.raises(UnsupportedVersionError, match="not installed") as ei:
        _check({**BRIDGE_019, "megatron-bridge": None}, require_bridge=True)
    assert "--no-deps megatron-bridge==0.6.2" in str(ei.value) and "Python 3.12" in str(ei.value)


def test_unrequired_framework_mispaired_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    _check({"megatron-core": "0.19.2", "nemo-toolkit": "2.7.3", "megatron-bridge": "0.4.0"})
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
], ids=["bridge-on-0.15", "unknown-bridge", "nemo-on-0.19"])
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


def test_installed_pair_is_bridge_06_on_019_and_python_312() -> None:
    """This environment is the Bridge tier's: what the tests above pretend around."""
    installed = _versions.check_versions(require_bridge=True)
    assert installed["megatron-bridge"].startswith("0.6.") and installed["megatron-core"].startswith("0.19.")
    assert installed["nemo-toolkit"] is None and sys.version_info[:2] == (3, 12)


def test_an_old_nvidia_resiliency_ext_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-resiliency-ext 0.4.1 (the newest that installs on glibc < 2.39) breaks megatron-core 0.19's import."""
    from megatron_patches import bridge

    _pretend(monkeypatch, nvidia_resiliency_ext="0.4.1")
    with pytest.raises(UnsupportedVersionError, match="nvidia-resiliency-ext 0.4.1 is installed"):
        bridge.apply(importlib.metadata.version("megatron-bridge"))


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
assert len(patch.replaced()) == len(MCORE), (len(patch.replaced()), len(MCORE))  # all exist on 0.19.2
assert patch._bridge is not None and patch._bridge.replaced() == [], patch._bridge.replaced()
import megatron.bridge  # the stand-in makes this import work
from megatron.bridge.peft import lora_layers
from megatron.bridge.training import initialize, pretrain, setup
import megatron.core.extensions.transformer_engine as mcore_te

# 1, 2. the stand-ins: served to Bridge's LoRA module and pretrain.py only, and gone from sys.modules
assert lora_layers.te.__name__ == "transformer_engine.pytorch"
assert lora_layers.te.Linear.__module__ == "megatron_patches.bridge"
assert pretrain.CallWrapper.__module__ == "megatron_patches.bridge"
for root in ("transformer_engine", "nvidia_resiliency_ext"):
    assert not [n for n in sys.modules if n.split(".")[0] == root], f"stand-in {root} left in sys.modules"
    try:
        importlib.import_module(root)
        raise SystemExit(f"{root} importable outside the modules it is served to")
    except ModuleNotFoundError:
        pass
assert mcore_te.HAVE_TE is False, "megatron-core must not see a Transformer Engine"
# 3-5: patched once imported
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
    """And the megatron-core part of the CPU shim on 0.19.2: every attribute it replaces exists, and comes back."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-3000:] + res.stderr[-6000:]


def test_every_mcore_patch_finds_its_target_on_019() -> None:
    """The megatron-core patches outside enable_cpu (each checks its own attributes when applied): applied and
    removed on the installed 0.19."""
    from megatron_patches import distopt_load, traffic

    patch = distopt_load.fix_fp32_distopt_load()
    patch.remove()
    cls = traffic._bucket_group_cls()
    assert all(name in cls.__dict__ for name in traffic._METHODS)
