"""``python -m tools.campaign`` (``scripts/campaign``): randomized faults against the tiny mcore GPT recipe on 4 CPU ranks, and a table.

Every case is one real ``torchrun`` job (``--max-restarts 1``, 2 for a kill during recovery) of
``recipes/mcore_gpt_plain_loop.py`` (megatron-core ``GPTModel``, distributed or replicated optimizer, TP 1 or 2, 4
ranks laid out as 2 "nodes") with one fault (see :data:`KIND_SPECS`): a SIGKILL or SIGSTOP (hang) of a random rank
in the forward pass, the backward pass, the optimizer step, the middle of its snapshot copy or the middle of
streaming it to the ring successor; a second SIGKILL while the restarted job loads the restored state; one rank, the
two ranks of a node, a rank and its ring successor, a whole DP group or every rank restarting with an empty host store;
a random bit flip, a truncation or a malformed header in the victim's newest snapshot. Its per-step losses and final
parameters / optimizer state are compared (``==``) with a failure-free run of the same configuration.

The in-process kinds (``inproc-kill``: SIGKILL of a rank in its optimizer step; ``inproc-hang``: SIGSTOP there, our
detector finds it silent and its launcher kills it) run the recipe in its in-process mode instead: 4 active ranks + 1
hot spare, the store host and one of our launchers (:mod:`neighbor_ckpt.inprocess.launcher`) per simulated node (the
commands of ``neighbor-ckpt launch``, :func:`neighbor_ckpt.cli.launch.inprocess_commands`); the spare takes the
victim's place, no process restarts. ``inproc-two-faults``: two SIGKILLs in one launch, the second on a rank of the
generation that recovered from the first, after it completed a step (two spares; the faults planned in the case's
``fault_injection.faults``). ``inproc-shrink``: no spare, the victim's node lost for good, ``elastic.enabled``: the job
goes on at a smaller data-parallel size on the same global batch. ``data-misplaced`` (restart path): the restarted
attempt reads other samples than before the failure; the data check must stop it at the replayed step, announced.
``inproc-stuck``: one rank's training thread blocked in a C call while its heartbeat goes on (only the progress tags
show it). ``inproc-store-node``: node 0 (its launcher, the primary store host it runs and rank 0) SIGKILLed;
``inproc-store-stop``: the primary store host SIGSTOPped for good: the job fails over to node 1's standby store
(``fault_injection.target: store_node``). ``inproc-spare-lost``: the hot spare SIGKILLed while idle (reported, the
job goes on). ``inproc-grow-back``: two faults with one spare and ``inprocess.grow_back``: the replacement the first
victim's launcher starts takes the second lost rank. ``inproc-node-lost``: 2 simulated nodes of 2 processes each and a
spare node of 2 hot spares; node 1 lost whole in the case's step (``fault_injection.target: node``: its launcher, its
store host and both ranks); the spare node takes both ranks, and the judge also checks that one decision declared
both of node 1's processes dead, that one generation failed, and that the recovery timeline has its detection
(:func:`~tools.campaign.judge.node_loss`). ``inproc-node-lost-elastic``: the same with one spare on a third node (two nodes
alone are no majority once one is lost: they stop, cut off) for the two lost ranks, ``elastic.enabled``: DP 4 -> 2,
judged as a shrink. ``inproc-node-hung``: as ``inproc-node-lost`` with SIGSTOP: node 1's launcher and
ranks hang (its store host runs on); found and replaced the same way, and the launch ends the stopped launcher once
the job completed. ``node-lost-for-good``: the restart path on 2 simulated nodes of 2 ranks, a torchrun agent each
(``neighbor_ckpt.cli.torchrun_nodes``), ``elastic.enabled``: node 1 lost whole (its agent and both ranks SIGKILLed);
the launch says so and node 0 restarts alone at DP 2, resharded from its host memory: judged as a shrink.
``inproc-partition-primary``, ``-minority-with-spare``, ``-heal``, ``-ranks``: each simulated node in a network
namespace of its own (``launch.simulate_network``; root, workers started cold; refused in one line where it cannot be
made), the network cut in the optimizer step (``fault_injection.target: partition``): node 0 (primary store, rank 0)
for good; node 0 and a spare node; that cut healed after 10 s; node 1's rank traffic only. Judged exact, and as
tests/e2e/test_partitions.py: the side cut off says it is cut off from the majority and forms no generation, the
healed majority is never fenced, the spare takes the rank (:func:`~tools.campaign.judge.partition`).
``inproc-other-user``: ``inproc-kill``'s case while a second Unix user (root, ``useradd``, no login shell; refused in
one line where it cannot be made; one the campaign made is removed when it ends, however it ends) tries every 0.5 s
to read, write ``complete`` and write ``dead`` at every store address of the launch (:mod:`.other_user`): exact only
with every attempt refused, its process alive at the end and nothing of it seen by the job
(:func:`~tools.campaign.judge.other_user`).
Distributed optimizer, TP 1: compared with the same failure-free run as the restart-path cases of that configuration
(in-process recovery changes no arithmetic; a shrink's failure-free run has dropout off and the global batch fixed).

Outcomes: ``exact`` (the job finished and every loss, recomputed ones included, and the final state equal the
failure-free run), ``fallback`` (the job said it fell back to the insurance checkpoint, a megatron-core distributed
checkpoint every ``--insurance-every`` steps, and trained bit for bit what it should: the first launch attempt's
losses those of the failure-free run, every step after the insurance iteration and the final state those of the
failure-free run resumed from the same insurance checkpoint, :func:`resume_baseline`), ``resized`` (a shrink: the
steps before the fault exact, the later ones within 1e-4 and on the same samples, :func:`compare_resized`),
``stopped`` (the data check stopped a restart on misplaced data at the replayed step: the expected loud stop),
``FAILED``
(anything else: divergence, a crash, a hang past the deadline). For hangs and lost nodes the table also gives the
detection time: from the moment the victim stopped (``fault.json``) to the first rank's detection log line (in
process: the recovery timeline's ``detect`` phase, from the fault as its earliest witness saw it). An in-process case
whose recovery gave up (announced) and that the restart path then recovered exactly is a ``fallback`` too, when a
restart attempt really ran (its recovery reports exist; a give-up line alone is no restart). Every recovery of a case
is kept with its MTTR and detection (``Outcome.recoveries``, from its recovery timelines, fault to the first completed
step); the table's MTTR columns count every recovery.

Cases are drawn from ``random.Random(seed)``: the seed reproduces the campaign. Usage::

    python -m tools.campaign --faults 200 --seed 7 --out runs/campaign
    python -m tools.campaign --faults 200 --seed 7 --out runs/campaign --resume   # after a stop: the cases left
    python -m tools.campaign --out runs/campaign --report --results campaign.json  # its table and results, no run
    python -m tools.campaign --out runs/campaign --rejudge 85  # case 85's recorded run, judged again, no run

``<out>/campaign.json`` records the options and the commit (``git describe --dirty``); ``--resume`` refuses to mix
outcomes of another commit or other options into one table.

The parts: :mod:`.cases` (the kinds, a case, its outcome, the seeded draw), :mod:`.runner` (running each case and the
failure-free runs, ``--resume``, the command line), :mod:`.judge` (comparing a case with its failure-free run),
:mod:`.report` (the table and the results document), :mod:`.rejudge` (a recorded run judged again),
:mod:`.other_user` (the second Unix user of ``inproc-other-user``).
"""

__all__: list[str] = []  # import each name from its module (cases, judge, report, rejudge, runner)
