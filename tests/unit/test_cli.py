"""`neighbor-ckpt inspect`: lists versions and catches corruption without unpickling anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neighbor_ckpt.cli.main import inspect_store, main
from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore


def _store_with_two_versions(tmp_path: Path) -> HostStore:
    store = HostStore(tmp_path, job_id="job", rank=3)
    t = torch.arange(100, dtype=torch.float32)
    plan = plan_shards([TensorMeta.of("w", StateKind.MAIN_PARAM, t)], dp_size=2, distributed_optimizer=True)
    for it in (7, 8):
        write_image(store, ROLE_OWN, planned=plan.unique, sources=[t + it], payload_bytes=plan.unique_bytes,
                    iteration=it, layout="L", meta={}, extras={"it": it})
    return store


def test_inspect_lists_every_committed_version_as_valid(tmp_path: Path) -> None:
    _store_with_two_versions(tmp_path)
    rows = inspect_store(tmp_path)
    assert sorted((r["iteration"], r["owner"], r["status"]) for r in rows) == [(7, 3, "valid"), (8, 3, "valid")]


def test_inspect_reports_a_flipped_byte_as_corrupt(tmp_path: Path) -> None:
    store = _store_with_two_versions(tmp_path)
    path = store.path(ROLE_OWN, 0)
    slot = store.slot(ROLE_OWN, 0)
    assert slot is not None
    off = slot.payload_off + 5
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x10
    path.write_bytes(bytes(raw))
    statuses = sorted(r["status"] for r in inspect_store(tmp_path))
    assert statuses[0].startswith("CORRUPT: ") and "payload checksum mismatch" in statuses[0]
    assert statuses[1] == "valid"


def test_inspect_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _store_with_two_versions(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["iteration"] for r in rows} == {7, 8}


def test_cli_rejects_unknown_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--bogus"])
