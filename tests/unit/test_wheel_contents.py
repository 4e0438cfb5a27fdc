"""The wheel holds the library with its recipes and job files, and none of the checkout's tools (benchmarks, fault
campaign). Built from a copy of the checkout in a few seconds; installing it and launching from it is
tests/e2e/test_wheel_install.py."""

from __future__ import annotations

from pathlib import Path

from neighbor_ckpt.recipes import CONFIGS_DIR, RECIPES_DIR
from tests.wheel import REPO, build_wheel, tool_names, wheel_names


def test_the_wheel_ships_every_recipe_and_job_file_and_no_tool(tmp_path: Path) -> None:
    names = set(wheel_names(build_wheel(tmp_path)))
    recipes = {f"neighbor_ckpt/recipes/{p.name}" for p in RECIPES_DIR.glob("*.py")}
    configs = {f"neighbor_ckpt/recipes/configs/{p.name}" for p in CONFIGS_DIR.glob("*.yaml")}
    assert {"neighbor_ckpt/recipes/nemo_pretrain.py", "neighbor_ckpt/recipes/mcore_gpt_plain_loop.py",
            "neighbor_ckpt/recipes/configs/gpt_tiny_cpu.yaml"} <= recipes | configs
    assert recipes | configs <= names, sorted((recipes | configs) - names)
    assert "neighbor_ckpt/cli/main.py" in names and "megatron_patches/__init__.py" in names
    assert not tool_names(sorted(names)), tool_names(sorted(names))
    assert not [n for n in names if n.split("/")[0] in ("tests", "recipes", "configs")]


def test_the_checkouts_recipes_and_configs_are_links_into_the_package() -> None:
    for name, target in (("recipes", RECIPES_DIR), ("configs", CONFIGS_DIR)):
        assert (REPO / name).is_symlink(), f"{name}/ is a link to the package's copy, not a second copy"
        assert (REPO / name).resolve() == target
