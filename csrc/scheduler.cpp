#include "scheduler.h"

#include <climits>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace sdvg {

namespace {
struct Cancelled : std::runtime_error {
  Cancelled() : std::runtime_error("sdvg scheduler cancelled") {}
};

template <class E, size_t N>
const char* name_in(E e, const char* const (&names)[N]) {
  const auto i = static_cast<size_t>(e);
  return i < N ? names[i] : "?";
}

template <class E, size_t N>
E parse_in(const std::string& name, const char* const (&names)[N], const char* what) {
  for (size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<E>(i);
  std::ostringstream os;
  os << "unknown " << what << " '" << name << "'; choose ";
  for (size_t i = 0; i < N; ++i) os << (i == 0 ? "" : i + 1 == N ? " or " : ", ") << names[i];
  throw std::invalid_argument(os.str());
}
}  // namespace

const char* mode_name(Mode m) { return name_in(m, kModeNames); }
const char* decision_name(Decision d) { return name_in(d, kDecisionNames); }
const char* role_name(Role r) { return name_in(r, kRoleNames); }
const char* stage_name(Stage s) { return name_in(s, kStageNames); }
Mode parse_mode(const std::string& name) { return parse_in<Mode>(name, kModeNames, "mode"); }

void SchedulerConfig::validate() const {
  std::ostringstream os;
  if (!live && num_blocks < 1) os << "num_blocks " << num_blocks << " must be >= 1; ";
  if (live && num_blocks != 0)
    os << "num_blocks " << num_blocks << " must be 0 for a live video (its plan says where it stops); ";
  if (max_held_target_commits < 0) os << "max_held_target_commits " << max_held_target_commits << " must be >= 0; ";
  if (record_blocks < 0) os << "record_blocks " << record_blocks << " must be >= 0 (0: every block's record); ";
  if (frames_per_block < 1) os << "frames_per_block " << frames_per_block << " must be >= 1; ";
  if (prefix_frames < 0) os << "prefix_frames " << prefix_frames << " must be >= 0; ";
  if (drafter_steps < 1) os << "drafter_steps " << drafter_steps << " must be >= 1; ";
  if (run_ahead_blocks < 1) os << "run_ahead_blocks " << run_ahead_blocks << " must be >= 1; ";
  if (run_ahead && drafter_recompute && !own_context && mode == Mode::Sdvg)
    os << "a recompute drafter cannot roll back a speculative commit (run_ahead with the committed context); ";
  std::string msg = os.str();
  if (msg.empty()) return;
  msg.resize(msg.size() - 2);  // the last "; "
  throw std::invalid_argument("invalid scheduler config: " + msg);
}

BlockPlan Executor::plan(int block) {
  throw std::logic_error("sdvg scheduler: every video asks the executor for its blocks' plans (block " +
                         std::to_string(block) + "), but this executor plans no blocks");
}

void Executor::recache(Role role, int block) {
  throw std::logic_error(std::string("sdvg scheduler: a live plan re-caches the ") + role_name(role) + " for block " +
                         std::to_string(block) + ", but this executor does not implement recache");
}

Scheduler::Scheduler(SchedulerConfig config, Executor& executor) : cfg_(std::move(config)), ex_(executor) {
  cfg_.validate();
}

Scheduler::~Scheduler() {
  cancel();
  if (drafter_thread_.joinable()) drafter_thread_.join();
}

void Scheduler::cancel() {
  cancelled_.store(true);
  std::lock_guard<std::mutex> lk(mu_);
  cv_.notify_all();
}

void Scheduler::check_cancel() const {
  if (cancelled_.load()) throw Cancelled();
}

template <class F>
auto Scheduler::timed(int block, Stage stage, bool main_thread, F&& fn) -> decltype(fn()) {
  check_cancel();
  const auto t0 = Clock::now();
  auto account = [&] {
    const auto t1 = Clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    std::lock_guard<std::mutex> lk(mu_);
    if (block >= records_base_) {  // (a dropped block's record and spans are not kept)
      record(block).times[static_cast<int>(stage)] += dt;
      trace_.push_back({block, stage, main_thread, std::chrono::duration<double>(t0 - start_).count(),
                        std::chrono::duration<double>(t1 - start_).count()});
    }
    counters_.stage_call_s += dt;
    if (main_thread) counters_.main_stage_s += dt;
  };
  if constexpr (std::is_void_v<decltype(fn())>) {
    fn();
    account();
  } else {
    auto out = fn();
    account();
    return out;
  }
}

bool Scheduler::route(const BlockPlan& p, const Scored& s) const {
  if (!p.scored) return p.accept;  // the router decided without the draft (its decision is in the plan)
  if (!s.valid) throw std::invalid_argument("the block's router reads its score, but no reward model ran");
  return s.score >= p.tau;
}

// ------------------------------------------------------------------ per-block state
Scheduler::Slot& Scheduler::slot(int b) { return slots_[b]; }

BlockRecord& Scheduler::record(int b) {
  if (b < records_base_)
    throw std::logic_error("sdvg scheduler: block " + std::to_string(b) + "'s record was dropped (record_blocks)");
  while (records_base_ + static_cast<int>(records_.size()) <= b) {
    records_.emplace_back();
    records_.back().index = records_base_ + static_cast<int>(records_.size()) - 1;
  }
  return records_[b - records_base_];
}

void Scheduler::prune() {
  // the main thread reads a block's slot until it emits it; the lane reads block L's and L-1's
  const int keep_from = std::min(emitted_upto_, lane_at_ == INT_MAX ? INT_MAX : lane_at_ - 1);
  while (!slots_.empty() && slots_.begin()->first < keep_from) slots_.erase(slots_.begin());
  if (cfg_.record_blocks <= 0) return;
  // the records (and spans) of emitted blocks past the last record_blocks, none a thread still reads
  while (!records_.empty() && records_base_ < keep_from - cfg_.record_blocks) {
    records_.pop_front();
    ++records_base_;
  }
  while (!trace_.empty() && trace_.front().block < records_base_) trace_.pop_front();
}

BlockPlan Scheduler::plan_of(int b) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    Slot& s = slot(b);
    if (s.planned) return s.plan;
  }
  // One thread makes the plan; the other, arriving meanwhile, waits here and reads it (the executor's
  // plan may wait for input: mu_ is not held, so the thread ahead never stalls the one behind).
  std::lock_guard<std::mutex> call(plan_call_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    Slot& s = slot(b);
    if (s.planned) return s.plan;
    if (b != planned_)
      throw std::logic_error("sdvg scheduler: block " + std::to_string(b) + " planned out of order (next is " +
                             std::to_string(planned_) + ")");
  }
  check_cancel();
  BlockPlan p = ex_.plan(b);
  if (!cfg_.live && !p.stop && b >= cfg_.num_blocks)
    throw std::logic_error("sdvg scheduler: block " + std::to_string(b) + " planned past the video's " +
                           std::to_string(cfg_.num_blocks) + " blocks (its plan must stop or say last)");
  std::lock_guard<std::mutex> lk(mu_);
  Slot& s = slot(b);
  s.plan = p;
  s.planned = true;
  planned_ = b + 1;
  if (!p.stop) record(b);
  return p;
}

