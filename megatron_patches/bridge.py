"""Megatron-Bridge 0.3.1 (on megatron-core 0.16) on CPU-only torch with gloo: what :func:`megatron_patches.enable_cpu`
adds when megatron-bridge is installed. For smoke runs and tests only, like the rest of the CPU shim.

With the megatron-core patches of :mod:`megatron_patches.cpu` in place, four things still stop Bridge's
``pretrain(cfg, forward_step)`` on a CPU-only machine (measured; ``../shared/notes/cpu-stack.md``). Each is one named
entry here, version-checked, and undone exactly by :meth:`BridgePatch.disable`:

1. :data:`TE_STAND_IN` -- ``import megatron.bridge`` reaches ``peft/lora_layers.py`` and ``peft/lora.py``, which
   ``import transformer_engine.pytorch as te`` unconditionally and subclass ``te.Linear`` (and evaluate
   ``te.ops.Sequential`` annotations) at import time. A CPU machine has no Transformer Engine (and installing it
   without a GPU driver breaks megatron-core's own try-import). A stand-in package (three empty ``torch.nn.Module``
   classes) is served to those two modules only, for their import statement only: an import hook on
   ``sys.meta_path`` answers for ``transformer_engine`` when the importing module is one of :data:`TE_IMPORTERS`, and
   drops the stand-in from ``sys.modules`` at the next import of anything else. Every other ``HAVE_TE`` check
   (megatron-core's, modelopt's, Bridge's own) still finds no Transformer Engine. Bridge's LoRA code compares
   classes with ``te.Linear``, which nothing is, so LoRA falls back to its non-TE paths.
2. ``allow_no_cuda`` -- ``training.setup.setup`` calls ``training.initialize.initialize_megatron`` without
   ``allow_no_cuda=True``, so it asserts ``torch.cuda.is_available()``; the replacement passes ``allow_no_cuda=True``.
3. ``rng_tracker_seed`` -- ``training.initialize._set_random_seed`` seeds megatron-core's RNG tracker only
   ``if torch.cuda.device_count() > 0`` (dropout then fails: "cuda rng state model-parallel-rng is not added"). The
   replacement seeds it as Bridge does on a GPU, with the same seed (``seed + 100 * pp rank [+ 10 * dp rank]``):
   the gap :mod:`megatron_patches.cpu` closes for NeMo.
4. ``skip_helpers_build`` -- ``training.initialize.initialize_megatron`` runs ``compile_helpers()`` (``make`` in
   ``megatron/core/datasets``), but the megatron-core wheel ships the built ``helpers_cpp`` and no Makefile, so
   ``make`` fails and it calls ``sys.exit(1)``. The replacement skips the build when ``helpers_cpp`` is importable
   (a wheel-install problem, not a CPU one).

Entries 2-4 patch Bridge modules that are imported after :func:`enable_cpu` (by ``pretrain``): the same import hook
patches each right after it is imported (or at once if it already is). Hence the order: ``enable_cpu(nemo=False)``
before ``import megatron.bridge``. The default GPT provider picks Transformer Engine's layer spec; pass
megatron-core's local one (``get_gpt_layer_local_spec``).

Not a CPU patch, used on GPUs too: ``data_init_event`` (:func:`on_data_init`), the one event
:class:`neighbor_ckpt.bridge.NeighborCheckpoint` needs that Megatron-Bridge 0.3.1 lacks: after the model, optimizer,
scheduler and Bridge's own checkpoint load, before the data iterators are built (where the restore must happen so the
loop and the iterators start at the restored step and sample). Installed while a listener is registered, version
checked (0.3.1), undone by identity when the last listener is removed.

Not a patch either: :func:`reset_global_state`, between in-process generations, drops what a ``pretrain`` that failed
mid-training left in Bridge's global state (Bridge's own ``destroy_global_state``, which only a ``pretrain`` that
returns calls), version-checked (0.3.1).
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

__all__ = ["BridgePatch", "PATCHES", "TE_IMPORTERS", "TE_STAND_IN", "apply", "is_installed", "DataInit", "DataInitHook",
           "on_data_init", "data_init_installed", "reset_global_state", "RESET_VERSIONS"]

logger = logging.getLogger(__name__)

BRIDGE = "megatron-bridge"
TE_STAND_IN = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")
"""The modules of the Transformer Engine stand-in (patch 1)."""
TE_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora"})
"""The only modules the stand-in is served to: they import Transformer Engine unconditionally (0.3.1: lora_layers.py
line 20, lora.py line 21)."""

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
# Patch 1: the Transformer Engine stand-in
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
        self._te = _te_modules()

    def find_spec(self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None) \
            -> importlib.machinery.ModuleSpec | None:
        if name in self._te:
            if _importer() not in TE_IMPORTERS:
                return None
            spec = importlib.util.spec_from_loader(name, _Prebuilt(self._te[name]),
                                                   is_package=hasattr(self._te[name], "__path__"))
            logger.debug("megatron_patches.bridge: Transformer Engine stand-in for %s", _importer())
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
        for name, module in self._te.items():
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
                        f"{self.version}; these patches were written for megatron-bridge 0.3.1")
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


def apply(version: str) -> BridgePatch:
    """Install the Bridge patches for megatron-bridge ``version`` (already checked by
    :func:`megatron_patches._versions.check_versions` with ``require_bridge``). Call before ``import megatron.bridge``:
    :func:`megatron_patches.enable_cpu` does."""
    patch = BridgePatch(version)
    try:
        patch._apply()
    except BaseException:
        patch.disable()
        raise
    logger.info("megatron_patches.bridge: Megatron-Bridge %s CPU patches on (Transformer Engine stand-in for %s; %s)",
                version, ", ".join(sorted(TE_IMPORTERS)), ", ".join(f"{p.module}.{p.name}" for p in PATCHES))
    return patch


# --------------------------------------------------------------------------------------------------------------
# data_init_event: an event before Bridge builds its data iterators (0.3.1 has none; 0.5+ has on_data_init_start)
# --------------------------------------------------------------------------------------------------------------

DATA_INIT_VERSIONS = ("0.3.1",)
"""The megatron-bridge releases :func:`on_data_init` was written against."""
DATA_INIT_ATTRS = ("setup_optimizer", "load_checkpoint", "setup_data_iterators")
"""What :func:`on_data_init` wraps in ``megatron.bridge.training.setup`` (module globals ``setup()`` calls): the
first captures the model chunks, optimizer and scheduler it builds, the second records Bridge's own checkpoint load
(the arguments, to load it again, and the step it reached), the third calls the listeners before it runs."""


@dataclass
class DataInit:
    """What a :func:`on_data_init` listener gets: ``setup()``'s objects after the model, optimizer, scheduler and
    Bridge's own checkpoint load, before the data iterators exist (they start at ``train_state``'s consumed samples)."""

    cfg: Any
    """The ``ConfigContainer``."""
    train_state: Any
    """``GlobalState.train_state``: what the listener sets is what the data iterators and the loop start from."""
    model: list[Any]
    optimizer: Any
    scheduler: Any
    loaded_step: int | None = None
    """``train_state.step`` right after Bridge's own ``load_checkpoint`` (steps completed); None: it loaded none."""
    _load: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None

    def reload(self) -> None:
        """Run Bridge's ``load_checkpoint`` again, with the arguments ``setup()`` gave it (model, optimizer,
        scheduler, train state and RNG back to its checkpoint)."""
        if self._load is None:
            raise RuntimeError("megatron_patches.bridge: Bridge loaded no checkpoint in this setup()")
        if self.scheduler is not None and hasattr(self.scheduler, "num_steps"):
            # megatron-core's OptimizerParamScheduler.load_state_dict *adds* the loaded step count to the current
            # one (step(increment=num_steps)): loaded a second time, the learning rate would be that of twice the steps
            self.scheduler.num_steps = 0
        fn, args, kwargs = self._load
        fn(*args, **kwargs)


