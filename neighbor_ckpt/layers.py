"""The may-import rules of the house, in one place: which part of the code may import which.

Folders are layers: a module imports its own unit and the units its entry in :data:`LAYERS` names, never one above
it or a sibling beside it. A *unit* is a subpackage or top-level module of :mod:`neighbor_ckpt`
(``neighbor_ckpt.snapshot``, ``neighbor_ckpt.errors``), the package's own ``__init__`` (``neighbor_ckpt``: the
public entry points), or a top-level package of the checkout (``megatron_patches``, ``tools``, ``tests``).

:data:`LAYERS` is ordered bottom up and an entry names only units listed before it, so the table itself cannot hold a
cycle. ``tests/unit/test_layers.py`` parses every module of ``neighbor_ckpt``, ``megatron_patches`` and ``tools``
with :mod:`ast` (imports at any level: module top, inside functions, under ``TYPE_CHECKING``, relative ones,
``importlib.import_module`` of a literal name) and fails naming the file, the line and the import that breaks a
rule; it also fails on a unit missing from the table (a new subpackage or top-level package: add it here, at the
layer it belongs to, with what it may import).

Only imports of our own code are governed here. What a unit may import from third parties (no framework below the
glue, megatron-core only lazily in ``adapters/megatron.py``, ...) is said in its package docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layer", "LAYERS", "EXCEPTIONS", "LIBRARY_ROOTS", "OUTSIDE_ROOTS", "layer_of"]


@dataclass(frozen=True)
class Layer:
    unit: str
    may_import: frozenset[str]
    what: str


def _layer(unit: str, what: str, *may_import: str) -> Layer:
    return Layer(unit, frozenset(may_import), what)


_ERRORS = "neighbor_ckpt.errors"
_FOUNDATION = (_ERRORS, "neighbor_ckpt.validation", "neighbor_ckpt.fault_config", "neighbor_ckpt.config")
_CORE = (*_FOUNDATION, "neighbor_ckpt.runtime", "neighbor_ckpt.snapshot", "neighbor_ckpt.recovery",
         "neighbor_ckpt.planning", "neighbor_ckpt.report", "neighbor_ckpt.adapters")
_GLUE = (*_CORE, "neighbor_ckpt.checkpointer", "megatron_patches", "neighbor_ckpt.inprocess", "neighbor_ckpt.glue")
_THIN_GLUE = (_ERRORS, "neighbor_ckpt.config", "neighbor_ckpt.checkpointer", "neighbor_ckpt.glue",
              "neighbor_ckpt.inprocess", "megatron_patches")
"""What a framework callback reaches: the checkpointer, the shared glue, the in-process engine and the megatron-core
patches (plus the errors and the configuration); never the core behind them."""
_LIBRARY = (*_GLUE, "neighbor_ckpt.lightning", "neighbor_ckpt.bridge", "neighbor_ckpt")

LAYERS: tuple[Layer, ...] = (
    # -- the foundation: typed errors, the validation mechanism, the configuration
    _layer(_ERRORS, "the exception types"),
    _layer("neighbor_ckpt.layers", "this table"),
    _layer("neighbor_ckpt.validation", "one validation mechanism for config and job files", _ERRORS),
    _layer("neighbor_ckpt.fault_config", "fault injection's section of the configuration", _ERRORS,
           "neighbor_ckpt.validation"),
    _layer("neighbor_ckpt.config", "NeighborCkptConfig (YAML neighbor_ckpt:)", _ERRORS, "neighbor_ckpt.validation",
           "neighbor_ckpt.fault_config"),
    # -- megatron-core / NeMo internals: patched in one place, knowing nothing of ours but the errors
    _layer("megatron_patches", "the only code touching megatron-core / NeMo / Megatron-Bridge internals", _ERRORS),
    # -- the core
    _layer("neighbor_ckpt.runtime", "the process around training: detector, reaper, preflight, failpoints",
           *_FOUNDATION),
    _layer("neighbor_ckpt.snapshot", "what is saved and where it goes: razor, slot, store, engine, transport",
           *_FOUNDATION, "neighbor_ckpt.runtime"),
    _layer("neighbor_ckpt.recovery", "inventory -> reconcile -> transfer -> restore; the Recoverer",
           *_FOUNDATION, "neighbor_ckpt.runtime", "neighbor_ckpt.snapshot"),
    # three siblings above the core, none importing another
    _layer("neighbor_ckpt.planning", "planner, goodput, job files: pure arithmetic, no processes (so no runtime)",
           *_FOUNDATION, "neighbor_ckpt.snapshot"),
    _layer("neighbor_ckpt.report", "status line, metrics, recovery timeline",
           *_FOUNDATION, "neighbor_ckpt.runtime", "neighbor_ckpt.snapshot", "neighbor_ckpt.recovery"),
    _layer("neighbor_ckpt.adapters", "the unique state of mcore / torch optimizers",
           *_FOUNDATION, "neighbor_ckpt.snapshot", "megatron_patches"),
    # -- the facade: wiring and the per-step work; no framework
    _layer("neighbor_ckpt.checkpointer", "NeighborCheckpointer", *_CORE),
    # -- framework glue
    _layer("neighbor_ckpt.inprocess", "in-place recovery: our engine, launcher, store host, rank assignment",
           *_CORE, "neighbor_ckpt.checkpointer", "megatron_patches"),
    _layer("neighbor_ckpt.glue", "what every framework callback shares: its set-up, the insurance, resume and "
           "data-position policy, the state adapters, the RNG (no framework, so no megatron_patches)",
           *_CORE, "neighbor_ckpt.checkpointer"),
    _layer("neighbor_ckpt.lightning", "the Lightning / NeMo 2 callback: thin, over the glue", *_THIN_GLUE),
    _layer("neighbor_ckpt.bridge", "the Megatron-Bridge callback: thin, over the glue", *_THIN_GLUE),
    _layer("neighbor_ckpt", "the public entry points (package __init__, lazy re-exports)", *_GLUE,
           "neighbor_ckpt.lightning", "neighbor_ckpt.bridge"),
    # -- the top of the house: what runs the library
    _layer("neighbor_ckpt.recipes", "recipe scripts and job files shipped as package data", *_LIBRARY),
    _layer("neighbor_ckpt.cli", "the neighbor-ckpt command", *_LIBRARY, "neighbor_ckpt.recipes"),
    # -- outside the library (not in the wheel): may import anything of it; nothing in it imports them
    _layer("tools", "benchmarks and the fault campaign", *_LIBRARY, "neighbor_ckpt.recipes", "neighbor_ckpt.cli"),
    _layer("tests", "the tests (not checked: they may import anything)", *_LIBRARY, "neighbor_ckpt.recipes",
           "neighbor_ckpt.cli", "tools"),
)
"""Bottom up; each entry names only units listed before it."""

EXCEPTIONS: dict[tuple[str, str], str] = {}
"""(importing module, imported module) -> why this one import breaks its unit's rule, until when. The test fails on
an exception that is no longer used."""

LIBRARY_ROOTS = ("neighbor_ckpt", "megatron_patches")
"""The top-level packages of the wheel."""

OUTSIDE_ROOTS = ("tools", "tests")
"""Top-level packages of the checkout outside the wheel; the library never imports them."""


def layer_of(unit: str) -> Layer | None:
    """The entry of ``unit``, or None when the table lacks it."""
    for layer in LAYERS:
        if layer.unit == unit:
            return layer
    return None
