"""Which keys a block of queries sees under a sliding window, and attention sinks folded into a softmax.

A block is a run of queries at consecutive global positions against a run of keys at consecutive positions
(one device: the new tokens against the cache and themselves; context parallelism: one chunk against another).
A query at q sees a key at k when 0 <= q - k (causal) and, with a window W, q - k < W (Hugging Face's rule: the
query itself and the W - 1 before it). `visible` trims a block to the queries that see at least one of its keys
and the keys some query sees, and states the rest as a `Band` around the block's bottom-right diagonal, the form
FlashAttention's window_size_left / window_size_right take (and the CPU kernel as an additive mask): a block
wholly outside the window is skipped, never computed. Trimming first matters: FlashAttention reads a negative
window size as unbounded, and a row that sees no key has no softmax at all; after trimming neither happens.

An attention sink (gpt-oss) is a learned logit s_h per head, one more column of every query's softmax with no
value: with L the log-sum-exp of the query's scores, the output is out * exp(L - L') where L' = logaddexp(L, s_h),
i.e. out * sigmoid(L - s_h). Folded in once, after every block of keys has been merged, the sink is one more
block of the merge; the kernels' backward, given the final output and L', then yields exact dq, dk, dv (their
softmax is the one with the sink column), and the sink's own gradient is -sum over queries of
exp(s_h - L') * (dout . out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Band:
    """Query i of a block of sq sees key j of sk when -left <= j - i - (sk - sq) <= right (None: unbounded):
    the keys around the query's place on the block's bottom-right diagonal."""

    left: int | None = None
    right: int | None = None


FULL, CAUSAL = Band(), Band(None, 0)


def visible(q_start: int, q_len: int, k_start: int, k_len: int,
            window: int | None) -> tuple[slice, slice, Band] | None:
    """The rows of the queries at q_start.. that see a key at k_start.. (causally, within `window`), the columns
    of the keys they see, and the band between them; None when no query sees any key."""
    q_end, k_end = q_start + q_len, k_start + k_len
    first = max(q_start, k_start)  # a query sees keys at or before itself
    last = q_end if window is None else min(q_end, k_end + window - 1)  # ... and not window or more before
    if first >= last:
        return None
    k_first = k_start if window is None else max(k_start, first - window + 1)
    k_last = min(k_end, last)
    right = last - k_last  # the last query's distance past the last key: the diagonal's offset
    everything = first >= k_last - 1 and (window is None or last - 1 - k_first < window)
    band = FULL if everything else Band(None if window is None else window - 1 - right, right)
    return slice(first - q_start, last - q_start), slice(k_first - k_start, k_last - k_start), band


def additive_mask(band: Band, sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The band as a [sq, sk] mask of 0 and -inf (None: nothing masked), for kernels taking a mask."""
    if band == FULL:
        return None
    offset = (torch.arange(sk, device=device) - (sk - sq)) - torch.arange(sq, device=device).unsqueeze(1)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if band.left is not None:
        seen &= offset >= -band.left
    if band.right is not None:
        seen &= offset <= band.right
    return torch.zeros(sq, sk, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Fold each head's sink logit into the merged softmax: scales the fp32 `out` [b, heads, s, d] in place and
    returns the new log-sum-exp [b, heads, s]."""
    merged = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    return merged


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sink per head, from the final output, its gradient and the log-sum-exp with the sink folded in."""
    weight = torch.exp(sinks.float().view(1, -1, 1) - lse)  # the sink column's probability
    return -(weight * (dout.float() * out.float()).sum(-1)).sum((0, 2)).to(sinks.dtype)
