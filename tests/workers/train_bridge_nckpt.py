"""Test worker: ``train_bridge.py``'s Megatron-Bridge job with :class:`neighbor_ckpt.bridge.NeighborCheckpoint` added
-- what a Bridge user's script adds: ``enable_cpu(nemo=False)`` (CPU only) and the callback in
``pretrain(cfg, forward_step, callbacks=[...])``.

Environment: as ``train_bridge.py`` (OUT_DIR, STEPS, TP, SEED, DIST_OPT, BRIDGE_CKPT_EVERY), plus TEST_STORE_BASE and WIPE_RANKS (each
rank its own store root, a listed rank an empty one on a restart: ``common.setup_store_env``), NCKPT_CONFIG (a YAML
file with a neighbor_ckpt: section) and the fault: KILL_RANK, KILL_STEP (SIGKILL inside that optimizer step, first
attempt only); SNAPSHOTS_UNTIL (first attempt: no snapshot of step N and later, an in-memory version that lags Bridge's
own checkpoint). Leaves what ``train_bridge.py`` leaves, plus ``report.rank{r}.attempt{a}.json`` (the recovery report)
``fault.json`` (when the victim was killed) and ``error.rank{r}.json`` (the exception that stopped the rank, if any).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import attempt, setup_store_env, write_json  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(levelname)s %(name)s: %(message)s")
    setup_store_env(RANK)
    from megatron_patches import enable_cpu

    enable_cpu(nemo=False)

    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from train_bridge import build

    from neighbor_ckpt import NeighborCkptConfig
    from neighbor_ckpt.bridge import NeighborCheckpoint

    out = Path(os.environ["OUT_DIR"])
    cfg, record = build()
    nc_config = NeighborCkptConfig.from_yaml(os.environ["NCKPT_CONFIG"]) if os.environ.get("NCKPT_CONFIG") else None
    neighbor = NeighborCheckpoint(nc_config)

    class Faults(Callback):
        """Test plumbing: the recovery report, and the fault (SIGKILL once inside optimizer step KILL_STEP)."""

        def on_train_start(self, context: Any) -> None:
            ckpt = neighbor.checkpointer
            if ckpt is not None and neighbor.last_recovery is not None:
                write_json(out / f"report.rank{RANK}.attempt{ckpt.attempt.label}.json",
                           {**neighbor.last_recovery.report.to_dict(), "winner": neighbor.winner,
                            "train_state_step": context.state.train_state.step,
                            "consumed_train_samples": context.state.train_state.consumed_train_samples})
            if os.environ.get("SNAPSHOTS_UNTIL") and attempt() == 0:
                until, completed = int(os.environ["SNAPSHOTS_UNTIL"]), neighbor.session.step_completed

                def lagging(step: int, state: Any) -> bool:
                    return completed(step, state) if step < until else False

                neighbor.session.step_completed = lagging  # type: ignore[method-assign]
            if os.environ.get("KILL_RANK") and int(os.environ["KILL_RANK"]) == RANK and attempt() == 0:
                from megatron_patches.step_tags import tag_optimizer_steps

                kill_step, state = int(os.environ["KILL_STEP"]), context.state

                def maybe_kill() -> None:
                    if state.train_state.step == kill_step:
                        write_json(out / "fault.json", {"rank": RANK, "step": kill_step, "phase": "optimizer",
                                                        "unix": time.time()})
                        os.kill(os.getpid(), signal.SIGKILL)

                tag_optimizer_steps(context.optimizer, on_enter=maybe_kill, on_exit=lambda: None)

    try:
        pretrain(cfg, forward_step, callbacks=[neighbor, Faults(), record])
    except Exception as e:
        write_json(out / f"error.rank{RANK}.json", {"type": type(e).__name__, "message": str(e), "attempt": attempt()})
        raise


if __name__ == "__main__":
    main()
