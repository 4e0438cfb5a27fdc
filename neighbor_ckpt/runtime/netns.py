"""The simulated network of a single-machine launch, made and cut for real (``launch.simulate_network``).

:mod:`neighbor_ckpt.runtime.network_plan` says what exists (names, addresses); this module runs the ``ip`` commands:

* :func:`simulated_network` (a context manager, around a launch): checks that it can be done (root, ``ip``,
  ``nsenter``, a namespace can be made), cleans what crashed launches left, chooses a tag and a prefix no live launch
  uses, makes the namespaces, veths and bridges, and removes them on the way out, also after a failure.
* :func:`cut` (the partition fault, from a process inside a node's namespace): moves the cut nodes' veth ends to the
  side's own bridge, in the launch's namespace (``nsenter --net=/proc/<launch pid>/ns/net``), and, with a heal time,
  starts a timer process of its own session (``python -m neighbor_ckpt.runtime.netns heal``) that moves them back:
  it outlives the process that cut, which may exit meanwhile.

**State and leftovers.** Each launch keeps ``/run/neighbor_ckpt-netns/<tag>.json`` (its plan) locked (``flock``) for
as long as it runs. A file nobody holds is a crashed launch's: the next launch removes its namespaces, links and heal
timers (:func:`clean_leftovers`). The choice of tag and prefix is made under one lock, so two launches starting at
once never take the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Literal, Sequence

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.runtime.network_plan import (LINK_PREFIX, NETNS_PREFIX, RANK_IFNAME, STORE_IFNAME, SUBNETS,
                                                NetworkPlan, subnet_prefix)

__all__ = ["STATE_DIR", "simulated_network", "refuse_impossible", "clean_leftovers", "setup", "teardown", "cut",
           "heal", "plan_from_env", "main"]

logger = logging.getLogger(__name__)

STATE_DIR = Path("/run/neighbor_ckpt-netns")
"""Where the live launches' plans are (one locked file each)."""
IP_TIMEOUT_S = 30.0


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and res.returncode != 0:
        raise ConfigError(f"launch.simulate_network: `{' '.join(cmd)}` failed: "
                          f"{(res.stderr or res.stdout).strip() or f'exit {res.returncode}'}")
    return res


def refuse_impossible() -> None:
    """Raise :class:`~neighbor_ckpt.errors.ConfigError` (one line) unless network namespaces can be made here: root,
    ``ip`` and ``nsenter`` on the PATH, and ``ip netns add`` works."""
    if os.geteuid() != 0:
        raise ConfigError("launch.simulate_network: true needs root (it makes network namespaces, veth pairs and "
                          f"bridges); this runs as uid {os.geteuid()}: run as root, or set launch.simulate_network: "
                          "false")
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"launch.simulate_network: {', '.join(missing)} not found on the PATH (iproute2, "
                          "util-linux); install them, or set launch.simulate_network: false")
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if res.returncode != 0:
        raise ConfigError(f"launch.simulate_network: cannot make a network namespace here (`ip netns add`: "
                          f"{res.stderr.strip() or res.returncode}); run where that works (root, not in a container "
                          "that forbids it), or set launch.simulate_network: false")


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _held(path: Path) -> bool:
    """Whether a live launch holds ``path`` (its lock)."""
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except FileNotFoundError:
        return False


def _links() -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _write_heal_marker(marker: Path) -> None:
    """The heal timer's file: its exact identity (this process's start time; the pid is in the name), 0600."""
    from neighbor_ckpt.runtime.procs import process_start

    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{process_start()!r}\n")


def heal_timer_is(marker: Path, pid: int) -> bool:
    """Whether ``pid`` is the very heal timer that wrote ``marker`` (its start time as recorded, read without
    following a link from a file of this user): a pid reused since by another process, whatever its command line,
    is never killed."""
    from neighbor_ckpt.runtime.procs import process_start

    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd) as f:
        if os.fstat(f.fileno()).st_uid != os.geteuid():
            return False
        try:
            recorded = float(f.read(64).strip())
        except ValueError:
            return False
    return process_start(pid) == recorded


