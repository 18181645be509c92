"""flashtile: exact FlashAttention (v1, v2, v3) for PyTorch, in Triton."""
from flashtile.api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                           flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                           flash_attn_varlen_qkvpacked_func)
from flashtile.fp8 import fp8_attn_func
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.reference import standard_attention
from flashtile.sdpa import scaled_dot_product_attention

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache", "fp8_attn_func", "scaled_dot_product_attention", "standard_attention"]
__version__ = "0.1.0"
