"""The launchers' restart rendezvous without a node lost for good (:mod:`neighbor_ckpt.inprocess.restart_rendezvous`):
which nodes count as lost (launcher silent for ``detector.timeout_s`` and every process of it declared dead), and
whether the restart goes on without them (spares cover them, or elastic) or says what to set."""

from __future__ import annotations

from neighbor_ckpt.inprocess.restart_rendezvous import LostNodes, parse_nodes, restart_verdict


def test_node_lists_parse_each_node_once_in_order() -> None:
    assert parse_nodes(b"node0,node1,node0,") == ["node0", "node1"] and parse_nodes(None) == []


def test_a_node_is_lost_only_when_its_launcher_stood_still_for_the_timeout_and_its_processes_are_dead() -> None:
    watch = LostNodes(timeout_s=2.0, bound_s=6.0)
    procs = {"node1": (2, 3), "node2": (4, 5)}
    watch.observe("node1", "17", 100.0)
    watch.observe("node2", "3", 100.0)
    dead = {2: "silent", 3: "silent"}
    assert watch.lost(["node1", "node2"], processes=procs, dead=dead, now=101.0) == (), "not silent long enough"
    watch.observe("node2", "4", 101.5)  # node2's launcher beats on
    assert watch.lost(["node1", "node2"], processes=procs, dead=dead, now=102.5) == ("node1",)
    assert watch.lost(["node1"], processes=procs, dead={2: "silent"}, now=102.5) == (), \
        "a live process of the node: its launcher may only be slow"
    assert watch.lost(["node3"], processes=procs, dead=dead, now=200.0) == (), "never seen: not judged"
    assert watch.lost(["node1"], processes=procs, dead={}, now=106.5) == ("node1",), \
        "silent past the bound: lost although nobody declared its processes (the job gave up first)"


def test_the_restart_goes_on_without_a_lost_node_when_spares_or_elastic_allow_else_names_the_setting() -> None:
    lost = {"node1": (2, 3)}
    ok = restart_verdict(lost=lost, processes=6, spares=2, elastic=False)
    assert ok.go_on and "spares take their places" in ok.message
    shrink = restart_verdict(lost=lost, processes=4, spares=0, elastic=True)
    assert shrink.go_on and "smaller data-parallel size" in shrink.message
    no = restart_verdict(lost=lost, processes=4, spares=0, elastic=False)
    assert not no.go_on
    assert "node(s) node1 lost for good" in no.message and "neighbor_ckpt.elastic.enabled: true" in no.message
    assert "2 more process(es) than the 2 left" in no.message
