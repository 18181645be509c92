"""A Llama-style model trained with attn_implementation "sdpa" and "flashtile", same init, same data.

    python scripts/train_llama.py --out DIR      (on a GPU; transformers 5.0 or newer)
    python scripts/train_llama.py --fp8 --layers 8 --steps 300 --out DIR   (and "fp8": FP8 attention)

With ``--fp8`` a third copy trains with attn_implementation "fp8": flashtile.fp8_attn_func (Q, K,
V quantized per block after incoherent processing, both forward matmuls in e4m3, the backward
straight through in bf16); its loss curve, final loss and throughput join the others.

1. Loss curves: each implementation trains its own copy of one random init for ``--steps`` steps on
   the same generated token batches (a random sparse bigram chain: learnable, no download);
   float32 weights under bf16 autocast, AdamW with warmup and gradient clipping (bf16 weights
   without warmup make the trajectory chaotic: two runs whose gradients agree to a cosine of
   0.99999 at every step still part ways).
2. Throughput (measured first): training steps timed in alternating order (sdpa, flashtile, sdpa,
   ...), median of ``--rounds`` rounds per implementation, at ``--seqlen`` and at ``--long-seqlen``;
   peak memory.
3. Greedy generation with the KV cache: 64 new tokens from a fixed prompt on the sdpa-trained
   weights, with each implementation and with transformers' "eager" attention as a control (a
   second exact implementation); at the first token either differs from sdpa's, the sdpa logits'
   margin between its top two tokens, and between the two chosen tokens in the float32 model on
   the common prefix (bf16 rounding flips a token only where that margin is tiny).

Writes DIR/training.json and DIR/training.png (loss curves) and prints a Markdown summary.
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import flashtile.integrations.transformers  # noqa: F401  registers attn_implementation="flashtile"
from flashtile import bench, fp8

IMPLEMENTATIONS = ("sdpa", "flashtile")
# Generation's control: transformers' own attention in PyTorch, a second exact implementation whose
# greedy tokens part from sdpa's where bf16 rounding decides a near tie, as flashtile's may.
CONTROL = "eager"
# No "flash" in the name: transformers would take it for a FlashAttention kernel to load.
FP8 = "fp8"


def fp8_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface over flashtile.fp8_attn_func: query, key, value (batch,
    heads, seqlen, head_dim) in, (batch, seqlen, heads, head_dim) out; causal, unpadded batches."""
    if attention_mask is not None:
        raise NotImplementedError("attn_implementation='fp8' takes unpadded causal batches (no attention mask)")
    if dropout:
        raise NotImplementedError("attn_implementation='fp8' has no dropout")
    # Under autocast the rotary embedding hands back float32 queries and keys; transformers'
    # flash-attention path casts them back to the half type the same way.
    half = value.dtype if value.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    out = fp8.fp8_attn_func(*(x.transpose(1, 2).to(half) for x in (query, key, value)), softmax_scale=scaling,
                            causal=True)
    return out, None


AttentionInterface.register(FP8, fp8_attention)
AttentionMaskInterface.register(FP8, flash_attention_mask)  # None without padding


