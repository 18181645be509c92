"""The ``flashtile`` command: bench, decode, io, demo, info."""
import argparse
import os
import sys
import time


def _choices(allowed, cast=str):
    """argparse type for a comma-separated list whose items must be in ``allowed``."""
    def parse(text):
        items = [cast(x) for x in text.split(",") if x]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: allowed values are {', '.join(map(str, allowed))} (comma-separated)")
        return items
    return parse


def _positive_int(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return n


def _positive_int_to(most):
    """argparse type for an integer in [1, ``most``]."""
    def parse(text):
        n = _positive_int(text)
        if n > most:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer up to {most}")
        return n
    return parse


def _number_at_least(least, strictly=False):
    """argparse type for a finite number >= ``least`` (> where ``strictly``)."""
    def parse(text):
        try:
            x = float(text)
        except ValueError:
            x = float("nan")
        if not (x > least if strictly else x >= least) or x == float("inf"):  # (NaN fails both)
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number {'>' if strictly else '>='} "
                                             f"{least:g}")
        return x
    return parse


def _rate(text):
    """A dropout rate: a number in [0, 1)."""
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a dropout rate in [0, 1)")
    return p


def _folder(text):
    """A folder to write into: absent (made then) or a directory."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return text


def _file_stem(text):
    """A file name without a folder: the results' name inside --out."""
    if not text or text in (".", "..") or "/" in text or os.sep in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file name without a folder (the folder is --out)")
    return text


def _positive_ints(text):
    items = [x for x in text.split(",") if x]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return [_positive_int(x) for x in items]


