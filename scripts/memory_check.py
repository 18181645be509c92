"""Peak extra memory of one forward+backward per provider and seqlen (b1 h16 d128 bf16, causal).

One call per cell (no timing loop): at 128k tokens a single pass already takes seconds.
Out-of-memory is a result: it is recorded, not raised.

    python scripts/memory_check.py --providers standard,flashtile-v2,flashtile-v3 --out memory.json
"""
import argparse
import json

import torch

from flashtile import bench


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="4096,16384,65536,131072")
    ap.add_argument("--providers", default="standard,flashtile-v2,flashtile-v3,sdpa-flash")
    ap.add_argument("--out", default="memory.json")
    args = ap.parse_args()
    env = bench.environment()
    records = []
    for s in (int(x) for x in args.seqlens.split(",")):
        for provider in args.providers.split(","):
            q, k, v = (torch.randn(1, s, 16, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                       for _ in range(3))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                out = bench.PROVIDERS[provider](q, k, v, True)
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
                torch.cuda.synchronize()
                peak, status = torch.cuda.max_memory_allocated() - base, "ok"
            except torch.OutOfMemoryError:
                peak, status = None, "out of memory"
            del q, k, v
            out = None
            torch.cuda.empty_cache()
            records.append(dict(provider=provider, b=1, h=16, sq=s, sk=s, d=128, causal=True, mode="fwdbwd",
                                dtype="bf16", peak_mem_bytes=peak, status=status, **env))
            shown = f"{peak / 2**30:.2f} GiB" if peak is not None else status
            print(f"seqlen {s:>6} {provider:14} {shown}", flush=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
