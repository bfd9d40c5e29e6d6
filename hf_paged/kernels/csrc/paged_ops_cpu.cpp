// The CPU kernel (paged_attention_cpu.cpp) registered with torch's dispatcher as the CPU implementation of
// hf_paged::paged_attention, write_kv, paged_attention_quantized and write_kv_quantized, so a compiled step calls it
// without going through Python (the ops' schemas, fake implementations and every other device stay in
// hf_paged/kernels/ops.py). Each does what the Python implementation does, with the same ATen operations in the
// same order where it computes (the quantization, the rotation of quantized formats), so the results are the same
// bits. Calls the kernel cannot take (another backend named, a dtype it does not read, "auto" with a row of more
// queries than it takes) go on to the same op implemented in Python (hf_paged::*_any).

#include "paged_attention_cpu.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorIndexing.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <optional>
#include <string_view>

namespace {

constexpr int32_t kQueryTile = 16;          // kernels/cpu.py: QUERY_TILE
constexpr int32_t kMinSplitKeys = 512;      // MIN_SPLIT_KEYS
constexpr int64_t kMinWorkPerThread = 2048;  // MIN_WORK_PER_THREAD
constexpr int64_t kAutoMaxQueries = 256;    // kernels.AUTO_CPU_MAX_QUERIES

int dtype_code(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return 0;
    case c10::ScalarType::BFloat16:
      return 1;
    case c10::ScalarType::Half:
      return 2;
    default:
      return -1;
  }
}

bool is_int32_index(const at::Tensor& t) {
  return t.scalar_type() == c10::ScalarType::Int && t.is_contiguous() && t.device().is_cpu();
}

// Whether the in-place kernel takes a call with these tables and backend as the Python dispatch would send it there.
bool kernel_takes_rows(const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                       std::string_view backend) {
  if (backend != "auto" && backend != "cpu") return false;
  if (!is_int32_index(block_tables) || !is_int32_index(seq_lens) || !is_int32_index(query_start)) return false;
  if (block_tables.dim() != 2) return false;
  if (backend == "auto") {
    const int32_t* start = query_start.data_ptr<int32_t>();
    for (int64_t r = 0; r + 1 < query_start.numel(); ++r) {
      if (start[r + 1] - start[r] > kAutoMaxQueries) return false;
    }
  }
  return true;
}

// The kernel's parameters for `query` over K/V stored as `key_cache`/`value_cache` (element or code strides).
Params kernel_params(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& out, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start, double scale, std::optional<int64_t> window,
                     std::optional<double> softcap, const at::Tensor& sink_logits, int64_t head_dim) {
  Params p{};
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.out = out.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start = query_start.data_ptr<int32_t>();
  p.sinks = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
  p.table_stride = block_tables.stride(0);
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.kv_stride_block = key_cache.stride(0);
  p.kv_stride_token = key_cache.stride(1);
  p.kv_stride_head = key_cache.stride(2);
  p.num_rows = static_cast<int32_t>(seq_lens.numel());
  p.num_q_heads = static_cast<int32_t>(query.size(1));
  p.num_kv_heads = static_cast<int32_t>(key_cache.size(2));
  p.head_dim = static_cast<int32_t>(head_dim);
  p.block_size = static_cast<int32_t>(key_cache.size(1));
  p.window = window.has_value() ? static_cast<int32_t>(*window) : 0;
  p.scale = static_cast<float>(scale);
  p.softcap = softcap.has_value() ? static_cast<float>(*softcap) : 0.0f;
  p.num_threads = at::get_num_threads();
  p.query_tile = kQueryTile;
  p.min_split_keys = kMinSplitKeys;
  p.min_work_per_thread = kMinWorkPerThread;
  return p;
}

at::Tensor float_sinks(const std::optional<at::Tensor>& sinks) {
  return sinks.has_value() ? sinks->to(c10::ScalarType::Float).contiguous() : at::Tensor();
}

void run_kernel(const Params& p, c10::ScalarType dtype, int kv_format) {
  int status = hf_paged_attention(&p, dtype_code(dtype), kv_format);
  TORCH_CHECK(status == 0, "the CPU paged-attention kernel refused its arguments (status ", status, ")");
}