def _remove_tag(tag: str) -> None:
    """Remove everything of launch ``tag`` (a live one's at its end, a crashed one's later): its heal timers, its
    namespaces, its links, its state file."""
    for timer in STATE_DIR.glob(f"{tag}.heal.*"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(timer.name.rsplit(".", 1)[1])
            if heal_timer_is(timer, pid):
                os.kill(pid, signal.SIGKILL)
        timer.unlink(missing_ok=True)
    for ns in _namespaces():
        if ns.startswith(f"{NETNS_PREFIX}{tag}-"):
            _ip("netns", "del", ns, check=False)
    links = [link for link in _links() if link.startswith(f"{LINK_PREFIX}{tag}-")]
    for link in sorted(links, key=lambda name: "-b" in name or "-c" in name):  # the veths, then the bridges
        _ip("link", "del", link, check=False)
    (STATE_DIR / f"{tag}.json").unlink(missing_ok=True)


def clean_leftovers() -> list[str]:
    """Remove what launches that ended without cleaning up left (their state file is held by nobody); the tags
    removed. Call under :func:`_global_lock`."""
    removed = []
    for path in sorted(STATE_DIR.glob("*.json")):
        tag = path.stem
        if not _held(path):
            _remove_tag(tag)
            removed.append(tag)
    live = {p.stem for p in STATE_DIR.glob("*.json")}
    stray = {name[len(NETNS_PREFIX):].split("-")[0] for name in _namespaces() if name.startswith(NETNS_PREFIX)}
    stray |= {name[len(LINK_PREFIX):].split("-")[0] for name in _links()
              if name.startswith(LINK_PREFIX) and "-" in name and len(name[len(LINK_PREFIX):].split("-")[0]) == 4}
    for tag in sorted(stray - live):  # made by a launch that died before it wrote its state file, or half removed
        if len(tag) == 4 and all(c in "0123456789abcdef" for c in tag):
            _remove_tag(tag)
            removed.append(tag)
    if removed:
        logger.warning("launch.simulate_network: removed the namespaces and links that ended launches left: %s",
                       ", ".join(sorted(set(removed))))
    return removed


def _used_prefixes() -> set[tuple[int, int]]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", "table", "all",
                                                                   check=False).stdout
    used = set()
    for word in out.split():
        parts = word.split("/")[0].split(".")
        if len(parts) == 4 and parts[0] == "10" and all(p.isdigit() for p in parts):
            used.add((int(parts[1]), int(parts[2])))
    return used


def _choose(nodes: int, launch_pid: int) -> NetworkPlan:
    rng = random.SystemRandom()
    live = [NetworkPlan.from_json(p.read_text()) for p in STATE_DIR.glob("*.json")]
    tags = {p.tag for p in live} | {link[len(LINK_PREFIX):].split("-")[0] for link in _links()}
    used = _used_prefixes()
    taken = {p.subnet for p in live}
    for _ in range(1000):
        tag, subnet = f"{rng.randrange(1 << 16):04x}", rng.randrange(SUBNETS)
        a, b = subnet_prefix(subnet)
        if tag not in tags and subnet not in taken and (a, b) not in used and (a, b + 1) not in used:
            return NetworkPlan(tag=tag, nodes=nodes, subnet=subnet, launch_pid=launch_pid)
    raise ConfigError("launch.simulate_network: no free 10.x.y prefix or tag found for this launch's network")


def setup(plan: NetworkPlan) -> None:
    """Make ``plan``'s namespaces, veth pairs and bridges (see :mod:`~neighbor_ckpt.runtime.network_plan`)."""
    for network in ("store", "rank"):
        for cut_side in (False, True):
            br = plan.bridge(network, cut=cut_side)
            _ip("link", "add", br, "type", "bridge")
            _ip("link", "set", br, "up")
    _ip("addr", "add", f"{plan.bridge_address()}/24", "dev", plan.bridge("store"))
    for i in range(plan.nodes):
        ns = plan.netns(i)
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", netns=ns)
        for network, ifname in (("store", STORE_IFNAME), ("rank", RANK_IFNAME)):
            link = plan.link(network, i)  # type: ignore[arg-type]
            _ip("link", "add", link, "type", "veth", "peer", "name", ifname, "netns", ns)
            _ip("link", "set", link, "master", plan.bridge(network), "up")  # type: ignore[arg-type]
            _ip("addr", "add", f"{plan.address(i, network)}/24", "dev", ifname, netns=ns)  # type: ignore[arg-type]
            _ip("link", "set", ifname, "up", netns=ns)


