"""``python -m tools.bench [--compare | --nemo-step | --generations] [...]``: the micro-benchmark, or with
``--compare`` the side-by-side comparison, with ``--nemo-step`` the NeMo step-time benchmark, with ``--generations``
the in-process engine's cost per generation on one process, with ``--store-gate`` what the store token costs a store
operation, with ``--reform`` where an in-process re-form's time goes, gate on and off, with ``--kill-repeat`` the
in-process kill of the demo launched again and again, each compared bit for bit, with ``--nodes`` in-process MTTR
and detection of a killed rank and of a lost node by ranks per node and number of processes (the rest goes to that
one), with ``--scale`` the control plane at 8 to 1,024 simulated nodes (:mod:`tools.bench.scale`)."""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in args:
        from tools.bench import compare

        return compare.main([a for a in args if a != "--compare"])
    if "--nemo-step" in args:
        from tools.bench import nemo_step

        return nemo_step.main([a for a in args if a != "--nemo-step"])
    if "--store-gate" in args:
        from tools.bench import store_gate

        return store_gate.main([a for a in args if a != "--store-gate"])
    if "--reform" in args:
        from tools.bench import reform

        return reform.main([a for a in args if a != "--reform"])
    if "--kill-repeat" in args:
        from tools.bench import kill_repeat

        return kill_repeat.main([a for a in args if a != "--kill-repeat"])
    if "--nodes" in args:
        from tools.bench import nodes

        return nodes.main([a for a in args if a != "--nodes"])
    if "--scale" in args:
        from tools.bench import scale

        return scale.main([a for a in args if a != "--scale"])
    if "--generations" in args:
        from tools.bench import generations

        return generations.main([a for a in args if a != "--generations"])
    from tools.bench import micro

    return micro.main(args)


if __name__ == "__main__":
    sys.exit(main())