// ------------------------------------------------------------------------------------------------ unquantized

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start, double scale, std::optional<int64_t> window,
                               std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                               c10::string_view backend) {
  const auto type = query.scalar_type();
  const bool takes = kernel_takes_rows(block_tables, seq_lens, query_start, backend) && query.dim() == 3 &&
                     key_cache.dim() == 4 && dtype_code(type) >= 0 && key_cache.scalar_type() == type &&
                     value_cache.scalar_type() == type && query.stride(2) == 1 && key_cache.stride(3) == 1 &&
                     value_cache.strides().equals(key_cache.strides()) &&
                     value_cache.sizes().equals(key_cache.sizes());
  if (!takes) {
    static auto any = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("hf_paged::paged_attention_any", "")
                          .typed<decltype(paged_attention_cpu)>();
    return any.call(query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks,
                    backend);
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  at::Tensor sink_logits = float_sinks(sinks);
  run_kernel(kernel_params(query, key_cache, value_cache, out, block_tables, seq_lens, query_start, scale, window,
                           softcap, sink_logits, query.size(2)),
             type, 0);
  return out;
}

void check_slots(const at::Tensor& slots, int64_t num_slots, const char* op) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, op, ": slot ", slot[i], " is out of bounds for ", num_slots,
                " slots");
  }
}

void write_kv_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
                  const at::Tensor& keys, const at::Tensor& values) {
  const bool direct = key_cache.dim() == 4 && keys.dim() == 3 && key_cache.is_contiguous() &&
                      value_cache.is_contiguous() && value_cache.sizes().equals(key_cache.sizes()) &&
                      value_cache.scalar_type() == key_cache.scalar_type() && keys.is_contiguous() &&
                      values.is_contiguous() && values.sizes().equals(keys.sizes()) &&
                      keys.scalar_type() == key_cache.scalar_type() && values.scalar_type() == key_cache.scalar_type() &&
                      slots.scalar_type() == c10::ScalarType::Long && slots.is_contiguous() &&
                      keys.size(0) == slots.numel() && keys.size(1) == key_cache.size(2) &&
                      keys.size(2) == key_cache.size(3);
  if (!direct) {  // what the Python implementation does
    key_cache.view({-1, keys.size(1), keys.size(2)}).index_copy_(0, slots, keys.to(key_cache.scalar_type()));
    value_cache.view({-1, values.size(1), values.size(2)}).index_copy_(0, slots, values.to(value_cache.scalar_type()));
    return;
  }
  check_slots(slots, key_cache.size(0) * key_cache.size(1), "write_kv");  // every slot before writing any
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = keys.size(1) * keys.size(2) * keys.element_size();
  auto* key_out = static_cast<char*>(key_cache.data_ptr());
  auto* value_out = static_cast<char*>(value_cache.data_ptr());
  const auto* key_in = static_cast<const char*>(keys.data_ptr());
  const auto* value_in = static_cast<const char*>(values.data_ptr());
  for (int64_t i = 0; i < slots.numel(); ++i) {
    std::memcpy(key_out + slot[i] * bytes, key_in + i * bytes, bytes);
    std::memcpy(value_out + slot[i] * bytes, value_in + i * bytes, bytes);
  }
}

// ------------------------------------------------------------------------------------------------ quantized pages
// kv_format.py: "int8" and "int4" store every vector rotated by hadamard(head_dim), with a bfloat16 scale per token
// and head; codes int8, or two 4-bit codes a byte (code + 8, low nibble first).

int bits_of(std::string_view kv_dtype) {
  if (kv_dtype == "int8") return 8;
  if (kv_dtype == "int4") return 4;
  return 0;
}

// hadamard(head_dim) as kv_format.py builds it, asked of Python once per head dim (hf_paged::hadamard_of).
at::Tensor hadamard(const at::Tensor& like) {
  const int64_t head_dim = like.size(-1);
  static std::mutex lock;
  static std::map<int64_t, at::Tensor> built;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto found = built.find(head_dim);
    if (found != built.end()) return found->second;
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hf_paged::hadamard_of", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  at::Tensor matrix = op.call(like);
  std::lock_guard<std::mutex> guard(lock);
  return built.emplace(head_dim, matrix).first->second;
}

at::Tensor rotate(const at::Tensor& x) {  // kv_format.rotate: x.float() @ hadamard(head_dim)
  return at::matmul(x.to(c10::ScalarType::Float), hadamard(x));
}

