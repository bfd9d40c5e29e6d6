// Paged attention on the CPU, reading K/V through block tables where the blocks lie (no dense copy).
//
// One call covers decode steps (one query per row), prefill chunks and mixed packed steps: row r's queries are
// query[q_start[r] .. q_start[r + 1]), the last tokens of its seq_lens[r] tokens, causal (query i of a row with n
// queries sits at position seq_len - n + i). Grouped-query attention (query head h reads KV head h / (Hq / Hkv)),
// a sliding window (a query at p sees keys k with p - k < window), logit soft-capping and attention sinks (one logit
// per query head that takes softmax mass and has no value). Softmax is online, in fp32, a block at a time.
//
// Work is split into items (row, KV head, query tile, key split), run in parallel with OpenMP on at most one thread
// per min_work_per_thread query-vector x key products; an item loads each K/V row of its range once, as fp32, for all
// the query heads of its KV head: four keys' dot products with a query vector run side by side (independent sums;
// with AVX-512, the four vectors of partial sums are added across their lanes together; in a block that every query
// vector sees whole, they are the logits as they stand), and each query vector's output accumulates a block's weighted
// values in registers (with AVX-512, up to four query vectors at a time, each value row loaded once for them: a KV
// head's three query vectors together, not one after another). Rows with few items (a small decode batch) split
// their keys; the splits are merged with their log-sum-exp. Plain C ABI (called through ctypes): no torch headers,
// so it builds in about a second.
//
// Quantized pages (hf_paged.kv_format): K/V held as int8 codes, or int4 codes two a byte (low nibble first, stored
// as code + 8), with a bfloat16 scale per token and KV head; a row is dequantized as code * scale in fp32 as it is
// loaded, so nothing but the codes and scales is read.
//
// Keys per channel (kv_dtype="int4-channel", hf_paged.channel_keys): values as int4 above; a full block's keys as
// 4-bit codes 0..15 with a bfloat16 step and minimum per channel of the block and KV head (code * step + minimum),
// read against the rotated query; an open block's keys exact, in the query's dtype, in the rows of its companion
// blocks (stage_tables names them), read against the query before its rotation.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Params {
  const void* query;      // [tokens, q_heads, head_dim], head_dim contiguous
  const void* key_cache;  // [blocks, block_size, kv_heads, head_dim] (quantized: code bytes), last dim contiguous
  const void* value_cache;
  const uint16_t* key_scales;    // quantized pages: bfloat16 [blocks, block_size, kv_heads]; else null
  const uint16_t* value_scales;
  void* out;              // [tokens, q_heads, head_dim], head_dim contiguous
  const int32_t* block_tables;  // [rows, table_stride]
  const int32_t* seq_lens;      // [rows]
  const int32_t* query_start;   // [rows + 1]
  const float* sinks;           // [q_heads] or null
  int64_t table_stride;
  int64_t q_stride_token, q_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;  // in elements of the stored type (codes: bytes)
  int64_t scale_stride_block, scale_stride_token, scale_stride_head;
  int32_t num_rows, num_q_heads, num_kv_heads, head_dim, block_size;
  int32_t window;  // 0: no window
  float scale;
  float softcap;   // 0: none
  int32_t num_threads;
  int32_t query_tile;  // queries of a row per item
  int32_t min_split_keys;  // a key split holds at least this many keys
  int64_t min_work_per_thread;  // query-vector x key products worth a thread of their own
  // keys per channel (kv_format 3) only, else null / 0:
  const uint16_t* key_params;   // bfloat16 [blocks, kv_heads, 2, head_dim]: each channel's step, then minimum
  int64_t kp_stride_block, kp_stride_head;
  const int32_t* stage_tables;  // [blocks, stage_stride]: an open block's companion blocks (-1 first: none)
  int64_t stage_stride;
  const void* staging;          // a companion's row as [staging_tokens, kv_heads, head_dim] keys in the query's type
  int64_t st_stride_block, st_stride_token, st_stride_head;
  int32_t staging_tokens;
  const void* query_plain;      // the query before its rotation (open blocks' keys are not rotated); query's strides
};

