// The CPU kernel (paged_attention_cpu.cpp) registered with torch's dispatcher as the CPU implementation of
// hf_paged::paged_attention and hf_paged::write_kv, so a compiled step calls it without going through Python
// (the ops' schemas, fake implementations and every other device stay in hf_paged/kernels/ops.py). Calls the
// kernel cannot take (another backend named, a dtype it does not read, "auto" with a row of more queries than it
// takes) go on to hf_paged::paged_attention_any, the same op implemented in Python.

#include "paged_attention_cpu.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

namespace {

constexpr int32_t kQueryTile = 16;
constexpr int32_t kMinSplitKeys = 512;
constexpr int64_t kMinWorkPerThread = 2048;
constexpr int64_t kAutoMaxQueries = 256;

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

// Whether the in-place kernel takes this call as the Python dispatch would send it there.
bool kernel_takes(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                  std::string_view backend) {
  if (backend != "auto" && backend != "cpu") return false;
  if (query.dim() != 3 || key_cache.dim() != 4 || dtype_code(query.scalar_type()) < 0) return false;
  if (key_cache.scalar_type() != query.scalar_type() || value_cache.scalar_type() != query.scalar_type()) return false;
  if (query.stride(2) != 1 || key_cache.stride(3) != 1 || value_cache.stride(3) != 1) return false;
  if (!value_cache.strides().equals(key_cache.strides()) || !value_cache.sizes().equals(key_cache.sizes())) return false;
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

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start, double scale, std::optional<int64_t> window,
                               std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                               c10::string_view backend) {
  if (!kernel_takes(query, key_cache, value_cache, block_tables, seq_lens, query_start, backend)) {
    static auto any = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("hf_paged::paged_attention_any", "")
                          .typed<decltype(paged_attention_cpu)>();
    return any.call(query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks,
                    backend);
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  at::Tensor sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(c10::ScalarType::Float).contiguous();
  Params p{};
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.out = out.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start = query_start.data_ptr<int32_t>();
  p.sinks = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
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
  p.head_dim = static_cast<int32_t>(query.size(2));
  p.block_size = static_cast<int32_t>(key_cache.size(1));
  p.window = window.has_value() ? static_cast<int32_t>(*window) : 0;
  p.scale = static_cast<float>(scale);
  p.softcap = softcap.has_value() ? static_cast<float>(*softcap) : 0.0f;
  p.num_threads = at::get_num_threads();
  p.query_tile = kQueryTile;
  p.min_split_keys = kMinSplitKeys;
  p.min_work_per_thread = kMinWorkPerThread;
  int status = hf_paged_attention(&p, dtype_code(query.scalar_type()), 0);
  TORCH_CHECK(status == 0, "the CPU paged-attention kernel refused its arguments (status ", status, ")");
  return out;
}

void write_kv_cpu(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
                  const at::Tensor& keys, const at::Tensor& values) {
  const int64_t row = keys.numel() / std::max<int64_t>(keys.size(0), 1);
  const bool direct = key_cache.is_contiguous() && value_cache.is_contiguous() && keys.is_contiguous() &&
                      values.is_contiguous() && keys.scalar_type() == key_cache.scalar_type() &&
                      values.scalar_type() == value_cache.scalar_type() && slots.scalar_type() == c10::ScalarType::Long &&
                      slots.is_contiguous() && values.sizes().equals(keys.sizes()) && keys.dim() == 3 &&
                      key_cache.numel() == value_cache.numel() && keys.size(0) == slots.numel() &&
                      key_cache.dim() == 4 && key_cache.size(2) * key_cache.size(3) == row;
  if (!direct) {
    key_cache.view({-1, keys.size(1), keys.size(2)}).index_copy_(0, slots, keys.to(key_cache.scalar_type()));
    value_cache.view({-1, values.size(1), values.size(2)}).index_copy_(0, slots, values.to(value_cache.scalar_type()));
    return;
  }
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = row * keys.element_size();
  auto* key_out = static_cast<char*>(key_cache.data_ptr());
  auto* value_out = static_cast<char*>(value_cache.data_ptr());
  const auto* key_in = static_cast<const char*>(keys.data_ptr());
  const auto* value_in = static_cast<const char*>(values.data_ptr());
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "write_kv: slot ", slot[i], " is out of bounds for ", num_slots,
                " slots");
  }
  for (int64_t i = 0; i < slots.numel(); ++i) {
    std::memcpy(key_out + slot[i] * bytes, key_in + i * bytes, bytes);
    std::memcpy(value_out + slot[i] * bytes, value_in + i * bytes, bytes);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("write_kv", &write_kv_cpu);
}
