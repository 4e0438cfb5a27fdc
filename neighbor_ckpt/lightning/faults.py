"""Fault injection for demos and fault campaigns: ``neighbor_ckpt.fault_injection`` in a job's YAML.

:class:`FaultInjector` kills (SIGKILL) or hangs (SIGSTOP) ranks at the steps the section plans
(:meth:`~neighbor_ckpt.fault_config.FaultInjectionConfig.planned`: the one-fault keys, or a ``faults`` list), each fault
once, in the first launch attempt only (``TORCHELASTIC_RESTART_COUNT == 0``), so the restarted job trains through.
Under in-process recovery a fault fires in whichever generation first runs its step (:meth:`FaultSpec.fires
<neighbor_ckpt.fault_config.FaultSpec.fires>`): with faults in steps 3 and 7, the second fires in generation 1, after the
first was recovered, on the rank of that number in generation 1 (a spare, if it took that rank's place). Build a
new injector for every generation (it reads the generation from the :class:`~neighbor_ckpt.NeighborCheckpoint`
beside it, or takes it as ``generation``). On the restart path the whole job restarts after the first fault, so only
the faults of the earliest planned step fire.

With ``replace_store`` the victim restarts with an empty host store, as a replacement node would; with ``permanent``
its launcher agent is killed with it (its node is gone: no restart brings it back). ``target: node`` (in process)
loses node ``fault_injection.node`` whole: its ranks SIGKILL its launcher, its processes and store host die with it.
``target: store_node`` is refused here: only the plain megatron-core recipe injects it, in process. ``target:
partition`` (in process, ``launch.simulate_network``) cuts the network between simulated nodes; rank ``rank`` cuts it
and trains on.

Phases: ``forward`` (start of the training batch), ``backward`` (when the first gradient is computed: a tensor
hook, so it fires inside megatron-core's forward-backward too) and ``optimizer`` (Lightning's
``on_before_optimizer_step``, after the gradients were reduced).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.glue.faults import empty_host_store, fire, partition_possible
from neighbor_ckpt.inprocess.identity import node_index
from neighbor_ckpt.lightning._compat import callback_bases

__all__ = ["FaultInjector"]

logger = logging.getLogger(__name__)


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultInjector(*callback_bases()):  # type: ignore[misc]
    """Attach next to :class:`~neighbor_ckpt.NeighborCheckpoint` (before it in ``callbacks``) to inject the faults
    ``config.fault_injection`` plans. Does nothing when that section is not enabled.

    Args:
        config: the configuration (its ``fault_injection`` section).
        generation: the in-process generation this trainer runs (None: the ``attempt`` of the NeighborCheckpoint
            among the trainer's callbacks, else 0).

    Raises:
        ConfigError: a planned fault's ``target`` is ``store_node`` (injected by the plain megatron-core recipe only),
            or ``node`` outside a launch of simulated nodes (in process, or one torchrun agent per node).
    """

    def __init__(self, config: NeighborCkptConfig, generation: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.faults = config.fault_injection.refuse_unsupported(
            node=config.inprocess.enabled or node_index() is not None,  # in process, or a simulated node's agent
            hung_node=config.inprocess.enabled, partition=config.inprocess.enabled and partition_possible())
        self.generation = generation
        self._launch = _attempt()
        self._start_step: int | None = None
        self._fired: set[int] = set()
        self._hook: Any = None

    @property
    def fault(self) -> Any:
        """The first planned fault (the one-fault form's), for callers that know one."""
        return self.faults[0] if self.faults else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if self.faults and self._launch > 0 and rank in self.config.fault_injection.replaced_ranks():
            d = empty_host_store(self.config, rank)
            logger.warning("fault injection: rank %d restarts on a 'replaced node': its host store %s was emptied",
                           rank, d)

    def _generation(self, trainer: Any) -> int:
        if self.generation is not None:
            return self.generation
        for cb in trainer.callbacks:
            attempt = getattr(cb, "attempt", None)
            if attempt is not None and hasattr(attempt, "inprocess"):
                return int(attempt.inprocess)
        return 0

    def _due(self, trainer: Any, phase: str) -> list[int]:
        if not self.faults or self._launch != 0:
            return []
        if self._start_step is None:
            self._start_step = trainer.global_step  # the first batch of this fit: where its generation resumed
        g, rank, step = self._generation(trainer), trainer.global_rank, trainer.global_step
        return [i for i, f in enumerate(self.faults) if i not in self._fired and f.fires(
            rank=rank, step=step, phase=phase, launch=self._launch, generation=g, start_step=self._start_step,
            node=node_index())]

    def _fire(self, i: int, trainer: Any, where: str) -> None:
        self._fired.add(i)
        fire(self.faults[i], trainer.global_rank, where)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        for i in self._due(trainer, "forward"):
            self._fire(i, trainer, "forward")
        backward = self._due(trainer, "backward")
        if backward and self._hook is None:
            param = next(p for p in pl_module.parameters() if p.requires_grad)

            def hook(grad: Any, due: list[int] = backward) -> None:
                for i in due:
                    if i not in self._fired:
                        self._fire(i, trainer, "backward")

            self._hook = param.register_hook(hook)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for i in self._due(trainer, "optimizer"):
            self._fire(i, trainer, "optimizer")
