"""The Hopper (sm_90a) kernels, in Gluon: the forward (forward.py), dk/dv (dkdv.py; also with dq fused in,
by atomic adds from registers, or by TMA reduce-adds from shared memory) and dq (dq.py), each persistent
and warp-specialized (a 1-warp TMA producer, two consumer warpgroups), with the portable kernels'
contracts; HSTU attention's forward (hstu_forward.py) on the forward's scheduler and ring, and its backward
(hstu_backward.py: dk/dv and dq) on the same scheduler and pipeline helpers. scheduler.py
hands out the blocks and runs the forward's and dq's partition loops, pipeline.py holds the barriers and
shared-memory ring helpers, scores.py the score transform and softmax step, fills.py the zero fills,
addressing.py where tiles, statistics and rows are in global memory. Compiled only: Gluon has no
interpreter.
"""
