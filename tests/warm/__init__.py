"""Warm worker start for the end-to-end tests: workers forked from an interpreter that has already imported torch,
megatron-core, Lightning and NeMo, instead of each importing them again.

Why: on the 2-core test machine an end-to-end job is mostly imports. NeMo costs ~25 s of CPU per process and
megatron-core ~12 s; four ranks, and again after every restart, make a NeMo kill test ~2-3 minutes of which well
over half is ``import``. Forking from one pre-imported process (a "zygote", as Android starts its apps) costs
milliseconds per worker.

What stays real: torchrun (or ``neighbor-ckpt launch``'s per-node launchers, the campaign) starts every worker as a
process of its own, restarts them, and sees them die: each worker is a small client (:mod:`tests.warm.client`,
standard library only, no torch) that asks the zygote (:mod:`tests.warm.zygote`) for a fork running the worker
script with the client's argv, environment, working directory and stdio, forwards the signals it receives, and
exits the way the fork exited (SIGKILL of the fork: the client SIGKILLs itself, so the launcher sees ``-9``). A
fork whose client dies is SIGKILLed. Library code sees its launcher agent as its parent (``os.getppid``).

What differs from a cold start: the module state of the pre-imported libraries is the zygote's (imports ran without
the rank's environment; Lightning's ``rank_zero_only.rank`` is set again from it; their objects are frozen out of
the garbage collector, ``gc.freeze``), the hash seed and numpy's global RNG are shared, and ``/proc/<pid>/cmdline``
is the zygote's (``/proc/<pid>/environ`` is the client's, set by the zygote where the kernel allows it: the library
kills a pid read from a store only when that process carries the launch's run tag there; what a fork started is
also found by its session, and stopped with its run).
Where a test depends on the process being started cold, it runs cold (marker ``cold``): the headline megatron-core
kill test and the Slurm tests always do, and ``NEIGHBOR_CKPT_TEST_COLD=1`` runs every test cold. A cold and a warm
run of one configuration share their failure-free baseline, so the suite itself compares warm and cold workers bit
for bit.

In-process recovery (:mod:`neighbor_ckpt.inprocess`) forks warm too. Its launcher's child is the client, in a
session of its own with ``PR_SET_PDEATHSIG``; the fork is the process the engine runs in. What reaches the fork:
the launcher's SIGKILL of a process the detector listed dead goes to the client's session, whose death the fork's
watch thread turns into a SIGKILL of the fork, and the launcher also SIGKILLs the pid the engine recorded under
``proc/<p>`` (the fork: same node id, its start time and its run tag checked), so a SIGSTOPped fork, whose watch
thread cannot run, dies as well; a launcher that dies takes the client with it (parent-death signal) and so the
fork. What the fork
reports reaches the launcher: its exit status (the engine's fallback, fenced and hygiene statuses) and its death by
a signal are the client's. The watch thread is in the engine's thread baseline (started before the worker), so the
hygiene check does not count it.

Hooked in through ``NEIGHBOR_CKPT_WORKER_PREFIX`` (a command every launcher of the library runs its workers
under: :func:`neighbor_ckpt.cli.launch.worker_program`), set per test by ``tests.conftest._worker_start``."""
