"""The simulated network of a single-machine launch, as data (``launch.simulate_network``): names and addresses.

Each simulated node runs in a network namespace of its own (``nckpt-<tag>-<i>``) with two interfaces, each one end
of a veth pair whose other end is a port of a bridge in the launch's own namespace:

* ``nckst`` on the **store network** (``10.A.B.0/24``, node ``i`` at ``.i+1``, the bridge at ``.254``): the store
  hosts and their gates listen there, the processes' store tunnels and the launchers connect there;
* ``nckgl`` on the **rank network** (``10.A.B+1.0/24``): gloo (``GLOO_SOCKET_IFNAME=nckgl``), so the ranks'
  connections can be cut while the stores stay reachable (``traffic: ranks``).

Each network has two bridges, ``nk<tag>-b<s|g>`` (everyone) and ``nk<tag>-c<s|g>`` (the side cut off): a partition
moves the root-side ends of the cut nodes' veths (``nk<tag>-s<i>``, ``nk<tag>-g<i>``) to the second bridge, so the
nodes cut off still reach each other and nobody else; healing moves them back. Each node's ``127.0.0.1`` is its own.

``tag`` (4 hex digits) and the ``10.A.B`` prefix are chosen per launch by :mod:`neighbor_ckpt.runtime.netns`, so two
launches (two tests at once) never share a name or a route. This module is pure: :mod:`neighbor_ckpt.runtime.netns`
runs the ``ip`` commands.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["NetworkPlan", "CutPlan", "STORE_IFNAME", "RANK_IFNAME", "NETNS_PREFIX", "LINK_PREFIX", "PLAN_ENV",
           "subnet_prefix", "SUBNETS"]

STORE_IFNAME = "nckst"
"""A node's interface on the store network (inside its namespace)."""
RANK_IFNAME = "nckgl"
"""A node's interface on the rank network (inside its namespace): ``GLOO_SOCKET_IFNAME``."""
NETNS_PREFIX = "nckpt-"
"""Every namespace of a launch is ``nckpt-<tag>-<node>``."""
LINK_PREFIX = "nk"
"""Every link of a launch in its own namespace is ``nk<tag>-...`` (at most 15 characters: Linux's limit)."""
PLAN_ENV = "NEIGHBOR_CKPT_NETWORK_PLAN"
"""Set for every launcher and process of a launch with a simulated network: the plan file (JSON,
:meth:`NetworkPlan.to_json`), which the partition fault reads to cut the network."""
SUBNETS = 40 * 128
"""How many ``10.A.B`` prefixes there are to choose from (:func:`subnet_prefix`)."""


def subnet_prefix(index: int) -> tuple[int, int]:
    """``(A, B)`` of prefix ``index`` (``0 <= index < SUBNETS``): ``A`` in 200..239, ``B`` even (``B + 1`` is the
    rank network's)."""
    if not 0 <= index < SUBNETS:
        raise ValueError(f"subnet index {index}: not in [0, {SUBNETS})")
    return 200 + index // 128, 2 * (index % 128)


