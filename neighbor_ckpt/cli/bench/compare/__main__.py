"""``python -m neighbor_ckpt.cli.bench.compare`` (``neighbor-ckpt bench --compare``)."""

import sys

from neighbor_ckpt.cli.bench.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
