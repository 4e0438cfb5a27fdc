"""Run unmodified megatron-core 0.15 / 0.19 training code on CPU-only PyTorch with gloo: for smoke runs and tests only.

**Never use this on a machine with a GPU.** :func:`enable_cpu` refuses to start when ``torch.cuda.is_available()``
is True. It exists so that the project's tests can drive the real megatron-core stack (``GPTModel``,
``DistributedDataParallel``, ``DistributedOptimizer``, the pipeline schedules) on CPU-only CI machines.

megatron-core hard-codes CUDA in code paths a CPU run cannot avoid. Every patch below is named, listed, and
undone exactly by :meth:`CpuPatch.disable`:

1. A :class:`torch.overrides.TorchFunctionMode` (:class:`CudaToCpuMode`), pushed on the torch-function mode stack
   of the thread that calls :func:`enable_cpu`, which

   * maps every ``device=`` argument naming CUDA (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")`` or a bare
     int, which torch reads as a CUDA ordinal) to ``"cpu"``. Needed for e.g. ``torch.tensor([1.0],
     device='cuda')`` in ``megatron/core/optimizer/optimizer.py:FP32Optimizer.__init__``, and the grad/param
     buffers allocated with ``device=torch.cuda.current_device()`` in
     ``megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBuffer.__init__``;
   * makes ``Tensor.cuda()`` return the tensor itself and maps ``Tensor.to("cuda" | int | cuda device)`` (and
     ``torch._C._nn._parse_to``, behind ``Module.to``) to CPU, so ``Module.cuda()`` in training scripts is a no-op. (A no-op, not a copy: after
     ``DistributedDataParallel`` has made parameters views into its contiguous buffer a copy would break them);
   * ignores pinned memory (``Tensor.pin_memory()`` returns the tensor, ``pin_memory=True`` becomes False) since
     a CPU-only build cannot pin; ``Tensor.record_stream`` is a no-op;
   * makes ``Tensor.type()`` (no argument) answer with the CUDA type name (``"torch.cuda.FloatTensor"``): the
     DistributedOptimizer sorts parameters by that string
     (``megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._build_model_and_main_param_groups``),
     as do ``optimizer.py:Float16OptimizerWithFloat16Params.__init__`` and ``clip_grads.py:clip_grad_by_total_norm_fp32``,
     and raise on anything else. ``Tensor.type("torch.cuda.X")`` converts to the CPU type.

   ``Tensor.is_cuda`` and ``Tensor.device`` still tell the truth (``False`` / ``cpu``), and
   ``torch.cuda.is_available()`` stays ``False``: neighbor_ckpt itself reads it to choose its CPU paths.

2. Attributes replaced, all in :data:`PATCHED_ATTRIBUTES` (one table, so :meth:`CpuPatch.disable` is visibly
   complete):

   * ``torch.cuda.current_device`` -> 0, ``set_device`` -> no-op (``device=torch.cuda.current_device()``
     everywhere in mcore);
   * ``torch.cuda.synchronize``, ``Stream``, ``Event``, ``stream``, ``current_stream``, ``default_stream``:
     stand-ins that do nothing (CPU ops are synchronous). ``synchronize`` runs on every pipeline send/recv
     (``pipeline_parallel/p2p_communication.py``); the stream functions are used by
     ``param_and_grad_buffer.py:_ParamAndGradBucketGroup.start_grad_sync`` with
     ``num_distributed_optimizer_instances > 1`` and by NeMo's
     ``nemo/lightning/megatron_parallel.py:MegatronParallel.init_model_parallel``
     (``with torch.cuda.stream(torch.cuda.Stream()): self.init_ddp()``); the ``why`` column of the table
     names each user;
   * the CUDA RNG: ``torch.cuda.{get,set}_rng_state[_all]``, ``manual_seed[_all]``, ``seed[_all]``,
     ``initial_seed``, ``default_generators`` (and the same names in ``torch.cuda.random``) and
     ``megatron.core.tensor_parallel.random._lazy_call`` (bound there by ``from torch.cuda import _lazy_call``,
     which on a CUDA-less build would queue the call forever). See "RNG" below;
   * the optimizer: ``megatron.core.optimizer.{Adam, USING_PYTORCH_OPTIMIZER}`` and
     ``megatron.core.optimizer.distrib_optimizer.{Adam, HAVE_APEX_OR_TE, USING_APEX_OPTIMIZER}``. See "Adam".

   * mixture of experts: the entries of :data:`megatron_patches.moe.PATCHES` (that module's docstring says what
     each fixes and why).

3. A :class:`logging.Filter` on the ``megatron.core.tensor_parallel.random`` logger that drops its
   "CPU RNG state changed within GPU RNG context" warning, which fires on every dropout inside
   ``CudaRNGStatesTracker.fork`` here by construction (see "RNG").

4. Megatron-Bridge 0.6 (megatron-core 0.19), when installed: the five patches of :mod:`megatron_patches.bridge`
   (stand-ins of Transformer Engine and nvidia-resiliency-ext for the Bridge modules that import them, CUDA-free
   ``initialize_megatron``, the RNG tracker seeded on CPU, no datasets-helper build where the wheel ships it), applied
   as Bridge's modules are imported; so call :func:`enable_cpu` before ``import megatron.bridge``.

RNG
    On CPU, dropout draws from the CPU default generator whatever the tracker does: there is no way to hand
    ``torch.nn.functional.dropout`` another generator. So the stand-in for "CUDA device 0's default generator"
    *is* ``torch.default_generator``: ``torch.cuda.default_generators == (torch.default_generator,)`` and
    ``torch.cuda.get_rng_state()`` is ``torch.get_rng_state()``. Then megatron's
    ``tensor_parallel.random.CudaRNGStatesTracker.fork`` (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``)
    swaps the tracker's state into the generator dropout actually uses, exactly as on a GPU:
    attention dropout inside ``get_cuda_rng_tracker().fork()`` draws from the ``model-parallel-rng`` stream
    (different per TP rank), hidden dropout outside it from the default stream. Tracker states are CPU
    generator states (``ByteTensor`` of 5056 bytes); ``tracker.get_states()`` / ``set_states()`` plus
    ``torch.get_rng_state()`` / ``torch.set_rng_state()`` capture and restore everything bit-exactly.
    Consequence: ``torch.cuda.manual_seed(s)`` (called by ``model_parallel_cuda_manual_seed``) reseeds the CPU
    generator too.

Adam
    Without apex / Transformer Engine, megatron-core 0.15 falls back to ``torch.optim.Adam[W]``, which keeps
    ``'step'`` per parameter; the DistributedOptimizer's checkpoint code then takes the non-apex branches
    (``distrib_optimizer.py:DistributedOptimizer.state_dict`` asserts a single per-param step, which fails
    before the first step). :class:`FusedAdamSemanticsAdam` reproduces apex ``FusedAdam``: ``'step'`` (an int)
    lives in each param group, ``'exp_avg'`` / ``'exp_avg_sq'`` per parameter, L2 or decoupled (``adam_w_mode``)
    weight decay, same update formula. It is plain elementwise CPU arithmetic, so bit-deterministic.
    ``megatron/core/optimizer/__init__.py:_get_megatron_optimizer_based_on_param_groups`` picks it through the
    module globals ``Adam`` / ``USING_PYTORCH_OPTIMIZER``; ``distrib_optimizer.py`` checks
    ``isinstance(optimizer, Adam)`` and branches on ``HAVE_APEX_OR_TE`` / ``USING_APEX_OPTIMIZER``.

Limits: the torch-function mode is thread-local; :func:`enable_cpu` must be called on the thread that trains
(it is, in torchrun workers and Lightning). megatron modules that the patches touch are imported by
:func:`enable_cpu` itself, so it works whether megatron was imported before or not.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from neighbor_ckpt.errors import UnsupportedPlatformError

from . import bridge as _bridge
from . import moe as _moe
from ._versions import check_versions
from .device_mode import CPU, CudaToCpuMode

__all__ = [
    "CpuPatch",
    "FusedAdamSemanticsAdam",
    "PATCHED_ATTRIBUTES",
    "active_patch",
    "enable_cpu",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------
# 2a. torch.cuda stand-ins: device, streams, events
# --------------------------------------------------------------------------------------------------------------

def _current_device() -> int:
    return 0


def _set_device(device: Any) -> None:
    return None


def _synchronize(device: Any = None) -> None:
    return None


class _Event:
    """Stand-in for ``torch.cuda.Event``: CPU work is done when it returns, so every event is complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: "_Event") -> float:
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time: both events must have been recorded")
        return (end_event._t - self._t) * 1000.0


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: one implicit CPU "stream"; waits and syncs are no-ops."""

    device = CPU
    cuda_stream = 0
    stream_id = 0
    device_index = 0
    device_type = 1  # DeviceType::CPU

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_STREAM = _Stream()


def _current_stream(device: Any = None) -> _Stream:
    return _DEFAULT_STREAM


def _default_stream(device: Any = None) -> _Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    yield


# --------------------------------------------------------------------------------------------------------------
# 2b. The CUDA RNG, backed by the CPU default generator (module docstring, "RNG")
# --------------------------------------------------------------------------------------------------------------

def _cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _cuda_get_rng_state_all() -> list[torch.Tensor]:
    return [torch.default_generator.get_state()]


def _cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state.clone())


def _cuda_set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    states = list(new_states)  # one stand-in "device": its state is the first
    if states:
        torch.default_generator.set_state(states[0].clone())


def _cuda_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cuda_seed() -> None:
    torch.default_generator.seed()


def _cuda_initial_seed() -> int:
    return torch.default_generator.initial_seed()


def _lazy_call_now(callable: Callable[[], Any], **kwargs: Any) -> None:  # noqa: A002 - torch's parameter name
    """``torch.cuda._lazy_call`` queues until CUDA initialises, which never happens here: call at once."""
    callable()


class _DropForkWarning(logging.Filter):
    """Drops mcore's "CPU RNG state changed within GPU RNG context": here the two generators are one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# --------------------------------------------------------------------------------------------------------------
