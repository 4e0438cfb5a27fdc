"""RNG states survive a snapshot's codec exactly: every stream continues with the same draws."""

from __future__ import annotations

import random

import numpy as np
import torch

from neighbor_ckpt.snapshot import codec as _codec
from neighbor_ckpt.snapshot.rng import capture_rng, restore_rng


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(3).tolist()


def test_every_stream_continues_identically_after_a_codec_round_trip() -> None:
    random.seed(5)
    random.gauss(0, 1)  # leaves a cached second gaussian in the state
    np.random.seed(3)
    torch.manual_seed(9)
    text, tensors = _codec.encode(capture_rng())
    expected = _draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng(_codec.decode(text, tensors))
    assert _draws() == expected


def test_python_state_travels_as_one_array_and_the_tuple_form_still_restores() -> None:
    state = capture_rng()
    assert state["python"]["words"].dtype == np.uint32 and state["python"]["words"].shape == (625,)
    random.seed(11)
    old_form = dict(capture_rng(), python=random.getstate())
    expected = _draws()
    restore_rng(old_form)
    assert _draws() == expected
