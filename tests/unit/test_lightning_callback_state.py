"""The Lightning callback's own state goes through Lightning's Callback API (state_dict / load_state_dict), under the
key and in the format release 0.1 wrote into Lightning checkpoints; an insurance file in that format loads through
load_state_dict (the end-to-end resume from one: tests/e2e/test_lightning_recovery.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from neighbor_ckpt.glue.insurance import InsuranceFiles  # noqa: E402
from neighbor_ckpt.lightning._state import load_insurance_checkpoint  # noqa: E402
from neighbor_ckpt.lightning.callback import NeighborCheckpoint  # noqa: E402


def _release_0_1_training_state() -> dict:
    """As release 0.1 wrote it (keys captured from its trainer.save_checkpoint)."""
    return {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"processed": 6, "completed": 6}}},
            "schedulers": [{"step_size": 3, "last_epoch": 6}], "rng": {"python": None, "numpy": ("MT19937", [1, 2])},
            "batches_in_epoch": 6}


def test_state_dict_is_release_0_1s_entry_under_the_same_key() -> None:
    cb = NeighborCheckpoint()
    assert cb.state_key == "NeighborCheckpoint"  # the key in ckpt["callbacks"] of every checkpoint written so far
    assert cb.state_dict() == {"training_state": None}
    cb.session.last_state = _release_0_1_training_state()
    assert cb.state_dict() == {"training_state": cb.session.last_state}


def test_an_insurance_file_in_release_0_1s_format_loads_weights_optimizer_and_state_through_load_state_dict(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = pl.LightningModule()
    module.net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module.net(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = {"epoch": 0, "global_step": 6, "pytorch-lightning_version": pl.__version__,
            "state_dict": {k: v.clone() + 1 for k, v in module.state_dict().items()},
            "loops": {}, "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "callbacks": {"NeighborCheckpoint": {"training_state": _release_0_1_training_state()}}}
    files = InsuranceFiles(tmp_path, every_n_steps=3)
    torch.save(ckpt, files.path(6))

    cb = NeighborCheckpoint()
    seen = []
    original = cb.load_state_dict
    cb.load_state_dict = lambda sd: (seen.append(sd), original(sd))[1]  # type: ignore[method-assign]
    fresh = torch.optim.AdamW(module.parameters(), lr=1e-2)
    trainer = SimpleNamespace(lightning_module=module, optimizers=[fresh])
    loader = cb.session.own_insurance(files, lambda path: load_insurance_checkpoint(trainer, cb, path))
    assert loader is not None and loader() == 6
    assert seen == [{"training_state": _release_0_1_training_state()}]
    assert torch.equal(module.state_dict()["net.weight"], ckpt["state_dict"]["net.weight"])
    assert fresh.state_dict()["state"][0]["step"] == 1
    assert cb.session._loaded_state is not None and cb.session._loaded_state["batches_in_epoch"] == 6


class _Payload:
    """Any object whose unpickling runs code (here: a class of the test module)."""


def test_an_insurance_file_is_loaded_weights_only_and_one_holding_code_is_refused(tmp_path: Path) -> None:
    """On 2c061fd the insurance was loaded with ``weights_only=False``: unpickling ran whatever the file named. Now
    tensors, containers and the RNG state's numpy arrays load; anything else is a typed error, never executed."""
    import numpy as np

    from neighbor_ckpt.errors import NeighborCkptError
    from neighbor_ckpt.lightning._state import _load_weights_only

    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "rng": {"numpy": np.random.get_state(),
                                                             "words": np.arange(3, dtype=np.uint32)}}, good)
    loaded = _load_weights_only(good)
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    assert np.array_equal(loaded["rng"]["numpy"][1], np.random.get_state()[1])
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}, "x": _Payload()}, bad)
    with pytest.raises(NeighborCkptError, match="not loaded without running code"):
        _load_weights_only(bad)
