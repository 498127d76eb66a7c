"""The machine a benchmark ran on, as one line for its JSON (`"machine": machine(device)`).

GPUs are named when the run used one (a CUDA `device`), or, with no device given, when torch is
already imported and sees one; torch is never imported just to say so (the wire and sandbox
benches do not use it).
"""

from __future__ import annotations

import os
import platform
import sys


def machine(device=None) -> str:
    """`device`: a torch.device or its string (None: whatever the process already uses)."""
    parts = []
    kind = str(device) if device is not None else ""
    torch = sys.modules.get("torch")
    if kind.startswith("cuda") or (device is None and torch is not None):
        import torch
        if torch.cuda.is_available():
            index = torch.device(kind).index if kind.startswith("cuda") else None
            parts.append(f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(index or 0)}")
    parts.append(f"{platform.machine()} {os.cpu_count()} cpu, {platform.system()} {platform.release()}")
    parts.append(f"python {platform.python_version()}")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)
