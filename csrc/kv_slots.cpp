#include "kv_slots.h"

#include <algorithm>
#include <sstream>

namespace sdvg {

namespace {
[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }
}  // namespace

FrameSlotTable::FrameSlotTable(const SlotLayout& layout) : layout_(layout) {
  if (layout.max_frames < 1) fail("KV cache max_frames must be >= 1, got " + std::to_string(layout.max_frames));
  if (layout.sink_frames < 0 || layout.window_frames < 0 || layout.slack_frames < 0)
    fail("KV cache sink/window/slack frames must be >= 0");
  if (layout.window_frames == 0) {
    if (layout.sink_frames != 0 || layout.slack_frames != 0)
      fail("KV cache sink_frames and slack_frames need a window (window_frames > 0)");
    num_slots_ = layout.max_frames;
    ring_ = 0;
  } else {
    int64_t with_sink = 0;
    if (__builtin_add_overflow(layout.window_frames, layout.slack_frames, &ring_) ||
        __builtin_add_overflow(layout.sink_frames, ring_, &with_sink))
      fail("KV cache window + slack + sink frames exceed 2^63 - 1; give a smaller window");
    // Never more slots than frames a video can reach.
    num_slots_ = std::min(layout.max_frames, with_sink);
  }
}

int64_t FrameSlotTable::slot_of(int64_t frame) const {
  if (frame < 0 || frame >= layout_.max_frames) {
    std::ostringstream os;
    os << "frame " << frame << " is outside the KV cache (max_frames " << layout_.max_frames
       << "); allocate the cache for more frames";
    fail(os.str());
  }
  if (!windowed() || frame < layout_.sink_frames) return frame;
  return layout_.sink_frames + (frame - layout_.sink_frames) % ring_;
}

std::vector<int64_t> FrameSlotTable::write(int64_t num_frames) {
  if (num_frames < 1) fail("KV cache write needs >= 1 frame, got " + std::to_string(num_frames));
  if (pending_ != 0 && pending_ != num_frames) {
    std::ostringstream os;
    os << "KV cache has " << pending_ << " pending frames; a write of " << num_frames
       << " frames must commit() or discard() them first";
    fail(os.str());
  }
  if (windowed() && num_frames > layout_.window_frames) {
    std::ostringstream os;
    os << "block of " << num_frames << " frames does not fit the attention window of "
       << layout_.window_frames << " frames";
    fail(os.str());
  }
  std::vector<int64_t> slots;
  slots.reserve(num_frames);
  for (int64_t f = committed_; f < committed_ + num_frames; ++f) slots.push_back(slot_of(f));
  pending_ = num_frames;
  high_water_ = std::max(high_water_, committed_ + pending_);
  return slots;
}

void FrameSlotTable::commit() {
  if (pending_ == 0) fail("KV cache commit() without a pending write");
  committed_ += pending_;
  pending_ = 0;
}

void FrameSlotTable::discard() { pending_ = 0; }

std::vector<int64_t> FrameSlotTable::visible_frames_until(int64_t end) const {
  std::vector<int64_t> frames;
  if (!windowed()) {
    for (int64_t f = 0; f < end; ++f) frames.push_back(f);
    return frames;
  }
  const int64_t sinks = std::min(layout_.sink_frames, end);
  for (int64_t f = 0; f < sinks; ++f) frames.push_back(f);
  for (int64_t f = std::max(sinks, end - layout_.window_frames); f < end; ++f) frames.push_back(f);
  return frames;
}

bool FrameSlotTable::can_rollback(int64_t frame, std::string* why) const {
  auto say = [&](const std::string& s) {
    if (why) *why = s;
    return false;
  };
  if (frame < 0 || frame > committed_) {
    std::ostringstream os;
    os << "cannot roll back to frame " << frame << ": committed frames are [0, " << committed_ << ")";
    return say(os.str());
  }
  if (!windowed()) return true;
  // A frame f (not a sink) is intact iff no later written frame shares its slot.
  for (int64_t f : visible_frames_until(frame)) {
    if (f < layout_.sink_frames) continue;
    if (f + ring_ < high_water_) {
      std::ostringstream os;
      os << "cannot roll back to frame " << frame << ": frame " << f << " was overwritten by frame "
         << f + ring_ << " (rollback depth " << high_water_ - frame << " > slack_frames "
         << layout_.slack_frames << "); allocate the cache with more slack_frames";
      return say(os.str());
    }
  }
  return true;
}

void FrameSlotTable::rollback(int64_t frame) {
  std::string why;
  if (!can_rollback(frame, &why)) fail(why);
  pending_ = 0;
  committed_ = frame;
}

std::vector<int64_t> FrameSlotTable::visible_frames() const { return visible_frames_until(end_frame()); }

std::vector<int64_t> FrameSlotTable::visible_slots() const {
  std::vector<int64_t> slots;
  for (int64_t f : visible_frames()) slots.push_back(slot_of(f));
  return slots;
}

std::pair<int64_t, int64_t> FrameSlotTable::visible_slot_range() const {
  const auto slots = visible_slots();
  if (slots.empty()) return {0, 0};
  for (size_t i = 1; i < slots.size(); ++i)
    if (slots[i] != slots[i - 1] + 1) return {-1, -1};
  return {slots.front(), slots.back() + 1};
}

}  // namespace sdvg
