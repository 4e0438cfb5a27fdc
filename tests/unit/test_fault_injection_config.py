"""``neighbor_ckpt.fault_injection`` (issue 29 item 3): the one-fault keys or a ``faults`` list, never both; ``target:
rank | store_node | node``; :meth:`FaultInjectionConfig.planned` gives the faults in one form; each fault fires once, in the
first launch attempt, in the in-process generation that first runs its step (:meth:`FaultSpec.fires`); the
Lightning injector fires each planned fault once and refuses ``store_node``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.fault_config import FaultInjectionConfig, FaultSpec
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.planning.jobspec import load_job

REPO = Path(__file__).resolve().parents[2]


def fi(**section: object) -> FaultInjectionConfig:
    return NeighborCkptConfig.from_dict({"fault_injection": section}).fault_injection


def test_one_fault_form_keeps_its_keys_and_defaults() -> None:
    assert fi(enabled=True).planned() == (FaultSpec(target="rank", rank=1, step=5, phase="optimizer",
                                                    signal="SIGKILL", replace_store=True, permanent=False),)
    (f,) = fi(enabled=True, rank=2, step=0, phase="forward", signal="SIGSTOP", replace_store=False).planned()
    assert (f.rank, f.step, f.phase, f.signal, f.replace_store) == (2, 0, "forward", "SIGSTOP", False)
    assert fi(rank=3).planned() == () and FaultInjectionConfig().planned() == (), "nothing planned when disabled"


def test_faults_list_gives_one_spec_per_entry() -> None:
    planned = fi(enabled=True, faults=[{"rank": 1, "step": 3}, {"rank": 2, "step": 7, "phase": "forward",
                                                                  "target": "rank", "permanent": True}]).planned()
    assert [(f.rank, f.step, f.phase, f.permanent) for f in planned] == [(1, 3, "optimizer", False),
                                                                        (2, 7, "forward", True)]
    assert fi(enabled=True, faults=[{"target": "store_node"}]).planned()[0].target == "store_node"


def test_both_forms_at_once_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"fault_injection\.faults: given together with the one-fault key\(s\) "
                                          r"rank, step: use one form"):
        fi(enabled=True, rank=1, step=3, faults=[{"rank": 2}])
    fi(enabled=True, rank=None, faults=[{"rank": 2}])  # a null one-fault key is not given


def test_entries_are_validated_like_every_section() -> None:
    with pytest.raises(ConfigError) as e:
        fi(faults=[{"rank": -1, "stp": 3, "phase": "sideways", "step": "3"}, 7, {"target": "switch"}])
    lines = str(e.value).splitlines()
    assert "neighbor_ckpt.fault_injection.faults[0].stp: unknown key (allowed keys of " \
           "neighbor_ckpt.fault_injection.faults[0]: heal_after_s, node, nodes, permanent, phase, rank, replace_store, " \
           "signal, step, target, traffic)" in lines
    assert "neighbor_ckpt.fault_injection.faults[0].step: expected an integer, got '3'" in lines
    assert any(line.startswith("neighbor_ckpt.fault_injection.faults[0].phase: 'sideways' is not allowed")
               for line in lines)
    assert "neighbor_ckpt.fault_injection.faults[0].rank: -1 must be >= 0" in lines
    assert any(line.startswith("neighbor_ckpt.fault_injection.faults[1]: expected a mapping") for line in lines)
    assert any(line.startswith("neighbor_ckpt.fault_injection.faults[2].target: 'switch' is not allowed")
               for line in lines)
    with pytest.raises(ConfigError, match=r"faults: an empty list plans no fault"):
        fi(enabled=True, faults=[])
    with pytest.raises(ConfigError, match=r"faults: expected a list"):
        fi(faults={"rank": 1})
    with pytest.raises(ConfigError, match=r"fault_injection\.target: 'switch' is not allowed"):
        fi(target="switch")
    with pytest.raises(ConfigError, match=r"faults\[0\]\.rank: expected an integer"):
        FaultInjectionConfig(enabled=True, faults=[{"rank": "one"}])  # the constructor holds to the same rules


def test_job_file_override_and_round_trip(tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / "gpt_tiny_bridge_cpu.yaml", [
        "neighbor_ckpt.fault_injection.enabled=true",
        "neighbor_ckpt.fault_injection.faults=[{rank: 1, step: 3}, {rank: 2, step: 7}]"])
    section = job.neighbor_ckpt.fault_injection
    assert [(f.rank, f.step) for f in section.planned()] == [(1, 3), (2, 7)]
    again = NeighborCkptConfig.from_dict(job.neighbor_ckpt.to_dict()).fault_injection
    assert again.planned() == section.planned()
    nemo = load_job(REPO / "configs" / "gpt_tiny_cpu.yaml", ["neighbor_ckpt.fault_injection.enabled=true",
                                                              "neighbor_ckpt.fault_injection.faults=[{rank: 2}]"])
    assert [f.rank for f in nemo.neighbor_ckpt.fault_injection.planned()] == [2]  # the job files leave both open
    with pytest.raises(ConfigError, match="use one form"):
        load_job(REPO / "configs" / "gpt_tiny_cpu.yaml", ["neighbor_ckpt.fault_injection.rank=1",
                                                           "neighbor_ckpt.fault_injection.faults=[{rank: 2}]"])


def test_store_node_is_refused_by_the_injectors_that_cannot_inject_it_and_planned_for_those_that_can() -> None:
    section = fi(enabled=True, faults=[{"rank": 1, "step": 3}, {"target": "store_node", "step": 5}])
    with pytest.raises(ConfigError, match=r"faults\[1\]\.target: store_node \(the node hosting the store in use\) "
                                          r"is injected only in process"):
        section.refuse_unsupported()
    assert [f.target for f in section.refuse_unsupported(store_node=True)] == ["rank", "store_node"]
    with pytest.raises(ConfigError, match=r"fault_injection\.phase: 'backward' is not injected here"):
        fi(enabled=True, phase="backward").refuse_unsupported(phases=("forward", "optimizer"), where=" here")
    assert fi(enabled=False, target="store_node").refuse_unsupported() == ()


def test_a_whole_node_fault_fires_on_every_rank_of_that_node_and_is_refused_off_the_inprocess_path() -> None:
    (f,) = fi(enabled=True, target="node", node=1, step=5).planned()
    assert (f.target, f.node) == ("node", 1) and "node 1 (its launcher" in f.describe()
    due = dict(step=5, phase="optimizer", launch=0, generation=0, start_step=0)
    assert f.fires(rank=2, node=1, **due) and f.fires(rank=3, node=1, **due), "every rank of node 1"
    assert not f.fires(rank=1, node=0, **due) and not f.fires(rank=2, node=None, **due)
    with pytest.raises(ConfigError, match=r"target: node \(a whole node.*only where each node has a launcher"):
        fi(enabled=True, target="node").refuse_unsupported()
    assert fi(enabled=True, target="node").refuse_unsupported(node=True)[0].target == "node"
    assert fi(enabled=True, target="node", signal="SIGSTOP").planned()[0].signal == "SIGSTOP", "a node that hangs"
    with pytest.raises(ConfigError, match="SIGSTOP of a whole node .* only in process"):
        fi(enabled=True, target="node", signal="SIGSTOP").refuse_unsupported(node=True)
    assert fi(enabled=True, target="node", signal="SIGSTOP").refuse_unsupported(node=True, hung_node=True)
    with pytest.raises(ConfigError, match="node"):
        fi(enabled=True, target="node", node=-1).planned()


def test_each_fault_fires_once_in_the_generation_that_first_runs_its_step() -> None:
    """Rank 1 in step 3, rank 2 in step 7: generation 0 dies in step 3; generation 1 resumes at step 3 and replays
    it without the first fault, then runs step 7 with the second; nothing fires after a launcher restart."""
    first, second = fi(enabled=True, faults=[{"rank": 1, "step": 3}, {"rank": 2, "step": 7}]).planned()

    def fires(f: FaultSpec, *, rank: int, step: int, generation: int, start: int, launch: int = 0,
              phase: str = "optimizer") -> bool:
        return f.fires(rank=rank, step=step, phase=phase, launch=launch, generation=generation, start_step=start)

    assert fires(first, rank=1, step=3, generation=0, start=0)
    assert not fires(first, rank=1, step=3, generation=1, start=3), "replayed step: fired in generation 0"
    assert fires(second, rank=2, step=7, generation=1, start=3)
    assert not fires(second, rank=1, step=7, generation=1, start=3), "another rank"
    assert not fires(second, rank=2, step=7, generation=1, start=3, phase="forward"), "another phase"
    assert not fires(first, rank=1, step=3, generation=0, start=0, launch=1), "first launch attempt only"
    assert fires(first, rank=1, step=3, generation=0, start=3), "generation 0 resumed from a disk checkpoint"
    store = FaultSpec(target="store_node", rank=1, step=3)
    assert not fires(store, rank=1, step=3, generation=0, start=0), "store_node: the rank on the store's node"
    assert store.fires(rank=0, step=3, phase="optimizer", launch=0, generation=0, start_step=0, hosts_store=True)
    assert not store.fires(rank=0, step=2, phase="optimizer", launch=0, generation=0, start_step=0, hosts_store=True)


def test_replaced_ranks_are_the_first_faults_victims() -> None:
    assert fi(enabled=True).replaced_ranks() == {1}
    assert fi(enabled=True, faults=[{"rank": 2, "step": 7}, {"rank": 1, "step": 3},
                                    {"rank": 3, "step": 3, "replace_store": False}]).replaced_ranks() == {1}
    assert fi(enabled=False).replaced_ranks() == frozenset()


def test_lightning_injector_fires_each_planned_fault_once(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    from neighbor_ckpt.lightning import faults

    fired: list[tuple[int, int, str]] = []
    monkeypatch.setattr(faults, "fire", lambda f, rank, phase: fired.append((f.step, rank, phase)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    config = NeighborCkptConfig.from_dict({"fault_injection": {"enabled": True, "faults": [
        {"rank": 1, "step": 3, "phase": "forward"}, {"rank": 2, "step": 7}]}})

    def run(generation: int, rank: int, steps: range) -> None:
        inj = faults.FaultInjector(config)  # built anew for every generation, as the recipes do
        trainer = SimpleNamespace(global_rank=rank, global_step=steps.start,
                                  callbacks=[SimpleNamespace(attempt=SimpleNamespace(inprocess=generation))])
        for step in steps:
            trainer.global_step = step
            inj.on_train_batch_start(trainer, None, None, step)
            inj.on_before_optimizer_step(trainer, None, None)

    run(0, 1, range(0, 4))    # rank 1 dies in step 3 (forward)
    run(1, 1, range(3, 10))   # the spare as rank 1 replays step 3: not again
    run(1, 2, range(3, 8))    # rank 2 of generation 1 dies in step 7
    run(2, 2, range(7, 10))   # the next spare as rank 2 replays step 7: not again
    assert fired == [(3, 1, "forward"), (7, 2, "optimizer")]
    with pytest.raises(ConfigError, match="store_node"):
        faults.FaultInjector(NeighborCkptConfig.from_dict({"fault_injection": {"enabled": True,
                                                                               "target": "store_node"}}))


def test_the_plain_loop_recipe_injects_the_config_files_faults_and_refuses_them_beside_kill(tmp_path) -> None:
    from neighbor_ckpt.recipes import mcore_gpt_plain_loop as recipe

    cfg = tmp_path / "job.yaml"
    cfg.write_text("neighbor_ckpt:\n  fault_injection:\n    enabled: true\n    faults: [{rank: 1, step: 3}, "
                   "{rank: 2, step: 7, phase: forward}]\n")
    config = NeighborCkptConfig.from_yaml(cfg)
    planned = recipe.planned_faults(config, recipe.parse_args(["--config", str(cfg)]))
    assert [(f.rank, f.step, f.phase) for f in planned] == [(1, 3, "optimizer"), (2, 7, "forward")]
    assert recipe.planned_faults(NeighborCkptConfig(), recipe.parse_args([])) == ()
    with pytest.raises(ConfigError, match="faults planned twice: --kill and neighbor_ckpt.fault_injection"):
        recipe.planned_faults(config, recipe.parse_args(["--config", str(cfg), "--kill", "1:3"]))
    store = tmp_path / "store.yaml"
    store.write_text("neighbor_ckpt:\n  fault_injection:\n    enabled: true\n    target: store_node\n")
    with pytest.raises(ConfigError, match="target: store_node .* is injected only in process"):
        recipe.planned_faults(NeighborCkptConfig.from_yaml(store), recipe.parse_args([]))
    store.write_text("neighbor_ckpt:\n  inprocess: {enabled: true, spares: 1}\n  fault_injection:\n    enabled: true\n"
                     "    target: store_node\n")
    assert [f.target for f in recipe.planned_faults(NeighborCkptConfig.from_yaml(store), recipe.parse_args([]))] == \
        ["store_node"], "in process the plain loop injects it"
