"""What a CUDA device is, as the plans read it: compute capability, SM count, DRAM bandwidth.

Each is read from the driver once per device index and kept: the plans ask at every call.
The capability is kept in a plain dict, which torch.compile traces through.
"""
import functools

import torch

_CAPABILITIES: dict = {}


def capability(index) -> tuple[int, int]:
    """(major, minor) compute capability of the CUDA device ``index`` (None: the current one)."""
    if index is None:
        index = torch.cuda.current_device()
    found = _CAPABILITIES.get(index)
    if found is None:
        found = _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return found


@functools.lru_cache(maxsize=None)
def sm_count(index) -> int:
    """Streaming multiprocessors of the CUDA device ``index`` (an int: one entry per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def dram_gbps(index) -> float:
    """Peak DRAM bandwidth of the CUDA device ``index``, GB/s (its memory clock and bus width)."""
    import triton.testing
    return triton.testing.get_dram_gbps(index)
