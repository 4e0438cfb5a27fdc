"""What the in-process engine refuses when it is built, before it touches any store (one process); who a process is
comes from the environment once (:class:`ProcessIdentity`), and the engine itself reads none."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from neighbor_ckpt.config import DetectorConfig, InprocessConfig, NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import InprocessRecovery, protocol
from neighbor_ckpt.inprocess.identity import ProcessIdentity
from neighbor_ckpt.inprocess.store_clients import open_stores
from neighbor_ckpt.inprocess.stores import StoreAddresses

LAUNCHED = {protocol.ENV_LAUNCHER: "1234", protocol.ENV_STORE: "127.0.0.1:29650", protocol.ENV_PROCESSES: "5",
            protocol.ENV_SPARES: "1", protocol.ENV_PROCESS: "0"}
INPROCESS = InprocessConfig(enabled=True, spares=1)


@pytest.fixture()
def launched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", raising=False)
    for k, v in LAUNCHED.items():
        monkeypatch.setenv(k, v)


def test_plain_torchrun_is_refused_naming_our_launcher(launched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(protocol.ENV_LAUNCHER)
    with pytest.raises(ConfigError, match=r"neighbor-ckpt launch.*not plain torchrun"):
        InprocessRecovery.from_config(INPROCESS)


def test_under_our_launcher_the_engine_takes_the_launch_from_the_environment(launched: None) -> None:
    inproc = InprocessRecovery.from_config(INPROCESS)
    assert (inproc.store_host, inproc.store_port, inproc.world_size, inproc.spares) == ("127.0.0.1", 29650, 5, 1)
    assert inproc.active_world_size == 4
    assert inproc.identity == ProcessIdentity.from_env()


def test_the_detector_switched_off_is_refused_by_the_configuration() -> None:
    with pytest.raises(ConfigError, match="detector.enabled: false"):
        NeighborCkptConfig.from_dict({"inprocess": {"enabled": True, "spares": 1}, "detector": {"enabled": False}})


def test_a_spare_count_other_than_the_launchers_is_refused(launched: None) -> None:
    with pytest.raises(ConfigError, match="spares is 2 but the launcher started 1"):
        InprocessRecovery.from_config(InprocessConfig(enabled=True, spares=2))


def test_a_job_whose_ranks_are_not_the_launchs_is_refused(launched: None) -> None:
    with pytest.raises(ConfigError, match="for a job of 8 rank"):
        InprocessRecovery.from_config(INPROCESS, ranks=8)
    InprocessRecovery.from_config(INPROCESS, ranks=4)


def test_the_old_timer_variable_is_refused(launched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", "soft_timeout=10")
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        ProcessIdentity.from_env()


@pytest.mark.parametrize("name", [protocol.ENV_PROCESS, protocol.ENV_PROCESSES, protocol.ENV_SPARES])
def test_a_launch_variable_that_is_not_an_integer_is_refused_by_name(launched: None, monkeypatch: pytest.MonkeyPatch,
                                                                     name: str) -> None:
    monkeypatch.setenv(name, "two")
    with pytest.raises(ConfigError, match=f"{name}='two' is not an integer"):
        ProcessIdentity.from_env()


@pytest.mark.parametrize("text", ["", "host", "host:", ":29650", "host:port"])
def test_a_store_address_that_is_not_host_port_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        StoreAddresses.parse(text, "--inprocess-store")
    assert StoreAddresses.parse("[::1]:29650", "x").addresses == (("::1", 29650),)


def test_a_store_on_the_command_line_wins_over_the_launchers(launched: None) -> None:
    assert ProcessIdentity.from_env(store="10.0.0.1:1,10.0.0.2:2").stores.addresses == (("10.0.0.1", 1),
                                                                                          ("10.0.0.2", 2))


@pytest.mark.parametrize(("processes", "spares"), [(4, 4), (4, -1), (0, 0)])
def test_an_identity_with_impossible_counts_is_refused(processes: int, spares: int) -> None:
    with pytest.raises(ConfigError, match="process"):
        ProcessIdentity(process=0, processes=processes, spares=spares, stores=StoreAddresses((("h", 1),)))


def test_the_engine_is_built_from_its_parts_with_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given an identity and its stores, the engine reads nothing of the environment (a bare one here)."""
    identity = ProcessIdentity(process=2, processes=3, spares=1, stores=StoreAddresses((("127.0.0.1", 29650),)),
                               run_id="r", launch=1)
    stores = open_stores(identity, detector=DetectorConfig(), inprocess=INPROCESS)
    for name in list(__import__("os").environ):
        monkeypatch.delenv(name)
    inproc = InprocessRecovery(INPROCESS, identity=identity, stores=stores)
    assert (inproc.process, inproc.active_world_size, inproc.launch) == (2, 2, 1)
    assert inproc.clients.prefix == protocol.launch_prefix("r", 1)


def test_the_engines_constructor_reads_no_environment_variable() -> None:
    """The one place that reads the engine's environment is :meth:`ProcessIdentity.from_env`."""
    src = textwrap.dedent(inspect.getsource(InprocessRecovery.__init__))
    names = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute)}
    assert not ({"environ", "getenv"} & attrs) and "env" not in names


def test_no_class_of_the_inprocess_package_is_a_mixin() -> None:
    """Collaborators are handed what they use; no class of ``inprocess/`` inherits another's attributes (exceptions
    and typing protocols aside)."""
    root = Path(__file__).resolve().parents[2] / "neighbor_ckpt" / "inprocess"
    defined: dict[str, str] = {}
    trees = {p: ast.parse(p.read_text()) for p in sorted(root.glob("*.py"))}
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined[node.name] = p.name
    found = []
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in defined and not name.endswith(("Error", "Exception", "Aborted", "Lost", "Timeout")):
                    found.append(f"{p.name}:{node.lineno}: {node.name}({name})")
    assert not found, "classes built on another class of inprocess/ (hand it in instead): " + ", ".join(found)