# 2c. Adam with apex FusedAdam semantics (module docstring, "Adam")
# --------------------------------------------------------------------------------------------------------------

class FusedAdamSemanticsAdam(torch.optim.Optimizer):
    """Adam / AdamW with apex ``FusedAdam``'s interface and state layout, in plain (deterministic) torch ops.

    * ``param_group['step']`` is a Python int incremented once per ``step()`` for every non-empty group;
      per-parameter state holds only ``'exp_avg'`` and ``'exp_avg_sq'`` (fp32, shaped like the parameter);
    * ``adam_w_mode=True`` (default, as apex): decoupled weight decay; False: L2 added to the gradient;
    * update: ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p])`` with ``bc = 1 - beta**step``
      (apex ``multi_tensor_adam`` ``ADAM_MODE_0`` / ``ADAM_MODE_1``).
    """

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 **unsupported: Any) -> None:
        if amsgrad:
            raise ValueError("FusedAdamSemanticsAdam does not support amsgrad (neither does apex FusedAdam)")
        extra = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if extra:
            raise ValueError(f"FusedAdamSemanticsAdam (megatron_patches.cpu) does not support {sorted(extra)}; "
                             f"use OptimizerConfig(use_precision_aware_optimizer=False)")
        if lr < 0.0 or eps < 0.0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid Adam hyper-parameters lr={lr} eps={eps} betas={betas}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = int(group.get("step", 0)) + 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            if group["bias_correction"]:
                bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
            else:
                bc1 = bc2 = 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdamSemanticsAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                pf = p.float()
                if not self.adam_w_mode and wd != 0.0:
                    g = g.add(pf, alpha=wd)
                exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
                update = (exp_avg / bc1).div_(denom)
                if self.adam_w_mode and wd != 0.0:
                    update.add_(pf, alpha=wd)
                if p.dtype == torch.float32:
                    p.add_(update, alpha=-lr)
                else:
                    p.copy_(pf.add_(update, alpha=-lr))
        return loss


