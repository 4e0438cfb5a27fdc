"""The re-form probe of ``python -m tools.bench --reform`` (not part of the library; never imported by it).

``tools/bench/reform.py`` puts this directory first on the workers' ``PYTHONPATH`` with
``NEIGHBOR_CKPT_REFORM_PROBE=DIR``; Python then runs this file at start-up in every process of the launch. In a
worker (not a launcher, not a store host) it wraps, as their modules are imported, the functions a re-form goes
through (the engine's clean-up and barrier, the strategy's process group and megatron-core's parallel state, the
groups, the optimizer, the checkpointer) and records the wall-clock span of each call from the engine's
``abort_start`` (a survivor) or ``initialize`` of a later generation (a spare) to the first completed step after it
(the engine's ``first_step_end``), then writes ``DIR/probe.<pid>.json``. A wrapper costs a few microseconds per call;
the groups are a few dozen calls. Without the variable it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("NEIGHBOR_CKPT_REFORM_PROBE")
_SKIP = ("neighbor_ckpt.inprocess.launcher", "neighbor_ckpt.inprocess.store_host", "tools.bench")

# The spans recorded (module -> (object path, attribute, label)); a missing attribute is skipped.
TARGETS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "neighbor_ckpt.inprocess.engine": (("InprocessRecovery", "_finalize", "engine.finalize"),
                                       ("InprocessRecovery", "_check_hygiene", "engine.hygiene"),
                                       ("InprocessRecovery", "_next", "engine.assignment")),
    "neighbor_ckpt.inprocess.generation": (("GenerationStore", "join", "engine.barrier"),),
    "neighbor_ckpt.inprocess.engine_state": (),
    "torch.distributed.distributed_c10d": (("", "init_process_group", "torch.init_process_group"),
                                           ("", "new_group", "torch.new_group"),
                                           ("", "destroy_process_group", "torch.destroy_process_group")),
    "megatron.core.parallel_state": (("", "initialize_model_parallel", "mcore.initialize_model_parallel"),
                                     ("", "destroy_model_parallel", "mcore.destroy_model_parallel")),
    "megatron.core.optimizer": (("", "get_megatron_optimizer", "mcore.get_megatron_optimizer"),),
    "nemo.lightning.pytorch.strategies.megatron_strategy": (
        ("MegatronStrategy", "setup_distributed", "nemo.strategy.setup_distributed"),
        ("MegatronStrategy", "setup", "nemo.strategy.setup"),
        ("MegatronStrategy", "setup_optimizers", "nemo.strategy.setup_optimizers")),
    "nemo.lightning.megatron_parallel": (("MegatronParallel", "init_model_parallel", "nemo.init_model_parallel"),),
    "lightning.pytorch.trainer.trainer": (("Trainer", "__init__", "lightning.Trainer.__init__"),
                                          ("Trainer", "fit", "lightning.Trainer.fit")),
    "neighbor_ckpt.lightning.callback": (("NeighborCheckpoint", "on_fit_start", "ckpt.callback.on_fit_start"),),
    "neighbor_ckpt.checkpointer": (("NeighborCheckpointer", "__init__", "ckpt.__init__"),
                                   ("NeighborCheckpointer", "recover", "ckpt.recover")),
}


class _Probe:
    def __init__(self, out: str) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.on = False
        self.spans: list[tuple[str, float, float, str]] = []
        self.events: list[tuple[str, int, float]] = []
        self.process: int | None = None
        self.written = False

    def span(self, label: str, t0: float, t1: float) -> None:
        if self.on:
            with self.lock:
                self.spans.append((label, t0, t1, threading.current_thread().name))

    def event(self, engine: object, name: str, when: float) -> None:
        state = getattr(engine, "state", engine)
        generation = getattr(state, "generation", None)
        if generation is None:
            generation = getattr(engine, "_generation", 0)
        self.process = getattr(engine, "process", self.process)
        if name in ("abort_start", "initialize") and not self.on and not self.written:
            if name == "abort_start" or generation >= 1:
                self.on = True
        if self.on:
            with self.lock:
                self.events.append((name, int(generation), when))
        if name == "first_step_end" and self.on and generation >= 1:
            self.on = False
            self.dump()

    def dump(self) -> None:
        self.written = True
        path = os.path.join(self.out, f"probe.{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "process": self.process, "spans": self.spans, "events": self.events}, f)
        os.replace(path + ".tmp", path)


def _wrap(probe: _Probe, owner: object, attr: str, label: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "_reform_probe", False):
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            probe.span(label, t0, time.time())

    wrapper._reform_probe = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)


def _patch(probe: _Probe, name: str, module: object) -> None:
    for path, attr, label in TARGETS.get(name, ()):
        owner = module
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        if owner is not None:
            _wrap(probe, owner, attr, label)
    if name == "torch.distributed.distributed_c10d":
        import torch.distributed as dist  # the package re-exports the functions: wrap its names too

        for _, attr, label in TARGETS[name]:
            if getattr(dist, attr, None) is not getattr(module, attr, None):
                setattr(dist, attr, getattr(module, attr))
    # Every engine event goes through EngineState.event (the abort's included); older engines: InprocessRecovery.event
    if name == "neighbor_ckpt.inprocess.engine_state" or (
            name == "neighbor_ckpt.inprocess.engine" and "neighbor_ckpt.inprocess.engine_state" not in sys.modules):
        cls = getattr(module, "EngineState", None) or module.InprocessRecovery  # type: ignore[attr-defined]
        orig = cls.event

        def event(self, name, when=None):  # noqa: ANN001, ANN202
            t = orig(self, name, when)
            probe.event(self, name, t)
            return t

        cls.event = event


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, probe: _Probe) -> None:
        self.probe = probe

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module, exec_module=exec_module, name=name):  # noqa: ANN001, ANN202
            exec_module(module)
            try:
                _patch(self.probe, name, module)
            except Exception as e:  # noqa: BLE001 - a probe never stops a run
                print(f"reform probe: {name}: {e}", file=sys.stderr)

        spec.loader.exec_module = patched
        return spec


def _install() -> None:
    argv = " ".join(getattr(sys, "orig_argv", sys.argv))  # with ``-m``, sys.argv lacks the module at start-up
    if not _OUT or any(s in argv for s in _SKIP):
        return
    sys.meta_path.insert(0, _Finder(_Probe(_OUT)))


_install()
