"""Mutation testing: plant each plausible bug below in a copy of the repository, one at a time, run the
CPU tests meant to catch it, and report which test did (`python tests/mutation.py [--only TEXT]`).
A mutant that survives means a test is missing or too weak. tests/README.md lists the last results.
`--check` runs no test: it checks that each original text occurs exactly once in its file.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
# (what the bug is, file, original text, planted text, the pytest arguments that must catch it, split as
# a shell would); the snippets are quoted code, one mutant per line.
# ruff: noqa: E501
MUTANTS = [
 ("kernels: no lower clamp of offsets", "jagged_flash_jax/kernels/shared.py", "start = tl.minimum(tl.maximum(start, 0), num_tokens)\n    return start, tl.minimum(tl.maximum(end, start), num_tokens)", "start = tl.minimum(start, num_tokens)\n    return start, tl.minimum(tl.maximum(end, start), num_tokens)", "tests/test_memory_safety.py"),
 ("kernels: empty sequence read as length 1", "jagged_flash_jax/kernels/shared.py", "    return start, tl.minimum(tl.maximum(end, start), num_tokens)", "    return start, tl.minimum(tl.maximum(end, start + 1), num_tokens)", "tests/test_jagged_attention.py -k log_sum_exp"),
 ("kernels: int64 offsets truncated to int32", "jagged_flash_jax/kernels/shared.py", "start = tl.load(offsets_ptr + sequence).to(tl.int64)\n    end = tl.load(offsets_ptr + sequence + 1).to(tl.int64)", "start = tl.load(offsets_ptr + sequence).to(tl.int32).to(tl.int64)\n    end = tl.load(offsets_ptr + sequence + 1).to(tl.int32).to(tl.int64)", "tests/test_memory_safety.py"),
 ("kernels: causal shift reversed", "jagged_flash_jax/kernels/shared.py", "    if ALIGNED:\n        return n_k - n_q", "    if ALIGNED:\n        return n_q - n_k", "tests/test_jagged_attention.py -k interpret"),
 ("kernels: causal mask excludes the diagonal", "jagged_flash_jax/kernels/shared.py", "keep = (key_rows <= query_rows + shift) & keep", "keep = (key_rows < query_rows + shift) & keep", "tests/test_jagged_attention.py -k interpret"),
 ("kernels: window's left bound off by one", "jagged_flash_jax/kernels/shared.py", "keep = (key_rows >= query_rows + (shift - WINDOW_LEFT)) & keep", "keep = (key_rows >= query_rows + (shift - WINDOW_LEFT + 1)) & keep", "tests/test_features.py -k interpret"),
 ("kernels: window's key blocks not skipped", "jagged_flash_jax/kernels/shared.py", "        start = tl.maximum(query_start + shift - WINDOW_LEFT, 0)", "        start = n_k * 0", "tests/test_features.py -k skips"),
 ("kernels: softcap's derivative missing from dq", "jagged_flash_jax/kernels/portable/backward.py", "        ds = ds * (1.0 - t * t)", "        ds = ds * 1.0", "tests/test_features.py -k interpret"),
 ("kernels: alibi bias with the wrong sign", "jagged_flash_jax/kernels/shared.py", "x = x - slope * tl.abs(", "x = x + slope * tl.abs(", "tests/test_features.py -k interpret"),
 ("kernels: alibi distance not bottom-right aligned", "jagged_flash_jax/kernels/shared.py", "tl.abs(query_rows + shift - key_rows)", "tl.abs(query_rows - key_rows)", "tests/test_features.py -k interpret"),
 ("xla backend: the backward's probabilities not bounded by 1", "jagged_flash_jax/xla/softmax.py", "    return jnp.exp(jnp.minimum((scores - lse[..., None]) * p.scale, 0.0))", "    return jnp.exp((scores - lse[..., None]) * p.scale)", 'tests/test_adversarial_numerics.py -k "bounds_its_probabilities and xla"'),
 ("xla backend: window's right bound off by one", "jagged_flash_jax/xla/softmax.py", "keep &= distances >= -right", "keep &= distances > -right", "tests/test_features.py -k xla"),
 ("kernels: GQA maps heads to kv heads by modulo", "jagged_flash_jax/kernels/portable/forward.py", "    kv_head = head // KV_GROUP\n    if V_KEY_MAJOR:", "    kv_head = head % (NUM_HEADS // KV_GROUP)\n    if V_KEY_MAJOR:", "tests/test_jagged_attention.py -k interpret"),
 ("kernels: dk/dv sum only the first head of a group", "jagged_flash_jax/kernels/portable/backward.py", "for member in range(0, KV_GROUP):", "for member in range(0, 1):", "tests/test_jagged_attention.py -k interpret"),
 ("kernels: dv misses the output scale", "jagged_flash_jax/kernels/portable/backward.py", "dv * OUT_SCALE, kv_token_stride", "dv, kv_token_stride", "tests/test_fbgemm.py -k interpret"),
 ("kernels: queries with no key get log-sum-exp 0", "jagged_flash_jax/kernels/portable/forward.py", "lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), INF)", "lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), 0.0)", "tests/test_jagged_attention.py -k log_sum_exp"),
 ("kernels: tokens past max_seq_len not zeroed", "jagged_flash_jax/kernels/portable/fills.py", "    if end - start > MAX_LEN:", "    if end - start > MAX_LEN + (1 << 30):", "tests/test_fbgemm.py -k interpret"),
 ("kernels: tokens after the last sequence not zeroed", "jagged_flash_jax/kernels/portable/fills.py", "        _zero_rows(bases, tl.maximum(first, covered_end), last, cols, token_stride, FILL)", "        _zero_rows(bases, last, last, cols, token_stride, FILL)", "tests/test_fbgemm.py -k interpret"),
 ("kernels: malformed offsets taken as sorted", "jagged_flash_jax/kernels/portable/fills.py", "    return tl.sum(unsorted, axis=0) == 0", "    return tl.sum(unsorted, axis=0) >= 0", "tests/test_memory_safety.py -k without_overlap"),
 ("kernels: backward recomputes p without the scale", "jagged_flash_jax/kernels/portable/backward.py", "p = probability((scores - lse[:, None]) * QK_SCALE)", "p = probability(scores - lse[:, None])", "tests/test_jagged_attention.py -k interpret"),
 ("kernels: dq recomputes p unbounded (exp2, not probability)", "jagged_flash_jax/kernels/portable/backward.py", "p = probability((scores - lse[:, None]) * QK_SCALE)", "p = tl.math.exp2((scores - lse[:, None]) * QK_SCALE)", "tests/test_adversarial_numerics.py -k bounds_its_probabilities"),
 ("kernels: the backward's probabilities not bounded by 1", "jagged_flash_jax/kernels/shared.py", "    return tl.math.exp2(tl.minimum(x, 0.0, propagate_nan=tl.PropagateNan.ALL))", "    return tl.math.exp2(x)", "tests/test_adversarial_numerics.py -k bounds_its_probabilities"),
 ("kernels: the soft cap's tanh without its series (cancels far below the cap)", "jagged_flash_jax/kernels/shared.py", "    if SERIES:", "    if False:", "tests/test_features.py -k far_above"),
 ("kernels: the series left to caps above 1e30", "jagged_flash_jax/kernels/shared.py", "SERIES_CAP_LOG2 = tl.constexpr(64.0 * 1.4426950408889634)", "SERIES_CAP_LOG2 = tl.constexpr(1e30)", "tests/test_features.py -k far_above"),
 ("kernels: a NaN input's log-sum-exp taken for no key (row_sum > 0)", "jagged_flash_jax/kernels/portable/forward.py", "attended = row_sum != 0", "attended = row_sum > 0", "tests/test_lse.py -k nan_input"),
 ("kernels: the forward's tail program goes on to attend as block -1", "jagged_flash_jax/kernels/portable/forward.py", "    # register that held the offsets pointer.\n    if sequence == batch:\n        zero_uncovered((o_ptr, o_ptr), q_offsets_ptr, batch, segment, head, chunk=slot, fill_chunk=fill_chunk,\n                       layout=q_layout, MAX_LEN=Q_MAX_LEN, FILL=FILL)\n        return\n    if slot == 0:\n        zero_tail((o_ptr, o_ptr), q_offsets_ptr, sequence, segment, head, layout=q_layout, MAX_LEN=Q_MAX_LEN,\n                  FILL=FILL)\n        return\n    q_start", "    # register that held the offsets pointer.\n    if sequence == batch:\n        zero_uncovered((o_ptr, o_ptr), q_offsets_ptr, batch, segment, head, chunk=slot, fill_chunk=fill_chunk,\n                       layout=q_layout, MAX_LEN=Q_MAX_LEN, FILL=FILL)\n        return\n    if slot == 0:\n        zero_tail((o_ptr, o_ptr), q_offsets_ptr, sequence, segment, head, layout=q_layout, MAX_LEN=Q_MAX_LEN,\n                  FILL=FILL)\n    q_start", "tests/test_fbgemm.py -k interpret"),
 ("kernels: the one-axis grid maps programs to sequences with the wrong stride", "jagged_flash_jax/kernels/portable/memory.py", "        head_sequence = pid // slots", "        head_sequence = pid // (slots + 1)", "tests/test_jagged_attention.py -k grouped"),
 ("kernels: a key-major v reads the tokens before its sequence", "jagged_flash_jax/kernels/portable/memory.py", "        mask = (rows[None, :] >= first_row) & (rows[None, :] < num_rows)", "        mask = rows[None, :] < num_rows", "tests/test_jagged_attention.py -k key_major"),
 ("kernels: a key-major window attends the keys before its sequence", "jagged_flash_jax/kernels/portable/forward.py", "            keep = keep & (key_rows[None, :] >= lead)", "            keep = keep", "tests/test_jagged_attention.py -k key_major"),
 ("kernels: a key-major window ignores the segment", "jagged_flash_jax/kernels/portable/memory.py", "    first = segment.to(tl.int64) * num_tokens + seq_start", "    first = seq_start.to(tl.int64)", "tests/test_transforms.py -k vmap_equals"),
 ("kernels: a key-major query window attends the queries before its sequence", "jagged_flash_jax/kernels/portable/backward.py", "keep = (query_rows[None, :] >= lead) if QDO_KEY_MAJOR else True", "keep = (query_rows[None, :] >= 0) if QDO_KEY_MAJOR else True", "tests/test_jagged_attention.py -k key_major"),
 ("kernels: a launch of one kind of program takes its slots as pairs", "jagged_flash_jax/kernels/portable/backward.py", "        is_dq = DQ_PROGRAMS\n        block = slot\n", "        is_dq = DQ_PROGRAMS\n        block = slot // 2\n", "tests/test_fbgemm.py -k tile_sizes"),
 ("calls: bfloat16 takes a key-major v", "jagged_flash_jax/launch/calls.py", "p.input_precision == \"tf32\" and p.itemsize == 4", "p.input_precision == \"tf32\" and p.itemsize >= 2", "tests/test_launchers.py"),
 ("calls: key-major operands at any head dimension", "jagged_flash_jax/launch/calls.py", "head_block(p.head_dim) in KEY_MAJOR_HEAD_DIMS[operands]", "head_block(p.head_dim) > 0", "tests/test_launchers.py"),
 ("configs: a window's width does not key the tiles", "jagged_flash_jax/configs.py", "longest if band is None else min(longest, band)", "longest", "tests/test_launchers.py -k window"),
 ("configs: causal forwards ignore the entry's fwd_causal", "jagged_flash_jax/configs.py", "    if causal and tiles.fwd_causal is not None:", "    if False and tiles.fwd_causal is not None:", 'tests/test_launchers.py -k "fwd_causal or narrow_bands or hopper_forward"'),
 ("configs: the portable forward ignores its entry's fwd_causal", "jagged_flash_jax/configs.py", "    tiles = dataclasses.replace(_for_mask(table[key], causal), fwd_causal=None)", "    tiles = dataclasses.replace(table[key], fwd_causal=None)", 'tests/test_launchers.py -k "fwd_causal"'),
 ("tune: causal cases' forward tiles taken as fwd", "benchmarks/tune.py", "        if r.get(\"causal\") and \"fwd\" in json.loads(tiles):", "        if False and \"fwd\" in json.loads(tiles):", "tests/test_benchmarks.py -k fwd_causal"),
 ("configs: fitted key blocks grow past shared memory", "jagged_flash_jax/configs.py", "        while (fitted.block_n > c.block_n", "        while (False and fitted.block_n > c.block_n", "tests/test_launchers.py -k shared_memory"),
 ("kernels: the TMA forward loads its masked key blocks by TMA too", "jagged_flash_jax/kernels/portable/forward.py", "    BY_TMA: tl.constexpr = TMA and not MASKED", "    BY_TMA: tl.constexpr = TMA", "tests/test_jagged_attention.py -k tma_loads_read"),
 ("kernels: the TMA forward's tile rows miss the kv head", "jagged_flash_jax/kernels/portable/forward.py", "                 + kv_head.to(tl.int64) * kv_layout[2])", "                 + 0 * kv_layout[2])", "tests/test_jagged_attention.py -k tma"),
 ("implementations: the portable forward's TMA loads off Hopper GPUs", "jagged_flash_jax/implementations.py", "            self.launcher == \"gpu\" and _wgmma_reason(context.device) is None", "            self.launcher == \"gpu\"", "tests/test_launchers.py -k tma"),
 ("implementations: the portable forward's TMA loads at every head dimension", "jagged_flash_jax/implementations.py", "            and p.head_dim in configs.PORTABLE_TMA_LOADS_HEAD_DIMS)", "            )", "tests/test_launchers.py -k tma"),
 ("kernels: the TMA forward's tiles miss the offsets segment", "jagged_flash_jax/kernels/portable/forward.py", "first = ((segment.to(tl.int64) * kv_tokens + kv_start) * kv_token_stride", "first = ((kv_start) * kv_token_stride", "tests/test_transforms.py -k tma_loads"),
 ("configs: query blocks not fitted to max_seq_len", "jagged_flash_jax/configs.py", "block_m = min(c.block_m, q_rows)", "block_m = c.block_m", "tests/test_launchers.py"),
 ("kernels: the key-major transpose writes past its padded tokens", "jagged_flash_jax/kernels/portable/transpose.py", "mask=(cols[:, None] < D) & (rows[None, :] < padded - first))", "mask=(cols[:, None] < D) & (rows[None, :] < padded - first + 16))", "tests/test_memory_safety.py -k adversarial"),
 ("interpret: triton.language left patched after an interpreted run", "jagged_flash_jax/launch/interpret.py", "        _restore_language(state)\n", "\n", "tests/test_launchers.py -k triton_language"),
 ("calls: the portable dq/dk miss the output scale", "jagged_flash_jax/launch/calls.py", "OUT_SCALE=p.out_scale, DS_SCALE=p.scale * p.out_scale", "OUT_SCALE=p.out_scale, DS_SCALE=p.scale", "tests/test_fbgemm.py -k interpret"),
 ("checks: allow_tf32 inverted", "jagged_flash_jax/checks.py", 'input_precision="tf32" if allow_tf32 else "ieee", window=window', 'input_precision="ieee" if allow_tf32 else "tf32", window=window', "tests/test_launchers.py"),
 ("calls: the portable log-sum-exp stored in the input dtype", "jagged_flash_jax/launch/calls.py", "jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),\n        params=dict(params, fill_chunk", "jax.ShapeDtypeStruct(p.stats_shape, q.dtype)),\n        params=dict(params, fill_chunk", "tests/test_transforms.py -k residual"),
 ("transforms: HTD folds batched offsets into heads", "jagged_flash_jax/transforms.py", 'self.into_heads = p.layout == "HTD" and not per_row', 'self.into_heads = p.layout == "HTD"', "tests/test_transforms.py -k vmap"),
 ("transforms: outputs not marked varying (shard_map)", "jagged_flash_jax/transforms.py", "    axes = frozenset().union(*(varying_axes(x) for x in inputs))", "    axes = frozenset()", "tests/test_transforms.py -k shard_map"),
 ("transforms: head-dimension sharding accepted", "jagged_flash_jax/transforms.py", "            if axes[2]:", "            if False:", "tests/test_transforms.py -k unsupported"),
 ("api: kv_max_seq_len ignored", "jagged_flash_jax/api.py", "kv_max_seq_len = (max_seq_len if kv_max_seq_len is None", "kv_max_seq_len = (max_seq_len if True", "tests/test_jagged_attention.py -k xla"),
 ("checks: default scale 1/D", "jagged_flash_jax/checks.py", "        return 1.0 / math.sqrt(head_dim)", "        return 1.0 / head_dim", "tests/test_jagged_attention.py -k xla"),
 ("xla backend: causal without the bottom-right shift", "jagged_flash_jax/xla/softmax.py", "keep &= key_rows[:, None, :] <= query_rows[:, :, None] + (n_k - n_q)[:, None, None]", "keep &= key_rows[:, None, :] <= query_rows[:, :, None]", "tests/test_jagged_attention.py -k xla"),
 ("api: the log-sum-exp's gradient enters delta with the wrong sign", "jagged_flash_jax/_util.py", "    return jnp.where(lse < jnp.inf, dlse, 0.0) * (1.0 / ds_scale)", "    return jnp.where(lse < jnp.inf, dlse, 0.0) * (-1.0 / ds_scale)", "tests/test_lse.py -k float64"),
 ("api: the returned log-sum-exp keeps the rows no query attends", "jagged_flash_jax/api.py", "    keep = attended[:, None, :] & (lse != jnp.inf)", "    keep = lse != jnp.inf", "tests/test_lse.py -k unwritten"),
 ("jagged: packed offsets not made local", "jagged_flash_jax/jagged.py", "own = offsets[bounds[s]:bounds[s + 1] + 1] - firsts[s]", "own = offsets[bounds[s]:bounds[s + 1] + 1]", "tests/test_api.py -k pack"),
 ("gpu launcher: num_warps dropped", "jagged_flash_jax/launch/gpu.py", "        num_warps=call.num_warps, num_stages=call.num_stages,", "        num_stages=call.num_stages,", "tests/test_launchers.py"),
 ("select: $JAGGED_FLASH_JAX_FORWARD=portable keeps the Hopper kernels", "jagged_flash_jax/select.py", 'kept = tuple(c for c in candidates if not c.hopper) if choice == "portable" else candidates', "kept = candidates", "tests/test_launchers.py -k environment_chooses"),
 ("implementations: the Hopper kernels take several offsets segments", "jagged_flash_jax/implementations.py", "    if p.num_segments != 1:", "    if p.num_segments < 1:", 'tests/test_launchers.py -k "keeps_what_the_hopper or one_segment"'),
 ("implementations: the portable kernels ignore the grid's limit", "jagged_flash_jax/implementations.py", "return _kernels_reason(p) or calls.grid_error(p, config.tiles)", "return _kernels_reason(p)", "tests/test_api.py -k bad_input"),
 ("hstu: the targets' ids clamped one past the history's end", "jagged_flash_jax/xla/hstu.py", "return jnp.minimum(pos, max_id[..., None]) if num_targets is not None else pos", "return jnp.minimum(pos, max_id[..., None] + 1) if num_targets is not None else pos", "tests/test_hstu.py -k mask_anchors"),
 ("hstu: the contextual rows do not see the history", "jagged_flash_jax/xla/hstu.py", "    if contextual_seq_len > 0:\n        valid |= (row == 0) & (col < max_id)", "    if contextual_seq_len < 0:\n        valid |= (row == 0) & (col < max_id)", 'tests/test_hstu.py -k "mask_anchors or matches_float64"'),
 ("hstu xla backend: relu for silu in the forward", "jagged_flash_jax/xla/hstu.py", "side.tokens, key_tokens), u * sig, 0.0)", "side.tokens, key_tokens), jnp.maximum(u, 0.0), 0.0)", 'tests/test_hstu.py -k "matches_float64 and xla"'),
 ("hstu xla backend: dq takes sigmoid for the derivative of silu", "jagged_flash_jax/xla/hstu.py", "du = jnp.where(keep, dp * sig * (1 + u * (1 - sig)), 0.0)", "du = jnp.where(keep, dp * sig, 0.0)", 'tests/test_hstu.py -k "matches_float64 and xla"'),
 ("hstu: the per-token scale's gradient takes the first head's share only", "jagged_flash_jax/hstu.py", "dscale = dscale.sum(axis=1).reshape(-1)", "dscale = dscale[:, 0].reshape(-1)", "tests/test_hstu.py -k attn_scale"),
 ("hstu hopper: the backward's dO descriptor of D columns, not V", "jagged_flash_jax/launch/hstu.py", "do=(dkdv.block_m, p.value_dim)", "do=(dkdv.block_m, p.head_dim)", "tests/test_launchers.py -k hstu_hopper_backward"),
 ("hstu hopper: the Hopper backward where its kernels cannot take the problem", "jagged_flash_jax/implementations.py", "if self._hopper_reason(p, context, hopper) is None:", "if self._hopper_reason(p, context, hopper) is not None:", "tests/test_launchers.py -k hstu_hopper"),
 ("checks: max_seq_len=True accepted", "jagged_flash_jax/checks.py", "    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):", "    if not isinstance(value, (int, np.integer)):", "tests/test_api.py"),
 ("implementations: the dq-fused backward on D = 256's 64-key blocks", "jagged_flash_jax/implementations.py", "        if config.fused_dq and config.tiles.dkdv.block_n != 128:", "        if config.fused_dq and config.tiles.dkdv.block_n < 64:", "tests/test_launchers.py -k d256"),
 ("configs: auto leaves D = 256 on the portable backward", "jagged_flash_jax/configs.py", "HOPPER_BACKWARD_AUTO_HEAD_DIMS = (64, 128, 256)", "HOPPER_BACKWARD_AUTO_HEAD_DIMS = (64, 128)", "tests/test_launchers.py -k environment_chooses"),
 ("configs: auto leaves D = 64 on the portable backward", "jagged_flash_jax/configs.py", "HOPPER_BACKWARD_AUTO_HEAD_DIMS = (64, 128, 256)", "HOPPER_BACKWARD_AUTO_HEAD_DIMS = (128, 256)", "tests/test_launchers.py -k environment_chooses"),
 ("select: deterministic=False leaves the dq-fused backward out", "jagged_flash_jax/select.py", "    if not deterministic and fused is not None", "    if False and fused is not None", "tests/test_launchers.py -k deterministic"),
 ("implementations: deterministic=False fuses dq at every length", "jagged_flash_jax/implementations.py", "            if longest < (shortest := FUSED_DQ_MIN_LENGTH[p.head_dim]):", "            if longest < (shortest := 0):", "tests/test_launchers.py -k deterministic"),
 ("kernels: dk/dv at D = 64 reads K from shared memory at every tile, not its registers", "jagged_flash_jax/kernels/hopper/dkdv.py", "st_tok = warpgroup_mma(k_op, q.permute((1, 0))", "st_tok = warpgroup_mma(k, q.permute((1, 0))", 'tests/test_hopper.py -k "own_operand_from_registers"'),
 ("kernels: D = 256's P^T and dS^T tiles once per ring slot (past shared memory)", "jagged_flash_jax/kernels/hopper/dkdv.py", "        pds_smem = gl.allocate_shared_memory(dtype, [4, CONSUMER_ROWS, BLOCK_M // 2], half_layout)", "        pds_smem = gl.allocate_shared_memory(dtype, [4 * STAGES, CONSUMER_ROWS, BLOCK_M // 2], half_layout)", 'tests/test_hopper.py -k "backward_compiles_for_sm90a and 256"'),
 ("launch: the Hopper kernels take the shortest sequences first", "jagged_flash_jax/launch/calls.py", "    return jnp.argsort(-work, stable=True).astype(jnp.int32)", "    return jnp.argsort(work, stable=True).astype(jnp.int32)", "tests/test_launchers.py -k longest_sequences_first"),
 ("launch: the sequences' work counts their queries only", "jagged_flash_jax/launch/calls.py", "    work = n_q.astype(jnp.float32) * n_k.astype(jnp.float32)", "    work = n_q.astype(jnp.float32)", "tests/test_launchers.py -k longest_sequences_first"),
 ("implementations: Hopper's longest_first not passed on", "jagged_flash_jax/implementations.py", "fused_dq=backward and self.fused_dq, longest_first=self.longest_first)", "fused_dq=backward and self.fused_dq)", "tests/test_launchers.py -k sequences_order"),
 ("launch: the Hopper kernels never read the order asked for", "jagged_flash_jax/launch/calls.py", "PRODUCER_REGS=HOPPER_PRODUCER_REGS, ORDERED=config.longest_first),", "PRODUCER_REGS=HOPPER_PRODUCER_REGS, ORDERED=False),", "tests/test_launchers.py -k hopper_launch_zeroes_its_own_outputs"),
 ("launch: the Hopper kernels take the sequences in the offsets' order", "jagged_flash_jax/launch/calls.py", "    if not config.longest_first:\n        return no_order()", "    if True:\n        return no_order()", "tests/test_launchers.py -k longest_sequences_first"),
 ("launch: HSTU's Hopper kernels take the sequences in the offsets' order", "jagged_flash_jax/launch/hstu.py", "    if not longest_first:\n        return calls.no_order()", "    if True:\n        return calls.no_order()", "tests/test_launchers.py -k hstu_hopper_kernels_take"),
 ("implementations: HstuHopper's longest_first not passed on to the backward", "jagged_flash_jax/implementations.py", "                                                      longest_first=self.longest_first)", "                                                      )", "tests/test_launchers.py -k hstu_hopper_implementation_sets"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="run the mutants whose description contains this")
    parser.add_argument("--check", action="store_true",
                        help="only check that each mutant's original text occurs exactly once in its file")
    args = parser.parse_args()
    if args.check:
        wrong = [(name, path, (REPO / path).read_text().count(old) if (REPO / path).exists() else 0)
                 for name, path, old, _, _ in MUTANTS]
        for name, path, count in wrong:
            if count != 1:
                print(f"{count} times  {name}: {path}")
        return 1 if any(count != 1 for _, _, count in wrong) else 0
    survivors = 0
    for name, path, old, new, tests in MUTANTS:
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(tmp) / "repo"
            shutil.copytree(REPO, work, ignore=shutil.ignore_patterns(
                ".git", ".venv", ".ci-venv", ".whl", ".probe", "__pycache__", ".hypothesis"))
            source = (work / path).read_text()
            if old not in source:
                print(f"NOT APPLIED  {name}: the original text is gone from {path}")
                survivors += 1
                continue
            (work / path).write_text(source.replace(old, new, 1))
            start = time.time()
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                  "-o", "addopts=-ra -n 2", *shlex.split(tests)], cwd=work, capture_output=True,
                                 text=True, env={**__import__("os").environ, "PYTHONPATH": str(work)})
            failed = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("FAILED")]
            caught = run.returncode != 0 and failed
            survivors += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'} {name}: {failed[0] if failed else ''} "
                  f"({time.time() - start:.0f} s)", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
