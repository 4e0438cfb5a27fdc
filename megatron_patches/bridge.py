"""Megatron-Bridge 0.6 (on megatron-core 0.19, Python 3.12) on CPU-only torch with gloo: what
:func:`megatron_patches.enable_cpu` adds when megatron-bridge is installed. For smoke runs and tests only, like the rest
of the CPU shim.

With the megatron-core patches of :mod:`megatron_patches.cpu` in place, five things still stop Bridge's
``pretrain(cfg, forward_step)`` on a CPU-only machine (measured; ``../shared/notes/cpu-stack.md``). Each is one named
entry here, version-checked, and undone exactly by :meth:`BridgePatch.disable`:

1. ``te_stand_in`` (:data:`STAND_INS`) -- ``import megatron.bridge`` reaches ``peft/lora_layers.py``, which
   ``import transformer_engine.pytorch as te`` unconditionally and evaluates ``te.ops.Sequential`` annotations at
   import time. A CPU machine has no Transformer Engine (and installing it without a GPU driver breaks megatron-core's
   own try-import). A stand-in package (empty ``torch.nn.Module`` classes) is served to the importers named in
   :data:`STAND_INS` only, for their import statement only: an import hook on ``sys.meta_path`` answers for the
   package when the importing module is one of them, and drops the stand-in from ``sys.modules`` at the next import
   of anything else. Every other ``HAVE_TE`` check (megatron-core's, modelopt's, Bridge's own) still finds no
   Transformer Engine. Bridge's LoRA code compares classes with ``te.Linear``, which nothing is, so LoRA falls back
   to its non-TE paths.
2. ``nvrx_stand_in`` (:data:`STAND_INS`, only while nvidia-resiliency-ext is not installed) -- ``training/pretrain.py``
   imports ``CallWrapper`` from ``nvidia_resiliency_ext.inprocess`` for a type annotation. nvidia-resiliency-ext 0.5+
   wheels need glibc 2.39, and the 0.4.1 that installs on older systems breaks ``import megatron.core`` 0.19 (its
   ``dist_checkpointing`` asserts nvidia-resiliency-ext >= 0.6 as soon as the async-checkpoint modules import), so the
   Bridge environment has none; the same import hook serves that one module an empty ``CallWrapper``. Bridge's own
   in-process restart (the one user of the real package) is refused beside our callback anyway
   (:func:`neighbor_ckpt.bridge.checks.check_bridge_config`).
3. ``allow_no_cuda`` -- ``training.setup.setup`` calls ``training.initialize.initialize_megatron`` without
   ``allow_no_cuda=True``, so it asserts ``torch.cuda.is_available()``; the replacement passes ``allow_no_cuda=True``.
4. ``rng_tracker_seed`` -- ``training.initialize._set_random_seed`` seeds megatron-core's RNG tracker only
   ``if torch.cuda.device_count() > 0`` (dropout then fails: "cuda rng state model-parallel-rng is not added"). The
   replacement seeds it as Bridge does on a GPU, with the same seed (``seed + 100 * pp rank [+ 10 * dp rank]``):
   the gap :mod:`megatron_patches.cpu` closes for NeMo.
5. ``skip_helpers_build`` -- ``training.initialize.initialize_megatron`` runs ``compile_helpers()`` (``make`` in
   ``megatron/core/datasets``), but the megatron-core wheel ships the built ``helpers_cpp`` and no Makefile, so
   ``make`` fails and it calls ``sys.exit(1)``. The replacement skips the build when ``helpers_cpp`` is importable
   (a wheel-install problem, not a CPU one).

Entries 3-5 patch Bridge modules that are imported after :func:`enable_cpu` (by ``pretrain``): the same import hook
patches each right after it is imported (or at once if it already is). Hence the order: ``enable_cpu(nemo=False)``
before ``import megatron.bridge``. The default GPT provider picks Transformer Engine's layer spec; pass
megatron-core's local one (``get_gpt_layer_local_spec``).

Not a patch, used on GPUs too: :func:`data_init` reads Bridge 0.6's own ``on_data_init_start`` event (after the model,
optimizer, scheduler and Bridge's own checkpoint load, before the data iterators) into a :class:`DataInit`, whose
``reload()`` loads Bridge's checkpoint again through Bridge's own checkpoint manager (``create_checkpoint_manager``,
``CheckpointLoadContext``). Megatron-Bridge 0.3.1 had no such event; the wrappers of ``setup()`` that stood in for it
are gone with 0.3.1.

Not a CPU patch, used on GPUs too: ``pretrain_config_check`` (:func:`on_pretrain_config`), a look at ``pretrain``'s
``ConfigContainer`` before ``pretrain`` wraps ``_pretrain`` in nvidia-resiliency-ext's in-process restart, so that
:class:`neighbor_ckpt.bridge.NeighborCheckpoint` refuses Bridge's in-process restart and local checkpointing before
either starts (Bridge 0.6 has no callback event that early). Installed while a listener is registered,
version-checked (0.6), undone by identity when the last listener is removed.

Not a patch either: :func:`reset_global_state`, between in-process generations, drops what a ``pretrain`` that failed
mid-training left in Bridge's global state (Bridge's own ``destroy_global_state``, which only a ``pretrain`` that
returns calls), version-checked (0.6).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from neighbor_ckpt.errors import UnsupportedVersionError

__all__ = ["BridgePatch", "PATCHES", "STAND_INS", "BRIDGE_VERSIONS", "apply", "is_installed", "DataInit", "data_init",
           "reset_global_state", "on_pretrain_config", "ConfigCheckHook", "config_check_installed"]

logger = logging.getLogger(__name__)

BRIDGE = "megatron-bridge"
BRIDGE_VERSIONS = ("0.6",)
"""The megatron-bridge releases (prefixes) every entry here was written against and tested with (0.6.2)."""

STAND_INS: dict[str, frozenset[str]] = {
    "transformer_engine": frozenset({"megatron.bridge.peft.lora_layers"}),
    "nvidia_resiliency_ext": frozenset({"megatron.bridge.training.pretrain"}),
}
"""Stand-in package (patches 1 and 2) -> the only modules it is served to, which import it unconditionally at import
time (0.6.2: ``peft/lora_layers.py`` line 20, ``training/pretrain.py`` line 19)."""

_SETUP = "megatron.bridge.training.setup"
_INITIALIZE = "megatron.bridge.training.initialize"


def is_installed() -> bool:
    """Whether megatron-bridge is installed (package metadata; nothing is imported)."""
    try:
        importlib.metadata.version(BRIDGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# --------------------------------------------------------------------------------------------------------------
# Patches 2-4: replacements, each built from the original
# --------------------------------------------------------------------------------------------------------------

def _allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


def _seed_rng_tracker(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _set_random_seed(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        import torch

        if torch.cuda.device_count() > 0:
            return  # seeded by the original
        from megatron.core import tensor_parallel
        from megatron.core.utils import get_pg_rank

        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        pgs = a["pg_collection"]
        rank = torch.distributed.get_rank()
        seed = a["seed_"] + 100 * torch.distributed.get_group_rank(pgs.pp, rank)  # as the original computes it
        if a["data_parallel_random_init"]:
            seed += 10 * torch.distributed.get_group_rank(pgs.dp, rank)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, a["te_rng_tracker"], a["inference_rng_tracker"], a["use_cudagraphable_rng"],
            tp_rank=get_pg_rank(pgs.tp), ep_rank=get_pg_rank(pgs.ep), etp_rank=get_pg_rank(pgs.expt_tp))

    return _set_random_seed


def _skip_shipped_helpers(original: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(original)
    def compile_helpers() -> Any:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            logger.debug("megatron_patches.bridge: megatron.core.datasets.helpers_cpp is installed; not building it")
            return None
        return original()

    return compile_helpers


@dataclass(frozen=True)
class BridgeAttr:
    module: str
    name: str
    replacement: Callable[[Any], Any]
    """Builds the replacement from the original."""
    why: str


#: Patches 2-4 (the module docstring says why each is needed). :meth:`BridgePatch.disable` restores exactly these.
PATCHES: tuple[BridgeAttr, ...] = (
    BridgeAttr(_SETUP, "initialize_megatron", _allow_no_cuda,
               "allow_no_cuda: setup() calls it without allow_no_cuda=True, and it asserts CUDA then"),
    BridgeAttr(_INITIALIZE, "_set_random_seed", _seed_rng_tracker,
               "rng_tracker_seed: seeds megatron-core's RNG tracker only when CUDA devices exist"),
    BridgeAttr(_INITIALIZE, "compile_helpers", _skip_shipped_helpers,
               "skip_helpers_build: runs make where the wheel ships helpers_cpp and no Makefile (sys.exit(1))"),
)


# --------------------------------------------------------------------------------------------------------------
# Patches 1 and 2: the Transformer Engine and nvidia-resiliency-ext stand-ins
# --------------------------------------------------------------------------------------------------------------

def _te_modules() -> dict[str, types.ModuleType]:
    import torch

    def stand_in(name: str) -> type:
        return type(name, (torch.nn.Module,), {
            "__module__": "megatron_patches.bridge",
            "__doc__": "Transformer Engine stand-in (megatron_patches.bridge): never instantiated; Bridge's LoRA "
                       "subclasses and compares classes with it"})

    te = types.ModuleType("transformer_engine", "Transformer Engine stand-in (megatron_patches.bridge)")
    pytorch = types.ModuleType("transformer_engine.pytorch", te.__doc__)
    ops = types.ModuleType("transformer_engine.pytorch.ops", te.__doc__)
    pytorch.Linear, pytorch.LayerNormLinear, ops.Sequential = (stand_in(n) for n in
                                                               ("Linear", "LayerNormLinear", "Sequential"))
    te.pytorch, pytorch.ops = pytorch, ops
    te.__path__, pytorch.__path__ = [], []
    return {m.__name__: m for m in (te, pytorch, ops)}


def _nvrx_modules() -> dict[str, types.ModuleType]:
    doc = "nvidia-resiliency-ext stand-in (megatron_patches.bridge)"
    nvrx = types.ModuleType("nvidia_resiliency_ext", doc)
    inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess", doc)
    inprocess.CallWrapper = type("CallWrapper", (), {
        "__module__": "megatron_patches.bridge",
        "__doc__": "nvidia-resiliency-ext stand-in: a type annotation of Bridge's pretrain.py, never instantiated"})
    nvrx.inprocess = inprocess
    nvrx.__path__, inprocess.__path__ = [], []
    return {m.__name__: m for m in (nvrx, inprocess)}


def _stand_ins() -> dict[str, tuple[types.ModuleType, frozenset[str]]]:
    """Module name -> (stand-in, the importers it is served to): Transformer Engine always; nvidia-resiliency-ext only
    while it is not installed (an installed one is checked by :func:`apply`)."""
    out = {name: (module, STAND_INS["transformer_engine"]) for name, module in _te_modules().items()}
    try:
        importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        out.update({name: (module, STAND_INS["nvidia_resiliency_ext"]) for name, module in _nvrx_modules().items()})
    return out


class _Prebuilt(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _importer() -> str | None:
    """``__name__`` of the module whose code runs the import being resolved (the import machinery's frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(("<frozen importlib", "<frozen zipimport")):
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


class _PatchedLoader(importlib.abc.Loader):
    """The module's own loader; after it has run the module, ``then(module)``; the module keeps its own loader."""

    def __init__(self, inner: importlib.abc.Loader, then: Callable[[types.ModuleType], None]) -> None:
        self._inner, self._then = inner, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._then(module)


class _ImportHook(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while the patch is active: serves the stand-in (patch 1), patches modules of
    :data:`PATCHES` once imported (patches 2-4)."""

    def __init__(self, patch: "BridgePatch") -> None:
        self._patch = patch
        self._stand_ins = _stand_ins()

    def find_spec(self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None) \
            -> importlib.machinery.ModuleSpec | None:
        if name in self._stand_ins:
            module, importers = self._stand_ins[name]
            if _importer() not in importers:
                return None
            spec = importlib.util.spec_from_loader(name, _Prebuilt(module), is_package=hasattr(module, "__path__"))
            logger.debug("megatron_patches.bridge: %s stand-in for %s", name, _importer())
            return spec
        self.evict()
        if name not in self._patch.pending():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchedLoader(spec.loader, self._patch.patch_module)
                return spec
        return None

    def evict(self) -> None:
        """Take the stand-in out of ``sys.modules`` (it was there for one import statement)."""
        for name, (module, _) in self._stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


# --------------------------------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------------------------------

_MISSING = object()


class BridgePatch:
    """The active Bridge patches (:func:`apply`); :meth:`disable` removes the import hook and restores every
    replaced attribute (identity-exact). Held and undone by :class:`megatron_patches.cpu.CpuPatch`."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._lock = threading.Lock()
        self._saved: list[tuple[types.ModuleType, str, Any]] = []
        self._done: set[str] = set()
        self._hook: _ImportHook | None = None

    def pending(self) -> set[str]:
        return {p.module for p in PATCHES} - self._done

    def replaced(self) -> list[tuple[str, str]]:
        return [(m.__name__, n) for m, n, _ in self._saved]

    def patch_module(self, module: types.ModuleType) -> None:
        """Apply the entries of :data:`PATCHES` for ``module`` (just imported)."""
        with self._lock:
            if module.__name__ in self._done:
                return
            for attr in PATCHES:
                if attr.module != module.__name__:
                    continue
                original = module.__dict__.get(attr.name, _MISSING)
                if original is _MISSING:
                    raise UnsupportedVersionError(
                        f"megatron_patches.bridge: {attr.module}.{attr.name} does not exist in megatron-bridge "
                        f"{self.version}; these patches were written for megatron-bridge "
                        f"{', '.join(BRIDGE_VERSIONS)}")
                self._saved.append((module, attr.name, original))
                setattr(module, attr.name, attr.replacement(original))
            self._done.add(module.__name__)

    def _apply(self) -> None:
        self._hook = _ImportHook(self)
        sys.meta_path.insert(0, self._hook)
        for name in sorted(self.pending()):
            if name in sys.modules:
                self.patch_module(sys.modules[name])

    def disable(self) -> None:
        """Remove the import hook (and the stand-in, if an import left it) and restore every attribute. Idempotent."""
        with self._lock:
            if self._hook is not None:
                if self._hook in sys.meta_path:
                    sys.meta_path.remove(self._hook)
                self._hook.evict()
                self._hook = None
            for module, name, original in reversed(self._saved):
                setattr(module, name, original)
            self._saved.clear()
            self._done.clear()


def _check_nvrx() -> None:
    """An installed nvidia-resiliency-ext older than 0.6 breaks ``import megatron.core`` 0.19 (an assert in
    ``dist_checkpointing.strategies.nvrx``): refuse it by name, before anything imports megatron-core."""
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return
    release = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    if release < (0, 6):
        raise UnsupportedVersionError(
            f"nvidia-resiliency-ext {version} is installed beside megatron-core 0.19, whose dist_checkpointing refuses "
            f"any release before 0.6 at import (an assert). Install nvidia-resiliency-ext>=0.6 (its wheels need "
            f"glibc 2.39) or uninstall it: pip uninstall nvidia-resiliency-ext (megatron_patches then serves Bridge's "
            f"pretrain.py the one class it imports)")


def apply(version: str) -> BridgePatch:
    """Install the Bridge patches for megatron-bridge ``version`` (already checked by
    :func:`megatron_patches._versions.check_versions` with ``require_bridge``). Call before ``import megatron.bridge``:
    :func:`megatron_patches.enable_cpu` does.

    Raises:
        UnsupportedVersionError: ``version`` is not one of :data:`BRIDGE_VERSIONS`, or an nvidia-resiliency-ext
            older than 0.6 is installed (megatron-core 0.19 cannot be imported beside it)."""
    if not any(version == v or version.startswith(v + ".") for v in BRIDGE_VERSIONS):
        raise UnsupportedVersionError(f"megatron_patches.bridge: written for megatron-bridge "
                                      f"{', '.join(v + '.x' for v in BRIDGE_VERSIONS)}, found {version}")
    _check_nvrx()
    patch = BridgePatch(version)
    try:
        patch._apply()
    except BaseException:
        patch.disable()
        raise
    stand_ins = sorted({name.split(".")[0] for name in patch._hook._stand_ins}) if patch._hook else []
    logger.info("megatron_patches.bridge: Megatron-Bridge %s CPU patches on (stand-ins: %s; %s)", version,
                ", ".join(stand_ins), ", ".join(f"{p.module}.{p.name}" for p in PATCHES))
    return patch


# --------------------------------------------------------------------------------------------------------------
# data_init: Bridge 0.6's own on_data_init_start event, read into what NeighborCheckpoint restores in
# --------------------------------------------------------------------------------------------------------------

@dataclass
class DataInit:
    """What :func:`data_init` reads from Bridge's ``on_data_init_start`` context: ``setup()``'s objects after the model,
    optimizer, scheduler and Bridge's own checkpoint load, before the data iterators exist (they start at
    ``train_state``'s consumed samples)."""

    state: Any
    """Bridge's ``GlobalState``."""
    model: list[Any]
    optimizer: Any
    scheduler: Any
    loaded_step: int | None = None
    """``train_state.step`` after Bridge's own checkpoint load (steps completed); None: it loaded none (a fresh start,
    or a pretrained checkpoint for finetuning, which resets the step to 0)."""

    @property
    def cfg(self) -> Any:
        """The ``ConfigContainer``."""
        return self.state.cfg

    @property
    def train_state(self) -> Any:
        """``GlobalState.train_state``: what the listener sets is what the data iterators and the loop start from."""
        return self.state.train_state

    def reload(self) -> None:
        """Load Bridge's checkpoint again (model, optimizer, scheduler, train state and RNG back to it), through
        Bridge's own checkpoint manager, as ``setup()`` loaded it."""
        if self.loaded_step is None:
            raise RuntimeError("megatron_patches.bridge: Bridge loaded no checkpoint in this setup()")
        from megatron.bridge.training.checkpointing import CheckpointLoadContext, create_checkpoint_manager

        if self.scheduler is not None and hasattr(self.scheduler, "num_steps"):
            # megatron-core's OptimizerParamScheduler.load_state_dict *adds* the loaded step count to the current
            # one (step(increment=num_steps)): loaded a second time, the learning rate would be that of twice the steps
            self.scheduler.num_steps = 0
        cfg = self.cfg
        optimizer = self.optimizer if cfg.checkpoint.load_optim and not cfg.checkpoint.finetune else None
        create_checkpoint_manager(cfg.checkpoint).load(CheckpointLoadContext(
            state=self.state, model=self.model, optimizer=optimizer, opt_param_scheduler=self.scheduler,
            skip_load_to_model_and_opt=cfg.dist.use_torch_fsdp2))


def data_init(context: Any) -> DataInit:
    """The :class:`DataInit` of Bridge's ``on_data_init_start`` callback ``context`` (a ``CallbackContext`` with
    ``state``, ``model``, ``optimizer`` and ``scheduler``)."""
    step = int(context.state.train_state.step)
    return DataInit(state=context.state, model=list(context.model), optimizer=context.optimizer,
                    scheduler=context.scheduler, loaded_step=step if step > 0 else None)


# --------------------------------------------------------------------------------------------------------------
# reset_global_state: what a failed pretrain leaves behind, dropped between in-process generations
# --------------------------------------------------------------------------------------------------------------

def reset_global_state() -> bool:
    """Drop the process-wide state a ``pretrain`` that failed mid-training leaves behind, so that the next in-process
    generation's ``pretrain`` starts as the first did (called after the abort, by
    :func:`neighbor_ckpt.bridge.inprocess.attach`'s clean-up). False when Megatron-Bridge's training code was never
    imported (nothing to reset).

    A ``pretrain`` that returns cleans up in ``_finish_train`` with ``initialize.destroy_global_state()``: the
    num-microbatches calculator (``init_num_microbatches_calculator`` refuses a second one: "num microbatches
    calculator is already initialized"), megatron-core's global memory buffer and model-parallel groups
    (``initialize_model_parallel`` refuses to run twice), and the rerun state machine. A failed one never gets
    there: the same function is called here (Bridge's in-process wrapper does the same after its abort).
    Everything else ``pretrain`` uses lives on its ``GlobalState``, made anew by every call.

    Raises:
        UnsupportedVersionError: megatron-bridge is not one of :data:`BRIDGE_VERSIONS`, or lacks the function.
    """
    if "megatron.bridge.training.initialize" not in sys.modules:
        return False
    version = importlib.metadata.version(BRIDGE)
    if not any(version == v or version.startswith(v + ".") for v in BRIDGE_VERSIONS):
        raise UnsupportedVersionError(
            f"megatron_patches.bridge.reset_global_state: written for megatron-bridge {', '.join(BRIDGE_VERSIONS)}, "
            f"found {version}")
    initialize = sys.modules["megatron.bridge.training.initialize"]
    destroy = getattr(initialize, "destroy_global_state", None)
    if not callable(destroy):
        raise UnsupportedVersionError(f"megatron_patches.bridge.reset_global_state: {_INITIALIZE} has no "
                                      f"destroy_global_state in megatron-bridge {version}")
    destroy()
    return True


# --------------------------------------------------------------------------------------------------------------
# pretrain_config_check: a look at pretrain's ConfigContainer before Bridge wraps it for its in-process restart
# --------------------------------------------------------------------------------------------------------------

_PRETRAIN = "megatron.bridge.training.pretrain"
_cc_lock = threading.Lock()
_cc_listeners: list[Callable[[Any], None]] = []
_cc_saved: list[tuple[types.ModuleType, Any, Any]] = []


class ConfigCheckHook:
    """One listener of :func:`on_pretrain_config`; :meth:`remove` is idempotent and restores ``pretrain``'s
    ``runtime_config_update`` (by identity) when the last listener goes."""

    def __init__(self, listener: Callable[[Any], None]) -> None:
        self._listener: Callable[[Any], None] | None = listener

    def remove(self) -> None:
        with _cc_lock:
            if self._listener is None:
                return
            for i in range(len(_cc_listeners) - 1, -1, -1):
                if _cc_listeners[i] is self._listener:
                    del _cc_listeners[i]
                    break
            self._listener = None
            if not _cc_listeners:
                for module, original, wrapper in _cc_saved:
                    if getattr(module, "runtime_config_update", None) is wrapper:
                        module.runtime_config_update = original
                _cc_saved.clear()


def on_pretrain_config(listener: Callable[[Any], None]) -> ConfigCheckHook:
    """Patch ``pretrain_config_check``: call ``listener(cfg)`` at the start of every Megatron-Bridge ``pretrain`` (right
    after its ``runtime_config_update(cfg)``, before ``pretrain`` wraps ``_pretrain`` in nvidia-resiliency-ext's
    in-process restart when ``cfg.inprocess_restart.enabled``). Bridge 0.6 has no callback event that early: its first,
    ``on_data_init_start``, fires inside the wrapped function, where a refusal would be restarted by that wrapper. What
    the listener raises stops ``pretrain``. Imports ``megatron.bridge.training.pretrain`` (on CPU: after
    :func:`megatron_patches.enable_cpu`). Undone by the returned hook's ``remove()``.

    Raises:
        UnsupportedVersionError: megatron-bridge is not one of :data:`BRIDGE_VERSIONS`, or ``pretrain`` has no
            module global ``runtime_config_update``.
    """
    version = importlib.metadata.version(BRIDGE)
    if not any(version == v or version.startswith(v + ".") for v in BRIDGE_VERSIONS):
        raise UnsupportedVersionError(f"megatron_patches.bridge.on_pretrain_config: written for megatron-bridge "
                                      f"{', '.join(BRIDGE_VERSIONS)}, found {version}")
    import importlib as _importlib

    module = _importlib.import_module(_PRETRAIN)
    with _cc_lock:
        if not _cc_saved:
            original = getattr(module, "runtime_config_update", None)
            if not callable(original):
                raise UnsupportedVersionError(f"megatron_patches.bridge.on_pretrain_config: {_PRETRAIN} has no "
                                              f"runtime_config_update in megatron-bridge {version}")

            @functools.wraps(original)
            def runtime_config_update(cfg: Any) -> Any:
                result = original(cfg)
                for check in list(_cc_listeners):
                    check(cfg)
                return result

            _cc_saved.append((module, original, runtime_config_update))
            module.runtime_config_update = runtime_config_update
        _cc_listeners.append(listener)
    return ConfigCheckHook(listener)


def config_check_installed() -> bool:
    """Whether the ``pretrain_config_check`` wrapper is in place now."""
    return bool(_cc_saved)
