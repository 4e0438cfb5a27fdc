"""Megatron-Core / NeMo internals: the only package that patches them (see the Megatron/NeMo issue)."""
