"""One-shot GPU probes (``python3 tools/gpu_probe/<name>.py``): diagnostics run on a lent device machine, each
printing what it measured; not part of any test tier. On a machine without CUDA each exits at once (status 0) with
a "needs CUDA" line."""
