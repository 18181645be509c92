"""Host time per call: flashtile against SDPA on a call whose GPU time is well below its host
time (b1, 256 tokens, 16/4 heads, d64, causal), forward, forward + backward, and a decoding step
(one query, 32/8 heads, d128, cache 4k).  Measured per process (the CPU's speed varies from one
process to the next): run it several times, alternating trees, and join the runs with --table.

    python scripts/host_time.py --out host_tree_1.json          (on a GPU; the flashtile imported)
    python scripts/host_time.py --table host_*.json              (median per tree and call)
"""
import argparse
import json
import os
import statistics
import sys
import time


def host_us(call, calls=300, rounds=3):
    """Microseconds of host time a call, the best of ``rounds`` rounds of ``calls`` calls (the
    device synchronized between rounds, not inside them)."""
    import torch
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def measure():
    """{call: host microseconds} for flashtile (the one imported) and SDPA."""
    import torch
    import torch.nn.functional as F

    import flashtile
    from flashtile import kvcache
    q, k, v = (torch.randn(1, heads, 256, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2).requires_grad_()
               for heads in (16, 4, 4))
    dout = torch.randn(1, 256, 16, 64, dtype=torch.bfloat16, device="cuda")
    calls = {"flashtile": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
             "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True, enable_gqa=True).transpose(1, 2)}
    result = {}
    for name, call in calls.items():
        with torch.no_grad():
            result[f"{name} forward"] = host_us(call)
        result[f"{name} forward+backward"] = host_us(lambda: torch.autograd.backward(call(), dout))
    query = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache_k, cache_v = (torch.randn(1, 4096, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    lengths = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        result["flashtile decode"] = host_us(lambda: kvcache.flash_attn_with_kvcache(query, cache_k, cache_v,
                                                                                  cache_seqlens=lengths), 1000)
        result["sdpa decode"] = host_us(lambda: F.scaled_dot_product_attention(
            query.transpose(1, 2), cache_k.transpose(1, 2), cache_v.transpose(1, 2), enable_gqa=True), 1000)
    return dict(tree=os.path.dirname(os.path.dirname(os.path.abspath(flashtile.__file__))), host_us=result)


def table(runs) -> str:
    """Markdown: per call, each tree's median host time over its runs (µs)."""
    trees = sorted({run["tree"] for run in runs})
    calls = list(dict.fromkeys(call for run in runs for call in run["host_us"]))
    lines = ["| call | " + " | ".join(trees) + " |", "|---|" + "---|" * len(trees)]
    for call in calls:
        cells = []
        for tree in trees:
            values = [run["host_us"][call] for run in runs if run["tree"] == tree and call in run["host_us"]]
            cells.append(f"{statistics.median(values):.1f} ({len(values)})" if values else "")
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write this process's measurement here (JSON)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="join earlier measurements instead")
    args = ap.parse_args(argv)
    if args.table:
        print(table([json.load(open(path)) for path in args.table]))
        return
    run = measure()
    for call, us in run["host_us"].items():
        print(f"{call:26s} {us:8.1f} us")
    if args.out:
        json.dump(run, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