struct Item {
  int32_t row, kv_head, q_begin, q_end, k_begin, k_end, slot;  // slot: partial-result index, -1 = write out
};

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits, bool is_bf16) {
  if (is_bf16) {
    uint32_t word = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &word, sizeof f);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

template <typename T>
struct Scalar;
template <>
struct Scalar<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
};
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
template <>
struct Scalar<BF16> {
  static inline float load(const BF16* p, int64_t i) { return to_float(p[i].bits, true); }
  static inline void store(BF16* p, int64_t i, float v) {
    uint32_t word;
    std::memcpy(&word, &v, sizeof word);
    if ((word & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
      p[i].bits = static_cast<uint16_t>((word >> 16) | 0x40u);
      return;
    }
    word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest even, as torch does
    p[i].bits = static_cast<uint16_t>(word >> 16);
  }
};
template <>
struct Scalar<F16> {
  static inline float load(const F16* p, int64_t i) { return to_float(p[i].bits, false); }
  static inline void store(F16* p, int64_t i, float v) {
    _Float16 h = static_cast<_Float16>(v);
    std::memcpy(&p[i].bits, &h, sizeof h);
  }
};

// exp(x) for x <= 0 (arguments here are logit - running max): Cody-Waite range reduction and a degree-6
// polynomial, within 2 ulp of expf. Its constants, shared by the scalar and the 16-lane form:
constexpr float kExpFloor = -87.0f;                                // below it exp underflows
constexpr float kLog2e = 1.44269504088896341f;                     // 1 / ln 2
constexpr float kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;  // ln 2 = kLn2High - kLn2Low
constexpr int kExpTerms = 6;
constexpr float kExpPolynomial[kExpTerms] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                             4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = x < kExpFloor ? kExpFloor : x;
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2High + n * kLn2Low;
  float p = kExpPolynomial[0];
  for (int i = 1; i < kExpTerms; ++i) p = p * r + kExpPolynomial[i];
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, step for step (the portable softmax loop stays scalar: GCC's `omp simd` reduction
// privatises its sum with a memset that the vectoriser gives up on)
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 reduced = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), reduced);
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}

// The lanes of a 16-wide chunk starting at j that hold one of n values.
inline __mmask16 lanes_from(int j, int n) {
  return n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
}

// The largest of s[0 .. n - 1] (-inf for none).
inline float block_max16(const float* s, int n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < n; j += 16) {
    const __mmask16 lanes = lanes_from(j, n);  // masked loads: nothing is read past s[n - 1]
    best = _mm512_mask_max_ps(best, lanes, best, _mm512_maskz_loadu_ps(lanes, s + j));
  }
  return _mm512_reduce_max_ps(best);
}

// s[j] = exp(s[j] - max) (0 where s[j] is -inf, a key the query does not see), returning their sum.
inline float exp_block16(float* s, int n, float max) {
  const __m512 max_v = _mm512_set1_ps(max), hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 lanes = lanes_from(j, n);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + j);
    const __mmask16 seen = _mm512_mask_cmp_ps_mask(lanes, x, hidden, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive16(_mm512_sub_ps(x, max_v)));
    _mm512_mask_storeu_ps(s + j, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// Online-softmax state of one query vector.
struct State {
  float max, sum;
};

// Quantized storage types: int8 codes, and int4 codes two a byte.
struct Q8 {
  int8_t code;
};
struct Q4 {
  uint8_t codes;
};

// One key or value row as fp32: the row itself for fp32 storage, else converted (or dequantized with its scale,
// `scales[scale_at]`) into `buffer`.
template <typename KV>
inline const float* row_as_float(const KV* base, int64_t at, const uint16_t*, int64_t, int D, float* buffer) {
  for (int d = 0; d < D; ++d) buffer[d] = Scalar<KV>::load(base, at + d);
  return buffer;
}
template <>
inline const float* row_as_float<float>(const float* base, int64_t at, const uint16_t*, int64_t, int, float*) {
  return base + at;
}
template <>
inline const float* row_as_float<Q8>(const Q8* base, int64_t at, const uint16_t* scales, int64_t scale_at, int D,
                                     float* buffer) {
  const float scale = to_float(scales[scale_at], true);
  const int8_t* codes = &base[at].code;
#pragma omp simd
  for (int d = 0; d < D; ++d) buffer[d] = static_cast<float>(codes[d]) * scale;
  return buffer;
}
template <>
inline const float* row_as_float<Q4>(const Q4* base, int64_t at, const uint16_t* scales, int64_t scale_at, int D,
                                     float* buffer) {
  const float scale = to_float(scales[scale_at], true);
  const uint8_t* codes = &base[at].codes;
#pragma omp simd
  for (int i = 0; i < D / 2; ++i) {
    buffer[2 * i] = static_cast<float>(static_cast<int>(codes[i] & 15u) - 8) * scale;
    buffer[2 * i + 1] = static_cast<float>(static_cast<int>(codes[i] >> 4) - 8) * scale;
  }
  return buffer;
}

// Bytes of one stored row of D values.
template <typename KV>
constexpr int row_bytes(int D) {
  return D * static_cast<int>(sizeof(KV));
}
template <>
constexpr int row_bytes<Q4>(int D) {
  return D / 2;
}

constexpr int kKeyGroup = 4;  // keys whose dot products with one query vector run side by side
constexpr int kPrefetchBlocks = 4;  // how far ahead an item asks for its blocks (measured: 2, 4, 8, 16)

#if defined(__AVX512F__)
// out[0..3] = the sums of the 16 lanes of s0 .. s3, added across the four vectors at once (two unpacks, a shuffle,
// two halvings) rather than one vector at a time.
inline void store_lane_sums(__m512 s0, __m512 s1, __m512 s2, __m512 s3, float* out) {
  // each 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], then [a, b, c, d] partial sums
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(s0, s1), _mm512_unpackhi_ps(s0, s1));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(s2, s3), _mm512_unpackhi_ps(s2, s3));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), high);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
#endif

