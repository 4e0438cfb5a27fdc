"""``python -m neighbor_ckpt.cli.bench.micro`` (``scripts/bench``)."""

import sys

from neighbor_ckpt.cli.bench.micro.cli import main

if __name__ == "__main__":
    sys.exit(main())