at::Tensor paged_attention_quantized_cpu(const at::Tensor& query, const at::Tensor& key_codes,
                                         const at::Tensor& key_scales, const at::Tensor& value_codes,
                                         const at::Tensor& value_scales, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                                         c10::string_view kv_dtype, std::optional<int64_t> window,
                                         std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                         c10::string_view backend) {
  const auto type = query.scalar_type();
  const int bits = bits_of(kv_dtype);
  const auto code_type = bits == 8 ? c10::ScalarType::Char : c10::ScalarType::Byte;
  const bool takes = bits != 0 && kernel_takes_rows(block_tables, seq_lens, query_start, backend) &&
                     query.dim() == 3 && key_codes.dim() == 4 && dtype_code(type) >= 0 && query.stride(2) == 1 &&
                     key_codes.scalar_type() == code_type && value_codes.scalar_type() == code_type &&
                     key_codes.stride(3) == 1 && value_codes.strides().equals(key_codes.strides()) &&
                     value_codes.sizes().equals(key_codes.sizes()) && key_scales.dim() == 3 &&
                     key_scales.scalar_type() == c10::ScalarType::BFloat16 &&
                     value_scales.scalar_type() == c10::ScalarType::BFloat16 &&
                     value_scales.sizes().equals(key_scales.sizes());
  if (!takes) {
    static auto any = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("hf_paged::paged_attention_quantized_any", "")
                          .typed<decltype(paged_attention_quantized_cpu)>();
    return any.call(query, key_codes, key_scales, value_codes, value_scales, block_tables, seq_lens, query_start,
                    scale, kv_dtype, window, softcap, sinks, backend);
  }
  // kv_format.attends_rotated_pages: the query rotated in, the output rotated back out
  at::Tensor rotated = rotate(query).to(type);
  at::Tensor key_scale = key_scales.contiguous(), value_scale = value_scales.contiguous();
  at::Tensor out = at::empty(rotated.sizes(), rotated.options());
  at::Tensor sink_logits = float_sinks(sinks);
  Params p = kernel_params(rotated, key_codes, value_codes, out, block_tables, seq_lens, query_start, scale, window,
                           softcap, sink_logits, query.size(2));
  p.key_scales = reinterpret_cast<const uint16_t*>(key_scale.data_ptr());
  p.value_scales = reinterpret_cast<const uint16_t*>(value_scale.data_ptr());
  p.scale_stride_block = key_scale.stride(0);
  p.scale_stride_token = key_scale.stride(1);
  p.scale_stride_head = key_scale.stride(2);
  run_kernel(p, type, bits == 8 ? 1 : 2);
  return rotate(out).to(type);
}

// KVFormat.store: quantize every vector of `x` on its own and index_copy_ codes and scales into their slots.
void store_quantized(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& slots,
                     int bits) {
  const int64_t max_code = (int64_t{1} << (bits - 1)) - 1;
  const double scale_max = static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
  at::Tensor values = rotate(x);
  at::Tensor absmax = values.abs().amax(-1);
  at::Tensor new_scales =
      at::clamp(absmax.div(max_code), std::optional<at::Scalar>(), std::optional<at::Scalar>(scale_max))
          .to(c10::ScalarType::BFloat16);
  at::Tensor divisor = new_scales.to(c10::ScalarType::Float);
  divisor = at::where(divisor.gt(0), divisor, at::ones_like(divisor));
  at::Tensor rounded = at::round(values.div(divisor.unsqueeze(-1))).clamp_(-max_code, max_code);
  at::Tensor new_codes;
  if (bits == 8) {
    new_codes = rounded.to(c10::ScalarType::Char);
  } else {
    at::Tensor nibbles = rounded.add(8).to(c10::ScalarType::Byte);  // 1..15, 8 is zero
    using at::indexing::Slice;
    new_codes = nibbles.index({"...", Slice(0, c10::nullopt, 2)})
                    .bitwise_or(nibbles.index({"...", Slice(1, c10::nullopt, 2)}).bitwise_left_shift(4));
  }
  std::vector<int64_t> code_rows{-1};
  for (int64_t d = 1; d < new_codes.dim(); ++d) code_rows.push_back(new_codes.size(d));
  codes.view(code_rows).index_copy_(0, slots, new_codes);
  scales.view({-1, new_scales.size(1)}).index_copy_(0, slots, new_scales);
}

void write_kv_quantized_cpu(const at::Tensor& key_codes, const at::Tensor& key_scales, const at::Tensor& value_codes,
                            const at::Tensor& value_scales, const at::Tensor& slots, const at::Tensor& keys,
                            const at::Tensor& values, c10::string_view kv_dtype) {
  const int bits = bits_of(kv_dtype);
  if (bits == 0) {
    static auto any = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("hf_paged::write_kv_quantized_any", "")
                          .typed<decltype(write_kv_quantized_cpu)>();
    return any.call(key_codes, key_scales, value_codes, value_scales, slots, keys, values, kv_dtype);
  }
  store_quantized(keys, key_codes, key_scales, slots, bits);
  store_quantized(values, value_codes, value_scales, slots, bits);
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("write_kv", &write_kv_cpu);
  m.impl("paged_attention_quantized", &paged_attention_quantized_cpu);
  m.impl("write_kv_quantized", &write_kv_quantized_cpu);
}