def batches(vocab, batch, seqlen, count, seed=0):
    """``count`` token batches from a random bigram chain, each token followed by one of 4."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    tokens = torch.empty(count * batch, seqlen, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (count * batch,), generator=g)
    choice = torch.randint(0, 4, (count * batch, seqlen), generator=g)
    for t in range(1, seqlen):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return list(tokens.view(count, batch, seqlen))


def make_model(args, seed=0):
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.long_seqlen, 4096),
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device="cuda")


def optimizer_of(model, warmup=20):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, schedule


def train_step(model, optimizer, tokens):
    optimizer, schedule = optimizer
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def timed_steps(model, tokens, steps):
    """Tokens per second over ``steps`` training steps (after one untimed), and peak memory."""
    optimizer = optimizer_of(model)
    train_step(model, optimizer, tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, tokens)
    torch.cuda.synchronize()
    return tokens.numel() * steps / (time.perf_counter() - start), torch.cuda.max_memory_allocated() / 2**30


def throughput(args, seqlen, batch, implementations):
    model = make_model(args)
    tokens = torch.randint(0, args.vocab, (batch, seqlen), device="cuda")
    runs = {name: [] for name in implementations}
    memory = {}
    for _ in range(args.rounds):
        for name in implementations:
            model.set_attn_implementation(name)
            tps, memory[name] = timed_steps(model, tokens, args.timed_steps)
            runs[name].append(tps)
    del model
    torch.cuda.empty_cache()
    return {name: dict(tokens_per_s=statistics.median(runs[name]), runs=runs[name], peak_gib=memory[name])
            for name in implementations}


def generate(model, prompt, name, new_tokens):
    model.set_attn_implementation(name)
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:].tolist(), [x[0].float() for x in out.logits]


def parting(model, prompt, reference, other):
    """Where greedy generation ``other`` ((tokens, logits), generate's) first leaves ``reference``:
    (its index, the reference's top-2 bf16 logit margin there, the two tokens' logits apart in
    the float32 model with sdpa on the common prefix), or (None, None, None) where they agree.
    bf16 logits step by 2**-6 to 2**-4 at their usual magnitudes."""
    ours, theirs = other[0], reference[0]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None:
        return None, None, None
    top = reference[1][first].topk(2).values
    prefix = torch.cat([prompt, torch.tensor([theirs[:first]], device=prompt.device, dtype=prompt.dtype)], 1)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(input_ids=prefix).logits[0, -1].float()
    return first, float(top[0] - top[1]), float(logits[theirs[first]] - logits[ours[first]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--long-seqlen", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed-steps", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--fp8", action="store_true", help='a third copy with attn_implementation "fp8"')
    ap.add_argument("--out", default="training_results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    implementations = IMPLEMENTATIONS + ((FP8,) if args.fp8 else ())

    # Throughput first, in a process that has not yet trained or generated: a 4k step is close to
    # bound by the host's enqueueing, which the phases below leave slower (docs/README.md).
    speed = {"seqlen_%d" % args.seqlen: throughput(args, args.seqlen, args.batch, implementations),
             "seqlen_%d" % args.long_seqlen: throughput(args, args.long_seqlen, 1, implementations)}

    data = batches(args.vocab, args.batch, args.seqlen, args.steps)
    losses, models = {}, {}
    for name in implementations:
        model = make_model(args)
        model.set_attn_implementation(name)
        optimizer = optimizer_of(model)
        curve = []
        for tokens in data:
            curve.append(train_step(model, optimizer, tokens.cuda()).detach())
        losses[name] = torch.stack(curve).float().tolist()
        models[name] = model if name in IMPLEMENTATIONS else None
        del optimizer
        print(f"{name}: loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}", flush=True)
    final = {name: statistics.mean(losses[name][-10:]) for name in implementations}
    with open(os.path.join(args.out, "training.json"), "w") as f:  # the curves, should a later phase fail
        json.dump(dict(config=vars(args), losses=losses, final_loss=final), f)

    model = models["sdpa"].eval()
    del models["flashtile"]
    torch.cuda.empty_cache()
    prompt = data[0][:1, :32].cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        tokens = {name: generate(model, prompt, name, args.new_tokens) for name in (*IMPLEMENTATIONS, CONTROL)}
    first, margin, margin32 = parting(model, prompt, tokens["sdpa"], tokens["flashtile"])
    control = dict(zip(("first_difference", "sdpa_top2_margin_there", "float32_margin_there"),
                       parting(model, prompt, tokens["sdpa"], tokens[CONTROL])))
    del model, models
    torch.cuda.empty_cache()

    record = dict(config=vars(args), losses=losses, final_loss=final,
                  final_loss_ratio=final["flashtile"] / final["sdpa"], throughput=speed,
                  generation=dict(sdpa=tokens["sdpa"][0], flashtile=tokens["flashtile"][0], equal=first is None,
                                  first_difference=first, sdpa_top2_margin_there=margin,
                                  float32_margin_there=margin32, control=dict(name=CONTROL,
                                                                              tokens=tokens[CONTROL][0], **control)),
                  **bench.environment())
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    if args.fp8:
        record["fp8_final_loss_ratio"] = final[FP8] / final["sdpa"]
        with open(os.path.join(args.out, "training.json"), "w") as f:
            json.dump(record, f, indent=1)
    plot(losses, os.path.join(args.out, "training.png"), args)
    print(summary(record))


def summary(record):
    lines = [f"final loss (mean of last 10 steps): sdpa {record['final_loss']['sdpa']:.4f}, flashtile "
             f"{record['final_loss']['flashtile']:.4f} (ratio {record['final_loss_ratio']:.4f})", "",
             "| seqlen | sdpa tok/s | flashtile tok/s | flashtile / sdpa | peak GiB sdpa / flashtile |", "|---|---|---|---|---|"]
    for cell, r in record["throughput"].items():
        lines.append(f"| {cell.split('_')[1]} | {r['sdpa']['tokens_per_s']:.0f} | {r['flashtile']['tokens_per_s']:.0f} | "
                     f"{r['flashtile']['tokens_per_s'] / r['sdpa']['tokens_per_s']:.3f} | "
                     f"{r['sdpa']['peak_gib']:.1f} / {r['flashtile']['peak_gib']:.1f} |")
    if "fp8_final_loss_ratio" in record:
        speeds = [f"{cell.split('_')[1]}: {r[FP8]['tokens_per_s']:.0f} "
                  f"({r[FP8]['tokens_per_s'] / r['sdpa']['tokens_per_s']:.3f}x sdpa)"
                  for cell, r in record["throughput"].items()]
        lines += ["", f"FP8 attention: final loss {record['final_loss'][FP8]:.4f} (ratio to sdpa "
                      f"{record['fp8_final_loss_ratio']:.4f}); tokens/s " + ", ".join(speeds)]
    g = record["generation"]
    lines += ["", "greedy generation against sdpa's: flashtile " + _parted(g)]
    if "control" in g:
        lines.append(f"  {g['control']['name']} (the control) " + _parted(g["control"]))
    return "\n".join(lines)


def _parted(g):
    if g["first_difference"] is None:
        return "identical"
    return (f"parts at token {g['first_difference']}, where sdpa's top-2 logits are "
            f"{g['sdpa_top2_margin_there']:.4f} apart (bf16), the two tokens' {g['float32_margin_there']:.4f} "
            f"in float32")


def plot(losses, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in losses:
        ax.plot(losses[name], label=f'attn_implementation="{name}"', linewidth=1.2,
                linestyle="-" if name == "sdpa" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Llama {args.layers}L h{args.hidden} {args.heads}/{args.kv_heads} heads, seqlen {args.seqlen}, "
                 f"batch {args.batch}, bf16 autocast, AdamW", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