// The dot products of `q` with the kKeyGroup rows `k`: independent sums, so their latencies overlap.
template <int HD>
inline void dot_group(const float* q, const float* const* k, int D, float* out) {
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (int d = 0; d < HD; d += 16) {
      const __m512 x = _mm512_loadu_ps(q + d);
      s0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[0] + d), s0);
      s1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[1] + d), s1);
      s2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[2] + d), s2);
      s3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[3] + d), s3);
    }
    store_lane_sums(s0, s1, s2, s3, out);
    return;
  }
#endif
  const int n = HD > 0 ? HD : D;
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int d = 0; d < n; ++d) {
    const float x = q[d];
    s0 += x * k0[d];
    s1 += x * k1[d];
    s2 += x * k2[d];
    s3 += x * k3[d];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// acc += sum_j weights[j] * v[j] over the n rows v: the accumulator stays in registers across the rows when the
// head dim is known at compile time.
template <int HD>
inline void accumulate(float* acc, const float* weights, const float* const* v, int n, int D) {
  if constexpr (HD > 0) {
    float a[HD];
#pragma omp simd
    for (int d = 0; d < HD; ++d) a[d] = acc[d];
    for (int j = 0; j < n; ++j) {
      const float w = weights[j];
      if (w == 0.0f) continue;
      const float* vj = v[j];
#pragma omp simd
      for (int d = 0; d < HD; ++d) a[d] += w * vj[d];
    }
#pragma omp simd
    for (int d = 0; d < HD; ++d) acc[d] = a[d];
  } else {
    for (int j = 0; j < n; ++j) {
      const float w = weights[j];
      if (w == 0.0f) continue;
      const float* vj = v[j];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] += w * vj[d];
    }
  }
}

#if defined(__AVX512F__)
// acc[m] += sum_j weights[m][j] * v[j] for kVectors query vectors m at once (rows `acc_stride` and `weight_stride`
// apart): every value row is loaded once for all of them, and their sums are independent chains in registers.
template <int HD, int kVectors>
inline void accumulate_vectors(float* acc, size_t acc_stride, const float* weights, size_t weight_stride,
                               const float* const* v, int n) {
  constexpr int C = HD / 16;
  __m512 a[kVectors][C];
  for (int m = 0; m < kVectors; ++m)
    for (int c = 0; c < C; ++c) a[m][c] = _mm512_loadu_ps(acc + m * acc_stride + 16 * c);
  for (int j = 0; j < n; ++j) {
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = _mm512_loadu_ps(v[j] + 16 * c);
    for (int m = 0; m < kVectors; ++m) {
      const __m512 w = _mm512_set1_ps(weights[m * weight_stride + j]);
      for (int c = 0; c < C; ++c) a[m][c] = _mm512_fmadd_ps(w, row[c], a[m][c]);
    }
  }
  for (int m = 0; m < kVectors; ++m)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + m * acc_stride + 16 * c, a[m][c]);
}
#endif

