"""What the order of the sequences costs the persistent Hopper kernels: `python -m
benchmarks.probes.sequence_order [--cases A,B] [--rounds 2] [--model | --scheduler]` (a GPU; --model
alone runs on the CPU).

The Hopper kernels take their (sequence, head, block) items from a counter. In the offsets' order, the
last items a launch hands out are the last sequence's, whatever its length: where it is long, the SMs
that finish first wait for it. Taking the longest sequences' items first (longest-processing-time first,
as FlashAttention-3 orders its causal items) leaves the short ones' for the tail. By default this times
one case's lengths in three orders of the same sequences (as drawn, longest first, shortest first)
through auto's kernels, alternating, forward and forward + backward, bfloat16, CUPTI: what the order
alone is worth (measured before the kernels ordered the sequences themselves).

--scheduler times the lengths as drawn through the Hopper kernels (forward and backward, wherever they
run) taking the sequences with the most work first (implementations.Hopper's longest_first) against
in the offsets' order (the default), alternating: what the scheduler gains.

--model prints what a greedy schedule of the items predicts (each SM taking the next item when it is
free; an item's cost its loop's blocks plus half a block, on 132 SMs): the work over the SMs' time,
in each order.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq

import numpy as np

from benchmarks import cases, impls, run

ORDERS = ("drawn", "longest-first", "shortest-first")
SMS = 132


@dataclasses.dataclass(frozen=True)
class OrderedCase(cases.Case):
    """A case whose sequences come in `order` (ORDERS), the same lengths."""

    order: str = "drawn"

    def lengths(self) -> np.ndarray:
        drawn = super().lengths()
        if self.order == "drawn":
            return drawn
        ordered = np.sort(drawn)
        return ordered[::-1].copy() if self.order == "longest-first" else ordered


def ordered(case: cases.Case, order: str) -> OrderedCase:
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
    return OrderedCase(**dict(fields, name=f"{case.name}-{order}"), order=order)


def model(case: cases.Case, order: str, block: int, loop_block: int) -> float:
    """The greedy schedule's efficiency (work over SMs x makespan) for a kernel's items (blocks of
    `block` rows, each walking the sequence's other side in blocks of `loop_block`; self-attention)."""
    lengths = np.minimum(ordered(case, order).lengths(), case.max_seq_len)
    items = [-(-n // loop_block) + 0.5
             for n in lengths for _ in range(case.heads) for _ in range(-(-n // block))]
    finish = [0.0] * SMS
    for cost in items:
        heapq.heappush(finish, heapq.heappop(finish) + cost)
    return sum(items) / SMS / max(finish)


def variants(case: cases.Case, scheduler: bool) -> list[tuple[str, cases.Case, str]]:
    """(label, case, implementation) of each row to time: the lengths in each of ORDERS through auto's
    kernels, or with `scheduler` the lengths as drawn through the Hopper kernels taking the sequences
    longest first (calls.sequence_order) or in the offsets' order."""
    if scheduler:
        return [(name, case, f"jfa-triton-hopper-{name}") for name in ("longest-first", "given-order")]
    return [(order, ordered(case, order), "jfa-triton") for order in ORDERS]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.sequence_order", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="long,dlrm-long,L8192,rec-long")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.1)
    p.add_argument("--model", action="store_true", help="the greedy schedule's prediction only")
    p.add_argument("--scheduler", action="store_true",
                   help="the drawn lengths through the Hopper kernels longest first against in order")
    args = p.parse_args(argv)
    selected = cases.select(args.cases.split(","), False)
    for case in selected:  # dk/dv: key blocks of 128 walking query blocks of 64; forward, dq: 128 and 128
        for kernel, loop_block in (("dk/dv", 64), ("fwd, dq", 128)):
            print(f"[model] {case.name:12s} {kernel:8s} "
                  + " ".join(f"{o} {model(case, o, 128, loop_block):.3f}" for o in ORDERS), flush=True)
    if args.model:
        return
    options = run.probe_options(args.seconds)
    for case in selected:
        for r in range(args.rounds):
            for label, variant, impl in variants(case, args.scheduler)[::1 if r % 2 == 0 else -1]:
                jobs = [(impl, mode, impls.IMPLS[impl][0], True) for mode in cases.MODES]

                def emit(row, r=r, name=case.name, label=label):
                    print(f"[order] round {r} {name:12s} {label:15s} {row['mode']:8s} {run.row_account(row)}",
                          flush=True)

                run.measure_case(variant, "bfloat16", jobs, options, emit)

if __name__ == "__main__":
    main()
