"""How much memory a device has free now: what a model's weights or a KV cache must fit in before it is allocated.

Allocating past it fails late and badly: torch raises deep inside a build, or on Linux the kernel's overcommit lets
the allocation through and the OOM killer ends the process as the memory is touched.
"""

import os


def available_bytes(device: str) -> int | None:
    """Free memory of ``device`` ("cpu" or "cuda"), or None where it cannot be known."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