// acc[m] += sum_j weights[m][j] * v[j] for the M query vectors of an item (accumulators D apart, weights bs apart).
template <int HD>
inline void accumulate_all(float* acc, const float* weights, const float* const* v, int M, int n, int D, int bs) {
  int m = 0;
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    constexpr int kVectors = HD <= 64 ? 4 : 2;  // accumulators that fit the 32 vector registers with a value row
    for (; m + kVectors <= M; m += kVectors) {
      accumulate_vectors<HD, kVectors>(acc + static_cast<size_t>(m) * D, D, weights + static_cast<size_t>(m) * bs, bs,
                                       v, n);
    }
    float* a = acc + static_cast<size_t>(m) * D;
    const float* w = weights + static_cast<size_t>(m) * bs;
    switch (M - m) {  // the rest together too: e.g. the three query vectors of a KV head with three query heads
      case 3:
        return accumulate_vectors<HD, 3>(a, D, w, bs, v, n);
      case 2:
        return accumulate_vectors<HD, 2>(a, D, w, bs, v, n);
      case 1:
        return accumulate_vectors<HD, 1>(a, D, w, bs, v, n);
      default:
        return;
    }
  }
#endif
  for (; m < M; ++m) accumulate<HD>(acc + static_cast<size_t>(m) * D, weights + static_cast<size_t>(m) * bs, v, n, D);
}

// One key row of a block whose keys are quantized per channel: code * step + minimum, in fp32 (`params`: the
// block's D steps then D minimums, as fp32).
inline const float* channel_row_as_float(const uint8_t* codes, const float* params, int D, float* buffer) {
  const float* step = params;
  const float* low = params + D;
#pragma omp simd
  for (int i = 0; i < D / 2; ++i) {
    buffer[2 * i] = static_cast<float>(codes[i] & 15u) * step[2 * i] + low[2 * i];
    buffer[2 * i + 1] = static_cast<float>(codes[i] >> 4) * step[2 * i + 1] + low[2 * i + 1];
  }
  return buffer;
}

