"""``python -m tools.campaign``."""

from .runner import main

raise SystemExit(main())
