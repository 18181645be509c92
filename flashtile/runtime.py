"""Facts about where flashtile runs: interpreter or GPU, which versions this device supports."""
import functools
import os

import torch

VERSIONS = ("v1", "v2", "v3")
# Every accepted value of ``version``: "tiled" is the PyTorch implementation, runnable anywhere.
VERSION_CHOICES = ("auto", *VERSIONS, "tiled")


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_not(version: str, device: torch.device) -> str | None:
    """None if ``version`` can run on ``device``; otherwise the reason it cannot."""
    if device.type == "cpu":
        if interpreting():
            return None
        return ("Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before importing "
                "flashtile to run them on CPU tensors; version='auto' uses the PyTorch tiled path on CPU")
    if device.type != "cuda":
        return f"device type {device.type!r} is not supported"
    major, minor = _capability(device.index)
    if version == "v3" and major != 9:
        return f"v3 uses Hopper TMA and warp specialization (compute capability 9.0); this GPU is {major}.{minor}"
    if major < 8:
        return f"flashtile needs compute capability >= 8.0; this GPU is {major}.{minor}"
    return None


@functools.lru_cache(maxsize=None)  # asked at every call; a device's capability does not change
def _capability(index):
    return torch.cuda.get_device_capability(index)


def resolve_version(version: str, device: torch.device) -> str:
    """Map 'auto' to the best version for the device and refuse versions that cannot run."""
    if version == "tiled":
        return version
    if version == "auto":
        if device.type == "cpu" and not interpreting():
            return "tiled"
        if device.type == "cuda" and why_not("v3", device) is None:
            return "v3"
        return "v2"
    reason = why_not(version, device)
    if reason is not None:
        raise RuntimeError(f"version={version!r} cannot run on {device}: {reason}")
    return version
