"""Calls checked once per kind.

A model makes the same few kinds of call in every layer and decoding step, and what a call's
checks and plan decide is a function of its kind alone: the shapes, strides, dtypes and devices
of its tensors and the values (with their types) of its plain options.  ``kind`` builds that
key; ``KeptCalls`` keeps what the checks decided per kind, the least recently used kind going
when full.  A call whose kind is None (a tensor subclass, an option that is not a plain value, as
a tensor whose value may change) is checked every time.
"""
import collections
import contextlib

import torch

from flashtile import options

# Option types whose value the kind holds (True == 1 == 1.0 kept apart by the type beside it).
PLAIN = frozenset((bool, int, float, str, type(None), options.KernelOptions))
_SEQUENCES = frozenset((tuple, list))
_INT = frozenset((int,))


def tensors_kind(tensors):
    """The shapes, strides, dtypes and devices of ``tensors`` (each a torch.Tensor or None), as a
    list; None where one is neither (a tensor subclass)."""
    key = []
    for x in tensors:
        if x is None:
            key.append(None)
        elif type(x) is torch.Tensor:
            key += (x.shape, x.stride(), x.dtype, x.device)
        else:
            return None
    return key


def kind(tensors, values):
    """The kind of a call with ``tensors`` (each a torch.Tensor or None) and ``values`` (plain
    options, each kept with its type; tuples and lists of ints), or None where it is not kept."""
    key = tensors_kind(tensors)
    if key is None:
        return None
    types = tuple(map(type, values))
    if not PLAIN.issuperset(types):  # sequences of ints are kept, as tuples
        for t, x in zip(types, values):
            if t not in PLAIN and (t not in _SEQUENCES or not _INT.issuperset(map(type, x))):
                return None
        if list in types:
            values = [tuple(x) if t is list else x for t, x in zip(types, values)]
    return (*key, *types, *values)


class KeptCalls:
    """What the checks decided, per kind of call; at most ``limit`` kinds, the least recently used
    going first (a model's kinds come back)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._kept = collections.OrderedDict()

    def get(self, key):
        """What was kept for ``key`` (None: nothing, or a kind that is not kept)."""
        if key is None:
            return None
        kept = self._kept.get(key)
        if kept is not None:
            with contextlib.suppress(KeyError):  # (evicted by another thread meanwhile)
                self._kept.move_to_end(key)
        return kept

    def keep(self, key, value):
        if key is None or self.limit <= 0:
            return
        while len(self._kept) >= self.limit:
            with contextlib.suppress(KeyError):  # (emptied by another thread meanwhile)
                self._kept.popitem(last=False)
        self._kept[key] = value

    def clear(self):
        self._kept.clear()

    def __len__(self):
        return len(self._kept)

    def __iter__(self):
        return iter(list(self._kept))
