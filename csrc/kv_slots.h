// Frame-slot bookkeeping for a block-causal KV cache (no tensors, no torch).
//
// A cache stores whole latent frames in slots. Frames [0, sink_frames) always
// live in slots [0, sink_frames). Without a window, frame f lives in slot f.
// With a window of W frames, the other frames live in a ring of W + slack
// slots, so the last W frames are always intact and a rollback of up to
// `slack` frames past the newest write restores exactly what was visible.
//
// Writing is two-phase: write(n) claims the slots of the n frames after the
// committed ones (repeated denoising passes overwrite the same slots), commit()
// advances the write pointer, discard() drops the pending frames, and
// rollback(frame) moves the pointer back without copying anything.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sdvg {

struct SlotLayout {
  int64_t max_frames = 0;     // frames one video may reach (absolute index bound)
  int64_t sink_frames = 0;    // first frames kept forever (window only)
  int64_t window_frames = 0;  // 0 = keep everything; else recent frames kept
  int64_t slack_frames = 0;   // extra ring slots that make rollback exact
};

class FrameSlotTable {
 public:
  explicit FrameSlotTable(const SlotLayout& layout);

  const SlotLayout& layout() const { return layout_; }
  bool windowed() const { return layout_.window_frames > 0; }
  int64_t num_slots() const { return num_slots_; }
  int64_t slot_of(int64_t frame) const;

  // Claim slots for the `num_frames` frames after the committed ones.
  // Calling it again with the same count (a later denoising pass) returns the
  // same slots. Returns the slot of each frame, in frame order.
  std::vector<int64_t> write(int64_t num_frames);
  void commit();
  void discard();
  // Move the write pointer back to `frame` (<= committed). Throws if a frame
  // that would be visible again has already been overwritten.
  void rollback(int64_t frame);
  bool can_rollback(int64_t frame, std::string* why = nullptr) const;

  int64_t committed_frames() const { return committed_; }
  int64_t pending_frames() const { return pending_; }
  int64_t end_frame() const { return committed_ + pending_; }
  int64_t high_water() const { return high_water_; }
  // Frames a forward pass attends to now (kept committed frames + pending), ascending.
  std::vector<int64_t> visible_frames() const;
  std::vector<int64_t> visible_slots() const;
  // If the visible slots are one ascending run, returns {first, last + 1}; else {-1, -1}.
  std::pair<int64_t, int64_t> visible_slot_range() const;

 private:
  std::vector<int64_t> visible_frames_until(int64_t end) const;
  SlotLayout layout_;
  int64_t num_slots_ = 0;
  int64_t ring_ = 0;
  int64_t committed_ = 0;
  int64_t pending_ = 0;
  int64_t high_water_ = 0;
};

}  // namespace sdvg
