"""HSTU attention's benchmark cases: lengths, targets and attended pairs from numpy alone, so that the
PyTorch harness of generative-recommenders' Triton kernel (hstu_torch_bench.py) and the JAX side
(hstu_padded.py, the library's op) time the same batches.

Causal, as gr's Triton kernel (the only mode it has). Lengths: "uniform" gives every sequence
max_seq_len tokens; "random" draws them uniformly in [contextual_seq_len + 1, max_seq_len]
(np.random.default_rng(0)). Targets: uniform in [1, max_targets] (default_rng(1)), at most the length
less the context, so that the history always covers the context (gr's kernels assume it). Every length
is at most max_seq_len, which gr's Triton kernel requires.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class HstuCase:
    name: str
    batch: int
    heads: int
    head_dim: int  # of q and k
    value_dim: int  # of v
    max_seq_len: int
    lengths_kind: str  # "uniform" or "random"
    max_targets: int = 0  # 0: no num_targets
    contextual_seq_len: int = 0
    max_attn_len: int = 0
    long: bool = False  # max_seq_len >= 4096: seconds rather than milliseconds per case

    @property
    def alpha(self) -> float:
        return self.head_dim ** -0.5

    def lengths(self) -> np.ndarray:
        if self.lengths_kind == "uniform":
            return np.full(self.batch, self.max_seq_len, np.int64)
        low = self.contextual_seq_len + 1
        return np.random.default_rng(0).integers(low, self.max_seq_len + 1, size=self.batch)

    def num_targets(self) -> np.ndarray | None:
        if not self.max_targets:
            return None
        drawn = np.random.default_rng(1).integers(1, self.max_targets + 1, size=self.batch)
        return np.minimum(drawn, self.lengths() - self.contextual_seq_len)

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths())]).astype(np.int64)

    def pairs(self) -> int:
        """Query-key pairs the causal HSTU mask keeps (the diagonal included), from the ids of
        reference.hstu_mask row by row: the ids are non-decreasing along a sequence, so a row's keys with
        id in [id - max_attn_len, id) are a range found by binary search."""
        total = 0
        targets = self.num_targets()
        c, window = self.contextual_seq_len, self.max_attn_len
        for b, n in enumerate(self.lengths()):
            position = np.arange(n)
            ids, history_end = position, n
            if c > 0:
                ids, history_end = np.maximum(position - c + 1, 0), n - c + 1
            if targets is not None:
                history_end = history_end - targets[b]
                ids = np.minimum(ids, history_end)
            below = np.searchsorted(ids, ids, side="left")  # keys with a smaller id
            first = np.searchsorted(ids, ids - window, side="left") if window > 0 else 0
            rows = below - first + 1  # and the diagonal
            if c > 0:  # the context rows (id 0) see every id before the history's end
                rows = np.where(ids == 0, np.searchsorted(ids, history_end, side="left")
                                + (history_end <= 0), rows)
            total += int(rows.sum())
        return total

    def flops(self, mode: str) -> float:
        """2 (D + V) H per kept pair for q.k and the weights times v; fwd+bwd 3.5x (the backward
        recomputes q.k and adds dv, dp, dq and dk)."""
        return 2.0 * (self.head_dim + self.value_dim) * self.heads * self.pairs() * (1.0 if mode == "fwd"
                                                                                      else 3.5)

    def describe(self) -> dict:
        targets = self.num_targets()
        return dict(B=self.batch, H=self.heads, D=self.head_dim, V=self.value_dim, L=self.max_seq_len,
                    lengths=self.lengths_kind, tokens=int(self.lengths().sum()),
                    targets=0 if targets is None else int(targets.sum()),
                    contextual_seq_len=self.contextual_seq_len, max_attn_len=self.max_attn_len,
                    long=self.long, pairs=self.pairs())

    def shrunk(self) -> HstuCase:
        """A tiny version for smoke runs on the CPU (same name and options)."""
        length = 48
        return dataclasses.replace(self, batch=min(self.batch, 3), heads=2, head_dim=16, value_dim=16,
                                   max_seq_len=length, max_targets=min(self.max_targets, 5),
                                   contextual_seq_len=min(self.contextual_seq_len, 3),
                                   max_attn_len=self.max_attn_len and 8)


CASES = (
    HstuCase("b128-l1024-uniform", 128, 4, 128, 128, 1024, "uniform"),
    HstuCase("b128-l1024-random", 128, 4, 128, 128, 1024, "random"),
    HstuCase("b128-l1024-random-targets", 128, 4, 128, 128, 1024, "random", max_targets=20),
    HstuCase("b64-l2048-h8-d64-random-targets", 64, 8, 64, 64, 2048, "random", max_targets=20),
    HstuCase("b64-l2048-random-targets-context-window", 64, 4, 128, 128, 2048, "random", max_targets=20,
             contextual_seq_len=8, max_attn_len=256),
    HstuCase("b32-l4096-random-targets", 32, 4, 128, 128, 4096, "random", max_targets=20, long=True),
    HstuCase("b32-l8192-random-targets", 32, 4, 128, 128, 8192, "random", max_targets=20, long=True),
    HstuCase("b32-l8192-uniform", 32, 4, 128, 128, 8192, "uniform", long=True),
)


def select(names: list[str] | None = None, *, long: bool = True) -> list[HstuCase]:
    """Cases by name (all when None); without `long`, the short ones only."""
    return [c for c in CASES if (names is None or c.name in names) and (long or not c.long)]
