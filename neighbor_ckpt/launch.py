"""Launcher integration (placeholder until the torchrun restart fix lands)."""


def prepare_torchrun_restart() -> bool:
    return False
