"""The torch-function mode that sends every CUDA placement to the CPU: item 1 of :mod:`megatron_patches.cpu`'s
docstring says what it maps and why. **Smoke runs and tests only.**

Its own module because two patch tables use it: :func:`megatron_patches.enable_cpu` pushes one on the training
thread's mode stack, and :mod:`megatron_patches.moe` runs each custom autograd function's backward under one of its
own (the autograd engine runs backward functions with an empty mode stack). Importing this module imports no
megatron code.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpuMode", "CPU"]

CPU = torch.device("cpu")


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # torch reads a bare int as a CUDA ordinal
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return False


def _cpu_if_cuda(d: Any) -> Any:
    return CPU if _is_cuda_device(d) else d


def _cuda_type_name(t: torch.Tensor) -> str:
    name = torch.Tensor.type(t)  # called inside the mode's handler: the mode is off here
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


class CudaToCpuMode(TorchFunctionMode):
    """Torch-function mode that sends every CUDA placement to the CPU (see the module docstring, item 1)."""

    _IDENTITY = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory})
    _NOOP = frozenset({torch.Tensor.record_stream})
    # Functions whose device may be passed positionally, and at which index.
    _POSITIONAL_DEVICE = {torch.Tensor.to: 1, torch._C._nn._parse_to: 0}  # _parse_to: Module.to

    def __torch_function__(self, func: Callable[..., Any], types: Iterable[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        if func in self._IDENTITY:
            return args[0]
        if func in self._NOOP:
            return None
        if func is torch.Tensor.type:
            if len(args) == 1 and "dtype" not in kwargs:
                return _cuda_type_name(args[0])
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            if isinstance(target, str) and target.startswith("torch.cuda."):
                args = (args[0], target.replace("torch.cuda.", "torch.", 1), *args[2:])
                kwargs.pop("dtype", None)
        idx = self._POSITIONAL_DEVICE.get(func)
        if idx is not None and len(args) > idx and _is_cuda_device(args[idx]):
            args = (*args[:idx], CPU, *args[idx + 1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)
