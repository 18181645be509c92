"""attn_implementation="flashtile" in Hugging Face transformers, on tiny randomly initialised models.

Each model runs in bf16 with flashtile and with a PyTorch attention of transformers ("sdpa", or
"eager" where the model has no sdpa), from the same weights; the oracle is that PyTorch attention
in float64 on those weights.  Logits (at non-padded positions) and every parameter's gradient must
satisfy the FlashAttention rule: |flashtile - oracle| <= 2 x |PyTorch bf16 - oracle| + 1% of
max |oracle|.  The initialiser range is raised so that attention is far from uniform, and each
feature test checks that the feature changes the oracle's logits.  Weights and inputs are drawn
on the CPU, so a GPU run sees the same model and tokens.

"eager" in float64 is an oracle only without left padding: it takes the softmax in float32, where
float64's mask value becomes -inf, so fully masked rows give NaN and spread it to other rows.
"""
import copy
import inspect

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import DEVICE  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import modeling_flash_attention_utils as fa_utils  # noqa: E402

import flashtile.integrations.transformers as ft  # noqa: E402
from flashtile import api  # noqa: E402

DTYPE = torch.bfloat16
VOCAB = 96
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.25, attention_dropout=0.0,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
RULE = (2.0, 1e-2)  # factor on PyTorch's bf16 error, and an absolute term as a fraction of max |oracle|


def llama(**extra):
    return transformers.LlamaConfig(**{**TINY, **extra})


def build(config, implementation, dtype, state=None):
    # A copy: from_config records the implementation on the config it is given.  The experts'
    # loop rather than grouped_mm, which float64 lacks (gpt-oss).
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation, dtype=dtype,
                                             experts_implementation="eager")
    if state is not None:
        model.load_state_dict(state)
    assert model.config._attn_implementation == implementation
    return model.to(DEVICE)


def trio(config, reference, tweak=None):
    """flashtile and ``reference`` in bf16 and ``reference`` in float64, one set of weights
    (those of the bf16 model, edited by ``tweak``)."""
    flash = build(config, "flashtile", DTYPE)
    if tweak is not None:
        with torch.no_grad():
            tweak(flash)
    state = flash.state_dict()
    return flash, build(config, reference, DTYPE, state), build(config, reference, torch.float64, state)


def batch_of(rows, seqlen, pads=(), vocab=VOCAB):
    """input_ids (rows, seqlen) and an attention mask; ``pads``: (row, left, right) padding counts."""
    ids = torch.randint(0, vocab, (rows, seqlen))
    mask = torch.ones(rows, seqlen, dtype=torch.long)
    for row, left, right in pads:
        mask[row, :left] = 0
        mask[row, seqlen - right:] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def run(model, ids, mask):
    """Logits and each parameter's gradient of a next-token loss over the non-padded positions."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    labels = torch.where(mask.bool(), ids, -100)[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].double().flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def within_rule(name, ours, pytorch, oracle, rule=RULE):
    factor, rel = rule
    ours, pytorch, oracle = ours.double(), pytorch.double(), oracle.double()
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    assert torch.isfinite(oracle).all(), f"{name}: the oracle is not finite"
    err, err_pt = (ours - oracle).abs().max().item(), (pytorch - oracle).abs().max().item()
    assert err <= factor * err_pt + rel * oracle.abs().max().item(), \
        f"{name}: error {err:.3e} > {factor} x {err_pt:.3e} + {rel} x max|oracle| ({oracle.abs().max().item():.3e})"


def check_model(config, ids, mask, reference="sdpa", tweak=None):
    """The rule for the logits at non-padded positions and for every gradient; returns the
    oracle's logits there and the weights."""
    flash, pytorch, oracle = trio(config, reference, tweak)
    (lf, gf), (lp, gp), (lo, go) = run(flash, ids, mask), run(pytorch, ids, mask), run(oracle, ids, mask)
    assert torch.isfinite(lf).all(), "flashtile gave non-finite logits (padded positions included)"
    keep = mask.bool()
    within_rule("logits", lf[keep], lp[keep], lo[keep])
    assert go.keys() == gf.keys() == gp.keys()
    for name in go:
        within_rule(f"grad of {name}", gf[name], gp[name], go[name])
    return lo[keep], flash.state_dict()


