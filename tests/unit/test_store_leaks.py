"""What a job leaves in /dev/shm and what a peer may make it allocate: staged spare slots removed by their launcher
(by pid) and counted by the preflight; a pulled image no larger than its owner published; the store of an earlier
release found by ``neighbor-ckpt inspect`` and removed by ``--cleanup``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import neighbor_ckpt.config as config_mod
from neighbor_ckpt.cli.main import main
from neighbor_ckpt.config import effective_user
from neighbor_ckpt.errors import TransportError
from neighbor_ckpt.runtime.preflight import check_host_memory
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore, remove_staged_slots, staged_slot_files


def test_a_pulled_image_larger_than_its_owner_published_is_refused_before_allocation(tmp_path: Path) -> None:
    store = HostStore(tmp_path, job_id="job", rank=1)
    store.pull_bounds[ROLE_OWN] = (4096, 1 << 20, 65536)
    with pytest.raises(TransportError, match="larger than the .* its owner published"):
        store.ensure_pulled(ROLE_OWN, 0, header_cap=4096, payload_cap=1 << 40, extras_cap=65536, src=2)
    assert not any(store.dir.iterdir()), "nothing was allocated"
    slot = store.ensure_pulled(ROLE_OWN, 0, header_cap=4096, payload_cap=1 << 20, extras_cap=65536, src=2)
    assert slot.payload_cap == 1 << 20
    store.close()


def _staged(root: Path, pid: int, suffix: str = "") -> Path:
    job = root / effective_user() / "job"
    job.mkdir(parents=True, exist_ok=True)
    p = job / f"staged-{pid}.own.slot{suffix}"
    p.write_bytes(b"\0" * 4096)
    return p


def test_the_staged_slots_of_exited_processes_are_removed_and_no_others(tmp_path: Path) -> None:
    gone, gone_tmp, alive = _staged(tmp_path, 123), _staged(tmp_path, 123, ".tmp"), _staged(tmp_path, 1234)
    assert remove_staged_slots(tmp_path, [123]) == sorted([gone, gone_tmp])
    assert not gone.exists() and not gone_tmp.exists() and alive.exists()
    assert staged_slot_files(tmp_path) == [alive]


def test_the_preflight_counts_staged_slots_as_the_jobs_memory(tmp_path: Path) -> None:
    _staged(tmp_path, 7)
    chk = check_host_memory(tmp_path, tmp_path / effective_user() / "job", need_per_rank=1 << 20, ranks_on_node=1,
                            mem_available=1 << 40)
    assert chk.staged == 4096 and chk.existing == 4096 and chk.need_on_node == (1 << 20) - 4096
    assert "staged by hot spares" in chk.message()


def test_inspect_finds_a_store_under_the_old_shared_default_and_cleanup_removes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    legacy = tmp_path / "legacy"
    monkeypatch.setattr(config_mod, "LEGACY_STORE_DIR", str(legacy))
    monkeypatch.setenv("NEIGHBOR_CKPT_STORE_DIR", str(tmp_path / "new"))
    old = HostStore(legacy, job_id="oldjob", rank=0)
    slot = old.ensure(ROLE_OWN, 0, header_cap=4096, payload_cap=4096, extras_cap=4096)
    old.close()
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "earlier release" in line]
    assert len(lines) == 1 and str(legacy / effective_user()) in lines[0] and "--cleanup" in lines[0], out
    assert main(["inspect", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in rows] == [str(slot.path)], rows
    assert main(["inspect", "--cleanup"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("removed ")] == [line for line in out.splitlines()
                                                                                 if "earlier release" in line], out
    assert not (legacy / effective_user()).exists() and legacy.exists()
    assert main(["inspect"]) == 0
    assert "earlier release" not in capsys.readouterr().out
    assert os.environ["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "new")
