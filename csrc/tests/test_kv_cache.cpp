// KV-cache buffers over libtorch (run with ctest when built with SDVG_WITH_TORCH).
#include <torch/torch.h>

#include <limits>
#include <string>

#include "check.h"
#include "../kv_cache.h"

using namespace sdvg;

static KVCache make(int64_t max_frames, int64_t sink = 0, int64_t window = 0, int64_t slack = 0) {
  SlotLayout l;
  l.max_frames = max_frames;
  l.sink_frames = sink;
  l.window_frames = window;
  l.slack_frames = slack;
  return KVCache({2, 1, 2, 4, 3}, l, at::kFloat, at::Device(at::kCPU));
}

static at::Tensor block(int64_t frames, float value) { return at::full({1, 2, frames * 3, 4}, value); }

static void test_write_overwrite_commit_view() {
  KVCache c = make(9);
  CHECK(c.nbytes() == 2 * 2 * 1 * 2 * 9 * 3 * 4 * 4);
  c.begin_write(3);
  c.write(0, block(3, 1), block(3, -1));
  c.begin_write(3);  // a later denoising pass overwrites the slot
  c.write(0, block(3, 2), block(3, -2));
  auto [k, v] = c.visible(0);
  CHECK(k.size(2) == 9 && k.eq(2).all().item<bool>() && v.eq(-2).all().item<bool>());
  CHECK(k.data_ptr() == c.layer_buffer(0).select(0, 0).data_ptr());  // a view, no copy
  c.commit();
  c.begin_write(3);
  c.write(0, block(3, 5), block(3, -5));
  auto [k2, v2] = c.visible(0);
  CHECK(k2.size(2) == 18 && k2.narrow(2, 0, 9).eq(2).all().item<bool>() && k2.narrow(2, 9, 9).eq(5).all().item<bool>());
  CHECK(throws([&] { c.write(0, block(2, 0), block(2, 0)); }));  // wrong size
}

static void test_write_tokens_only_touches_given_tokens() {
  // A windowed cache whose pending block wraps around the ring: tokens land in their frame's slot.
  KVCache c = make(30, 1, 6);
  for (int b = 0; b < 3; ++b) {
    c.begin_write(3);
    c.write(0, block(3, b + 1), block(3, b + 1));
    c.commit();
  }
  c.begin_write(3);
  c.write(0, block(3, 7), block(3, -7));
  at::Tensor before = c.buffer().clone();
  at::Tensor tokens = at::tensor(std::vector<int64_t>{0, 4, 8}, at::kLong);  // frame 0 t0, frame 1 t1, frame 2 t2
  c.begin_write(3);  // a later pass: only the active tokens are written
  c.write_tokens(0, at::full({1, 2, 3, 4}, 9.0f), at::full({1, 2, 3, 4}, -9.0f), tokens);
  auto [k, v] = c.visible(0);  // sink frame 0, frames 7..8 of the committed, then the 3 pending frames
  const int64_t base = k.size(2) - 9;
  for (int64_t i = 0; i < 9; ++i) {
    const bool written = i == 0 || i == 4 || i == 8;
    CHECK(k.select(2, base + i).eq(written ? 9.0f : 7.0f).all().item<bool>());
    CHECK(v.select(2, base + i).eq(written ? -9.0f : -7.0f).all().item<bool>());
  }
  CHECK(at::equal(before.select(0, 1), c.buffer().select(0, 1)));  // another layer: untouched
  CHECK(throws([&] { c.write_tokens(0, at::zeros({1, 2, 1, 4}), at::zeros({1, 2, 1, 4}),
                                     at::tensor(std::vector<int64_t>{9}, at::kLong)); }));  // past the block
  CHECK(throws([&] { c.write_tokens(0, at::zeros({1, 2, 2, 4}), at::zeros({1, 2, 2, 4}),
                                     at::tensor(std::vector<int64_t>{1}, at::kLong)); }));  // count mismatch
  c.commit();
  CHECK(throws([&] { c.write_tokens(0, at::zeros({1, 2, 1, 4}), at::zeros({1, 2, 1, 4}),
                                     at::tensor(std::vector<int64_t>{0}, at::kLong)); }));  // nothing pending
}

static void test_rollback_keeps_buffers() {
  KVCache c = make(9);
  for (int b = 0; b < 3; ++b) {
    c.begin_write(3);
    c.write(1, block(3, b + 1), block(3, b + 1));
    c.commit();
  }
  at::Tensor before = c.buffer().clone();
  c.rollback(3);
  CHECK(c.table().committed_frames() == 3);
  CHECK(at::equal(before, c.buffer()));
}

static void test_window_gathers_in_frame_order() {
  KVCache c = make(30, 1, 6);
  for (int b = 0; b < 6; ++b) {
    c.begin_write(3);
    c.write(0, block(3, b + 1), block(3, b + 1));
    if (b < 5) c.commit();
  }
  auto [k, v] = c.visible(0);  // sink frame (block 1), then blocks 5 and 6
  CHECK(k.size(2) == 7 * 3);
  CHECK(k.select(2, 0).eq(1).all().item<bool>());
  CHECK(k.narrow(2, 3, 9).eq(5).all().item<bool>() && k.narrow(2, 12, 9).eq(6).all().item<bool>());
}

static void test_sizes_beyond_2_63_are_refused() {
  SlotLayout l;
  l.max_frames = int64_t(1) << 40;  // 2^40 frames x 2^24 tokens: 2^64 elements and more
  const KVCacheShape huge{40, 1, 40, 128, int64_t(1) << 24};
  bool named = false;
  try {
    kv_cache_nbytes(huge, l, 2);
  } catch (const std::invalid_argument& e) {
    named = std::string(e.what()).find("exceeds 2^63") != std::string::npos;
  }
  CHECK(named);
  CHECK(throws([&] { KVCache(huge, l, at::kFloat, at::Device(at::kCPU)); }));  // refused before allocating
  SlotLayout small;
  small.max_frames = 9;
  CHECK(kv_cache_nbytes({2, 1, 2, 4, 3}, small, 4) == 2 * 2 * 1 * 2 * 9 * 3 * 4 * 4);
  const int64_t max = std::numeric_limits<int64_t>::max();
  CHECK(throws([&] { kv_cache_nbytes({max, 1, 1, 1, 1}, small, 1); }));  // max * 2 wraps
}

int main() {
  test_sizes_beyond_2_63_are_refused();
  test_write_overwrite_commit_view();
  test_write_tokens_only_touches_given_tokens();
  test_rollback_keeps_buffers();
  test_window_gathers_in_frame_order();
  return check_report("kv_cache");
}