void Scheduler::run() {
  const auto t0 = Clock::now();
  start_ = t0;
  const bool lane = cfg_.run_ahead && cfg_.mode != Mode::Target;
  {
    std::lock_guard<std::mutex> lk(mu_);
    trace_.clear();
    records_.clear();
    records_base_ = 0;
    slots_.clear();
    pending_target_commits_.clear();
    planned_ = consumed_ = emitted_upto_ = 0;
    lane_at_ = lane ? 0 : INT_MAX;
  }
  if (lane) {
    drafter_thread_ = std::thread([this] {
      try {
        drafter_loop();
      } catch (const Cancelled&) {
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        drafter_error_ = std::current_exception();
        cancelled_.store(true);
        cv_.notify_all();
      }
    });
  }
  std::exception_ptr main_error;
  try {
    run_main();
  } catch (...) {
    main_error = std::current_exception();
    cancel();
  }
  if (drafter_thread_.joinable()) drafter_thread_.join();
  counters_.scheduler_wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (drafter_error_) std::rethrow_exception(drafter_error_);
  if (main_error) std::rethrow_exception(main_error);
}

// ------------------------------------------------------------------ drafter side
Handle Scheduler::drafter_draft(int b) {
  return timed(b, Stage::Draft, !cfg_.run_ahead, [&] { return ex_.draft(b); });
}

