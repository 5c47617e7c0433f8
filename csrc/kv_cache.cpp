#include "kv_cache.h"

#include <sstream>

namespace sdvg {

namespace {

// a * b, refusing (std::invalid_argument, so Python sees a ValueError) a product beyond 2^63 - 1 or a
// negative factor; `what` names the quantity in the message.
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) {
    std::ostringstream os;
    os << what << ": " << a << " x " << b
       << (a < 0 || b < 0 ? " has a negative factor" : " exceeds 2^63 - 1 (9223372036854775807)")
       << "; use fewer blocks, a local window or smaller shapes";
    throw std::invalid_argument(os.str());
  }
  return out;
}

}  // namespace

int64_t kv_cache_nbytes(const KVCacheShape& s, const SlotLayout& layout, int64_t element_size) {
  FrameSlotTable table(layout);
  const char* what = "KV cache bytes";
  int64_t n = checked_mul(s.num_layers, 2, what);
  for (int64_t f : {s.batch, s.heads, table.num_slots(), s.tokens_per_frame, s.head_dim, element_size})
    n = checked_mul(n, f, what);
  return n;
}

KVCache::KVCache(const KVCacheShape& shape, const SlotLayout& layout, at::ScalarType dtype, at::Device device)
    : shape_(shape), table_(layout) {
  if (shape.num_layers < 1 || shape.batch < 1 || shape.heads < 1 || shape.head_dim < 1 ||
      shape.tokens_per_frame < 1)
    throw std::invalid_argument("KV cache shape entries must all be >= 1");
  kv_cache_nbytes(shape, layout, 1);  // the element count fits int64 (else a ValueError naming it)
  buffer_ = at::zeros({shape.num_layers, 2, shape.batch, shape.heads, table_.num_slots() * shape.tokens_per_frame,
                       shape.head_dim},
                      at::TensorOptions().dtype(dtype).device(device));
}

void KVCache::begin_write(int64_t num_frames) {
  pending_slots_ = table_.write(num_frames);
  refresh_visible();
}

void KVCache::refresh_visible() {
  const int64_t tpf = shape_.tokens_per_frame;
  auto range = table_.visible_slot_range();
  if (range.first >= 0) {
    visible_range_ = {range.first * tpf, range.second * tpf};
    visible_index_ = at::Tensor();
    return;
  }
  visible_range_ = {-1, -1};
  std::vector<int64_t> tokens;
  for (int64_t slot : table_.visible_slots())
    for (int64_t t = 0; t < tpf; ++t) tokens.push_back(slot * tpf + t);
  visible_index_ = at::tensor(tokens, at::TensorOptions().dtype(at::kLong)).to(buffer_.device());
}

void KVCache::write(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  if (pending_slots_.empty() || table_.pending_frames() == 0)
    throw std::logic_error("KV cache write() before begin_write()");
  const int64_t tpf = shape_.tokens_per_frame;
  const int64_t n = static_cast<int64_t>(pending_slots_.size());
  const std::vector<int64_t> want{shape_.batch, shape_.heads, n * tpf, shape_.head_dim};
  if (k.sizes() != at::IntArrayRef(want) || v.sizes() != at::IntArrayRef(want)) {
    std::ostringstream os;
    os << "KV cache write expects K/V of shape " << at::IntArrayRef(want) << ", got " << k.sizes() << " and "
       << v.sizes();
    throw std::invalid_argument(os.str());
  }
  at::Tensor buf = layer_buffer(layer);
  // Copy runs of consecutive slots in one go.
  int64_t i = 0;
  while (i < n) {
    int64_t j = i + 1;
    while (j < n && pending_slots_[j] == pending_slots_[j - 1] + 1) ++j;
    const int64_t dst0 = pending_slots_[i] * tpf, dst1 = pending_slots_[j - 1] * tpf + tpf;
    buf.select(0, 0).narrow(2, dst0, dst1 - dst0).copy_(k.narrow(2, i * tpf, (j - i) * tpf));
    buf.select(0, 1).narrow(2, dst0, dst1 - dst0).copy_(v.narrow(2, i * tpf, (j - i) * tpf));
    i = j;
  }
}

void KVCache::write_tokens(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tokens) {
  if (pending_slots_.empty() || table_.pending_frames() == 0)
    throw std::logic_error("KV cache write_tokens() before begin_write()");
  const int64_t tpf = shape_.tokens_per_frame;
  const int64_t n = static_cast<int64_t>(pending_slots_.size());
  if (tokens.dim() != 1 || tokens.scalar_type() != at::kLong)
    throw std::invalid_argument("KV cache write_tokens expects token indices as a 1-D int64 tensor");
  const int64_t a = tokens.size(0);
  const std::vector<int64_t> want{shape_.batch, shape_.heads, a, shape_.head_dim};
  if (k.sizes() != at::IntArrayRef(want) || v.sizes() != at::IntArrayRef(want)) {
    std::ostringstream os;
    os << "KV cache write_tokens expects K/V of shape " << at::IntArrayRef(want) << " (" << a
       << " token indices), got " << k.sizes() << " and " << v.sizes();
    throw std::invalid_argument(os.str());
  }
  if (a == 0) return;
  at::Tensor idx = tokens.to(at::kCPU);
  const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
  if (lo < 0 || hi >= n * tpf) {
    std::ostringstream os;
    os << "KV cache write_tokens: token index " << (lo < 0 ? lo : hi) << " outside the " << n * tpf
       << " pending tokens (" << n << " frames of " << tpf << ")";
    throw std::out_of_range(os.str());
  }
  // Buffer position of pending token i: slot of its frame * tpf + its place in the frame.
  at::Tensor slots = at::tensor(pending_slots_, at::TensorOptions().dtype(at::kLong));
  at::Tensor pos = slots.index_select(0, at::div(idx, tpf, "floor")) * tpf + at::remainder(idx, tpf);
  pos = pos.to(buffer_.device());
  at::Tensor buf = layer_buffer(layer);
  buf.select(0, 0).index_copy_(2, pos, k.to(buf.scalar_type()));
  buf.select(0, 1).index_copy_(2, pos, v.to(buf.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor> KVCache::visible(int64_t layer) const {
  at::Tensor buf = layer_buffer(layer);
  if (visible_range_.first >= 0) {
    const int64_t a = visible_range_.first, len = visible_range_.second - visible_range_.first;
    return {buf.select(0, 0).narrow(2, a, len), buf.select(0, 1).narrow(2, a, len)};
  }
  return {buf.select(0, 0).index_select(2, visible_index_), buf.select(0, 1).index_select(2, visible_index_)};
}

at::Tensor KVCache::layer_buffer(int64_t layer) const {
  if (layer < 0 || layer >= shape_.num_layers) {
    std::ostringstream os;
    os << "layer " << layer << " outside [0, " << shape_.num_layers << ")";
    throw std::out_of_range(os.str());
  }
  return buffer_.select(0, layer);
}

void KVCache::commit() {
  table_.commit();
  pending_slots_.clear();
  refresh_visible();
}

void KVCache::rollback(int64_t frame) {
  table_.rollback(frame);
  pending_slots_.clear();
  refresh_visible();
}

}  // namespace sdvg
