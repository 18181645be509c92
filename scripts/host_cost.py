"""Host time per call (Python + launch) against the GPU's, per provider, on one shape.

Where host >= wall the GPU waits on the CPU, and an event-timed benchmark of that cell measures
the launch path rather than the kernels (compare `flashtile bench --cuda-graphs`).  Shapes as
the bars: batch x seqlen = --tokens, heads x head_dim = --hidden.  Prints Markdown; with
--profile N, then the N functions of most cumulative time on the host path of each
(mode, causal, provider), from cProfile over a second round of calls.
"""
import argparse
import cProfile
import io
import pstats

from flashtile import bench


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--providers", default="flashtile-v3,flashtile-v2,sdpa-cudnn")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    env = bench.environment()
    d, s = args.head_dim, args.seqlen
    print(f"Host and wall time per call, {env['gpu']}, commit {env['commit']}, {env['date']}; "
          f"b{args.tokens // s} h{args.hidden // d} s{s} d{d}, ms\n")
    print("| mode | causal | provider | host | wall | host / wall |")
    print("|---|---|---|---|---|---|")
    available = bench.available_providers()[0]
    profiles = []
    for mode in args.modes.split(","):
        for causal in (False, True):
            case = bench.Case(args.tokens // s, args.hidden // d, args.hidden // d, s, s, d, causal, mode)
            for provider in args.providers.split(","):
                if provider not in available:
                    continue
                host, wall = bench.host_cost(provider, case, calls=args.calls)
                print(f"| {mode} | {causal} | {provider} | {host:.3f} | {wall:.3f} | {host / wall:.2f} |", flush=True)
                if args.profile:
                    profiler = cProfile.Profile()
                    bench.host_cost(provider, case, calls=args.calls, profiler=profiler)
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(args.profile)
                    profiles.append(f"### {mode}, causal {causal}, {provider} ({args.calls} calls)\n\n```\n"
                                    f"{text.getvalue().strip()}\n```\n")
    for profile in profiles:
        print("\n" + profile)


if __name__ == "__main__":
    main()
