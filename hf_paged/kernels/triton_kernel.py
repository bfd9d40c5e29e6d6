"""The Triton kernel of `kernels.triton` (imports triton: imported only when a call runs; see that module)."""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _dequantize(rows, dims, stride_dim, mask, QUANT_BITS: tl.constexpr):
    """Codes of quantized pages as fp32 (before the scale): int8 codes, or int4 codes two a byte (low nibble
    first, stored as code + 8)."""
    if QUANT_BITS == 8:
        return tl.load(rows + dims * stride_dim, mask=mask, other=0).to(tl.float32)
    packed = tl.load(rows + (dims // 2) * stride_dim, mask=mask, other=0x88).to(tl.int32)  # masked: codes 0
    nibble = tl.where(dims % 2 == 0, packed & 15, packed >> 4)
    return (nibble - 8).to(tl.float32)


@triton.jit
def _load_kv(rows, dims, stride_dim, mask, scales, scale_mask, QUANT_BITS: tl.constexpr):
    """A tile of K (or V) as the pages hold it: in the storage dtype, or quantized codes times their scales (`scales`
    and `scale_mask` broadcast against `rows`), in fp32."""
    if QUANT_BITS == 0:  # both branches return: compiled Triton needs one return type per branch, not a fallthrough
        tile = tl.load(rows + dims * stride_dim, mask=mask, other=0.0)
    else:
        scale = tl.load(scales, mask=scale_mask, other=0.0).to(tl.float32)
        tile = _dequantize(rows, dims, stride_dim, mask, QUANT_BITS) * scale
    return tile


@triton.jit
def _channel_scores(
    q, q_plain, key_ptr, key_params_ptr, stage_ptr, staging_ptr, block, slot, kv_head, offs_d, key_valid, dim_valid,
    k_stride_block, k_stride_slot, k_stride_head, k_stride_dim, kp_stride_block, kp_stride_head, kp_stride_two,
    kp_stride_dim, stage_stride, st_stride_block, st_stride_token, st_stride_head, st_stride_dim,
    STAGING_TOKENS: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Logits of a tile over keys quantized per channel (`kv_dtype="int4-channel"`): a full block's keys are 4-bit
    codes times their channel's step plus its minimum (rotated space, against `q`); an open block's keys are read
    exactly from its companions' rows (against `q_plain`)."""
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
    full_mask = full[None, :] & dim_valid[:, None]
    packed = tl.load(
        key_ptr
        + block[None, :] * k_stride_block
        + slot[None, :] * k_stride_slot
        + kv_head * k_stride_head
        + (offs_d[:, None] // 2) * k_stride_dim,
        mask=full_mask,
        other=0,
    ).to(tl.int32)
    nibble = tl.where(offs_d[:, None] % 2 == 0, packed & 15, packed >> 4).to(tl.float32)
    params = (
        key_params_ptr + block[None, :] * kp_stride_block + kv_head * kp_stride_head + offs_d[:, None] * kp_stride_dim
    )
    step = tl.load(params, mask=full_mask, other=0.0).to(tl.float32)
    low = tl.load(params + kp_stride_two, mask=full_mask, other=0.0).to(tl.float32)
    k = nibble * step + low  # 0 where the key is open or not read
    if DOT_FP32:
        s = tl.dot(q, k, input_precision="ieee") + tl.dot(q_plain, plain.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k.to(q.dtype)) + tl.dot(q_plain, plain.to(q.dtype))
    return s


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
    query_index = local_tile * BLOCK_Q + offs_m // GROUP  # the row's query of each tile row
    head = kv_head * GROUP + offs_m % GROUP
    query_valid = (offs_m // GROUP < BLOCK_Q) & (query_index < num_queries)
    dim_valid = offs_d < HEAD_DIM
    position = context + query_index  # of each query in its row
    query_at = (row_start + query_index)[:, None] * q_stride_token + head[:, None] * q_stride_head
    query_at += offs_d[None, :] * q_stride_dim
    query_mask = query_valid[:, None] & dim_valid[None, :]
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
        scale_at = block * s_stride_block + slot * s_stride_slot + kv_head * s_stride_head  # quantized pages only
        if CHANNEL_KEYS:
            s = _channel_scores(
                q, q_plain, key_ptr, key_params_ptr, stage_ptr, staging_ptr, block, slot, kv_head, offs_d,
                key_valid, dim_valid, k_stride_block, k_stride_slot, k_stride_head, k_stride_dim, kp_stride_block,
                kp_stride_head, kp_stride_two, kp_stride_dim, stage_stride, st_stride_block, st_stride_token,
                st_stride_head, st_stride_dim, STAGING_TOKENS, DOT_FP32,
            )  # fmt: skip
        else:
            k = _load_kv(
                key_ptr + block[None, :] * k_stride_block + slot[None, :] * k_stride_slot + kv_head * k_stride_head,
                offs_d[:, None],
                k_stride_dim,
                key_valid[None, :] & dim_valid[:, None],
                key_scales_ptr + scale_at[None, :],
                key_valid[None, :],
                QUANT_BITS,
            )  # [HEAD_DIM_PADDED, TILE_N]
            if not DOT_FP32:
                k = k.to(query_ptr.dtype.element_ty)  # dequantized codes to the tensor cores' half precision
            if DOT_FP32:
                s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k)
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
        v = _load_kv(
            value_ptr + block[:, None] * v_stride_block + slot[:, None] * v_stride_slot + kv_head * v_stride_head,
            offs_d[None, :],
            v_stride_dim,
            key_valid[:, None] & dim_valid[None, :],
            value_scales_ptr + scale_at[:, None],
            key_valid[:, None],
            QUANT_BITS,
        )  # [TILE_N, HEAD_DIM_PADDED]
        if not DOT_FP32:
            v = v.to(query_ptr.dtype.element_ty)
        if DOT_FP32:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + (row_start + query_index)[:, None] * o_stride_token
        + head[:, None] * o_stride_head
        + offs_d[None, :] * o_stride_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=query_valid[:, None] & dim_valid[None, :],
    )
