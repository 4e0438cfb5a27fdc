"""``python -m neighbor_ckpt.cli``: the ``neighbor-ckpt`` command."""

import sys

from neighbor_ckpt.cli.main import main

sys.exit(main())