def parser():
    from flashtile import bench, decode_bench, validation
    ap = argparse.ArgumentParser(prog="flashtile", description="Exact FlashAttention v1/v2/v3 in Triton.")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="TFLOP/s and memory against PyTorch SDPA, FlexAttention, standard attention")
    b.add_argument("--head-dims", type=_choices((32, 64, 96, 128, 192, 256), int), default=[64, 128, 256])
    b.add_argument("--head-dim-v", type=_positive_int, default=0,
                   help="V's (and the output's) head dim where it differs, e.g. 128 with --head-dims 192")
    b.add_argument("--seqlens", type=_positive_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    b.add_argument("--causal", type=_choices(("false", "true")), default=["false", "true"])
    b.add_argument("--modes", type=_choices(bench.MODES), default=["fwd", "bwd"])
    b.add_argument("--dtype", type=_choices(bench.DTYPES), default=["bf16"],
                   help="comma-separated; e4m3 and e5m2: float8 inputs with descales per (sequence, KV head), "
                        "forward only, on the flashtile providers (FlashAttention-3's FP8 interface)")
    b.add_argument("--providers", type=_choices(tuple(bench.PROVIDERS)), default=list(bench.DEFAULT_PROVIDERS),
                   help="comma-separated (default: every provider that runs here except flex, whose "
                        "per-shape torch.compile would dominate the run)")
    b.add_argument("--baseline", choices=tuple(bench.PROVIDERS), default="sdpa-cudnn",
                   help="provider the ratio columns divide by")
    b.add_argument("--repeats", type=_positive_int, default=1,
                   help="measure the grid this many times and keep each cell's median")
    b.add_argument("--tokens", type=_positive_int, default=16384, help="batch x seqlen (the papers' 16k)")
    b.add_argument("--hidden", type=_positive_int, default=2048, help="heads x headdim (the papers' 2048)")
    b.add_argument("--out", type=_folder, default="bench_results", help="folder for the JSON, Markdown and PNGs")
    b.add_argument("--name", type=_file_stem, default="bench")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--softcap", type=_number_at_least(0.0), default=0.0, help="scores capped at softcap * tanh(x / softcap)")
    b.add_argument("--alibi", action="store_true", help="ALiBi bias with slopes 2^(-8i/h)")
    b.add_argument("--sinks", action="store_true", help="one learnable sink logit per head")
    b.add_argument("--dropout", type=_rate, default=0.0, help="dropout_p of the timed calls (SDPA's providers too)")
    b.add_argument("--varlen", action="store_true",
                   help="the tokens packed as documents of random lengths (mean: each seqlen), through the varlen call")
    b.add_argument("--kernel-options", default="",
                   help="developer switches for the flashtile providers (options.KernelOptions text form)")
    b.add_argument("--cuda-graphs", action="store_true",
                   help="time CUDA-graph replays (forwards only, needs a GPU): the kernels' time without "
                        "the Python launch path; set against a run without it, shows launch-bound cells")
    io = sub.add_parser("io", help="IO model: HBM bytes and FLOPs per algorithm; with --measured, "
                                   "the regime (memory- or compute-bound) of each measured run")
    io.add_argument("--head-dims", type=_choices((32, 64, 96, 128, 192, 256), int), default=[64, 128])
    io.add_argument("--seqlens", type=_positive_ints, default=[1024, 4096, 16384])
    io.add_argument("--causal", type=_choices(("false", "true")), default=["false"])
    io.add_argument("--tokens", type=_positive_int, default=16384)
    io.add_argument("--hidden", type=_positive_int, default=2048)
    io.add_argument("--measured", metavar="BENCH_JSON", help="bench records to set the model against")
    io.add_argument("--copy-tbps", type=_number_at_least(0.0, strictly=True), default=None,
                    help="HBM copy ceiling in TB/s (default: measured here on a GPU, else the H200's 4.26)")
    io.add_argument("--matmul-tflops", type=_number_at_least(0.0, strictly=True), default=None,
                    help="bf16 matmul ceiling in TFLOP/s (default: measured here on a GPU, else the H200's 775)")
    io.add_argument("--out", default=None, help="also write the rows as JSON here")
    dec = sub.add_parser("decode", help="decoding over a KV cache: TB/s of K/V read against SDPA's backends")
    dec.add_argument("--batches", type=_positive_ints, default=[1, 8, 32, 64])
    dec.add_argument("--caches", type=_positive_ints, default=[4096, 16384, 32768, 131072],
                     help="keys in each sequence's cache")
    dec.add_argument("--heads", type=_positive_int, default=32)
    dec.add_argument("--heads-k", type=_positive_int, default=8)
    dec.add_argument("--head-dim", type=_positive_int_to(validation.MAX_HEAD_DIM), default=128)
    dec.add_argument("--page-size", type=_positive_int, default=16, help="rows per page of flashtile-paged")
    dec.add_argument("--providers", type=_choices(decode_bench.PROVIDERS), default=list(decode_bench.PROVIDERS))
    dec.add_argument("--kernel-options", default="",
                     help="developer switches for the flashtile providers, e.g. tiles.decode_paged=128,4,4")
    dec.add_argument("--num-splits", type=lambda text: 0 if text == "0" else _positive_int(text), default=0,
                     help="the flashtile providers' split count (0: the dispatcher's)")
    dec.add_argument("--out", type=_folder, default="bench_results")
    dec.add_argument("--name", type=_file_stem, default="decode")
    sub.add_parser("demo", help="flashtile vs standard attention: error against float64, memory, speed")
    sub.add_parser("info", help="GPU, versions, and which flashtile versions run here")
    return ap


def cmd_bench(args):
    import torch

    from flashtile import bench, options
    if not torch.cuda.is_available():
        if args.cuda_graphs:
            print("--cuda-graphs needs a CUDA GPU", file=sys.stderr)
            return 2
        if not options.interpreting():
            print("flashtile bench needs a CUDA GPU (try `flashtile demo` on this machine); to check the "
                  "pipeline on a CPU, set TRITON_INTERPRET=1 and narrow the grid, e.g. --head-dims 32 "
                  "--seqlens 64 --tokens 64 --hidden 64", file=sys.stderr)
            return 2
        print("no GPU: kernels run under the Triton interpreter; the times are not performance figures",
              file=sys.stderr)
    ok, why = bench.available_providers()
    providers = [p for p in args.providers if p in ok]
    for p in args.providers:
        if p not in ok:
            print(f"skipping {p}: {why[p]}", file=sys.stderr)
    kernel_options = _kernel_options(args.kernel_options)
    if kernel_options is None:
        return 2
    cases = bench.paper_grid(args.head_dims, args.seqlens, [c == "true" for c in args.causal], args.modes,
                             args.dtype, args.tokens, args.hidden, softcap=args.softcap,
                             alibi=args.alibi, sinks=args.sinks, varlen=args.varlen, dropout=args.dropout,
                             head_dim_v=args.head_dim_v)
    failures = []

    def failed(msg):
        failures.append(msg)
        print(f"failed: {msg}", file=sys.stderr)
    records = bench.run(cases, providers, args.repeats, on_error=failed, cuda_graph=args.cuda_graphs,
                        kernel_options=kernel_options)
    if not records:
        print("no provider ran a cell", file=sys.stderr)
        return 1
    table = bench.save(records, args.out, args.name, args.baseline, plots=not args.no_plots, failures=failures)
    print(table)
    return 0


def cmd_io(args):
    import json

    import torch

    from flashtile import bench, iomodel
    if args.measured is None:
        print("| d | causal | seqlen | algorithm | fwd GB | bwd GB | fwd TFLOP | bwd TFLOP | fwd FLOP/B | extra memory MiB |")
        print("|---" * 10 + "|")
        rows = []
        for d in args.head_dims:
            for causal in (c == "true" for c in args.causal):
                for s in args.seqlens:
                    shape = iomodel.Shape(max(1, args.tokens // s), args.hidden // d, s, s, d, causal)
                    for name, m in iomodel.summary(shape).items():
                        rows.append(dict(d=d, causal=causal, seqlen=s, algorithm=name, **m))
                        print(f"| {d} | {causal} | {s} | {name} | {m['fwd_bytes'] / 1e9:.2f} | "
                              f"{m['bwd_bytes'] / 1e9:.2f} | {m['fwd_flops'] / 1e12:.2f} | "
                              f"{m['bwd_flops'] / 1e12:.2f} | {m['fwd_flops'] / m['fwd_bytes']:.0f} | "
                              f"{m['extra_memory_bytes'] / 2**20:.1f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(tokens=args.tokens, hidden=args.hidden, rows=rows), f, indent=1)
        return 0
    try:
        with open(args.measured) as f:
            records = json.load(f)
    except (OSError, ValueError) as e:
        print(f"--measured: cannot read bench records from {args.measured!r}: {e}", file=sys.stderr)
        return 2
    copy_tbps, matmul_tflops = args.copy_tbps, args.matmul_tflops
    source = "given"
    if copy_tbps is None or matmul_tflops is None:
        measured = bench.ceilings() if torch.cuda.is_available() else None
        source = "measured now" if measured else "H200 reference values"
        copy_tbps = copy_tbps or (measured or {}).get("copy_tbps", iomodel.H200_COPY_TBPS)
        matmul_tflops = matmul_tflops or (measured or {}).get("matmul_tflops", iomodel.H200_MATMUL_TFLOPS)
    rows = iomodel.regime_rows(records, copy_tbps, matmul_tflops)
    print(f"Ceilings ({source}): copy {copy_tbps:.2f} TB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s. "
          "Bytes and FLOPs from the IO model (flashtile.iomodel), times from the bench records.")
    print()
    print("| provider | d | causal | seqlen | mode | ms | model GB | TB/s | % copy | model TFLOP/s | % matmul "
          "| FLOP/B | bound | % of bound |")
    print("|---" * 14 + "|")
    for r in rows:
        print(f"| {r['provider']} | {r['d']} | {r['causal']} | {r['sq']} | {r['mode']} | {r['ms']:.3f} | "
              f"{r['model_bytes'] / 1e9:.2f} | {r['tbps']:.2f} | {r['copy_pct']:.0f} | {r['tflops']:.0f} | "
              f"{r['matmul_pct']:.0f} | {r['intensity']:.0f} | {r['bound']} | {r['roofline_pct']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, matmul_tflops=matmul_tflops, ceilings=source, rows=rows), f, indent=1)
    return 0


def _kernel_options(text):
    """``--kernel-options`` parsed, or None once the error is printed."""
    from flashtile import options
    try:
        return options.KernelOptions.parse(text)
    except ValueError as e:
        print(f"--kernel-options: {e}", file=sys.stderr)
        return None


def cmd_decode(args):
    import torch

    from flashtile import decode_bench, options
    if not torch.cuda.is_available() and not options.interpreting():
        print("flashtile decode needs a CUDA GPU; to check the pipeline on a CPU, set TRITON_INTERPRET=1 and "
              "narrow the grid, e.g. --batches 1 --caches 64 --heads 4 --heads-k 2 --head-dim 32", file=sys.stderr)
        return 2
    kernel_options = _kernel_options(args.kernel_options)
    if kernel_options is None:
        return 2
    providers = [p for p in args.providers if torch.cuda.is_available() or p not in decode_bench.CUDA_ONLY]
    for p in sorted(set(args.providers) - set(providers)):
        print(f"skipping {p}: needs a CUDA GPU", file=sys.stderr)
    records = decode_bench.run(args.batches, args.caches, providers, args.heads, args.heads_k, args.head_dim,
                               args.page_size, on_error=lambda msg: print(f"failed: {msg}", file=sys.stderr),
                               kernel_options=kernel_options, num_splits=args.num_splits)
    if not records:
        print("no provider ran a cell", file=sys.stderr)
        return 1
    print(decode_bench.save(records, args.out, args.name))
    return 0


def cmd_demo(args):
    import torch

    from flashtile import api, dispatch, iomodel, standard_attention
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    b, s, h, d = (4, 4096, 16, 128) if cuda else (1, 1024, 4, 64)
    dtype = torch.bfloat16 if cuda else torch.float16
    version = dispatch.resolve_version("auto", torch.device(device))
    print(f"attention b={b} seqlen={s} heads={h} headdim={d} {str(dtype)[6:]} causal on {device} "
          f"(flashtile version: {version})")
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device) for _ in range(3))
    oracle = standard_attention(q, k, v, causal=True, upcast=True)

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t, (torch.cuda.max_memory_allocated() - base) if cuda else None

    flash = lambda: api.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    std = lambda: standard_attention(q, k, v, causal=True)  # noqa: E731
    if cuda:  # compile the kernels outside the timing
        flash(), std()
    out_f, t_f, mem_f = timed(flash)
    out_s, t_s, mem_s = timed(std)
    err = lambda x: (x.double() - oracle).abs().max().item()  # noqa: E731
    print(f"max |error| vs float64: flashtile {err(out_f):.2e}   standard attention {err(out_s):.2e}")
    if cuda:
        print(f"extra memory (measured): flashtile {mem_f / 2**20:.1f} MiB   standard attention {mem_s / 2**20:.1f} MiB")
        print(f"time: flashtile {t_f * 1e3:.2f} ms   standard attention {t_s * 1e3:.2f} ms   "
              f"speedup {t_s / t_f:.1f}x (single call; `flashtile bench` for medians)")
    else:
        model = iomodel.summary(iomodel.Shape(b, h, s, s, d, causal=True))
        print(f"extra memory (IO model): flashtile {model['v2']['extra_memory_bytes'] / 2**20:.2f} MiB   "
              f"standard attention {model['standard']['extra_memory_bytes'] / 2**20:.1f} MiB")
        print(f"HBM traffic (IO model, forward): flashtile-v2 {model['v2']['fwd_bytes'] / 2**20:.1f} MiB   "
              f"standard attention {model['standard']['fwd_bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_info(args):
    import torch
    import triton

    from flashtile import __version__, dispatch, options, validation
    print(f"flashtile {__version__}, torch {torch.__version__}, triton {triton.__version__}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    else:
        print(f"GPU: none (Triton interpreter {'on' if options.interpreting() else 'off'})")
    for version in dispatch.VERSIONS:
        reason = dispatch.why_not(version, device)
        print(f"  {version}: {'runs here' if reason is None else 'not here: ' + reason}")
    fp8 = dispatch.why_not("v2", device) or validation.fp8_capable(device)
    print(f"  fp8 (forward, flash_attn_interface): {'runs here' if fp8 is None else 'not here: ' + fp8}")
    print(f"  version='auto' picks: {dispatch.resolve_version('auto', device)}")
    return 0


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.command in ("bench", "io") and args.hidden < max(args.head_dims):
        ap.error(f"--hidden {args.hidden} is smaller than head dim {max(args.head_dims)}: no head would fit")
    if args.command == "bench" and args.cuda_graphs and args.modes != ["fwd"]:
        ap.error("--cuda-graphs times forwards only: add --modes fwd")
    if args.command == "decode" and args.heads % args.heads_k:
        ap.error(f"--heads {args.heads} is not a multiple of --heads-k {args.heads_k}")
    return {"bench": cmd_bench, "io": cmd_io, "decode": cmd_decode, "demo": cmd_demo,
            "info": cmd_info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