void Scheduler::drafter_commit(int b, const Handle& latents) {
  timed(b, Stage::DrafterCommit, !cfg_.run_ahead, [&] { ex_.drafter_commit_forward(b, latents); });
  if (cfg_.drafter_recompute) return;  // the latents joined the context: no forward, no pointer move
  ex_.drafter_cache_commit();
}

bool Scheduler::lane_recaches(const BlockPlan& p) const {
  return cfg_.run_ahead && cfg_.mode == Mode::Sdvg && p.forced && cfg_.skips_first_draft && p.drafter_recache &&
         !p.last;
}

void Scheduler::recache(Role role, int b, int charged, bool main_thread) {
  timed(charged, Stage::Recache, main_thread, [&] { ex_.recache(role, b); });
}

bool Scheduler::wait_decision(int b, Handle* emitted) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return slot(b).decided >= 0 || cancelled_.load(); });
  const Slot& s = slot(b);
  if (s.decided < 0) throw Cancelled();
  *emitted = s.emitted;
  return s.decided == 1;
}

bool Scheduler::resolve_speculative_commit(int b) {
  Handle emitted;
  if (wait_decision(b, &emitted)) return false;
  // the guess was wrong: undo it, commit the emitted (target's) block
  ex_.drafter_cache_rollback(cfg_.prefix_frames + static_cast<int64_t>(b) * cfg_.frames_per_block);
  drafter_commit(b, emitted);
  return true;
}

void Scheduler::drafter_loop() {
  const bool own = cfg_.mode == Mode::Draft || cfg_.own_context;
  bool speculative_prev = false;  // block b-1 was committed assuming it would be accepted
  struct Done {  // the lane reads no slot again, whatever ends it
    Scheduler* s;
    ~Done() {
      std::lock_guard<std::mutex> lk(s->mu_);
      s->lane_at_ = INT_MAX;
      s->prune();
    }
  } done{this};
  for (int b = 0;; ++b) {
    check_cancel();
    {  // the bounded queue: at most run_ahead_blocks drafts beyond the block being decided
      std::unique_lock<std::mutex> lk(mu_);
      lane_at_ = b;
      prune();
      cv_.wait(lk, [&] { return b - consumed_ < cfg_.run_ahead_blocks || cancelled_.load(); });
      if (cancelled_.load()) throw Cancelled();
    }
    const BlockPlan plan = plan_of(b);
    if (plan.stop) break;
    const bool forced = cfg_.mode == Mode::Sdvg && plan.forced;
    if (forced && cfg_.skips_first_draft) {  // no draft: the block's target output is committed
      if (speculative_prev) resolve_speculative_commit(b - 1);
      speculative_prev = false;
      if (lane_recaches(plan)) {  // re-cache now, beside the target's block; main waits for it
        recache(Role::Drafter, b, b, false);
        std::lock_guard<std::mutex> lk(mu_);
        slot(b).recached = true;
        cv_.notify_all();
      }
      Handle x;
      wait_decision(b, &x);
      if (!plan.last) drafter_commit(b, x);
      continue;
    }
    if (plan.drafter_recache) {
      if (speculative_prev) {  // never re-cache over an undecided commit
        resolve_speculative_commit(b - 1);
        speculative_prev = false;
      }
      recache(Role::Drafter, b, b, false);
    }
    Handle d = drafter_draft(b);
    if (speculative_prev) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        counters_.speculative_drafts += 1;
      }
      if (resolve_speculative_commit(b - 1)) {
        d = drafter_draft(b);
        std::lock_guard<std::mutex> lk(mu_);
        counters_.redrafts += 1;
        record(b).redrafts += 1;
      }
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      Slot& s = slot(b);
      s.draft = d;
      s.draft_ready = true;
      cv_.notify_all();
    }
    speculative_prev = false;
    if (plan.last) break;
    if (own) {
      drafter_commit(b, d);
    } else if (forced) {
      Handle x;
      wait_decision(b, &x);
      drafter_commit(b, x);
    } else {
      drafter_commit(b, d);  // assume acceptance; checked after the next draft
      speculative_prev = true;
    }
  }
}