def teardown(plan: NetworkPlan) -> None:
    """Remove ``plan``'s network (heal timers, namespaces, links, state file); never raises for what is gone."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _remove_tag(plan.tag)


@contextlib.contextmanager
def simulated_network(nodes: int) -> Iterator[tuple[NetworkPlan, Path]]:
    """A simulated network of ``nodes`` nodes for the launch in this process: ``(plan, plan file)``, removed on the
    way out (also when the block raises). Raises :class:`~neighbor_ckpt.errors.ConfigError` (one line) when it
    cannot be made (:func:`refuse_impossible`, or an ``ip`` command that failed)."""
    refuse_impossible()
    with _global_lock():
        clean_leftovers()
        plan = _choose(nodes, os.getpid())
        path = STATE_DIR / f"{plan.tag}.json"
        held = open(path, "w")  # held (locked) until this launch ends: no later launch takes it for a leftover
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(plan.to_json())
        held.flush()
    try:
        setup(plan)
        logger.info("launch.simulate_network: %d node namespace(s) %s..%s, stores on 10.%d.%d.0/24, ranks on "
                    "10.%d.%d.0/24", nodes, plan.netns(0), plan.netns(nodes - 1), *subnet_prefix(plan.subnet),
                    subnet_prefix(plan.subnet)[0], subnet_prefix(plan.subnet)[1] + 1)
        yield plan, path
    finally:
        teardown(plan)
        held.close()


# -- partitions (from a process of the launch) ------------------------------------------------------------------------

def plan_from_env(env: dict[str, str] | None = None) -> tuple[NetworkPlan, Path] | None:
    """The launch's plan and plan file, from :data:`~neighbor_ckpt.runtime.network_plan.PLAN_ENV`; None without one."""
    from neighbor_ckpt.runtime.network_plan import PLAN_ENV

    raw = (os.environ if env is None else env).get(PLAN_ENV)
    if not raw:
        return None
    return NetworkPlan.from_json(Path(raw).read_text()), Path(raw)


def _in_launch_ns(plan: NetworkPlan, argv: Sequence[str]) -> subprocess.CompletedProcess:
    cmd = ["nsenter", f"--net=/proc/{plan.launch_pid}/ns/net", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)


def _move(plan: NetworkPlan, nodes: Sequence[int], traffic: Literal["all", "ranks"], *, heal: bool) -> list[str]:
    """Run the cut (or heal) in the launch's namespace; the errors (one line each), empty when it all worked."""
    errors = []
    for argv in plan.cut(list(nodes), traffic).ip_commands(heal=heal):
        res = _in_launch_ns(plan, argv)
        if res.returncode != 0:
            errors.append(f"`{' '.join(argv)}`: {(res.stderr or res.stdout).strip() or res.returncode}")
    return errors


def cut(nodes: Sequence[int], traffic: Literal["all", "ranks"] = "all", heal_after_s: float | None = None,
        env: dict[str, str] | None = None) -> None:
    """Cut ``nodes`` off the other nodes now (``traffic: ranks``: their rank network only), and heal after
    ``heal_after_s`` seconds (None: never) by a timer of its own session, which outlives this process.

    Raises:
        ConfigError: this process is not in a launch with a simulated network, or the cut failed."""
    found = plan_from_env(env)
    if found is None:
        raise ConfigError("fault_injection.target: partition needs launch.simulate_network: true (this process is "
                          "in no simulated network)")
    plan, path = found
    errors = _move(plan, nodes, traffic, heal=False)
    if errors:
        raise ConfigError(f"fault_injection: the partition of node(s) {list(nodes)} failed: {'; '.join(errors)}")
    if heal_after_s is not None:
        from neighbor_ckpt.runtime.procs import python_module_command

        subprocess.Popen(python_module_command("neighbor_ckpt.runtime.netns", "heal", str(path),
                                               "--nodes", ",".join(map(str, nodes)), "--traffic", traffic,
                                               "--after", f"{heal_after_s:g}"),
                         start_new_session=True, stdin=subprocess.DEVNULL, close_fds=True)


def heal(plan: NetworkPlan, nodes: Sequence[int], traffic: Literal["all", "ranks"] = "all") -> list[str]:
    """Undo :func:`cut` (the errors, one line each; none when it worked)."""
    return _move(plan, nodes, traffic, heal=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m neighbor_ckpt.runtime.netns heal PLAN_FILE --nodes 0,1 --traffic all --after S`` (the heal timer
    :func:`cut` starts), or ``clean`` (remove what ended launches left)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m neighbor_ckpt.runtime.netns")
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("heal")
    h.add_argument("plan", type=Path)
    h.add_argument("--nodes", required=True)
    h.add_argument("--traffic", choices=("all", "ranks"), default="all")
    h.add_argument("--after", type=float, default=0.0)
    sub.add_parser("clean")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s neighbor_ckpt netns: %(message)s")
    if a.what == "clean":
        with _global_lock():
            clean_leftovers()
        return 0
    plan = NetworkPlan.from_json(a.plan.read_text())
    marker = STATE_DIR / f"{plan.tag}.heal.{os.getpid()}"
    _write_heal_marker(marker)
    try:
        time.sleep(a.after)
        if not a.plan.exists():  # the launch ended meanwhile: nothing left to heal
            return 0
        nodes = [int(n) for n in a.nodes.split(",") if n]
        errors = heal(plan, nodes, a.traffic)
        for line in errors:
            logger.error("heal: %s", line)
        if not errors:
            logger.warning("fault injection: the partition of node(s) %s healed after %g s", nodes, a.after)
        return 1 if errors else 0
    finally:
        marker.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
