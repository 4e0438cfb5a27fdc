"""``python -m tools.bench.micro`` (``scripts/bench``)."""

import sys

from tools.bench.micro.cli import main

if __name__ == "__main__":
    sys.exit(main())