// Attend the queries of one item over its key range. T: the query's and output's type; KV: the stored K/V's (T,
// or quantized codes). HD: the head dim when known at compile time (0: p.head_dim). kChannel: keys per channel
// (KV is then the values' Q4).
template <typename T, typename KV, int HD, bool kChannel = false>
void run_item(const Params& p, const Item& item, size_t slot_stride, float* partial_m, float* partial_l,
              float* partial_acc) {
  const int D = HD > 0 ? HD : p.head_dim;
  const int bs = p.block_size;
  const int rep = p.num_q_heads / p.num_kv_heads;
  const int nq = item.q_end - item.q_begin;
  const int M = nq * rep;  // query vectors of the item
  const int32_t row_start = p.query_start[item.row];
  const int32_t row_queries = p.query_start[item.row + 1] - row_start;
  const int32_t past = p.seq_lens[item.row] - row_queries;  // position of the row's first query
  const T* query = static_cast<const T*>(p.query);
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
  const int32_t* table = p.block_tables + item.row * p.table_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  std::vector<float> q(static_cast<size_t>(M) * D), acc(static_cast<size_t>(M) * D, 0.0f);
  std::vector<float> q_plain(kChannel ? static_cast<size_t>(M) * D : 0), block_params(kChannel ? 2 * D : 0);
  const T* query_plain = static_cast<const T*>(p.query_plain);
  std::vector<float> scores(static_cast<size_t>(M) * bs), k_buffer(static_cast<size_t>(kKeyGroup) * D),
      v_buffer(static_cast<size_t>(bs) * D);
  std::vector<const float*> v_rows(bs);
  std::vector<State> state(M);
  std::vector<int32_t> lo(M), hi(M);  // keys lo .. hi - 1 are visible to query vector m
  const bool first_split = item.k_begin == (p.window > 0 ? std::max(0, past + item.q_begin - p.window + 1) : 0);
  for (int i = 0; i < nq; ++i) {
    const int32_t pos = past + item.q_begin + i;
    for (int h = 0; h < rep; ++h) {
      const int m = i * rep + h;
      const int head = item.kv_head * rep + h;
      const int64_t base = static_cast<int64_t>(row_start + item.q_begin + i) * p.q_stride_token +
                           static_cast<int64_t>(head) * p.q_stride_head;
      // logits are scaled through the query (one multiply per query, not per key)
      for (int d = 0; d < D; ++d) q[static_cast<size_t>(m) * D + d] = Scalar<T>::load(query, base + d) * p.scale;
      if constexpr (kChannel) {
        for (int d = 0; d < D; ++d) {
          q_plain[static_cast<size_t>(m) * D + d] = Scalar<T>::load(query_plain, base + d) * p.scale;
        }
      }
      lo[m] = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
      hi[m] = pos + 1;
      // a sink takes softmax mass once: in the split holding the row's first keys
      const bool sink = p.sinks != nullptr && first_split;
      state[m] = sink ? State{p.sinks[head], 1.0f} : State{neg_inf, 0.0f};
    }
  }

  const float softcap = p.softcap;
  const int32_t lo_max = *std::max_element(lo.begin(), lo.end()), hi_min = *std::min_element(hi.begin(), hi.end());
  for (int32_t block = item.k_begin / bs; block * bs < item.k_end; ++block) {
    const int32_t first = std::max(item.k_begin, block * bs), stop = std::min(item.k_end, block * bs + bs);
    const int n = stop - first;
    const int64_t block_base = static_cast<int64_t>(table[block]) * p.kv_stride_block +
                               static_cast<int64_t>(item.kv_head) * p.kv_stride_head +
                               static_cast<int64_t>(first - block * bs) * p.kv_stride_token;
    // every query vector sees every key of the block, and no soft cap changes a logit (most blocks of a decode step)
    const bool all_visible = softcap == 0.0f && first >= lo_max && stop <= hi_min;
    const int64_t scale_base = static_cast<int64_t>(table[block]) * p.scale_stride_block +
                               static_cast<int64_t>(item.kv_head) * p.scale_stride_head +
                               static_cast<int64_t>(first - block * bs) * p.scale_stride_token;
    // keys per channel: an open block's keys from its companions (against the plain query), else this block's
    // steps and minimums
    const int32_t* companions = kChannel ? p.stage_tables + static_cast<int64_t>(table[block]) * p.stage_stride
                                         : nullptr;
    const bool staged = kChannel && companions[0] >= 0;
    const float* q_keys = staged ? q_plain.data() : q.data();
    if constexpr (kChannel) {
      if (!staged) {
        const uint16_t* params = p.key_params + static_cast<int64_t>(table[block]) * p.kp_stride_block +
                                 static_cast<int64_t>(item.kv_head) * p.kp_stride_head;
        for (int d = 0; d < 2 * D; ++d) block_params[d] = to_float(params[d], true);
      }
    }
    // ask the memory for the rows of the block kPrefetchBlocks ahead while this one is computed (blocks lie anywhere
    // in the pool, so no hardware prefetcher foresees them; into L2, not L1, which they would crowd): an item's
    // first block asks for its first kPrefetchBlocks + 1 blocks at once
    {
      const int bytes = row_bytes<KV>(D);
      const int32_t from = block == item.k_begin / bs ? block : block + kPrefetchBlocks;
      for (int32_t ahead = from; ahead <= block + kPrefetchBlocks && ahead * bs < item.k_end; ++ahead) {
        const int64_t at = static_cast<int64_t>(table[ahead]) * p.kv_stride_block +
                           static_cast<int64_t>(item.kv_head) * p.kv_stride_head;
        for (int j = 0; j < bs; ++j) {
          const char* k_row = reinterpret_cast<const char*>(kc + at + j * p.kv_stride_token);
          const char* v_row = reinterpret_cast<const char*>(vc + at + j * p.kv_stride_token);
          for (int byte = 0; byte < bytes; byte += 64) {
            __builtin_prefetch(k_row + byte, 0, 2);
            __builtin_prefetch(v_row + byte, 0, 2);
          }
        }
      }
    }
    // scores: every key row is read once and met by every query vector that sees it, kKeyGroup keys at a time
    for (int j0 = 0; j0 < n; j0 += kKeyGroup) {
      const int g = std::min(kKeyGroup, n - j0);
      const float* k[kKeyGroup];
      for (int t = 0; t < kKeyGroup; ++t) {  // a short group repeats its last key (its dots are not used)
        const int j = j0 + t;
        float* buffer = &k_buffer[static_cast<size_t>(t) * D];
        if (t >= g) {
          k[t] = k[g - 1];
        } else if constexpr (kChannel) {
          const int offset = first - block * bs + j;
          if (staged) {
            const T* row = static_cast<const T*>(p.staging) +
                           companions[offset / p.staging_tokens] * p.st_stride_block +
                           static_cast<int64_t>(offset % p.staging_tokens) * p.st_stride_token +
                           static_cast<int64_t>(item.kv_head) * p.st_stride_head;
            for (int d = 0; d < D; ++d) buffer[d] = Scalar<T>::load(row, d);
            k[t] = buffer;
          } else {
            const uint8_t* codes = &kc[block_base + j * p.kv_stride_token].codes;
            k[t] = channel_row_as_float(codes, block_params.data(), D, buffer);
          }
        } else {
          k[t] = row_as_float(kc, block_base + j * p.kv_stride_token, p.key_scales,
                              scale_base + j * p.scale_stride_token, D, buffer);
        }
      }
      if (all_visible && g == kKeyGroup) {  // the logits are the dot products: written in place
        for (int m = 0; m < M; ++m) {
          dot_group<HD>(&q_keys[static_cast<size_t>(m) * D], k, D, &scores[static_cast<size_t>(m) * bs + j0]);
        }
        continue;
      }
      for (int m = 0; m < M; ++m) {
        float* sm = &scores[static_cast<size_t>(m) * bs];
        float dots[kKeyGroup];
        dot_group<HD>(&q_keys[static_cast<size_t>(m) * D], k, D, dots);
        for (int t = 0; t < g; ++t) {
          const int32_t key = first + j0 + t;
          if (key < lo[m] || key >= hi[m]) {
            sm[j0 + t] = neg_inf;
            continue;
          }
          float logit = dots[t];
          if (softcap > 0.0f) logit = std::tanh(logit / softcap) * softcap;
          sm[j0 + t] = logit;
        }
      }
    }
    // online softmax, a block at a time
    bool any = false;
    for (int m = 0; m < M; ++m) {
      float* sm = &scores[static_cast<size_t>(m) * bs];
#if defined(__AVX512F__)
      const float block_max = block_max16(sm, n);
#else
      float block_max = neg_inf;
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, sm[j]);
#endif
      if (block_max == neg_inf) {  // no key of this block is visible to m
        for (int j = 0; j < n; ++j) sm[j] = 0.0f;
        continue;
      }
      any = true;
      State& st = state[m];
      const float new_max = std::max(st.max, block_max);
      // a block that raises no maximum rescales nothing (exp(0) is 1 exactly: the same bits, without the exp)
      const float alpha = st.max == neg_inf ? 0.0f : block_max <= st.max ? 1.0f : exp_nonpositive(st.max - new_max);
#if defined(__AVX512F__)
      const float block_sum = exp_block16(sm, n, new_max);
#else
      float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
      for (int j = 0; j < n; ++j) {
        const float e = sm[j] == neg_inf ? 0.0f : exp_nonpositive(sm[j] - new_max);
        sm[j] = e;
        block_sum += e;
      }
#endif
      st.sum = st.sum * alpha + block_sum;
      st.max = new_max;
      if (alpha != 1.0f) {
        float* am = &acc[static_cast<size_t>(m) * D];
#pragma omp simd
        for (int d = 0; d < D; ++d) am[d] *= alpha;
      }
    }
    if (!any) continue;
    // every value row is loaded (converted, dequantized) once, then weighted into each query vector's accumulator
    for (int j = 0; j < n; ++j) {
      v_rows[j] = row_as_float(vc, block_base + j * p.kv_stride_token, p.value_scales,
                               scale_base + j * p.scale_stride_token, D, &v_buffer[static_cast<size_t>(j) * D]);
    }
    accumulate_all<HD>(acc.data(), scores.data(), v_rows.data(), M, n, D, bs);
  }

  if (item.slot >= 0) {  // a key split: keep the unnormalised state for the merge
    for (int m = 0; m < M; ++m) {
      const size_t at = static_cast<size_t>(item.slot) * slot_stride + m;
      partial_m[at] = state[m].max;
      partial_l[at] = state[m].sum;
      std::memcpy(&partial_acc[at * D], &acc[static_cast<size_t>(m) * D], sizeof(float) * D);
    }
    return;
  }
  T* out = static_cast<T*>(p.out);
  for (int i = 0; i < nq; ++i) {
    for (int h = 0; h < rep; ++h) {
      const int m = i * rep + h;
      const int head = item.kv_head * rep + h;
      const float inv = state[m].sum > 0.0f ? 1.0f / state[m].sum : 0.0f;
      const int64_t base = static_cast<int64_t>(row_start + item.q_begin + i) * p.out_stride_token +
                           static_cast<int64_t>(head) * p.out_stride_head;
      for (int d = 0; d < D; ++d) Scalar<T>::store(out, base + d, acc[static_cast<size_t>(m) * D + d] * inv);
    }
  }
}