# --------------------------------------------------------------------------------------------------------------
# The table of replaced attributes
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Attr:
    module: str
    name: str
    replacement: Callable[[], Any]  # built at enable time (some need torch.default_generator etc.)
    why: str
    optional: bool = False
    """Skipped when its package is not installed (NeMo is an optional extra)."""
    framework: str | None = None
    """The optional framework this patch is for (``"nemo"``): :func:`enable_cpu` can be told to leave it out."""
    missing_ok: bool = False
    """The attribute may not exist yet: the patch defines it, :meth:`CpuPatch.disable` removes it."""


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _nemo_set_random_seed() -> Callable[[int], None]:
    """NeMo seeds mcore's RNG tracker only ``if torch.cuda.device_count() > 0``; on a GPU it always does.
    Seed it as NeMo would on a GPU (same seed: ``seed + 100 * pipeline rank``), so tracker-forked dropout runs."""
    from megatron.core import parallel_state, tensor_parallel
    from nemo.lightning import megatron_init

    original = megatron_init._set_random_seed

    def set_random_seed(seed_: int) -> None:
        original(seed_)
        if torch.cuda.device_count() == 0:
            tensor_parallel.model_parallel_cuda_manual_seed(seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank())

    return set_random_seed


_MCORE_RANDOM = "megatron.core.tensor_parallel.random"
_MCORE_OPT = "megatron.core.optimizer"
_MCORE_DISTOPT = "megatron.core.optimizer.distrib_optimizer"

