"""Test worker: runs ``recipes/mcore_gpt_plain_loop.py`` unmodified, after giving this rank its own store root.

Environment: OUT_DIR, TEST_STORE_BASE, WIPE_RANKS (see ``common.setup_store_env``), STEPS, TP, PP,
DIST_OPT (1|0), KILL_RANK, KILL_STEP, KILL_PHASE (forward|optimizer), KILL_SIGNAL (SIGKILL|SIGSTOP),
NCKPT_CONFIG (a YAML file with a neighbor_ckpt: section), EXTRA_ARGS (more recipe arguments, shell-quoted).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import setup_store_env  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "mcore_gpt_plain_loop.py"


def main() -> None:
    setup_store_env(int(os.environ["RANK"]))
    env = os.environ
    argv = ["--out", env["OUT_DIR"], "--steps", env.get("STEPS", "8"), "--tp", env.get("TP", "1"),
            "--pp", env.get("PP", "1")]
    if env.get("DIST_OPT", "1") == "0":
        argv.append("--no-dist-opt")
    if env.get("KILL_RANK"):
        argv += ["--kill", f"{env['KILL_RANK']}:{env['KILL_STEP']}", "--kill-phase", env.get("KILL_PHASE", "optimizer"),
                 "--kill-signal", env.get("KILL_SIGNAL", "SIGKILL")]
    if env.get("NCKPT_CONFIG"):
        argv += ["--config", env["NCKPT_CONFIG"]]
    argv += shlex.split(env.get("EXTRA_ARGS", ""))
    spec = importlib.util.spec_from_file_location("mcore_gpt_plain_loop", RECIPE)
    assert spec is not None and spec.loader is not None  # noqa: S101 - the file is in this repository
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.main(argv)


if __name__ == "__main__":
    main()