template <typename T, typename KV, bool kChannel>
void run_item_any(const Params& p, const Item& item, size_t slot_stride, float* partial_m, float* partial_l,
                  float* partial_acc) {
  switch (p.head_dim) {
    case 64:
      return run_item<T, KV, 64, kChannel>(p, item, slot_stride, partial_m, partial_l, partial_acc);
    case 128:
      return run_item<T, KV, 128, kChannel>(p, item, slot_stride, partial_m, partial_l, partial_acc);
    default:
      return run_item<T, KV, 0, kChannel>(p, item, slot_stride, partial_m, partial_l, partial_acc);
  }
}

// Merge the key splits of one (row, KV head, query tile) into the output.
template <typename T>
void merge_splits(const Params& p, const Item& first, int num_splits, size_t slot_stride, const float* partial_m,
                  const float* partial_l, const float* partial_acc) {
  const int D = p.head_dim, rep = p.num_q_heads / p.num_kv_heads;
  const int nq = first.q_end - first.q_begin, M = nq * rep;
  const int32_t row_start = p.query_start[first.row];
  T* out = static_cast<T*>(p.out);
  std::vector<float> acc(D);
  for (int m = 0; m < M; ++m) {
    float max = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < num_splits; ++k) max = std::max(max, partial_m[static_cast<size_t>(first.slot + k) * slot_stride + m]);
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < num_splits; ++k) {
      const size_t at = static_cast<size_t>(first.slot + k) * slot_stride + m;
      if (partial_m[at] == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(partial_m[at] - max);
      sum += partial_l[at] * w;
      const float* a = &partial_acc[at * D];
      for (int d = 0; d < D; ++d) acc[d] += a[d] * w;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int i = m / rep, head = first.kv_head * rep + m % rep;
    const int64_t base = static_cast<int64_t>(row_start + first.q_begin + i) * p.out_stride_token +
                         static_cast<int64_t>(head) * p.out_stride_head;
    for (int d = 0; d < D; ++d) Scalar<T>::store(out, base + d, acc[d] * inv);
  }
}