def assert_changes(logits, config, state, ids, mask, reference="sdpa"):
    """The feature under test matters: the oracle without it (``config``, ``state``) gives other logits."""
    other = build(config, reference, torch.float64, state)(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    change = (other - logits).abs().max().item()
    assert change > 0.05 * logits.abs().max().item(), f"the feature changes the logits by {change:.2e} only"


@pytest.fixture
def calls(monkeypatch):
    """Calls of flashtile's dense and varlen entry points, to show that the layers reached them."""
    counts = {"dense": 0, "varlen": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(api, "flash_attn_func", counted("dense", api.flash_attn_func))
    monkeypatch.setattr(api, "flash_attn_varlen_func", counted("varlen", api.flash_attn_varlen_func))
    return counts


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_llama_logits_and_gradients(padded, calls):
    torch.manual_seed(0)
    # GQA (4 query heads, 2 KV heads).  Row 1 left-padded (as generation pads), row 2
    # right-padded (as training collators pad): the varlen path.
    ids, mask = batch_of(3, 13, pads=[(1, 4, 0), (2, 0, 3)] if padded else [])
    check_model(llama(), ids, mask)
    layers = TINY["num_hidden_layers"]
    assert calls == ({"dense": 0, "varlen": layers} if padded else {"dense": layers, "varlen": 0})


def test_packed_sequences(calls):
    """Two sequences packed in one row, told apart by position_ids restarting at 0 (padding-free
    training): the varlen path, and each sequence's logits as if run alone."""
    torch.manual_seed(0)
    lengths = (6, 7)
    ids, _ = batch_of(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    flash, pytorch, oracle = trio(llama(), "sdpa")

    def alone(model):
        return torch.cat([model(input_ids=part).logits[0] for part in ids.split(lengths, dim=1)])

    with torch.no_grad():
        packed = flash(input_ids=ids, position_ids=positions).logits[0]
        within_rule("packed logits", packed, alone(pytorch), alone(oracle))
    assert calls["varlen"] == TINY["num_hidden_layers"]


def test_one_row_packing_read_once_per_position_ids(calls, monkeypatch):
    """transformers reads a single row's position_ids in every layer to tell packed sequences from
    one; flashtile decides it once per tensor (and again after an in-place change)."""
    checks = []
    check = fa_utils._is_packed_sequence
    # (counting the checks that read values: transformers still calls it with position_ids None)
    monkeypatch.setattr(fa_utils, "_is_packed_sequence",
                        lambda position_ids, *args, **kwargs: checks.append(position_ids is not None
                                                                            and position_ids.numel() > 1)
                        or check(position_ids, *args, **kwargs))
    torch.manual_seed(0)
    lengths = (6, 7)
    ids, _ = batch_of(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    flash, pytorch, oracle = trio(llama(), "sdpa")
    layers = TINY["num_hidden_layers"]
    with torch.no_grad():
        packed = flash(input_ids=ids, position_ids=positions).logits[0]
        assert (sum(checks), calls) == (1, {"dense": 0, "varlen": layers})
        assert torch.equal(flash(input_ids=ids, position_ids=positions).logits[0], packed)
        assert (sum(checks), calls["varlen"]) == (1, 2 * layers)
        positions.copy_(torch.arange(ids.shape[1]))  # one sequence now: decided again, the dense path
        whole = flash(input_ids=ids, position_ids=positions).logits[0]
        assert (sum(checks), calls) == (2, {"dense": layers, "varlen": 2 * layers})
        within_rule("one row's logits", whole, pytorch(input_ids=ids).logits[0], oracle(input_ids=ids).logits[0])


def test_fully_padded_row_is_finite():
    torch.manual_seed(0)
    ids, mask = batch_of(2, 11, pads=[(1, 11, 0)])
    logits = build(llama(), "flashtile", DTYPE)(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_mistral_sliding_window(padded):
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY, sliding_window=4)
    ids, mask = batch_of(2, 13, pads=[(1, 3, 0)] if padded else [])
    logits, state = check_model(config, ids, mask)
    assert_changes(logits, transformers.MistralConfig(**TINY, sliding_window=None), state, ids, mask)


def gemma2(softcap):
    # Layer 0 slides (window 5), layer 1 is global; the scale is query_pre_attn_scalar ** -0.5, not head_dim's.
    return transformers.Gemma2Config(**TINY, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=softcap,
                                     final_logit_softcapping=None)


def test_gemma2_softcap_window_and_scaling():
    torch.manual_seed(0)
    ids, mask = batch_of(2, 13, pads=[(1, 0, 4)])  # right padding: "eager" is the oracle (no sdpa with softcap)
    logits, state = check_model(gemma2(softcap=2.0), ids, mask, reference="eager")
    assert_changes(logits, gemma2(softcap=None), state, ids, mask, reference="eager")


def gpt_oss():
    # Layer 0 slides (window 4), layer 1 is global; both have sinks.
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                truncate=False)
    # One expert: a top-k choice that rounding could flip would make the logits jump between
    # models that agree to rounding, and the router's gradient is all cancellation.
    return transformers.GptOssConfig(**TINY, sliding_window=4, num_local_experts=1, num_experts_per_tok=1,
                                     rope_parameters=yarn)


def test_gpt_oss_sinks():
    torch.manual_seed(0)
    ids, mask = batch_of(2, 13, pads=[(1, 0, 3)])

    def strong_sinks(model):
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(TINY["num_attention_heads"]) * 2)

    logits, state = check_model(gpt_oss(), ids, mask, reference="eager", tweak=strong_sinks)
    no_sinks = {k: torch.full_like(v, -1e4) if k.endswith("sinks") else v for k, v in state.items()}
    assert_changes(logits, gpt_oss(), no_sinks, ids, mask, reference="eager")


def deepseek_v3():
    # Multi-head latent attention: Q and K of 12 + 4 (rotary) lanes, V of 8; dense MLPs only.
    tiny = {k: x for k, x in TINY.items() if k not in ("head_dim", "num_key_value_heads")}
    return transformers.DeepseekV3Config(**tiny, moe_intermediate_size=32, qk_nope_head_dim=12,
                                         qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=None,
                                         first_k_dense_replace=TINY["num_hidden_layers"], n_routed_experts=2,
                                         num_experts_per_tok=1, n_group=1, topk_group=1, rope_interleave=False)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_deepseek_v3_latent_attention(padded):
    # V's head dim differs from Q's and K's (transformers pads V to Q's for FlashAttention
    # kernels and crops the output).
    torch.manual_seed(0)
    ids, mask = batch_of(2, 13, pads=[(1, 3, 0)] if padded else [])
    check_model(deepseek_v3(), ids, mask)


def test_generate_with_cache_matches_sdpa():
    """Greedy decoding with a KV cache (one query over the cached keys at each step, bottom-right
    causal), left-padded as generation pads.  Each step's logits are within the rule of the
    oracle's full forward over the generated sequence, each token is the oracle's argmax up to
    that error, and the tokens are sdpa's up to the first step, if any, where two tokens tie
    within it (there bf16 rounding decides, for sdpa as for flashtile)."""
    torch.manual_seed(0)
    new, vocab = 4, 16
    ids, mask = batch_of(2, 9, pads=[(1, 3, 0)], vocab=vocab)
    flash, pytorch, oracle = trio(llama(vocab_size=vocab, initializer_range=0.1), "sdpa")
    options = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ours = flash.generate(input_ids=ids, attention_mask=mask, **options)
    theirs = pytorch.generate(input_ids=ids, attention_mask=mask, **options).sequences[:, -new:]
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new])], dim=1)
    with torch.no_grad():
        reference = oracle(input_ids=ours.sequences, attention_mask=full_mask).logits[:, -new - 1:-1].double()
        uncached = pytorch(input_ids=ours.sequences, attention_mask=full_mask).logits[:, -new - 1:-1]
    within_rule("generation logits", torch.stack(ours.logits, 1), uncached, reference)
    factor, rel = RULE
    tie = 2 * (factor * (uncached - reference).abs().max().item() + rel * reference.abs().max().item())
    tokens = ours.sequences[:, -new:]
    chosen = reference.gather(-1, tokens[..., None])[..., 0]
    assert (chosen >= reference.max(-1).values - tie).all(), "a generated token is not the oracle's greedy choice"
    for row in range(tokens.shape[0]):
        for step in range(new):
            a, b = tokens[row, step], theirs[row, step]
            if a != b:
                gap = (reference[row, step, a] - reference[row, step, b]).abs().item()
                assert gap <= tie, f"row {row} step {step}: tokens {a} and {b}, {gap:.3e} apart in the oracle"
                break


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_chunk_over_cache_is_bottom_right_causal(padded):
    """A chunk of 5 queries after 8 cached tokens: query i sees keys up to 8 + i."""
    torch.manual_seed(0)
    ids, mask = batch_of(2, 13, pads=[(1, 3, 0)] if padded else [])
    flash, pytorch, oracle = trio(llama(), "sdpa")

    def chunked(model):
        # transformers 5.25 renamed past_key_values to cache.
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            first = model(input_ids=ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
            return model(input_ids=ids[:, 8:], attention_mask=mask, **{name: first.past_key_values}).logits

    with torch.no_grad():
        reference = oracle(input_ids=ids, attention_mask=mask).logits[:, 8:]
    within_rule("chunk logits", chunked(flash), chunked(pytorch), reference)


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces a model through flashtile (batches without padding:
    with a padding mask, transformers' own flash mask helper branches on the mask's values)."""
    torch.manual_seed(0)
    ids, _ = batch_of(2, 13)
    model = build(llama(num_hidden_layers=1), "flashtile", DTYPE)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids).logits
    assert torch.equal(compiled, expected)


def test_register_is_idempotent_and_the_name_is_available():
    loader, check = fa_utils._lazy_imports, transformers.PreTrainedModel._check_and_adjust_attn_implementation
    ft.register()
    ft.register()
    assert fa_utils._lazy_imports is loader
    assert transformers.PreTrainedModel._check_and_adjust_attn_implementation is check
    assert not hasattr(loader.flashtile_original, "flashtile_original")
    assert transformers.AttentionInterface()["flashtile"] is ft.attention_forward
    assert "flashtile" in transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    # Other flash implementations still go to transformers' loader.
    with pytest.raises(ValueError, match="Could not find"):
        fa_utils._lazy_imports("flash_not_a_kernel")


def test_attention_dropout_in_training():
    # attention_dropout reaches the kernels in train mode (a new mask per call, reproduced by
    # torch.manual_seed) and not in eval mode.
    torch.manual_seed(0)
    ids, _ = batch_of(2, 9)
    model = build(llama(attention_dropout=0.3), "flashtile", DTYPE)
    with torch.no_grad():
        plain = model.eval()(input_ids=ids).logits
        model.train()
        torch.manual_seed(1)
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        torch.manual_seed(1)
        again = model(input_ids=ids).logits
    assert torch.equal(first, again) and not torch.equal(first, second) and not torch.equal(first, plain)


def test_refusals():
    torch.manual_seed(0)
    ids, mask = batch_of(1, 7)
    with pytest.raises(TypeError, match="bfloat16"):
        build(llama(), "flashtile", torch.float32)(input_ids=ids)
    model = build(llama(), "flashtile", DTYPE)
    with pytest.raises(ValueError, match="2-D padding mask"):
        ft.attention_forward(model.model.layers[0].self_attn, *torch.zeros(3, 1, 4, 7, 16, dtype=DTYPE),
                             torch.ones(1, 1, 7, 7, dtype=torch.bool))

    class NoFlash(transformers.LlamaForCausalLM):
        _supports_flash_attn = False

    config = llama()
    config._attn_implementation = "flashtile"
    with pytest.raises(ValueError, match="does not support FlashAttention"):
        NoFlash(config)