// --------------------------------------------------------------------- main side
Handle Scheduler::obtain_draft(int b, const BlockPlan& plan) {
  if (!cfg_.run_ahead) {
    if (plan.drafter_recache) recache(Role::Drafter, b, b, true);
    return drafter_draft(b);
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return slot(b).draft_ready || cancelled_.load(); });
  Slot& s = slot(b);
  if (!s.draft_ready) throw Cancelled();
  consumed_ = b + 1;
  cv_.notify_all();
  Handle d = std::move(s.draft);  // the queue holds only drafts not yet taken
  s.draft = nullptr;
  return d;
}

void Scheduler::settle(int b, bool accepted, const Handle& emitted) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot& s = slot(b);
  s.decided = accepted ? 1 : 0;
  s.emitted = emitted;
  cv_.notify_all();
}

void Scheduler::commit_held_targets(int block, int count) {
  const size_t n = count < 0 ? pending_target_commits_.size()
                             : std::min(pending_target_commits_.size(), static_cast<size_t>(count));
  for (size_t i = 0; i < n; ++i) {
    const HeldCommit& held = pending_target_commits_[i];
    if (held.recache) recache(Role::Target, held.block, block, true);
    timed(block, Stage::TargetCommit, true, [&] { ex_.target_commit_forward(held.block, held.latents); });
    if (cfg_.target_recompute) continue;  // the latents joined the context: no forward, no pointer move
    ex_.target_cache_commit();
  }
  pending_target_commits_.erase(pending_target_commits_.begin(), pending_target_commits_.begin() + n);
}