template <typename T, typename KV, bool kChannel = false>
int run(const Params& p) {
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.block_size <= 0 || p.head_dim <= 0) return 1;
  constexpr bool quantized = std::is_same<KV, Q8>::value || std::is_same<KV, Q4>::value;
  if (quantized && (p.key_scales == nullptr || p.value_scales == nullptr)) return 3;
  if (kChannel && (p.key_params == nullptr || p.stage_tables == nullptr || p.staging == nullptr ||
                   p.query_plain == nullptr || p.staging_tokens <= 0)) {
    return 5;
  }
  if (std::is_same<KV, Q4>::value && p.head_dim % 2 != 0) return 4;
  // a small call runs on the calling thread: waking a team costs more than its work
  int64_t work = 0;  // query vectors x keys
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int64_t nq = p.query_start[r + 1] - p.query_start[r];
    const int64_t keys = p.window > 0 ? std::min<int64_t>(p.seq_lens[r], p.window + nq) : p.seq_lens[r];
    work += nq * keys;
  }
  work *= p.num_q_heads;
  const int64_t enough = work / std::max<int64_t>(1, p.min_work_per_thread);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(p.num_threads, enough)));
  const int tile = std::max(1, p.query_tile);
  std::vector<Item> items;
  int tiles_total = 0;
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int32_t nq = p.query_start[r + 1] - p.query_start[r];
    tiles_total += (nq + tile - 1) / tile;
  }
  const int base_items = tiles_total * p.num_kv_heads;
  // split keys only while there are fewer items than threads to keep busy
  const int want_splits = base_items >= 2 * threads ? 1 : (2 * threads + base_items - 1) / std::max(1, base_items);
  std::vector<std::pair<size_t, int>> groups;  // (first item, splits) of every split (row, head, tile)
  int32_t slots = 0;
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const int32_t start = p.query_start[r], nq = p.query_start[r + 1] - start;
    const int32_t past = p.seq_lens[r] - nq;
    if (nq <= 0 || past < 0) continue;
    for (int32_t q0 = 0; q0 < nq; q0 += tile) {
      const int32_t q1 = std::min(nq, q0 + tile);
      const int32_t k_end = past + q1;
      const int32_t k_begin = p.window > 0 ? std::max(0, past + q0 - p.window + 1) : 0;
      const int32_t span = k_end - k_begin;
      int splits = std::min(want_splits, std::max(1, span / std::max(1, p.min_split_keys)));
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        if (splits <= 1) {
          items.push_back({r, h, q0, q1, k_begin, k_end, -1});
          continue;
        }
        // split at block edges
        const int32_t blocks = (k_end - k_begin + p.block_size - 1) / p.block_size;
        const int32_t per = (blocks + splits - 1) / splits;
        groups.emplace_back(items.size(), 0);
        for (int32_t k = k_begin; k < k_end;) {  // splits end at block edges
          const int32_t end = std::min(k_end, (k / p.block_size + per) * p.block_size);
          items.push_back({r, h, q0, q1, k, end, slots++});
          groups.back().second += 1;
          k = end;
        }
      }
    }
  }
  const int rep = p.num_q_heads / p.num_kv_heads;
  const size_t per_slot = static_cast<size_t>(tile) * rep;
  std::vector<float> partial_m(slots * per_slot), partial_l(slots * per_slot),
      partial_acc(slots * per_slot * p.head_dim);
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t i = 0; i < count; ++i) {
    run_item_any<T, KV, kChannel>(p, items[i], per_slot, partial_m.data(), partial_l.data(), partial_acc.data());
  }
  const int64_t num_groups = static_cast<int64_t>(groups.size());