#: Every attribute :func:`enable_cpu` replaces. :meth:`CpuPatch.disable` restores exactly these.
PATCHED_ATTRIBUTES: tuple[_Attr, ...] = (
    # device / streams / events
    _Attr("torch.cuda", "current_device", _const(_current_device), "device=torch.cuda.current_device() everywhere"),
    _Attr("torch.cuda", "set_device", _const(_set_device),
          "training scripts' torch.cuda.set_device(local_rank); nemo/lightning/fabric/strategies.py"),
    _Attr("torch.cuda", "is_initialized", _const(lambda: True),
          "nemo/lightning/io/pl.py:_fix_tensors_device asserts it when NeMo resumes from its disk checkpoint"),
    _Attr("torch.cuda", "synchronize", _const(_synchronize),
          "pipeline_parallel/p2p_communication.py (every PP send/recv), parallel_state.py, timers.py"),
    _Attr("torch.cuda", "Stream", _const(_Stream),
          "distributed_data_parallel.py (num_distributed_optimizer_instances > 1); "
          "nemo/lightning/megatron_parallel.py:MegatronParallel.init_model_parallel"),
    _Attr("torch.cuda", "Event", _const(_Event), "megatron/core/utils.py:StragglerDetector, combined_1f1b.py"),
    _Attr("torch.cuda", "stream", _const(_stream),
          "param_and_grad_buffer.py:start_grad_sync (partial DistOpt); NeMo MegatronParallel.init_model_parallel"),
    _Attr("torch.cuda", "current_stream", _const(_current_stream), "combined_1f1b.py, NeMo cuda_graph callback"),
    _Attr("torch.cuda", "default_stream", _const(_default_stream),
          "param_and_grad_buffer.py:start/finish_grad_sync (partial DistOpt)"),
    # the CUDA RNG (torch.cuda re-exports torch.cuda.random's functions: patch both names)
    _Attr("torch.cuda", "default_generators", lambda: (torch.default_generator,),
          "tensor_parallel.random._set_cuda_rng_state indexes it"),
    *(_Attr(mod, name, _const(fn), "CUDA RNG on the CPU default generator")
      for mod in ("torch.cuda", "torch.cuda.random")
      for name, fn in (("get_rng_state", _cuda_get_rng_state), ("get_rng_state_all", _cuda_get_rng_state_all),
                       ("set_rng_state", _cuda_set_rng_state), ("set_rng_state_all", _cuda_set_rng_state_all),
                       ("manual_seed", _cuda_manual_seed), ("manual_seed_all", _cuda_manual_seed),
                       ("seed", _cuda_seed), ("seed_all", _cuda_seed), ("initial_seed", _cuda_initial_seed))),
    _Attr(_MCORE_RANDOM, "_lazy_call", _const(_lazy_call_now), "bound by 'from torch.cuda import _lazy_call'"),
    # the optimizer
    _Attr(_MCORE_OPT, "Adam", _const(FusedAdamSemanticsAdam), "get_megatron_optimizer's adam class"),
    _Attr(_MCORE_OPT, "USING_PYTORCH_OPTIMIZER", _const(False), "take the apex/TE branch (adam_w_mode kwarg)"),
    _Attr(_MCORE_DISTOPT, "Adam", _const(FusedAdamSemanticsAdam), "DistributedOptimizer isinstance check"),
    _Attr(_MCORE_DISTOPT, "HAVE_APEX_OR_TE", _const(True), "state_dict: 'step' from param_groups"),
    _Attr(_MCORE_DISTOPT, "USING_APEX_OPTIMIZER", _const(True), "state_dict: 'step' from param_groups"),
    # NeMo 2 (only when installed)
    _Attr("nemo.lightning.megatron_init", "_set_random_seed", _nemo_set_random_seed,
          "NeMo seeds the RNG tracker only when torch.cuda.device_count() > 0", optional=True, framework="nemo"),
    # mixture of experts (megatron_patches/moe.py)
    *(_Attr(m.module, m.name, m.replacement, m.why, missing_ok=m.missing_ok) for m in _moe.PATCHES),
)

