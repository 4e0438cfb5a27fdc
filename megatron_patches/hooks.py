"""Attach a :class:`~neighbor_ckpt.NeighborCheckpointer` to a megatron-core optimizer: step tags and the
training-traffic signal together, removed together; and the data-position check's input: every micro-batch
megatron-core's forward-backward function draws (:mod:`megatron_patches.data_iter`, installed with the others);
:meth:`MegatronHooks.observe` wraps an iterator by hand."""

from __future__ import annotations

from typing import Any, Protocol

from megatron_patches.data_iter import DataIteratorHook, observe_forward_backward, observe_iterator
from megatron_patches.step_tags import StepTags, tag_optimizer_steps
from megatron_patches.traffic import TrafficHooks, TrafficListener, mark_training_traffic

__all__ = ["MegatronHooks", "install_hooks"]


class _Checkpointer(Protocol):
    gate: TrafficListener

    def wait(self) -> None: ...

    def begin_optimizer_step(self) -> None: ...

    def end_optimizer_step(self) -> None: ...

    def observe_input(self, batch: Any) -> None: ...


class MegatronHooks:
    """The patches for one checkpointer; :meth:`remove` undoes them (idempotent)."""

    def __init__(self, tags: StepTags, traffic: TrafficHooks, observe_input: Any = None,
                 data: DataIteratorHook | None = None) -> None:
        self.tags = tags
        self.traffic = traffic
        self.data = data
        """The forward-backward data-iterator hook (None: the checkpointer takes no input)."""
        self._observe_input = observe_input

    def observe(self, data_iterator: Any) -> Any:
        """The data iterator to hand to ``forward_backward_func``: each micro-batch goes to the checkpointer's
        ``observe_input`` (every micro-batch enters the step's fingerprint) on its way to ``forward_step_func``.
        Not needed for megatron-core's forward-backward functions (:mod:`megatron_patches.data_iter` observes what
        they draw; an iterator wrapped here is not observed twice): for loops that draw micro-batches otherwise.
        Wrap the host-side iterator (before ``.cuda()``: no device synchronization). ``None`` (pipeline stages
        without data) and lists (virtual pipeline: the first chunk's iterator is wrapped) are handled; an iterator
        created once and used for every step can be wrapped once."""
        if self._observe_input is None:
            return data_iterator
        return observe_iterator(data_iterator, self._observe_input)

    def remove(self) -> None:
        self.tags.remove()
        self.traffic.remove()
        if self.data is not None:
            self.data.remove()

    def __enter__(self) -> MegatronHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install_hooks(ckpt: _Checkpointer, optimizer: Any) -> MegatronHooks:
    """Tag ``optimizer.step`` (``optimizer``: the object the loop calls ``step`` on) and mark mcore DDP
    collectives: the wait point runs before the first gradient collective of each iteration; streaming pauses while
    collectives are in flight. The optimizer step's tag calls it too, for an iteration without a gradient
    collective: the engine blocks once per snapshot, so there (and for every further bucket group) it is a flag
    check that keeps the real wait's figure.

    And the data-position check's input: every micro-batch that megatron-core's training forward-backward function
    draws from its ``data_iterator`` goes to ``ckpt.observe_input`` (:mod:`megatron_patches.data_iter`; take
    ``get_forward_backward_func()`` after this call, or wrap the iterator with :meth:`MegatronHooks.observe`)."""
    traffic = mark_training_traffic(ckpt.gate, before_grad_sync=ckpt.wait)
    try:
        tags = tag_optimizer_steps(optimizer, on_enter=ckpt.begin_optimizer_step, on_exit=ckpt.end_optimizer_step)
    except Exception:
        traffic.remove()
        raise
    observe_input = getattr(ckpt, "observe_input", None)
    try:
        data = observe_forward_backward(observe_input) if observe_input is not None else None
    except Exception:
        tags.remove()
        traffic.remove()
        raise
    return MegatronHooks(tags, traffic, observe_input, data)
