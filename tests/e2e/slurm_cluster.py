"""A real single-node Slurm on this machine for the tests: munged, slurmctld and slurmd (Debian's ``munge`` and
``slurm-wlm``), each a foreground child of the test process with its own generated configuration, state, spool,
log, pid files and ports in a temporary directory; nothing under /etc is read or written and no system service is
started. ``sbatch``/``srun``/``sinfo`` reach it through ``SLURM_CONF`` (:meth:`SlurmCluster.env`).

What a container allows, and what the configuration does about it:

- cgroups: nothing cgroup-based is configured: ``ProctrackType=proctrack/linuxproc`` (processes tracked by parent
  pid), ``TaskPlugin=task/none`` (no CPU binding), ``JobAcctGatherType=jobacct_gather/none``, no accounting storage.
  This machine (gVisor, hybrid cgroup mounts: v1 controllers under a tmpfs /sys/fs/cgroup, an empty v2 ``unified``)
  would run ``proctrack/cgroup`` + ``task/cgroup,task/affinity`` too (tried: a step lands in
  ``/slurm_<node>/uid_0/job_1/step_0``, and a one-task ``srun`` inside an ``--exclusive`` allocation still gets
  every core, Slurm >= 21.08 semantics, so torchrun's workers are not squeezed onto one CPU), but a container with
  only a v2 hierarchy and no systemd to delegate from cannot (Slurm's cgroup/v2 wants a systemd-delegated subtree),
  and the cgroup paths are named by node and job id, so two sessions on one machine would share them.
- munge: /run/munge does not exist (no systemd/tmpfiles) and the packaged key belongs to user munge; ours runs as
  root (``--force``) with its own key and socket in the temporary directory, and Slurm is pointed at that socket
  (``AuthInfo=socket=...``), so a system munged, if any, is neither needed nor touched.
- host name: slurmd registers under ``hostname -s``; the node is declared by that name with ``NodeAddr=127.0.0.1``
  (the controller is ``SlurmctldHost=localhost``), so no DNS is needed beyond what /etc/hosts gives.
- ports: both daemons get free ports, so two test sessions (or a real Slurm) on one machine do not collide.

:func:`install` installs the packages through ``scripts/setup --slurm-only`` when they are missing (apt-get, root);
:func:`missing` says why it cannot, which is the one case where the Slurm tests are skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag

REPO = Path(__file__).resolve().parents[2]
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")


def _which(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def missing() -> list[str]:
    """The Slurm and munge programs that are not installed."""
    return [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]


def install(timeout: float = 900) -> str | None:
    """Install slurm-wlm and munge if missing (``scripts/setup --slurm-only``); None when they are there, else
    one line saying why they are not."""
    if not missing():
        return None
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "setup"), "--slurm-only"], capture_output=True,
                              text=True, timeout=timeout)
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    still = missing()
    if not still:
        return None
    return f"Slurm packages (slurm-wlm, munge) not installed and could not be installed ({why}); missing: {still}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


@dataclass
class SlurmCluster:
    """One slurmctld + one slurmd (node ``node``, partition ``debug``) and their munged, under ``root``."""

    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    tag: str = field(default_factory=new_run_tag)
    """Run tag in the daemons' environment (inherited by every slurmstepd): what :meth:`stop` sweeps."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` and a PATH that has the daemons."""
        env = dict(os.environ if base is None else base)
        env.update(SLURM_CONF=str(self.conf), PATH=os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"]))
        return env

    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        # Half the memory: slurmd drains a node whose configured RealMemory exceeds what it finds.
        self.conf.write_text(f"""# generated by tests/e2e/slurm_cluster.py: one node, no cgroups, no accounting
ClusterName=nckpt
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_mem_mb() // 2} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {**self.env(), RUN_TAG_ENV: self.tag}
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen([_which(name) or name, *args], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self, timeout: float = 120) -> None:
        """Write the configuration, start the three daemons and wait until the node is idle."""
        self.write_config()
        m = self.root / "munge"
        self._spawn("munged", ["--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--log-file={m / 'munged.log'}",
                               f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["-D", "-i"])  # -i: ignore (absent) saved state
        self._spawn("slurmd", ["-D"])
        self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} idle in sinfo")

    def node_state(self) -> str:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                              timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"single-node Slurm: no {what} after {timeout:.0f}s (exited: {dead}); "
                                   f"logs:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, tail: int = 30) -> str:
        parts = []
        for p in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if p.exists():
                parts.append(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-tail:]))
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job and wait until the queue is empty."""
        if self.procs.get("slurmctld") is None or self.procs["slurmctld"].poll() is not None:
            return
        subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env(), capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            q = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True,
                               timeout=30)
            if q.returncode != 0 or not q.stdout.strip():
                return
            time.sleep(1)

    def stop(self) -> None:
        """Cancel the jobs, SIGTERM the daemons (slurmd first), SIGKILL what is left, sweep their slurmstepds."""
        try:
            self.cancel_all()
        finally:
            for name in ("slurmd", "slurmctld", "munged"):
                p = self.procs.get(name)
                if p is None or p.poll() is not None:
                    continue
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            kill_tagged(self.tag)
