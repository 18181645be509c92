"""Values derived from a tensor's contents, kept while PyTorch sees those contents unchanged.

A model hands every layer the same small tensors (varlen offsets, position ids); what a call
reads of their values on the host (a wait on the device) is kept per tensor under its state, its
version counter and address, so that the other layers read nothing.  A change through PyTorch
bumps the version and the value is derived again; memory written behind PyTorch's back (a custom
kernel, ``.data``) is not seen.  Nothing is kept for inference-mode tensors (they count no
versions) or while torch.compile traces (a traced graph must not depend on it).
"""
import torch
from torch.utils.weak import WeakIdKeyDictionary


def state_of(x: torch.Tensor):
    """What identifies ``x``'s contents as PyTorch tracks them, or None where it does not."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    return x._version, x.data_ptr()


class KeptByTensor:
    """tensor -> a value derived from its contents, returned while they stay unchanged."""

    def __init__(self):
        self._kept = WeakIdKeyDictionary()

    def get(self, x: torch.Tensor):
        """The value kept for ``x`` in its present state, else None."""
        found = self._kept.get(x)
        if found is None or found[0] != state_of(x):
            return None
        return found[1]

    def put(self, x: torch.Tensor, value):
        """Keep ``value`` (not None) for ``x`` in its present state, where PyTorch tracks it."""
        state = state_of(x)
        if state is not None:
            self._kept[x] = (state, value)
