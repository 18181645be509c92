"""Developer switches and the process environment: the only module that reads ``os.environ``.

Users never need these.  ``KernelOptions`` forces a kernel, overrides a kernel's tiles (never
its algorithm) or switches FlashAttention-3 techniques off for an ablation.  A call takes them
from the private ``kernel_options=`` argument of the public functions (what ``flashtile
bench``, the scripts and the tests pass), else from ``FLASHTILE_KERNEL_OPTIONS``, read once at
import, in the same text form::

    FLASHTILE_KERNEL_OPTIONS="forward=triton;backward=v2;ablate=pingpong,overlap;tiles.v2_fwd=128,64,4,3"
"""
import os
from dataclasses import dataclass, field, fields

# What v3's forward and backward can be forced to run (dispatch.py says what each is);
# "v2" also keeps FP8 problems off the float8 Gluon passes, their default where they take them.
FORWARD_KERNELS = ("gluon", "triton", "v2")
BACKWARD_KERNELS = ("gluon", "gluon-reduce", "v2")
# FlashAttention-3 techniques of the Gluon kernels that an ablation can switch off.
TECHNIQUES = ("pingpong", "overlap", "persistent", "next_q", "q_registers")
# Tile tables an override can replace, and how many integers each takes (configs.py): block_m,
# block_n, warps, stages[, warp specialization] for the Triton kernels' Config; block_n, stages,
# consumer warpgroups[, 1/N of the exponentials on the FMA pipe] for the Gluon forward; Q rows,
# K/V rows, stages for the Gluon backward; keys a step, stages, warps[, registers a thread] for
# decoding over a contiguous or a paged cache (kernels/decode.py).
TILE_FIELDS = {
    "v1_fwd": (4,), "v1_bwd": (4,), "v2_fwd": (4,), "v2_bwd_kv": (4,), "v2_bwd_q": (4,), "v3_fwd": (4, 5),
    "v3_gluon": (3, 4), "v3_gluon_bwd": (3,), "v3_gluon_bwd_reduce": (3,), "decode": (3, 4), "decode_paged": (3, 4),
}

# Triton reads TRITON_INTERPRET when it is imported; so does flashtile.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETING


@dataclass(frozen=True)
class KernelOptions:
    forward: str | None = None          # v3's forward kernel: one of FORWARD_KERNELS
    backward: str | None = None         # v3's backward kernels: one of BACKWARD_KERNELS
    ablate: frozenset = field(default_factory=frozenset)  # TECHNIQUES switched off
    tiles: tuple = ()                   # sorted (table, (ints...)) pairs: TILE_FIELDS
    v1_splits: int | None = None        # programs per (batch, head) in v1 (1: the paper's one)

    def __post_init__(self):
        if self.forward not in (None, *FORWARD_KERNELS):
            raise ValueError(f"kernel option forward={self.forward!r}: expected one of {FORWARD_KERNELS}")
        if self.backward not in (None, *BACKWARD_KERNELS):
            raise ValueError(f"kernel option backward={self.backward!r}: expected one of {BACKWARD_KERNELS}")
        object.__setattr__(self, "ablate", frozenset(self.ablate))
        unknown = self.ablate - set(TECHNIQUES)
        if unknown:
            raise ValueError(f"kernel option ablate: unknown techniques {sorted(unknown)}; known: {TECHNIQUES}")
        tiles = tuple(sorted((name, tuple(values)) for name, values in dict(self.tiles).items()))
        for name, values in tiles:
            if name not in TILE_FIELDS:
                raise ValueError(f"kernel option tiles.{name}: unknown table; known: {sorted(TILE_FIELDS)}")
            # Sizes, stages and warps >= 1 (a 0 or a negative one would launch a wrong grid), the
            # optional last integer (a flag, a share, registers) >= 0.
            required = min(TILE_FIELDS[name])
            if len(values) not in TILE_FIELDS[name] or not all(
                    _integer_at_least(x, 1 if i < required else 0) for i, x in enumerate(values)):
                raise ValueError(f"kernel option tiles.{name}: expected {' or '.join(map(str, TILE_FIELDS[name]))} "
                                 f"integers, >= 1 (an optional last one >= 0), got {values}")
        object.__setattr__(self, "tiles", tiles)
        if self.v1_splits is not None and not _integer_at_least(self.v1_splits, 1):
            raise ValueError(f"kernel option v1_splits={self.v1_splits!r}: expected an integer >= 1")

    def tile(self, table: str):
        """The override of ``table``'s tiles, or None."""
        return dict(self.tiles).get(table)

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in (("forward", self.forward), ("backward", self.backward),
                                          ("v1_splits", self.v1_splits)) if v is not None]
        if self.ablate:
            parts.append("ablate=" + ",".join(sorted(self.ablate)))
        parts += [f"tiles.{name}=" + ",".join(map(str, values)) for name, values in self.tiles]
        return ";".join(parts)

    @classmethod
    def parse(cls, text: str) -> "KernelOptions":
        """The inverse of ``str``: ``key=value`` items separated by ';'."""
        fields, tiles = {}, {}

        def integers(key, value, count=None):
            try:
                values = tuple(int(x) for x in value.split(","))
            except ValueError:
                values = ()
            if not values or count not in (None, len(values)):
                raise ValueError(f"kernel options {text!r}: {key} takes {count or 'comma-separated'} integer"
                                 f"{'' if count == 1 else 's'}, got {value!r}")
            return values
        for item in filter(None, (part.strip() for part in (text or "").split(";"))):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep:
                raise ValueError(f"kernel options {text!r}: {item!r} is not key=value")
            if key in fields or (key.startswith("tiles.") and key[len("tiles."):] in tiles):
                raise ValueError(f"kernel options {text!r}: {key} is given twice")
            if key.startswith("tiles."):
                tiles[key[len("tiles."):]] = integers(key, value)
            elif key == "ablate":
                fields["ablate"] = frozenset(filter(None, (x.strip() for x in value.split(","))))
            elif key == "v1_splits":
                (fields["v1_splits"],) = integers(key, value, 1)
            elif key in ("forward", "backward"):
                fields[key] = value
            else:
                raise ValueError(f"kernel options {text!r}: unknown key {key!r}")
        return cls(tiles=tuple(tiles.items()), **fields)


def _integer_at_least(x, minimum: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


ENVIRONMENT = KernelOptions.parse(os.environ.get("FLASHTILE_KERNEL_OPTIONS", ""))


_TEXTS: dict = {}  # a plain dict, not functools.lru_cache: torch.compile traces through it


def text(options: KernelOptions) -> str:
    """``str(options)``, worked out once per options (it travels through the custom op as text)."""
    found = _TEXTS.get(options)
    if found is None:
        found = _TEXTS[options] = str(options)
    return found


def resolve(options) -> KernelOptions:
    """``kernel_options=`` as given (None: the environment's; a dict or a string: parsed)."""
    if options is None:
        return ENVIRONMENT
    if isinstance(options, KernelOptions):
        return options
    if isinstance(options, str):
        return KernelOptions.parse(options)
    if isinstance(options, dict):
        unknown = set(options) - {f.name for f in fields(KernelOptions)}
        if unknown:
            raise ValueError(f"kernel_options: unknown keys {sorted(map(str, unknown))}")
        return KernelOptions(**options)
    raise TypeError(f"kernel_options must be a KernelOptions, a dict or a string, got {type(options).__name__}")


def commit_override() -> str | None:
    """The commit benchmark records name when the tree is not a git checkout (FLASHTILE_COMMIT)."""
    return os.environ.get("FLASHTILE_COMMIT") or None
