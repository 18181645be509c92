"""Ring attention over gloo on CPU: 2 and 4 processes, each holding a shard of the sequence (zigzag
when causal), the PyTorch path per rank; outputs and gradients, gathered, against attention on
the whole sequence in one process by the FA rule: causal and not, sliding windows that cross
shards (with and without causal), GQA, attention sinks."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from attention_check import GRAD_RULE, OUT_RULE, assert_within_rule, make_qkv, run_and_grad

from flashtile import distributed, standard_attention

SEQLEN, HEADS, HEADS_K, HEAD_DIM = 48, 4, 2, 16


def _gathered(x, world, causal):
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return distributed.zigzag_unshard(parts) if causal else torch.cat(parts, dim=1)


def _worker(rank, world, store_path):
    # (a timeout, so that a rank left waiting fails the test instead of hanging it)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # (causal, window): windows narrower than a shard and wider than several.
        for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (True, (7, -1)),
                               (False, (20, 0)), (True, (30, 0))):
            torch.manual_seed(0)
            q, k, v = make_qkv(2, SEQLEN, SEQLEN, HEADS, HEADS_K, HEAD_DIM, torch.float16, "cpu")
            dout = torch.randn_like(q)

            def shard(x):
                return distributed.zigzag_shard(x, rank, world) if causal else x.chunk(world, dim=1)[rank]
            local = [shard(x).clone().requires_grad_() for x in (q, k, v)]
            out, lse = distributed.ring_flash_attn_func(*local, causal=causal, window_size=window, version="tiled",
                                                        return_softmax_lse=True)
            out.backward(shard(dout))
            results = [_gathered(x, world, causal) for x in (out.detach(), *(t.grad for t in local))]
            lse_all = _gathered(lse.transpose(1, 2), world, causal).transpose(1, 2)
            if rank == 0:
                def attention(a, b, c, upcast=False, return_lse=False):
                    return standard_attention(a, b, c, causal=causal, window_size=window, upcast=upcast,
                                              return_lse=return_lse)
                oracle, oracle_lse = attention(q, k, v, upcast=True, return_lse=True)
                _, _, oracle_grads = run_and_grad(lambda a, b, c: attention(a, b, c, upcast=True), q, k, v,
                                                  dout.double())
                pt, _, pt_grads = run_and_grad(attention, q, k, v, dout)
                case = f"causal={causal}, window={window}"
                assert_within_rule(f"out ({case})", results[0], pt, oracle, OUT_RULE)
                for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), results[1:], pt_grads, oracle_grads):
                    assert_within_rule(f"{name} ({case})", g, g_pt, g_ref, GRAD_RULE)
                torch.testing.assert_close(lse_all, oracle_lse.float(), atol=1e-4, rtol=1e-4)
        # Attention sinks: joined once after the merge; their gradient summed over the ranks.
        torch.manual_seed(1)
        q, k, v = make_qkv(1, SEQLEN, SEQLEN, HEADS, HEADS_K, HEAD_DIM, torch.float16, "cpu")
        dout = torch.randn_like(q)
        sinks = torch.randn(HEADS, requires_grad=True)
        local = [distributed.zigzag_shard(x, rank, world).clone().requires_grad_() for x in (q, k, v)]
        out = distributed.ring_flash_attn_func(*local, causal=True, version="tiled", sinks=sinks)
        out.backward(distributed.zigzag_shard(dout, rank, world))
        results = [_gathered(x, world, True) for x in (out.detach(), *(t.grad for t in local))]
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks)
        if rank == 0:
            def attention(a, b, c, s, upcast=False):
                return standard_attention(a, b, c, causal=True, upcast=upcast, sinks=s)
            oracle, _, oracle_grads = run_and_grad(lambda a, b, c: attention(a, b, c, sinks, True), q, k, v,
                                                   dout.double())
            pt, _, pt_grads = run_and_grad(lambda a, b, c: attention(a, b, c, sinks), q, k, v, dout)
            assert_within_rule("out (sinks)", results[0], pt, oracle, OUT_RULE)
            for name, g, g_pt, g_ref in zip(("dq", "dk", "dv"), results[1:], pt_grads, oracle_grads):
                assert_within_rule(f"{name} (sinks)", g, g_pt, g_ref, GRAD_RULE)
            whole = sinks.detach().double().requires_grad_()
            reference = standard_attention(q.double(), k.double(), v.double(), causal=True, sinks=whole)
            (expected,) = torch.autograd.grad(reference, whole, dout.double())
            torch.testing.assert_close(dsinks.double(), expected, atol=1e-2, rtol=1e-2)
        # Shards of different lengths are refused on every rank, also where one rank's alone would
        # fail a check of its own (an odd causal shard, q and k of different lengths).
        for uneven, causal, message in ((8 + 2 * rank, False, "same length"), (9 - rank % 2, True, "same length"),
                                        (8, True, "q and k must hold the same shard")):
            x = torch.randn(1, uneven, 2, 16, dtype=torch.float16)
            y = x[:, :7] if message.startswith("q and k") and rank == world - 1 else x
            try:
                distributed.ring_flash_attn_func(x, y, y, causal=causal, version="tiled")
            except ValueError as e:
                assert message in str(e), str(e)
            else:
                raise AssertionError(f"uneven shards were not refused ({message})")
        # K/V of any strides (a (batch, heads, seqlen, d) buffer seen as (batch, seqlen, heads, d)):
        # the same output and gradients as contiguous shards.
        torch.manual_seed(2)
        shards = [torch.randn(1, 2, 8, 16, dtype=torch.float16).transpose(1, 2) for _ in range(3)]
        runs = []
        for given in (shards, [x.contiguous() for x in shards]):
            leaves = [x.detach().requires_grad_() for x in given]
            out = distributed.ring_flash_attn_func(*leaves, causal=True, version="tiled")
            out.float().sum().backward()
            runs.append([out.detach(), *(x.grad for x in leaves)])
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        # A ring of one rank (a sub-group each): attention over the rank's own shard.
        alone = [dist.new_group([r]) for r in range(world)][rank]
        x = torch.randn(1, 8, 2, 16, dtype=torch.float16, requires_grad=True)
        out = distributed.ring_flash_attn_func(x, x, x, causal=True, version="tiled", group=alone)
        out.float().sum().backward()
        torch.testing.assert_close(out, standard_attention(x.detach(), x.detach(), x.detach(), causal=True),
                                   atol=2e-3, rtol=2e-3)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed: leave without the interpreter's teardown, where a background thread of
    # torch's CPU runtime now and then aborts the process (std::terminate, no Python frame) after
    # the work is done.
    os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_one_process(world, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def test_step_pairs_cover_the_band_once():
    # Every (query, key) pair of the global band is computed by exactly one kernel call of one
    # step, under the kernels' own band convention (aligned to the ends of both ranges).
    for world, seqlen, zigzag in ((1, 6, False), (3, 4, False), (4, 6, True), (2, 8, True)):
        for left, right in ((-1, -1), (-1, 0), (0, 0), (3, 1), (5, -1), (1, 7), (20, 2)):
            for rank in range(world):
                def positions(r):
                    p = torch.empty(seqlen, dtype=torch.long)
                    for start, local, n in distributed.shard_segments(r, world, seqlen, zigzag):
                        p[local:local + n] = torch.arange(start, start + n)
                    return p
                for source in range(world):
                    offset = positions(source)[None, :] - positions(rank)[:, None]
                    band = ((offset >= -left) | (left < 0)) & ((offset <= right) | (right < 0))
                    seen = torch.zeros(seqlen, seqlen, dtype=torch.int)
                    for rows, keys, k_left, k_right in distributed.step_pairs(rank, source, world, seqlen, zigzag,
                                                                              left, right):
                        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
                        d = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] - (n_k - n_q)
                        seen[rows, keys] += (((d >= -k_left) | (k_left < 0)) & ((d <= k_right) | (k_right < 0))).int()
                    assert torch.equal(seen, band.int()), (world, seqlen, zigzag, left, right, rank, source)


def test_ring_attention_refusals():
    q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="initialized torch.distributed"):
        distributed.ring_flash_attn_func(q, q, q)
    assert torch.equal(distributed.zigzag_unshard([distributed.zigzag_shard(q, r, 2) for r in range(2)]), q)
    with pytest.raises(ValueError, match=r"multiple of that .* got rank 0"):
        distributed.zigzag_shard(q[:, :6], 0, 2)
