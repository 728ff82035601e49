"""Float64 numpy reference of the op and its gradients, one sequence and head at a time.

Independent of the package: it reads offsets as written (they must be valid) and uses the textbook
softmax-attention gradients.
"""

from __future__ import annotations

import numpy as np


def attention_and_grads(q, k, v, do, offsets, max_seq_len):
    """(o, dq, dk, dv) in float64 for [H, T, D] inputs; zero outside the attended tokens."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    o, dq, dk, dv = (np.zeros_like(q) for _ in range(4))
    for b in range(len(offsets) - 1):
        start = int(offsets[b])
        n = min(int(offsets[b + 1]) - start, max_seq_len)
        if n <= 0:
            continue
        rows = slice(start, start + n)
        for h in range(q.shape[0]):
            qs, ks, vs, dos = q[h, rows], k[h, rows], v[h, rows], do[h, rows]
            scores = qs @ ks.T
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            o[h, rows] = p @ vs / max_seq_len
            dv[h, rows] = p.T @ dos / max_seq_len
            dp = dos @ vs.T / max_seq_len
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True))
            dq[h, rows] = ds @ ks
            dk[h, rows] = ds.T @ qs
    return o, dq, dk, dv


def attended_mask(offsets, total, max_seq_len):
    """Boolean [T]: whether token t is among the first max_seq_len tokens of some sequence."""
    mask = np.zeros(total, bool)
    for b in range(len(offsets) - 1):
        start = int(offsets[b])
        mask[start:start + min(int(offsets[b + 1]) - start, max_seq_len)] = True
    return mask