_di_lock = threading.Lock()
_di_listeners: list[Callable[[DataInit], None]] = []
_di_saved: list[tuple[types.ModuleType, str, Any, Any]] = []
_di_ctx: dict[str, Any] = {}


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)


def _wrap_setup_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setup_optimizer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _di_ctx.clear()  # a new setup(): nothing of an earlier one is kept
        _di_ctx["model"] = _bound(original, args, kwargs).get("model")
        _di_ctx["optimizer"], _di_ctx["scheduler"] = result
        return result

    return setup_optimizer


def _wrap_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        state = _bound(original, args, kwargs).get("state")
        _di_ctx["load"] = (original, args, kwargs)
        _di_ctx["loaded_step"] = getattr(getattr(state, "train_state", None), "step", None)
        return result

    return load_checkpoint


def _wrap_setup_data_iterators(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setup_data_iterators(*args: Any, **kwargs: Any) -> Any:
        listeners = list(_di_listeners)
        if listeners:
            a = _bound(original, args, kwargs)
            model = _di_ctx.get("model")
            event = DataInit(cfg=a.get("cfg"), train_state=a.get("train_state"),
                             model=list(model) if model is not None else [], optimizer=_di_ctx.get("optimizer"),
                             scheduler=_di_ctx.get("scheduler"),
                             loaded_step=_di_ctx.get("loaded_step") if "load" in _di_ctx else None,
                             _load=_di_ctx.get("load"))
            for listener in listeners:
                listener(event)
        _di_ctx.clear()
        return original(*args, **kwargs)

    return setup_data_iterators


_DI_WRAPPERS = {"setup_optimizer": _wrap_setup_optimizer, "load_checkpoint": _wrap_load_checkpoint,
                "setup_data_iterators": _wrap_setup_data_iterators}


class DataInitHook:
    """One listener of :func:`on_data_init`; :meth:`remove` is idempotent and restores ``setup``'s attributes (by
    identity) when the last listener goes."""

    def __init__(self, listener: Callable[[DataInit], None]) -> None:
        self._listener = listener
        self._active = True

    def remove(self) -> None:
        with _di_lock:
            if not self._active:
                return
            self._active = False
            for i in range(len(_di_listeners) - 1, -1, -1):
                if _di_listeners[i] is self._listener:
                    del _di_listeners[i]
                    break
            if not _di_listeners:
                for module, name, original, wrapper in reversed(_di_saved):
                    if getattr(module, name, None) is wrapper:
                        setattr(module, name, original)
                    else:
                        logger.debug("megatron_patches.bridge: %s.%s was wrapped again over ours; left in place",
                                     module.__name__, name)
                _di_saved.clear()
                _di_ctx.clear()


def data_init_installed() -> bool:
    """Whether the data-init event's wrappers are in place now."""
    return bool(_di_saved)


def on_data_init(listener: Callable[[DataInit], None]) -> DataInitHook:
    """Patch ``data_init_event``: call ``listener(DataInit)`` in every Megatron-Bridge ``setup()`` (``pretrain``'s)
    after the model, optimizer, scheduler and Bridge's own checkpoint load, right before it builds the data iterators
    -- where Megatron-Bridge 0.5+ fires ``on_data_init_start``. 0.3.1 has no such event, and its ``CallbackManager``
    rejects unknown events, hence a listener list. Imports ``megatron.bridge.training.setup`` (on CPU: after
    :func:`megatron_patches.enable_cpu`). Undone by the returned hook's ``remove()``.

    Raises:
        UnsupportedVersionError: megatron-bridge is not installed or is not 0.3.1, or ``setup`` lacks an attribute.
    """
    try:
        version = importlib.metadata.version(BRIDGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise UnsupportedVersionError("megatron_patches.bridge.on_data_init: megatron-bridge is not installed") from e
    if version not in DATA_INIT_VERSIONS:
        raise UnsupportedVersionError(
            f"megatron_patches.bridge.on_data_init: written for megatron-bridge {', '.join(DATA_INIT_VERSIONS)}, "
            f"found {version} (0.5+ has its own on_data_init_start event)")
    import importlib as _importlib

    setup = _importlib.import_module(_SETUP)
    with _di_lock:
        if not _di_saved:
            missing = [n for n in DATA_INIT_ATTRS if not callable(getattr(setup, n, None))]
            if missing:
                raise UnsupportedVersionError(
                    f"megatron_patches.bridge.on_data_init: {_SETUP} has no {', '.join(missing)} in megatron-bridge "
                    f"{version}")
            for name in DATA_INIT_ATTRS:
                original = getattr(setup, name)
                wrapper = _DI_WRAPPERS[name](original)
                _di_saved.append((setup, name, original, wrapper))
                setattr(setup, name, wrapper)
        _di_listeners.append(listener)
    return DataInitHook(listener)


# --------------------------------------------------------------------------------------------------------------
# reset_global_state: what a failed pretrain leaves behind, dropped between in-process generations
# --------------------------------------------------------------------------------------------------------------

RESET_VERSIONS = ("0.3.1",)
"""The megatron-bridge releases :func:`reset_global_state` was written against."""


def reset_global_state() -> bool:
    """Drop the process-wide state a ``pretrain`` that failed mid-training leaves behind, so that the next in-process
    generation's ``pretrain`` starts as the first did (called after the abort, by
    :func:`neighbor_ckpt.bridge.inprocess.attach`'s clean-up). False when Megatron-Bridge's training code was never
    imported (nothing to reset).

    A ``pretrain`` that returns cleans up in ``_finish_train`` with ``initialize.destroy_global_state()``: the
    num-microbatches calculator (``init_num_microbatches_calculator`` refuses a second one: "num microbatches
    calculator is already initialized"), megatron-core's global memory buffer and model-parallel groups
    (``initialize_model_parallel`` refuses to run twice), and the rerun state machine. A failed one never gets
    there: the same function is called here (Bridge's in-process wrapper does the same after its abort), plus this
    module's data-init context (the failed ``setup()``'s model and optimizer, held otherwise until the next one).
    Everything else ``pretrain`` uses lives on its ``GlobalState``, made anew by every call.

    Raises:
        UnsupportedVersionError: megatron-bridge is not one of :data:`RESET_VERSIONS`, or lacks the function.
    """
    _di_ctx.clear()
    if "megatron.bridge.training.initialize" not in sys.modules:
        return False
    version = importlib.metadata.version(BRIDGE)
    if version not in RESET_VERSIONS:
        raise UnsupportedVersionError(
            f"megatron_patches.bridge.reset_global_state: written for megatron-bridge {', '.join(RESET_VERSIONS)}, "
            f"found {version}")
    initialize = sys.modules["megatron.bridge.training.initialize"]
    destroy = getattr(initialize, "destroy_global_state", None)
    if not callable(destroy):
        raise UnsupportedVersionError(f"megatron_patches.bridge.reset_global_state: {_INITIALIZE} has no "
                                      f"destroy_global_state in megatron-bridge {version}")
    destroy()
    return True