@dataclass(frozen=True, kw_only=True, slots=True)
class CutPlan:
    """The links a partition moves (pure): the root-side veth ends of the nodes cut off."""

    links: tuple[str, ...]
    cut_bridge: dict[str, str]
    """link -> the bridge of the side cut off."""
    main_bridge: dict[str, str]
    """link -> the bridge of everyone (where healing puts it back)."""

    def ip_commands(self, *, heal: bool) -> list[list[str]]:
        """The ``ip`` commands (argument lists, ``ip`` first) that cut (``heal=False``) or heal."""
        to = self.main_bridge if heal else self.cut_bridge
        return [["ip", "link", "set", link, "master", to[link]] for link in self.links]


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkPlan:
    """One launch's simulated network (see the module docstring)."""

    tag: str
    """4 hex digits, unique among the launches on this machine."""
    nodes: int
    """Simulated nodes (namespaces)."""
    subnet: int
    """The ``10.A.B`` prefix's index (:func:`subnet_prefix`)."""
    launch_pid: int = 0
    """The launch process (its network namespace is where the bridges are: a cut runs there)."""

    def __post_init__(self) -> None:
        if len(self.tag) != 4 or any(c not in "0123456789abcdef" for c in self.tag):
            raise ValueError(f"network tag {self.tag!r}: 4 lowercase hex digits")
        if not 1 <= self.nodes <= 250:
            raise ValueError(f"{self.nodes} simulated nodes: between 1 and 250")
        subnet_prefix(self.subnet)

    # -- names ---------------------------------------------------------------------------------------------------
    def netns(self, node: int) -> str:
        """Node ``node``'s namespace (``/run/netns/<name>``)."""
        return f"{NETNS_PREFIX}{self.tag}-{self._node(node)}"

    def netns_path(self, node: int) -> str:
        return f"/run/netns/{self.netns(node)}"

    def bridge(self, network: Literal["store", "rank"], *, cut: bool = False) -> str:
        """The bridge of ``network``: everyone's, or (``cut``) the side cut off's."""
        return f"{LINK_PREFIX}{self.tag}-{'c' if cut else 'b'}{'s' if network == 'store' else 'g'}"

    def link(self, network: Literal["store", "rank"], node: int) -> str:
        """The root-side end of node ``node``'s veth on ``network`` (a port of the bridge)."""
        return f"{LINK_PREFIX}{self.tag}-{'s' if network == 'store' else 'g'}{self._node(node)}"

    @property
    def bridges(self) -> tuple[str, ...]:
        return tuple(self.bridge(n, cut=c) for n in ("store", "rank") for c in (False, True))

    # -- addresses -----------------------------------------------------------------------------------------------
    def address(self, node: int, network: Literal["store", "rank"] = "store") -> str:
        """Node ``node``'s address on ``network``."""
        a, b = subnet_prefix(self.subnet)
        return f"10.{a}.{b + (network == 'rank')}.{self._node(node) + 1}"

    def bridge_address(self) -> str:
        """The store network's address in the launch's own namespace (its bridge)."""
        a, b = subnet_prefix(self.subnet)
        return f"10.{a}.{b}.254"

    # -- what a launcher of node i gets --------------------------------------------------------------------------
    def enter(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace (no ``--``: the launcher's options end at
        the first ``--`` of its command line)."""
        return ["nsenter", f"--net={self.netns_path(node)}"]

    def env(self, plan_file: str) -> dict[str, str]:
        """The environment every launcher (and so every process) of the launch gets on top of its own."""
        return {"GLOO_SOCKET_IFNAME": RANK_IFNAME, PLAN_ENV: plan_file}

    # -- partitions ----------------------------------------------------------------------------------------------
    def cut(self, nodes: tuple[int, ...] | list[int], traffic: Literal["all", "ranks"] = "all") -> CutPlan:
        """What cutting ``nodes`` off the others moves (``traffic: ranks``: their rank network only)."""
        networks: tuple[Literal["store", "rank"], ...] = ("rank",) if traffic == "ranks" else ("store", "rank")
        links = tuple(self.link(n, i) for i in sorted(set(nodes)) for n in networks)
        kind = {self.link(n, i): n for i in sorted(set(nodes)) for n in networks}
        return CutPlan(links=links, cut_bridge={k: self.bridge(v, cut=True) for k, v in kind.items()},
                       main_bridge={k: self.bridge(v) for k, v in kind.items()})

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NetworkPlan:
        data = json.loads(text)
        return cls(tag=str(data["tag"]), nodes=int(data["nodes"]), subnet=int(data["subnet"]),
                   launch_pid=int(data.get("launch_pid", 0)))

    def _node(self, node: int) -> int:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node}: the launch has nodes 0..{self.nodes - 1}")
        return node