void Scheduler::run_main() {
  for (int b = 0;; ++b) {
    check_cancel();
    const BlockPlan plan = plan_of(b);
    if (plan.stop) break;
    const bool last = plan.last;
    BlockRecord* rec_ptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      rec_ptr = &record(b);  // a deque's elements stay put as it grows
    }
    BlockRecord& rec = *rec_ptr;
    Handle x, frames, d;
    bool accepted = false;
    bool target_recached = false;  // the target's re-cache for this block is made (before its denoise)
    auto run_target = [&] {  // 4. the target denoises the same noise (lazy commits flushed first)
      commit_held_targets(b);
      if (plan.target_recache) recache(Role::Target, b, b, true);
      target_recached = true;
      return timed(b, Stage::Target, true, [&] { return ex_.target(b); });
    };
    if (cfg_.mode == Mode::Target) {
      x = run_target();
      frames = timed(b, Stage::Decode, true, [&] { return ex_.decode(x, Role::Target, b); });
      rec.decision = Decision::Target;
    } else if (cfg_.mode == Mode::Draft) {
      d = obtain_draft(b, plan);
      x = d;
      frames = timed(b, Stage::Decode, true, [&] { return ex_.decode(x, Role::Drafter, b); });
      rec.decision = Decision::Draft;
      accepted = true;
      settle(b, true, x);
      if (!cfg_.run_ahead && !last) drafter_commit(b, x);
    } else {
      const bool forced = plan.forced;
      Handle snap, draft_frames;
      Scored scored;
      if (forced && cfg_.skips_first_draft) {
        std::lock_guard<std::mutex> lk(mu_);
        counters_.skipped_drafter_forwards += cfg_.drafter_steps;
        consumed_ = b + 1;  // the block has no draft to take
        cv_.notify_all();
      } else {
        d = obtain_draft(b, plan);  // 1. draft (made here, or taken from the run-ahead lane)
        snap = ex_.vae_snapshot();  // 2. decode + score the draft
        draft_frames = timed(b, Stage::Decode, true, [&] { return ex_.decode(d, Role::Drafter, b); });
        scored = timed(b, Stage::Score, true, [&] { return ex_.score(draft_frames, Role::Drafter, b); });
        rec.has_score = scored.valid;
        rec.score = scored.score;
        rec.frame_scores = scored.frame_scores;
      }
      accepted = !forced && route(plan, scored);  // 3. route
      if (accepted) {
        x = d;
        frames = draft_frames;
        rec.decision = Decision::Accepted;
        if (cfg_.score_emitted) rec.emitted_scores = rec.frame_scores;
      } else {
        rec.decision = forced ? Decision::Forced : Decision::Rejected;
        if (d) ex_.vae_restore(snap);
        x = run_target();
        frames = timed(b, Stage::Decode, true, [&] { return ex_.decode(x, Role::Target, b); });
        if (cfg_.score_emitted)
          rec.emitted_scores =
              timed(b, Stage::Score, true, [&] { return ex_.score(frames, Role::Target, b); }).frame_scores;
      }
      settle(b, accepted, x);
      if (!cfg_.run_ahead && !last) {
        if (!d && plan.drafter_recache) recache(Role::Drafter, b, b, true);  // a forced block it did not draft
        drafter_commit(b, (cfg_.own_context && d) ? d : x);
      }
    }
    if (cfg_.mode != Mode::Draft) {  // 5. commit (the drafter's commit is above, or on its lane)
      if (!last) {
        pending_target_commits_.push_back({b, x, plan.target_recache && !target_recached});
        const int cap = cfg_.max_held_target_commits;
        if (!(cfg_.lazy_target_commit && accepted && cfg_.mode == Mode::Sdvg))
          commit_held_targets(b);
        else if (cap > 0 && static_cast<int>(pending_target_commits_.size()) > cap)
          commit_held_targets(b, 1);  // the oldest, in order: the same cache as committing it later
      } else {
        std::lock_guard<std::mutex> lk(mu_);
        counters_.skipped_target_commits += 1 + static_cast<int64_t>(pending_target_commits_.size());
        pending_target_commits_.clear();
      }
    }
    if (last && cfg_.mode != Mode::Target) {
      std::lock_guard<std::mutex> lk(mu_);
      counters_.skipped_drafter_commits += 1;
    }
    rec.latents = x;
    rec.frames = frames;
    rec.draft_latents = cfg_.mode == Mode::Sdvg ? d : nullptr;  // draft mode: the draft is the block
    BlockRecord snapshot;
    {
      std::lock_guard<std::mutex> lk(mu_);
      snapshot = rec;
      rec.latents = rec.frames = rec.draft_latents = nullptr;  // the block's tensors go with the emitted copy
    }
    if (lane_recaches(plan)) {  // the block is emitted with the drafter's re-cache for it made (sequential order)
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return slot(b).recached || cancelled_.load(); });
      if (!slot(b).recached) throw Cancelled();
    }
    ex_.emit(snapshot);
    std::lock_guard<std::mutex> lk(mu_);
    emitted_upto_ = b + 1;
    prune();
    if (last) break;  // nothing is planned past the last block
  }
}

}  // namespace sdvg