_MISSING = object()


# --------------------------------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_ACTIVE: "CpuPatch | None" = None


class CpuPatch:
    """The active CPU patch (see the module docstring). Get it from :func:`enable_cpu`; undo with
    :meth:`disable` or by leaving a ``with enable_cpu():`` block. The handle is process-wide and shared:
    ``disable()`` undoes the patch for every holder."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []  # (module or class, name, original or _MISSING)
        self._names: list[tuple[str, str]] = []  # (module, name as in PATCHED_ATTRIBUTES) of each saved entry
        self._mode: CudaToCpuMode | None = None
        self._filter: _DropForkWarning | None = None
        self._bridge: _bridge.BridgePatch | None = None
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def replaced(self) -> list[tuple[str, str]]:
        """``(module, attribute)`` of every attribute currently replaced."""
        return list(self._names)

    def _apply(self, *, skip: frozenset[str] = frozenset(), bridge: str | None = None) -> None:
        try:
            if bridge is not None:  # first: it only installs an import hook (Bridge is imported later)
                self._bridge = _bridge.apply(bridge)
            for attr in PATCHED_ATTRIBUTES:
                if attr.framework in skip:
                    continue
                try:
                    module = importlib.import_module(attr.module)
                except ModuleNotFoundError:
                    if attr.optional:
                        continue
                    raise
                *path, leaf = attr.name.split(".")  # "Class.method": an attribute of a class of the module
                owner = module
                for part in path:
                    owner = getattr(owner, part)
                original = owner.__dict__.get(leaf, _MISSING)
                if original is _MISSING and not attr.missing_ok:
                    raise RuntimeError(f"megatron_patches.cpu: {attr.module}.{attr.name} does not exist; "
                                       f"the installed version is not one this patch was written for")
                self._saved.append((owner, leaf, original))
                self._names.append((attr.module, attr.name))
                setattr(owner, leaf, attr.replacement())
            self._filter = _DropForkWarning()
            logging.getLogger(_MCORE_RANDOM).addFilter(self._filter)
            self._mode = CudaToCpuMode()
            torch._C._push_on_torch_function_stack(self._mode)
        except BaseException:
            self._restore()
            raise
        self._active = True

    def _restore(self) -> None:
        if self._bridge is not None:
            self._bridge.disable()
            self._bridge = None
        if self._mode is not None:
            _remove_mode(self._mode)
            self._mode = None
        if self._filter is not None:
            logging.getLogger(_MCORE_RANDOM).removeFilter(self._filter)
            self._filter = None
        for module, name, original in reversed(self._saved):
            if original is _MISSING:
                if name in module.__dict__:
                    delattr(module, name)
            else:
                setattr(module, name, original)
        self._saved.clear()
        self._names.clear()

    def disable(self) -> None:
        """Restore every replaced attribute (identity-exact), pop the device mode, drop the log filter.
        Idempotent."""
        global _ACTIVE
        with _LOCK:
            if not self._active:
                return
            self._restore()
            self._active = False
            if _ACTIVE is self:
                _ACTIVE = None
        logger.info("megatron_patches.cpu disabled")

    def __enter__(self) -> "CpuPatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Pop ``mode`` from this thread's torch-function mode stack, keeping any modes pushed above it."""
    above: list[Any] = []
    try:
        while torch._C._len_torch_function_stack() > 0:
            top = torch._C._pop_torch_function_stack()
            if top is mode:
                return
            above.append(top)
        logger.warning("megatron_patches.cpu: the device mode was not on this thread's mode stack "
                       "(disable() called from another thread?)")
    finally:
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def active_patch() -> CpuPatch | None:
    """The active :class:`CpuPatch`, if any."""
    return _ACTIVE