#pragma omp parallel for num_threads(threads) if (threads > 1 && num_groups > 1)
  for (int64_t g = 0; g < num_groups; ++g) {
    merge_splits<T>(p, items[groups[g].first], groups[g].second, per_slot, partial_m.data(), partial_l.data(),
                    partial_acc.data());
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype (of the query and output): 0 float32, 1 bfloat16, 2 float16. kv_format: 0 K/V stored in dtype, 1 int8
// codes, 2 int4 codes (with scales), 3 keys per channel (values as 2). Returns 0 on success.
int hf_paged_attention(const Params* params, int dtype, int kv_format) {
  if (kv_format == 3) {
    switch (dtype) {
      case 0:
        return run<float, Q4, true>(*params);
      case 1:
        return run<BF16, Q4, true>(*params);
      case 2:
        return run<F16, Q4, true>(*params);
      default:
        return 2;
    }
  }
  if (kv_format < 0 || kv_format > 2) return 2;
  switch (dtype * 3 + kv_format) {
    case 0:
      return run<float, float>(*params);
    case 1:
      return run<float, Q8>(*params);
    case 2:
      return run<float, Q4>(*params);
    case 3:
      return run<BF16, BF16>(*params);
    case 4:
      return run<BF16, Q8>(*params);
    case 5:
      return run<BF16, Q4>(*params);
    case 6:
      return run<F16, F16>(*params);
    case 7:
      return run<F16, Q8>(*params);
    case 8:
      return run<F16, Q4>(*params);
    default:
      return 2;
  }
}

int hf_paged_abi_version() { return 4; }
}
