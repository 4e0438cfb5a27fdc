"""The recipes and job files that ship with the package (package data of the wheel).

* ``nemo_pretrain.py``: NeMo 2 pre-training driven by one job file (what ``neighbor-ckpt launch`` runs under torchrun);
  ``bridge_pretrain.py`` the same under Megatron-Bridge; both start through ``entry.py`` (command line, job file, the
  in-process engine).
* ``mcore_gpt_plain_loop.py``: a hand-written megatron-core loop with the plain-loop API; its :func:`build_gpt` is
  the model, optimizer and scheduler that the benchmarks (``tools/bench``) and the test workers train.
* ``lightning_ddp_demo.py``: plain Lightning DDP with the callback.
* ``configs/*.yaml``: the job files (``neighbor-ckpt launch gpt_tiny_cpu`` finds one by its bare name).

The recipes are scripts (torchrun runs them as files); this module only says where they are and imports none of
them. In a source checkout the top-level ``recipes`` and ``configs`` are links to here, so ``recipes/...`` and
``configs/...`` keep working from the checkout's root.
"""

from __future__ import annotations

from pathlib import Path

from neighbor_ckpt.errors import ConfigError

__all__ = ["RECIPES_DIR", "CONFIGS_DIR", "recipe_path", "shipped_configs", "find_config"]

RECIPES_DIR = Path(__file__).resolve().parent
"""Where the recipe scripts are (inside the installed package)."""
CONFIGS_DIR = RECIPES_DIR / "configs"
"""Where the shipped job files are."""


def recipe_path(name: str) -> Path:
    """The shipped recipe script ``name`` (e.g. ``"nemo_pretrain.py"``).

    Raises:
        ConfigError: it is not there (an installation without the package data)."""
    path = RECIPES_DIR / name
    if not path.is_file():
        raise ConfigError(f"the recipe {path} is missing from the installed neighbor_ckpt package; reinstall it "
                          "(the wheel ships neighbor_ckpt/recipes/*.py)")
    return path


def shipped_configs() -> list[str]:
    """The bare names of the shipped job files, sorted (``gpt_tiny_cpu``, ...)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def find_config(path: str | Path) -> Path:
    """The job file ``path`` names: ``path`` itself when it exists; else, when it is a bare name (``gpt_tiny_cpu``
    or ``gpt_tiny_cpu.yaml``) or a shipped path relative to a checkout (``configs/gpt_tiny_cpu.yaml``), the shipped
    file of that name. Any other missing path is returned unchanged (the caller reports it as missing): a mistyped
    path elsewhere never silently becomes a shipped file."""
    p = Path(path)
    if p.exists() or p.is_absolute() or p.parent not in (Path("."), Path("configs")):
        return p
    for name in (p.name, f"{p.name}.yaml"):
        shipped = CONFIGS_DIR / name
        if shipped.suffix == ".yaml" and shipped.is_file():
            return shipped
    return p
