// Preallocated per-layer K/V buffers for one causal DiT, driven by a FrameSlotTable.
#pragma once

#include <torch/types.h>

#include <tuple>
#include <vector>

#include "kv_slots.h"

namespace sdvg {

struct KVCacheShape {
  int64_t num_layers = 0;
  int64_t batch = 1;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t tokens_per_frame = 0;
};

// Bytes the buffers of a cache take, computable before allocation.
int64_t kv_cache_nbytes(const KVCacheShape& shape, const SlotLayout& layout, int64_t element_size);

class KVCache {
 public:
  KVCache(const KVCacheShape& shape, const SlotLayout& layout, at::ScalarType dtype, at::Device device);

  const KVCacheShape& shape() const { return shape_; }
  FrameSlotTable& table() { return table_; }
  const FrameSlotTable& table() const { return table_; }

  // Claim the slots of the next `num_frames` frames (see FrameSlotTable::write).
  void begin_write(int64_t num_frames);
  // Store layer `layer`'s K/V of the pending frames. k, v: [B, H, pending*tokens_per_frame, D].
  void write(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  // Store layer `layer`'s K/V of some pending tokens only (early exit: the active tokens of a step; the
  // others keep what an earlier pass wrote). k, v: [B, H, A, D]; tokens: [A] int64, indices into the
  // pending frames' tokens (0 <= i < pending*tokens_per_frame, frame-major), on any device.
  void write_tokens(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tokens);
  // K/V of every visible frame (ascending frame order): [B, H, visible*tokens_per_frame, D].
  // A view when the visible slots are contiguous, else a gathered copy.
  std::tuple<at::Tensor, at::Tensor> visible(int64_t layer) const;
  void commit();
  void rollback(int64_t frame);

  // Whole buffer of one layer: [2, B, H, num_slots*tokens_per_frame, D] (0 = K, 1 = V).
  at::Tensor layer_buffer(int64_t layer) const;
  at::Tensor buffer() const { return buffer_; }
  int64_t nbytes() const { return buffer_.numel() * buffer_.element_size(); }

 private:
  void refresh_visible();
  KVCacheShape shape_;
  FrameSlotTable table_;
  at::Tensor buffer_;  // [L, 2, B, H, num_slots*tokens_per_frame, D]
  std::vector<int64_t> pending_slots_;
  std::pair<int64_t, int64_t> visible_range_{0, 0};  // token range if contiguous
  at::Tensor visible_index_;                          // token indices otherwise
};

}  // namespace sdvg
