"""``python -m tools.bench.compare`` (``python -m tools.bench --compare``)."""

import sys

from tools.bench.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
