"""FlashAttention-3's Hopper kernels in Gluon: the forward (forward.py), the backward
(backward.py), and what they share: the persistent tile scheduler (scheduler.py) and the
shared-memory pipeline's buffers and barriers (pipeline.py)."""
