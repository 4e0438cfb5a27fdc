"""The simulated network's plan (names, addresses, one launch apart from another), what an in-process launch runs in
it, and the refusals of ``launch.simulate_network`` and ``fault_injection.target: partition`` (one line each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neighbor_ckpt.cli.launch import inprocess_commands, plan_launch, slurm_script
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.fault_config import FaultSpec
from neighbor_ckpt.runtime import netns
from neighbor_ckpt.runtime.network_plan import (PLAN_ENV, RANK_IFNAME, SUBNETS, NetworkPlan, subnet_prefix)


def test_a_plan_names_every_namespace_link_and_bridge_under_its_launch_tag_within_linux_limits() -> None:
    plan = NetworkPlan(tag="3f9a", nodes=12, subnet=5)
    assert plan.netns(0) == "nckpt-3f9a-0" and plan.netns_path(11) == "/run/netns/nckpt-3f9a-11"
    names = [*plan.bridges, *(plan.link(n, i) for n in ("store", "rank") for i in range(12))]
    assert len(set(names)) == len(names) == 4 + 24
    assert all(name.startswith("nk3f9a-") and len(name) <= 15 for name in names), names
    assert plan.bridge("store") == "nk3f9a-bs" and plan.bridge("rank", cut=True) == "nk3f9a-cg"
    other = NetworkPlan(tag="0001", nodes=12, subnet=6)
    assert not set(names) & {*other.bridges, *(other.link(n, i) for n in ("store", "rank") for i in range(12))}
    assert {plan.netns(i) for i in range(12)}.isdisjoint({other.netns(i) for i in range(12)})


def test_each_node_has_a_store_and_a_rank_address_and_launches_use_different_prefixes() -> None:
    plan = NetworkPlan(tag="00aa", nodes=3, subnet=130)
    a, b = subnet_prefix(130)
    assert (a, b) == (201, 4)
    assert [plan.address(i) for i in range(3)] == ["10.201.4.1", "10.201.4.2", "10.201.4.3"]
    assert [plan.address(i, "rank") for i in range(3)] == ["10.201.5.1", "10.201.5.2", "10.201.5.3"]
    assert plan.bridge_address() == "10.201.4.254"
    prefixes = {subnet_prefix(i) for i in range(SUBNETS)}
    assert len(prefixes) == SUBNETS and all(b % 2 == 0 for _, b in prefixes)  # B + 1 is never another's B
    with pytest.raises(ValueError):
        plan.address(3)
    with pytest.raises(ValueError):
        NetworkPlan(tag="xyz1", nodes=3, subnet=0)
    assert NetworkPlan.from_json(NetworkPlan(tag="00aa", nodes=3, subnet=130, launch_pid=7).to_json()) == \
        NetworkPlan(tag="00aa", nodes=3, subnet=130, launch_pid=7)


def test_a_cut_moves_the_cut_nodes_links_to_their_sides_bridge_and_healing_moves_them_back() -> None:
    plan = NetworkPlan(tag="00aa", nodes=4, subnet=0)
    everything = plan.cut([2, 0])
    assert everything.ip_commands(heal=False) == [
        ["ip", "link", "set", "nk00aa-s0", "master", "nk00aa-cs"], ["ip", "link", "set", "nk00aa-g0", "master", "nk00aa-cg"],
        ["ip", "link", "set", "nk00aa-s2", "master", "nk00aa-cs"], ["ip", "link", "set", "nk00aa-g2", "master", "nk00aa-cg"]]
    assert everything.ip_commands(heal=True)[0] == ["ip", "link", "set", "nk00aa-s0", "master", "nk00aa-bs"]
    ranks = plan.cut([1], "ranks")
    assert ranks.ip_commands(heal=False) == [["ip", "link", "set", "nk00aa-g1", "master", "nk00aa-cg"]]


def test_an_inprocess_launch_in_a_simulated_network_runs_each_launcher_in_its_node_namespace(tmp_path: Path) -> None:
    plan = NetworkPlan(tag="00aa", nodes=4, subnet=0, launch_pid=99)
    procs = inprocess_commands(["train.py"], active=3, spares=1, max_restarts=0, run_id="r", store_port=[5000, 5001,
                               5002, 5003], store_root=tmp_path, network=(plan, tmp_path / "net.json"))
    assert procs.stores == "10.200.0.1:5000,10.200.0.2:5001,10.200.0.3:5002,10.200.0.4:5003"
    assert procs.network == plan
    for i, (cmd, extra) in enumerate(procs.agents):
        assert list(cmd[:2]) == ["nsenter", f"--net=/run/netns/nckpt-00aa-{i}"]
        assert cmd[cmd.index("--store-listen") + 1] == f"10.200.0.{i + 1}"
        assert cmd[cmd.index("--store") + 1] == procs.stores
        env = dict(extra)
        assert env["GLOO_SOCKET_IFNAME"] == RANK_IFNAME and env[PLAN_ENV] == str(tmp_path / "net.json")
    with pytest.raises(ConfigError, match="a simulated network of 4 nodes for 3 nodes"):
        inprocess_commands(["t.py"], active=3, spares=0, max_restarts=0, run_id="r", store_port=5000,
                           store_root=tmp_path, network=(plan, tmp_path / "net.json"))


def _fi(**kw: object) -> NeighborCkptConfig:
    return NeighborCkptConfig.from_dict({"fault_injection": {"enabled": True, **kw}})


def test_a_partition_fault_needs_its_nodes_and_is_refused_outside_a_simulated_network() -> None:
    with pytest.raises(ConfigError, match=r"^neighbor_ckpt\.fault_injection\.nodes: target: partition needs the nodes"):
        _fi(target="partition")
    with pytest.raises(ConfigError, match=r"faults\[0\]\.heal_after_s: 0\.0 must be > 0 \(or null: never\)"):
        _fi(faults=[{"target": "partition", "nodes": [0], "heal_after_s": 0}])
    cfg = _fi(target="partition", nodes=[0, 3], heal_after_s=10, traffic="ranks", step=5, rank=2)
    (f,) = cfg.fault_injection.planned()
    assert (f.nodes, f.heal_after_s, f.traffic) == ([0, 3], 10, "ranks")
    assert f.describe() == "partition of node(s) [0, 3] (ranks traffic, healed after 10 s) in the optimizer phase of " \
                           "step 5"
    assert f.fires(rank=2, step=5, phase="optimizer", launch=0, generation=0, start_step=0)
    assert not f.fires(rank=0, step=5, phase="optimizer", launch=0, generation=0, start_step=0)
    # once: the rank that cut survives, and a generation that replays from an iteration before the cut's step (a cut
    # early in training) does not cut again
    assert not f.fires(rank=2, step=5, phase="optimizer", launch=0, generation=1, start_step=3)
    with pytest.raises(ConfigError) as e:
        cfg.fault_injection.refuse_unsupported(where=" by this injector")
    assert str(e.value) == ("neighbor_ckpt.fault_injection.target: partition (a cut between simulated nodes) needs "
                            "launch.simulate_network: true, in process (neighbor_ckpt.inprocess.enabled: true), not by "
                            "this injector; use target: node")
    assert cfg.fault_injection.refuse_unsupported(partition=True) == (f,)
    assert FaultSpec().traffic == "all" and FaultSpec().heal_after_s is None


def test_the_job_file_refuses_a_partition_without_the_simulated_network_and_the_network_outside_process() -> None:
    base = ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.fault_injection.enabled=true",
            "neighbor_ckpt.fault_injection.target=partition", "neighbor_ckpt.fault_injection.nodes=[0]"]
    with pytest.raises(ConfigError, match=r"neighbor_ckpt\.fault_injection\.target: partition cuts the network "
                                          r"between simulated nodes: it needs launch\.simulate_network: true"):
        plan_launch("gpt_tiny_cpu", base)
    with pytest.raises(ConfigError, match=r"^config\.launch\.simulate_network: the simulated network is made for the "
                                          r"simulated nodes of an in-process launch"):
        plan_launch("gpt_tiny_cpu", ["launch.simulate_network=true"])
    plan = plan_launch("gpt_tiny_cpu", [*base, "launch.simulate_network=true"])
    assert plan.job.launch.simulate_network
    with pytest.raises(ConfigError, match=r"^launch\.simulate_network: simulated nodes on one machine only"):
        slurm_script(plan)


def test_the_simulated_network_is_refused_in_one_line_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as e:
        with netns.simulated_network(3):
            pass
    assert str(e.value).startswith("launch.simulate_network: true needs root") and "\n" not in str(e.value)


def test_a_cut_outside_a_simulated_network_says_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="needs launch.simulate_network: true"):
        netns.cut([0], env={})


# -- the blame for a cut of the ranks' network (inprocess/reachability.py) ----------------------------------------------

def test_the_process_a_majority_cannot_reach_is_blamed_and_two_halves_blame_nobody() -> None:
    from neighbor_ckpt.inprocess.reachability import unreachable_by_majority

    cut1 = {0: frozenset({1}), 1: frozenset({0, 2}), 2: frozenset({1})}
    assert unreachable_by_majority(cut1, [0, 1, 2]) == (1,)
    assert unreachable_by_majority({0: frozenset({1}), 2: frozenset({1})}, [0, 1, 2]) == (1,)  # the cut one's report late
    assert unreachable_by_majority({0: frozenset({1})}, [0, 1, 2]) == ()  # one report is no majority yet
    halves = {0: frozenset({2, 3}), 1: frozenset({2, 3}), 2: frozenset({0, 1}), 3: frozenset({0, 1})}
    assert unreachable_by_majority(halves, [0, 1, 2, 3]) == ()
    assert unreachable_by_majority({p: frozenset() for p in range(3)}, range(3)) == ()
    assert unreachable_by_majority({0: frozenset({5})}, [0]) == ()  # a spare's report does not count


def test_a_probe_counts_a_timeout_as_unreachable_and_a_refusal_as_an_answer() -> None:
    import socket

    from neighbor_ckpt.inprocess.abort import Endpoint
    from neighbor_ckpt.inprocess.reachability import format_report, parse_report, probe

    with socket.socket() as listening, socket.socket() as closed, socket.socket() as full:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # its accept queue filled below: Linux drops the next SYNs, as a cut link does
        up, refused, blackhole = (Endpoint("127.0.0.1", s.getsockname()[1]) for s in (listening, closed, full))
        fillers = []
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", blackhole.port))
            fillers.append(c)
        try:
            lost = probe({1: [up], 2: [refused], 3: [blackhole], 4: [blackhole, up]}, timeout_s=0.5)
        finally:
            for c in fillers:
                c.close()
    assert lost == frozenset({3})
    assert parse_report(format_report(lost)) == lost and parse_report("-") == frozenset()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_launch_makes_its_network_removes_it_at_its_end_and_cleans_what_a_crashed_launch_left() -> None:
    import subprocess

    def links() -> str:
        return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout

    def namespaces() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with netns.simulated_network(2) as (plan, path):
        assert path == netns.STATE_DIR / f"{plan.tag}.json" and NetworkPlan.from_json(path.read_text()) == plan
        assert plan.launch_pid == os.getpid()
        assert all(f"{plan.netns(i)}" in namespaces() for i in range(2))
        assert all(f"{b}:" in links() for b in plan.bridges)
        crashed = NetworkPlan(tag=f"{(int(plan.tag, 16) + 1) % 65536:04x}", nodes=1, subnet=(plan.subnet + 1) % SUBNETS)
        netns.setup(crashed)  # as a launch that died: its state file held by nobody
        (netns.STATE_DIR / f"{crashed.tag}.json").write_text(crashed.to_json())
        with netns._global_lock():
            assert netns.clean_leftovers() == [crashed.tag]  # the live launch's network stays
        assert crashed.netns(0) not in namespaces() and plan.netns(0) in namespaces()
        assert f"nk{crashed.tag}-" not in links() and f"{plan.bridge('store')}:" in links()
    assert f"nk{plan.tag}-" not in links() and plan.netns(0) not in namespaces() and not path.exists()


def test_neighbor_ckpt_launch_runs_its_launchers_inside_the_network_it_makes(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    import contextlib

    from neighbor_ckpt.cli import launch

    made: list[int] = []
    seen: list[object] = []

    @contextlib.contextmanager
    def network(nodes: int):  # type: ignore[no-untyped-def]
        made.append(nodes)
        yield NetworkPlan(tag="00ab", nodes=nodes, subnet=1, launch_pid=os.getpid()), tmp_path / "00ab.json"

    monkeypatch.setattr(launch, "simulated_network", network)
    monkeypatch.setattr(launch, "run_inprocess", lambda procs, **kw: seen.append(procs) or 0)
    plan = plan_launch("gpt_tiny_cpu", ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1",
                                        "launch.simulate_network=true"], run_dir=tmp_path / "run")
    assert launch._run_inprocess(plan, {}) == 0
    (procs,) = seen
    assert made == [5] and procs.network is not None and procs.network.tag == "00ab"  # 4 ranks + a spare node
    assert all(cmd[0] == "nsenter" for cmd, _ in procs.agents)
    assert procs.stores.split(",")[4].startswith("10.200.2.5:")
    seen.clear()
    plain = plan_launch("gpt_tiny_cpu", ["neighbor_ckpt.inprocess.enabled=true"], run_dir=tmp_path / "run2")
    assert launch._run_inprocess(plain, {}) == 0 and seen[0].network is None and made == [5]  # type: ignore[attr-defined]


class _DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, k: str) -> bytes:
        return self.data[k]

    def set(self, k: str, v: str | bytes) -> None:
        self.data[k] = v.encode() if isinstance(v, str) else v


def test_a_monitor_probes_on_a_thread_of_its_own_reports_once_and_blames_what_the_majority_reports() -> None:
    import socket
    import threading
    import time

    from neighbor_ckpt.inprocess.reachability import PROBE_THREAD, ReachProbe

    store = _DictStore()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        store.set("gen/0/listen/1", f"127.0.0.1:{listening.getsockname()[1]}")
        store.set("gen/0/reach/1", "2")  # process 1 could not reach 2
        reach = ReachProbe(store, 0, timeout_s=0.5)
        assert reach.blame(0, [0, 1, 2]) == ((), False)  # the probe runs meanwhile
        deadline = time.monotonic() + 10
        while "gen/0/reach/0" not in store.data:
            assert time.monotonic() < deadline, "the probe's report never came"
            time.sleep(0.05)
            reach.blame(0, [0, 1, 2])
    assert store.data["gen/0/reach/0"] == b"-"  # process 2 published no listener: not probed, not blamed by 0
    loop = _DictStore()
    loop.set("gen/0/listen/1", "127.0.0.1:9,0.0.0.0:9")  # a loopback address names this host, not process 1's
    other = ReachProbe(loop, 0, timeout_s=0.5)
    while "gen/0/reach/0" not in loop.data:
        other.blame(0, [0, 1])
        time.sleep(0.05)
    assert loop.data["gen/0/reach/0"] == b"-"
    store.set("gen/0/reach/2", "-")
    assert reach.blame(0, [0, 1, 2]) == ((), True)
    store.set("gen/0/reach/0", "2")
    assert reach.blame(0, [0, 1, 2]) == ((2,), True)
    assert not [t for t in threading.enumerate() if t.name.startswith(PROBE_THREAD)]


def test_a_heal_timer_is_killed_by_its_exact_identity_not_by_a_tag_in_a_command_line(tmp_path: Path) -> None:
    """On 2c061fd the clean-up SIGKILLed the pid named in a heal timer's file whenever that pid's command line held
    the launch's tag: a reused pid, or any process with the tag among its arguments, was killed. Now the file records
    the timer's start time and only that very process matches."""
    import subprocess
    import sys

    marker = tmp_path / "tag.heal.1"
    netns._write_heal_marker(marker)
    assert netns.heal_timer_is(marker, os.getpid()), "the process that wrote it"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "tag"])
    try:
        assert not netns.heal_timer_is(marker, other.pid), "another process, the tag in its command line"
    finally:
        other.kill()
        other.wait()
    link = tmp_path / "tag.heal.2"
    link.symlink_to(marker)
    assert not netns.heal_timer_is(link, os.getpid()), "a link is not a timer's file"
    (tmp_path / "tag.heal.3").write_text("garbage\n")
    assert not netns.heal_timer_is(tmp_path / "tag.heal.3", os.getpid())
