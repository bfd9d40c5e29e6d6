"""The Triton kernel of `kernels.triton` (imports triton: imported only when a call runs; see that module)."""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _dot(a, b, like, DOT_FP32: tl.constexpr):
    """`a @ b` in fp32: fp32 products (`input_precision="ieee"`, no TF32), else both operands in `like`'s half
    precision on the tensor cores, accumulated in fp32 (codes of -127..127 convert to fp16/bf16 exactly)."""
    if DOT_FP32:  # both branches return: compiled Triton needs one return type per branch, not a fallthrough
        products = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        products = tl.dot(a.to(like.dtype), b.to(like.dtype))
    return products


@triton.jit
def _nibbles(at, mask, SIGNED: tl.constexpr):
    """4-bit codes two a byte, each byte loaded once (contiguous bytes load as vectors): the low nibbles (even
    channels) and the high nibbles (odd channels) as int32, `code - 8` where `SIGNED` (`"int4"`: stored as code +
    8), else `0..15` (keys per channel)."""
    packed = tl.load(at, mask=mask, other=0).to(tl.int32)
    low = packed & 15
    high = (packed >> 4) & 15
    if SIGNED:
        low = low - 8
        high = high - 8
    return low, high


@triton.jit
def _channel_scores(
    q_low, q_high, q_plain, key_ptr, key_rows, key_params_ptr, stage_ptr, staging_ptr, block, slot, kv_head, offs_d,
    offs_h, key_valid, dim_valid, half_valid, k_stride_dim, kp_stride_block, kp_stride_head, kp_stride_two,
    kp_stride_dim, stage_stride, st_stride_block, st_stride_token, st_stride_head, st_stride_dim,
    STAGING_TOKENS: tl.constexpr, DOT_FP32: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_DIM_PADDED: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """Logits of a tile over keys quantized per channel (`kv_dtype="int4-channel"`): a full block's keys are 4-bit
    codes times their channel's step plus its minimum (rotated space, against the rotated query's even and odd
    channels, `q_low` and `q_high`); an open block's keys are read exactly from its companions' rows (against
    `q_plain`). `key_rows`: where each key's codes start (block, slot and head)."""
    first_companion = tl.load(stage_ptr + block * stage_stride, mask=key_valid, other=-1)
    staged = key_valid & (first_companion >= 0)
    full = key_valid & (first_companion < 0)
    companion = tl.load(stage_ptr + block * stage_stride + slot // STAGING_TOKENS, mask=staged, other=0)
    plain = tl.load(
        staging_ptr
        + companion[None, :] * st_stride_block
        + (slot % STAGING_TOKENS)[None, :] * st_stride_token
        + kv_head * st_stride_head
        + offs_d[:, None] * st_stride_dim,
        mask=staged[None, :] & dim_valid[:, None],
        other=0.0,
    )  # [HEAD_DIM_PADDED, TILE_N]
    # full blocks' keys token by token ([TILE_N, HALF_DIM_PADDED]: contiguous bytes and channel parameters)
    full_mask = full[:, None] & half_valid[None, :]
    low, high = _nibbles(key_ptr + key_rows[:, None] + offs_h[None, :] * k_stride_dim, full_mask, False)
    channels = tl.arange(0, 2 * HALF_DIM_PADDED)  # loaded side by side, then split into even and odd
    params = (
        key_params_ptr
        + (block * kp_stride_block + kv_head * kp_stride_head)[:, None]
        + channels[None, :] * kp_stride_dim
    )  # [TILE_N, 2 * HALF_DIM_PADDED]: steps; their minimums kp_stride_two further
    params_mask = full[:, None] & (channels < HEAD_DIM)[None, :]
    steps = tl.load(params, mask=params_mask, other=0.0).to(tl.float32)
    step_low, step_high = tl.split(tl.reshape(steps, [TILE_N, HALF_DIM_PADDED, 2]))
    minimums = tl.load(params + kp_stride_two, mask=params_mask, other=0.0).to(tl.float32)
    min_low, min_high = tl.split(tl.reshape(minimums, [TILE_N, HALF_DIM_PADDED, 2]))
    k_low = low.to(tl.float32) * step_low + min_low  # 0 where the key is open or not read
    k_high = high.to(tl.float32) * step_high + min_high
    return (
        _dot(q_low, tl.trans(k_low), q_low, DOT_FP32)
        + _dot(q_high, tl.trans(k_high), q_low, DOT_FP32)
        + _dot(q_plain, plain, q_low, DOT_FP32)
    )


@triton.jit
def paged_attention_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    sinks_ptr,
    key_scales_ptr,
    value_scales_ptr,
    num_rows,
    scale,
    window,
    softcap,
    q_stride_token,
    q_stride_head,
    q_stride_dim,
    o_stride_token,
    o_stride_head,
    o_stride_dim,
    k_stride_block,
    k_stride_slot,
    k_stride_head,
    k_stride_dim,
    v_stride_block,
    v_stride_slot,
    v_stride_head,
    v_stride_dim,
    table_stride,
    s_stride_block,
    s_stride_slot,
    s_stride_head,
    key_params_ptr,  # keys per channel only (else unused): bf16 [blocks, kv_heads, 2, head_dim] steps, minimums
    kp_stride_block,
    kp_stride_head,
    kp_stride_two,
    kp_stride_dim,
    stage_ptr,  # int32 [blocks, stage_stride]: an open block's companion blocks (-1 first: none)
    stage_stride,
    staging_ptr,  # companions' rows as [blocks, STAGING_TOKENS, kv_heads, head_dim] keys in the query's dtype
    st_stride_block,
    st_stride_token,
    st_stride_head,
    st_stride_dim,
    query_plain_ptr,  # the query before its rotation, laid out as the query
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT_BITS: tl.constexpr,
    CHANNEL_KEYS: tl.constexpr,
    STAGING_TOKENS: tl.constexpr,
    HALF_DIM_PADDED: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the row whose query tiles hold `tile`: row r's tiles start at query_start[r] // BLOCK_Q + r
    low = 0
    high = num_rows
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    row = low - 1
    row_start = tl.load(query_start_ptr + row)
    num_queries = tl.load(query_start_ptr + row + 1) - row_start
    local_tile = tile - (row_start // BLOCK_Q + row)
    if local_tile * BLOCK_Q >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - num_queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_h = tl.arange(0, HALF_DIM_PADDED)  # 4-bit pages: byte h holds channels 2h (low nibble) and 2h + 1
    query_index = local_tile * BLOCK_Q + offs_m // GROUP  # the row's query of each tile row
    head = kv_head * GROUP + offs_m % GROUP
    query_valid = (offs_m // GROUP < BLOCK_Q) & (query_index < num_queries)
    dim_valid = offs_d < HEAD_DIM
    half_valid = offs_h < (HEAD_DIM + 1) // 2
    even_valid = query_valid[:, None] & (2 * offs_h < HEAD_DIM)[None, :]
    odd_valid = query_valid[:, None] & (2 * offs_h + 1 < HEAD_DIM)[None, :]
    position = context + query_index  # of each query in its row
    query_row = (row_start + query_index)[:, None] * q_stride_token + head[:, None] * q_stride_head
    query_at = query_row + offs_d[None, :] * q_stride_dim
    query_mask = query_valid[:, None] & dim_valid[None, :]
    if QUANT_BITS == 4:  # the query's even and odd channels meet the codes' low and high nibbles
        q = tl.load(query_ptr + query_row + (2 * offs_h)[None, :] * q_stride_dim, mask=even_valid, other=0.0)
        q_high = tl.load(query_ptr + query_row + (2 * offs_h + 1)[None, :] * q_stride_dim, mask=odd_valid, other=0.0)
        if DOT_FP32:
            q_high = q_high.to(tl.float32)
    else:
        q = tl.load(query_ptr + query_at, mask=query_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if CHANNEL_KEYS:  # open blocks' keys are exact and not rotated: they meet the query as it is
        q_plain = tl.load(query_plain_ptr + query_at, mask=query_mask, other=0.0)
        if DOT_FP32:
            q_plain = q_plain.to(tl.float32)

    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=query_valid, other=float("-inf")).to(tl.float32)
        l_i = tl.where(query_valid, 1.0, 0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if QUANT_BITS == 4:  # the output's even channels (`acc`) and odd channels
        acc = tl.zeros([BLOCK_M, HALF_DIM_PADDED], dtype=tl.float32)
        acc_high = tl.zeros([BLOCK_M, HALF_DIM_PADDED], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # keys this tile's queries can see: up to its last query's position, from its first query's window on
    last_query = tl.minimum((local_tile + 1) * BLOCK_Q, num_queries) - 1
    key_end = context + last_query + 1
    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(context + local_tile * BLOCK_Q - window + 1, 0)
    offs_n = tl.arange(0, TILE_N)
    table = tables_ptr + row * table_stride
    for first_key in range((key_begin // TILE_N) * TILE_N, key_end, TILE_N):
        key_position = first_key + offs_n
        key_valid = (key_position >= key_begin) & (key_position < key_end)  # never a skipped block
        block = tl.load(table + key_position // BLOCK_SIZE, mask=key_valid, other=0)
        slot = key_position % BLOCK_SIZE
        # quantized pages: codes as loaded, their per-token scales applied to the logits and to the probabilities
        # (a [TILE_N] vector each) instead of to every loaded element
        scale_at = block * s_stride_block + slot * s_stride_slot + kv_head * s_stride_head
        key_rows = block * k_stride_block + slot * k_stride_slot + kv_head * k_stride_head
        if CHANNEL_KEYS:
            s = _channel_scores(
                q, q_high, q_plain, key_ptr, key_rows, key_params_ptr, stage_ptr, staging_ptr, block, slot, kv_head,
                offs_d, offs_h, key_valid, dim_valid, half_valid, k_stride_dim, kp_stride_block, kp_stride_head,
                kp_stride_two, kp_stride_dim, stage_stride, st_stride_block, st_stride_token, st_stride_head,
                st_stride_dim, STAGING_TOKENS, DOT_FP32, HEAD_DIM, HALF_DIM_PADDED, TILE_N,
            )  # fmt: skip
        elif QUANT_BITS == 4:
            codes_low, codes_high = _nibbles(
                key_ptr + key_rows[None, :] + offs_h[:, None] * k_stride_dim,
                key_valid[None, :] & half_valid[:, None],
                True,
            )  # [HALF_DIM_PADDED, TILE_N]
            s = _dot(q, codes_low, q, DOT_FP32) + _dot(q_high, codes_high, q, DOT_FP32)
        else:
            k = tl.load(
                key_ptr + key_rows[None, :] + offs_d[:, None] * k_stride_dim,
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0,
            )  # [HEAD_DIM_PADDED, TILE_N]
            s = _dot(q, k, q, DOT_FP32)
        if QUANT_BITS != 0 and not CHANNEL_KEYS:  # each key's scale taken into its logit
            s = s * tl.load(key_scales_ptr + scale_at, mask=key_valid, other=0.0).to(tl.float32)[None, :]
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = query_valid[:, None] & key_valid[None, :] & (key_position[None, :] <= position[:, None])
        if USE_WINDOW:
            visible = visible & (position[:, None] - key_position[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a tile row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        value_rows = block * v_stride_block + slot * v_stride_slot + kv_head * v_stride_head
        if QUANT_BITS != 0:  # each key's value scale taken into its probability
            p = p * tl.load(value_scales_ptr + scale_at, mask=key_valid, other=0.0).to(tl.float32)[None, :]
        if QUANT_BITS == 4:
            acc_high = acc_high * alpha[:, None]
            codes_low, codes_high = _nibbles(
                value_ptr + value_rows[:, None] + offs_h[None, :] * v_stride_dim,
                key_valid[:, None] & half_valid[None, :],
                True,
            )  # [TILE_N, HALF_DIM_PADDED]
            acc += _dot(p, codes_low, q, DOT_FP32)
            acc_high += _dot(p, codes_high, q, DOT_FP32)
        else:
            v = tl.load(
                value_ptr + value_rows[:, None] + offs_d[None, :] * v_stride_dim,
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0,
            )  # [TILE_N, HEAD_DIM_PADDED]
            acc += _dot(p, v, q, DOT_FP32)
        m_i = m_new

    denominator = tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_row = out_ptr + (row_start + query_index)[:, None] * o_stride_token + head[:, None] * o_stride_head
    if QUANT_BITS == 4:
        tl.store(out_row + (2 * offs_h)[None, :] * o_stride_dim, (acc / denominator).to(out_ptr.dtype.element_ty),
                 mask=even_valid)  # fmt: skip
        tl.store(out_row + (2 * offs_h + 1)[None, :] * o_stride_dim,
                 (acc_high / denominator).to(out_ptr.dtype.element_ty), mask=odd_valid)  # fmt: skip
    else:
        tl.store(out_row + offs_d[None, :] * o_stride_dim, (acc / denominator).to(out_ptr.dtype.element_ty),
                 mask=query_valid[:, None] & dim_valid[None, :])  # fmt: skip
