"""Dense causal attention, the reference the paged backends are tested against."""

import torch


def dense_reference(q, k, v, num_computed, window=None):
    """q [Lq, H, D] at positions num_computed.., k/v [Lctx, Hkv, D]; causal (+ window); in fp32.
    Returns [Lq, H * D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[-1] ** -0.5
    q_pos = torch.arange(q.shape[0])[:, None] + num_computed
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)
