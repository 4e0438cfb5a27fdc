"""NeMo 2's OneLogger telemetry across in-process restarts.

NeMo 2.7.3 attaches a process-wide ``OneLoggerNeMoCallback`` (``nemo.lightning.callback_group.CallbackGroup``, on
global rank 0) to every trainer ``llm.pretrain`` builds. It opens a ``training_loop`` span at ``on_train_start``
and one span per training iteration, in a process-wide recorder (``nv_one_logger``'s ``TrainingTelemetryProvider``).
A training attempt that fails (its process groups aborted by the in-process engine) never reaches
``on_train_end``: its spans stay open, and the next attempt's ``on_train_start`` raises ``OneLoggerError: Cannot
start span training_loop while 1 span(s) with the same name is already active``, which fails the restart.

:func:`end_open_spans` stops every span the failed attempt left open (innermost first), as the end of that attempt;
the application span stays. It is what :mod:`neighbor_ckpt.lightning.inprocess` runs after the abort. Nothing is
patched: it calls the recorder's own ``stop``, so there is nothing to undo.
"""

from __future__ import annotations

import logging

__all__ = ["end_open_spans"]

logger = logging.getLogger(__name__)


def end_open_spans() -> int:
    """Stop the telemetry spans left open by a failed training attempt; returns how many (0 when OneLogger is
    absent, disabled on this rank, or nothing is open)."""
    try:
        from nv_one_logger.api.one_logger_provider import OneLoggerProvider
        from nv_one_logger.core.span import StandardSpanName
        from nv_one_logger.training_telemetry.api.training_telemetry_provider import TrainingTelemetryProvider
    except ImportError:
        return 0
    if not OneLoggerProvider.instance().one_logger_enabled:
        return 0
    recorder = TrainingTelemetryProvider.instance().recorder
    spans = [s for s in list(getattr(recorder, "_spans", {}).values())
             if s.active and s.name != StandardSpanName.APPLICATION]
    n = 0
    for span in reversed(spans):  # started last = innermost: children before their parents
        try:
            recorder.stop(span)
            n += 1
        except Exception as e:  # noqa: BLE001 - telemetry must not stop a recovery
            logger.warning("end_open_spans: could not stop telemetry span %s: %s", span.name, e)
    if n:
        logger.info("end_open_spans: stopped %d telemetry span(s) left open by the failed attempt", n)
    return n
