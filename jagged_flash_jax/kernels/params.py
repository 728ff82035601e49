"""The slots of the int32 array of runtime parameters that a launch passes last among its inputs: one
name each, which the kernels read them by (common.PARAM_*) and launch/plan.py packs them by. Plain ints,
so that the plan imports them without Triton. Strides marked "in units" are in units of the kernel's
STRIDE_ALIGN (the key-major D strides: of KEY_MAJOR_ALIGN) elements, see common._aligned.
"""

# The attention kernels (forward and backward), slots 0-8: read by `_params`.
BATCH = 0  # sequences per segment
Q_TOKENS = 1  # q tokens per segment
KV_TOKENS = 2  # kv tokens per segment
Q_TOKEN_STRIDE = 3  # q, o, do, dq: in units
Q_HEAD_STRIDE = 4
KV_TOKEN_STRIDE = 5  # k, v, dk, dv: in units
KV_HEAD_STRIDE = 6
Q_OFFSETS_STRIDE = 7  # between segments' offsets rows (0: one shared row)
KV_OFFSETS_STRIDE = 8
# The forward's own.
FWD_FILL_CHUNK = 9  # tokens each zero-fill program clears
FWD_SLOTS = 10  # programs per (segment, sequence or fill, head)
FWD_V_D_STRIDE = 11  # a key-major v's D rows, in units
# The Hopper forward's own (kernels/hopper.py).
HOPPER_FWD_BLOCKS = 9  # query blocks per (sequence, head)
HOPPER_FWD_FILL_CHUNK = 10  # tokens each zero-fill program clears
# The Hopper backward's own (kernels/hopper_backward.py), each launch (dk/dv, dq) its values.
HOPPER_BWD_BLOCKS = 9  # key (dk/dv) or query (dq) blocks per (sequence, head)
HOPPER_BWD_FILL_CHUNK = 10  # tokens each zero-fill program clears
# The backward's own.
BWD_Q_FILL_CHUNK = 9  # tokens each dq zero-fill program clears
BWD_KV_FILL_CHUNK = 10  # ... each dk/dv one
BWD_SLOTS = 11
BWD_KM_D_STRIDE = 12  # the key-major q and do's D rows, in units
# Kernels over the tokens of one array (the backward preprocess, the key-major transpose).
ARRAY_TOKENS = 0
ARRAY_TOKEN_STRIDE = 1  # in units
ARRAY_HEAD_STRIDE = 2  # in units
KEY_MAJOR_PADDED = 3  # the transpose's padded tokens, in units
