"""NeMo 2 worker for the data-position check: ``train_nemo.py`` unchanged (``llm.GPTModel``, ``MegatronStrategy``,
the ``NeighborCheckpoint`` callback), except that its mock data module reads *other* data in a restarted attempt:
from attempt ``DATA_CHANGE_FROM`` on (default 1) the mock dataset's seed is another, as a loader whose position or
source was not restored would be. Nothing in the training script feeds the data check: under ``MegatronStrategy``
the micro-batches reach it through the data iterator NeMo hands megatron-core's forward-backward function
(``megatron_patches.data_iter``, installed by the callback).

Environment: that of ``train_nemo.py``, plus DATA_CHANGE_FROM and NCKPT_DATA_CHECK (``error`` | ``warn``: the
callback's ``data_check``). Writes ``error.rank<R>.json`` (the exception that stopped the rank, if any) besides
``train_nemo.py``'s files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from common import attempt, write_json  # noqa: E402

import nemo_pretrain  # noqa: E402  (the recipe module train_nemo.py takes its mock data module from)
import train_nemo  # noqa: E402

_original = nemo_pretrain.mock_data_module


def _mock_data_module(cpu: bool) -> Any:
    base = _original(cpu)
    seed = 42 + (1000 if attempt() >= int(os.environ.get("DATA_CHANGE_FROM", "1")) else 0)

    class OtherDataAfterRestart(base):  # type: ignore[misc, valid-type]
        def setup(self, stage: str = "") -> None:
            from nemo.collections.llm.gpt.data.mock import _MockGPTDataset

            self._train_ds = _MockGPTDataset(self.tokenizer, "train", self.num_train_samples, self.seq_length,
                                             seed=seed, create_attention_mask=cpu)
            self._validation_ds = self._test_ds = self._train_ds

    return OtherDataAfterRestart


def _with_data_check(cls: Any) -> Any:
    """NeighborCkptConfig.from_dict with ``data_check`` from NCKPT_DATA_CHECK (train_nemo.py builds its config)."""
    original = cls.from_dict.__func__

    def from_dict(klass: Any, data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if os.environ.get("NCKPT_DATA_CHECK"):
            data = {**data, "data_check": os.environ["NCKPT_DATA_CHECK"]}
        return original(klass, data, *args, **kwargs)

    cls.from_dict = classmethod(from_dict)
    return cls


if __name__ == "__main__":
    from neighbor_ckpt import NeighborCkptConfig

    nemo_pretrain.mock_data_module = _mock_data_module
    _with_data_check(NeighborCkptConfig)
    try:
        train_nemo.main()
    except Exception as e:
        write_json(Path(os.environ["OUT_DIR"]) / f"error.rank{train_nemo.RANK}.json",
                   {"type": type(e).__name__, "message": str(e), "attempt": attempt()})
        raise
