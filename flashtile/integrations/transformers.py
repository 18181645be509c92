"""``attn_implementation="flashtile"`` for Hugging Face transformers (5.0 or newer; gpt-oss needs 5.3).

    import flashtile.integrations.transformers  # registers the name; register() does it again, harmlessly
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtile", dtype=torch.bfloat16)

transformers treats every attention name that contains "flash" as a FlashAttention kernel: such
layers get a 2-D padding mask (or None), and their flash_attn_func and flash_attn_varlen_func are
loaded by ``modeling_flash_attention_utils._lazy_imports``, which knows only the flash_attn
packages and Hub kernels. ``register`` wraps that loader so that "flashtile" loads the two
functions below, and registers transformers' own ``flash_attention_forward`` and
``flash_attention_mask`` under the name: transformers' FlashAttention path (unpadding to varlen,
packed sequences, the KV cache, sliding windows, softcap, gpt-oss's sinks) then runs on
flashtile. It also vouches for flashtile on models that list their compatible flash kernels
(gpt-oss), which transformers would otherwise swap for a Hub kernel, and refuses models that do
not support FlashAttention, as transformers does for flash kernels.
"""
import functools

import torch
import transformers
from packaging.version import Version

if Version(transformers.__version__).release < (5, 0):
    raise ImportError(f"flashtile's transformers integration needs transformers 5.0 or newer (5.3 for gpt-oss); "
                      f"this is {transformers.__version__}")

from transformers import AttentionInterface, PreTrainedModel  # noqa: E402
from transformers import modeling_flash_attention_utils as _fa_utils  # noqa: E402
from transformers.integrations.flash_attention import (  # noqa: E402
    flash_attention_forward as _hf_flash_attention_forward)
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: E402

from flashtile import api  # noqa: E402
from flashtile.tensor_state import KeptByTensor  # noqa: E402

NAME = "flashtile"
__all__ = ["NAME", "register", "attention_forward", "flash_attn_func", "flash_attn_varlen_func"]


def _check(q):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"attn_implementation='flashtile' computes in float16 or bfloat16, and the attention inputs "
                        f"are {q.dtype}: load the model with dtype=torch.bfloat16 (or float16), or run it under "
                        f"torch.autocast")


# The signatures name every keyword transformers' FlashAttention path passes when the loaded function
# accepts it (it inspects the varlen one): s_aux is its name for gpt-oss's sinks.
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=None,
                    deterministic=False, s_aux=None):
    """flashtile.flash_attn_func as transformers calls it for batches without padding."""
    _check(q)
    return api.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap or 0.0, deterministic=bool(deterministic), sinks=s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=None,
                           deterministic=False, s_aux=None):
    """flashtile.flash_attn_varlen_func as transformers calls it for padded or packed batches."""
    _check(q)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap or 0.0, deterministic=bool(deterministic), sinks=s_aux)


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' flash_attention_forward (query, key, value (batch, heads, seqlen, headdim)),
    refusing the 4-D masks it would misread as padding masks; a single row's packing is found
    once per position_ids tensor (``_with_packing``)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='flashtile' takes a 2-D padding mask (batch, seqlen_k) or None, as "
                         f"FlashAttention does; this model passed a mask of shape {tuple(attention_mask.shape)}")
    if attention_mask is None and query.shape[0] == 1:
        kwargs = _with_packing(kwargs)
    return _hf_flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


# position_ids tensor -> the keywords its packing changes.  On one unpadded row transformers tells
# packed sequences from one by reading position_ids' values (a wait on the device) in every layer;
# the layers of a forward share one position_ids tensor (tensor_state: kept while unchanged).
_PACKING = KeptByTensor()


def _with_packing(kwargs):
    """``kwargs`` for one unpadded row, the packing of its position_ids decided once per tensor
    state: position_ids None (transformers' check reads nothing; releases up to 5.17 check it
    before the varlen keywords), and for packed sequences the varlen keywords transformers takes
    as given (cu_seq_lens_q/k, max_length_q/k; the lengths as ints, so no layer reads them).
    Left as they are under torch.compile (a traced graph branches on no values) and where
    transformers lacks the helpers; for inference-mode tensors (no version counter) decided at
    each call."""
    position_ids = kwargs.get("position_ids")
    if (position_ids is None or position_ids.shape[-1] == 1 or kwargs.get("cu_seq_lens_q") is not None
            or not hasattr(_fa_utils, "prepare_fa_kwargs_from_position_ids")
            or not hasattr(_fa_utils, "_is_packed_sequence") or torch.compiler.is_compiling()):
        return kwargs
    change = _PACKING.get(position_ids)
    if change is None:
        change = dict(position_ids=None)
        if bool(_fa_utils._is_packed_sequence(position_ids, 1)):
            (cu_q, cu_k), (max_q, max_k) = _fa_utils.prepare_fa_kwargs_from_position_ids(position_ids)
            change.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=int(max_q), max_length_k=int(max_k))
        _PACKING.put(position_ids, change)
    return {**kwargs, **change}


def _functions():
    """What ``_lazy_imports`` returns: the flash functions (and the paged kvcache one, which
    later 5.x releases load and flashtile does not have), then transformers' own pad and unpad."""
    paged = (None,) if hasattr(_fa_utils, "_flash_with_kvcache_fn") else ()
    return (flash_attn_func, flash_attn_varlen_func, *paged, _fa_utils._pad_input, _fa_utils._unpad_input)


def _wrap_loader(original):
    @functools.wraps(original)
    def _lazy_imports(implementation, *args, **kwargs):
        if implementation == NAME:
            return _functions()
        return original(implementation, *args, **kwargs)

    _lazy_imports.flashtile_original = original
    return _lazy_imports


def _wrap_check(original):
    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation == NAME:
            if not (getattr(self, "_supports_flash_attn", False) or getattr(self, "_supports_flash_attn_2", False)):
                raise ValueError(f"{type(self).__name__} does not support FlashAttention in transformers, so it "
                                 f"cannot use attn_implementation='flashtile'; use 'sdpa' or 'eager'")
            listed = getattr(self, "_compatible_flash_implementations", None)
            if listed is not None and NAME not in listed:
                # On the instance: the model's class keeps its own list.
                self._compatible_flash_implementations = [*listed, NAME]
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation.flashtile_original = original
    return _check_and_adjust_attn_implementation


def register():
    """Make ``attn_implementation="flashtile"`` available; calling it again changes nothing."""
    if not hasattr(_fa_utils._lazy_imports, "flashtile_original"):
        _fa_utils._lazy_imports = _wrap_loader(_fa_utils._lazy_imports)
    check = PreTrainedModel._check_and_adjust_attn_implementation
    if not hasattr(check, "flashtile_original"):
        PreTrainedModel._check_and_adjust_attn_implementation = _wrap_check(check)
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
