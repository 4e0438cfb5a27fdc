"""``python -m tools.bench [--compare | --nemo-step] [...]``: the micro-benchmark, or with ``--compare`` the
side-by-side comparison, or with ``--nemo-step`` the NeMo step-time benchmark (the rest goes to that one)."""

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
    from tools.bench import micro

    return micro.main(args)


if __name__ == "__main__":
    sys.exit(main())
