"""One-shot GPU probes (``python3 tools/gpu_probe/<name>.py``): diagnostics run on a lent device machine, each
printing what it measured; not part of any test tier. On a machine without CUDA each exits at once (status 0) with
a "needs CUDA" line."""


def cuda_here(probe: str) -> bool:
    """Whether CUDA torch is usable here; if not, one line saying so (a probe then has nothing to do and exits 0)."""
    try:
        import torch
    except ImportError as e:
        print(f"{probe}: needs CUDA (torch is not importable: {e}); nothing to do")
        return False
    if not torch.cuda.is_available():
        print(f"{probe}: needs CUDA: torch.cuda.is_available() is False on this machine; nothing to do")
        return False
    return True
