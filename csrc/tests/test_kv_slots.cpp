// Unit tests of the KV-cache slot table (run with ctest).
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "check.h"
#include "../kv_slots.h"

using sdvg::FrameSlotTable;
using sdvg::SlotLayout;
using V = std::vector<int64_t>;



static SlotLayout layout(int64_t max_frames, int64_t sink = 0, int64_t window = 0, int64_t slack = 0) {
  SlotLayout l;
  l.max_frames = max_frames;
  l.sink_frames = sink;
  l.window_frames = window;
  l.slack_frames = slack;
  return l;
}

static void test_full_cache_write_commit_overwrite() {
  FrameSlotTable t(layout(9));
  CHECK(t.num_slots() == 9);
  CHECK(t.write(3) == (V{0, 1, 2}));
  CHECK(t.visible_frames() == (V{0, 1, 2}));
  CHECK(t.write(3) == (V{0, 1, 2}));  // second denoising pass overwrites the same slots
  CHECK(t.committed_frames() == 0 && t.pending_frames() == 3);
  t.commit();
  CHECK(t.committed_frames() == 3 && t.pending_frames() == 0);
  CHECK(t.write(3) == (V{3, 4, 5}));
  CHECK((t.visible_slot_range() == std::pair<int64_t, int64_t>{0, 6}));
  CHECK(throws([&] { t.write(2); }));  // pending count must match
  t.commit();
  CHECK(t.write(3) == (V{6, 7, 8}));
  t.commit();
  CHECK(throws([&] { t.write(3); }));  // past max_frames
  CHECK(throws([&] { t.commit(); }));  // nothing pending
}

static void test_rollback_moves_pointer_only() {
  FrameSlotTable t(layout(12));
  t.write(3);
  t.commit();
  t.write(3);
  t.commit();
  CHECK(t.committed_frames() == 6);
  t.rollback(3);
  CHECK(t.committed_frames() == 3);
  CHECK(t.visible_frames() == (V{0, 1, 2}));
  CHECK(t.write(3) == (V{3, 4, 5}));
  t.discard();
  CHECK(t.pending_frames() == 0);
  CHECK(throws([&] { t.rollback(4); }));  // cannot roll forward
  CHECK(throws([&] { t.rollback(-1); }));
}

static void test_window_with_sink_evicts_oldest_non_sink() {
  // 1 sink frame, window of 6 recent frames, no slack: 7 slots.
  FrameSlotTable t(layout(30, 1, 6));
  CHECK(t.num_slots() == 7);
  for (int b = 0; b < 4; ++b) {
    t.write(3);
    t.commit();
  }
  // 12 frames committed; visible = sink 0 + frames 6..11.
  CHECK(t.visible_frames() == (V{0, 6, 7, 8, 9, 10, 11}));
  auto slots = t.write(3);  // frames 12..14 evict 6..8
  CHECK(slots == (V{t.slot_of(12), t.slot_of(13), t.slot_of(14)}));
  CHECK(t.slot_of(12) == t.slot_of(6));
  CHECK(t.visible_frames() == (V{0, 9, 10, 11, 12, 13, 14}));
  CHECK(t.slot_of(0) == 0);  // the sink never moves
  // Without slack, rolling back past an eviction is refused with a reason.
  t.commit();
  std::string why;
  CHECK(!t.can_rollback(12, &why));
  CHECK(why.find("slack_frames") != std::string::npos);
  CHECK(throws([&] { t.write(7); }));  // a block larger than the window
}

static void test_window_slack_makes_rollback_exact() {
  FrameSlotTable t(layout(30, 1, 6, 3));
  CHECK(t.num_slots() == 10);
  for (int b = 0; b < 4; ++b) {
    t.write(3);
    t.commit();
  }
  auto before = t.visible_frames();
  t.write(3);
  t.commit();  // a speculative block
  CHECK(t.can_rollback(12));
  t.rollback(12);
  CHECK(t.visible_frames() == before);
  // Two blocks deep is more than 3 slack frames.
  t.write(3);
  t.commit();
  t.write(3);
  t.commit();
  CHECK(!t.can_rollback(12));
  CHECK(t.can_rollback(15));
}

static void test_bad_layouts() {
  CHECK(throws([] { FrameSlotTable t(layout(0)); }));
  CHECK(throws([] { FrameSlotTable t(layout(9, 1, 0)); }));  // sink without window
  CHECK(throws([] { FrameSlotTable t(layout(9, -1, 3)); }));
}

int main() {
  test_full_cache_write_commit_overwrite();
  test_rollback_moves_pointer_only();
  test_window_with_sink_evicts_oldest_non_sink();
  test_window_slack_makes_rollback_exact();
  test_bad_layouts();
  return check_report("kv_slots");
}