def enable_cpu(*, nemo: bool = True, bridge: bool | None = None) -> CpuPatch:
    """Make unmodified megatron-core 0.15 / 0.19 training code run on CPU-only torch (gloo). **Smoke runs and tests
    only; never on a GPU machine.**

    Checks the installed versions (:func:`megatron_patches._versions.check_versions`), refuses with
    :class:`~neighbor_ckpt.errors.UnsupportedPlatformError` when CUDA is available (nothing is patched then),
    and applies every patch in the module docstring. Idempotent: a second call returns the same active
    handle. Call it on the thread that trains, before building the model.

    ``nemo=False`` leaves NeMo's seeding alone and does not import NeMo: for plain megatron-core loops, which then
    start several seconds faster per process (``nemo.lightning`` pulls in Lightning, torchmetrics and transformers).
    With NeMo installed and ``nemo=True``, NeMo and megatron-core must be a pair it runs on (NeMo 2.7.3 on 0.15).

    ``bridge``: apply the Megatron-Bridge patches (:mod:`megatron_patches.bridge`); None (default): when
    megatron-bridge is installed. Bridge must then be 0.6 on megatron-core 0.19, else
    :class:`~neighbor_ckpt.errors.UnsupportedVersionError` names both; call it before ``import megatron.bridge``.
    """
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None and _ACTIVE.active:
            return _ACTIVE
        if bridge is None:
            bridge = _bridge.is_installed()
        versions = check_versions(require_nemo=nemo and _installed("nemo-toolkit"), require_bridge=bridge)
        if torch.cuda.is_available():
            raise UnsupportedPlatformError(
                "megatron_patches.cpu.enable_cpu() maps CUDA to the CPU for smoke runs and tests on CPU-only "
                "machines; this machine has CUDA, so it refuses to run. Run megatron-core normally here (do not "
                "call enable_cpu()).")
        patch = CpuPatch()
        patch._apply(skip=frozenset() if nemo else frozenset({"nemo"}),
                     bridge=versions["megatron-bridge"] if bridge else None)
        _ACTIVE = patch
    logger.info("megatron_patches.cpu enabled: %d attributes replaced, CUDA->CPU device mode on thread %s",
                len(patch._saved), threading.current_thread().name)
    return patch

