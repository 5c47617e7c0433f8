// The SDVG routing loop in C++: decisions, ordering, run-ahead, statistics.
//
// The scheduler knows nothing about tensors or Python: every piece of compute is a stage of an
// `Executor` (drafter denoise, target denoise, commit forwards, VAE decode, reward, VAE cache
// snapshot/restore, KV-cache pointer moves) and values travel as opaque handles. The same loop
// therefore runs eager modules, compiled modules or engines, and is unit-tested with fakes.
//
// Sequential order (run_ahead = false) is the reference loop of sdvg/generation/reference.py, step
// for step (its numbered steps are the numbered comments of run_main below).
// With run_ahead, a drafter thread drafts ahead while the main thread decodes, scores and
// commits. Under the `own` drafter context (the paper's rule) the drafter never waits for a
// decision: it drafts up to `run_ahead_blocks` blocks beyond the one being decided (a bounded
// queue). Under `committed` it drafts block b+1 assuming b is accepted; if b is rejected the
// drafter's KV pointer is rolled back, the target's block is committed instead and b+1 is drafted
// again. Every model sees the same sequence of operations on its own cache as in sequential
// order, so the output is identical.
//
// A role with a recompute context (Krea) rebuilds its cache inside its denoise stage; committing a
// block to it only hands the block's latents over (no forward, no pointer move).
//
// Every video is planned one block at a time by the executor (sdvg/generation/plan.py: a whole video's
// fixed plan or a live session): before its first work on block b, whichever thread reaches b first
// asks for the block's plan (`Executor::plan`: stop here, or produce it, last or not, forced or not,
// and how its draft is decided), once; the other thread reads the same plan. The video ends at the
// first block planned `stop`. The routing rule lives in Python (sdvg/generation/routers.py): a plan
// carries either the decision of a router that decides without looking at the draft (`accept`) or
// the threshold its block score is held to (`scored`, `tau`); the scheduler keeps no copy of a rule. A run-ahead drafter under the
// `committed` context never drafts a block whose conditioning changed (its plan's `drafter_recache`:
// the drafter first recomputes its context under the new conditioning) over a speculative commit not
// yet decided: it waits for the decision, so a rollback never has to undo a re-cache.
//
// A re-cache is a stage of its own (`Stage::Recache`, `Executor::recache`), made where the plan says:
// before a role's first work on the block (the drafter: its draft, or its commit of a block it did not
// draft; the target: its denoise, or its commit of the block, held or not), so both loops make the
// same forwards in the same order on each cache.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sdvg {

// Every name Python sees is spelled once, in the lists below: the enums, the structs, the name
// tuples of sdvg._C and the bindings are all generated from them, so none can drift from another.
// X(enumerator, "name")
#define SDVG_MODES(X) X(Sdvg, "sdvg") X(Target, "target") X(Draft, "draft")
#define SDVG_DECISIONS(X) \
  X(Forced, "forced") X(Accepted, "accepted") X(Rejected, "rejected") X(Target, "target") X(Draft, "draft")
#define SDVG_ROLES(X) X(Drafter, "drafter") X(Target, "target")
#define SDVG_STAGES(X)                                                        \
  X(Draft, "draft") X(Decode, "decode") X(Score, "score") X(Target, "target") \
  X(DrafterCommit, "drafter_commit") X(TargetCommit, "target_commit") X(Recache, "recache")

#define SDVG_ENUMERATOR_(id, name) id,
enum class Mode { SDVG_MODES(SDVG_ENUMERATOR_) };
enum class Decision { SDVG_DECISIONS(SDVG_ENUMERATOR_) };
enum class Role { SDVG_ROLES(SDVG_ENUMERATOR_) };
enum class Stage { SDVG_STAGES(SDVG_ENUMERATOR_) Count };
#undef SDVG_ENUMERATOR_
constexpr int kNumStages = static_cast<int>(Stage::Count);

#define SDVG_NAME_(id, name) name,
inline constexpr const char* kModeNames[] = {SDVG_MODES(SDVG_NAME_)};
inline constexpr const char* kDecisionNames[] = {SDVG_DECISIONS(SDVG_NAME_)};
inline constexpr const char* kRoleNames[] = {SDVG_ROLES(SDVG_NAME_)};
inline constexpr const char* kStageNames[] = {SDVG_STAGES(SDVG_NAME_)};
#undef SDVG_NAME_
static_assert(std::size(kStageNames) == static_cast<size_t>(kNumStages));

const char* mode_name(Mode m);
const char* decision_name(Decision d);
const char* role_name(Role r);
const char* stage_name(Stage s);
// Parse a name of the lists above; an unknown name is a std::invalid_argument listing the choices.
Mode parse_mode(const std::string& name);

// The scheduler's configuration. No field has a generation default here (those live in the Python
// configuration): every field is zero / false / empty (an enum: its first name) until set, and a
// config left so fails validate(). X(type, name, doc)
#define SDVG_CONFIG_FIELDS(X)                                                                              \
  X(Mode, mode, "sdvg | target | draft")                                                                   \
  X(int, num_blocks, "blocks in the video (>= 1)")                                                         \
  X(int, frames_per_block, "latent frames per block (>= 1)")                                               \
  X(int, prefix_frames, "latent frames before block 0 (a start frame's; >= 0): block b starts at prefix + b F") \
  X(int, drafter_steps, "drafter model calls per block denoise (>= 1; counted as skipped when not run)")   \
  X(bool, drafter_recompute, "drafter context rebuilt before each block (one more forward); commits record") \
  X(bool, target_recompute, "target context rebuilt before each block (one more forward); commits record")   \
  X(bool, own_context, "drafter context: its own drafts (true) or the emitted blocks (false)")             \
  X(bool, skips_first_draft, "sdvg mode: a forced block is not drafted (GenerationOptions.skips_first_draft)") \
  X(bool, lazy_target_commit, "commit accepted blocks into the target only when it next runs")             \
  X(bool, score_emitted, "also score the target's frames of rejected blocks")                              \
  X(bool, run_ahead, "a drafter thread drafts ahead while the current block is decoded, scored and committed") \
  X(int, run_ahead_blocks, "run-ahead: drafts the drafter may hold beyond the block being decided (>= 1)")   \
  X(bool, live, "an unbounded video: its plan alone says where it stops (num_blocks: 0)")                   \
  X(int, max_held_target_commits, "lazy target commits held at most, the oldest committed past it (0: no cap)") \
  X(int, record_blocks, "the records and trace spans of the last N emitted blocks kept, older ones dropped (0: all)")

struct SchedulerConfig {
#define SDVG_CONFIG_MEMBER_(type, name, doc) type name{};
  SDVG_CONFIG_FIELDS(SDVG_CONFIG_MEMBER_)
#undef SDVG_CONFIG_MEMBER_

  // Throws std::invalid_argument naming every field out of range.
  void validate() const;
};

// What the scheduler is told before block b (`Executor::plan`). X(type, name, doc)
#define SDVG_PLAN_FIELDS(X)                                                                                     \
  X(bool, stop, "the video ends before this block (nothing of it is made)")                                    \
  X(bool, last, "the video's last block: nothing is committed after it")                                       \
  X(bool, forced, "sdvg mode: the block goes to the target whatever the router says")                          \
  X(bool, drafter_recache, "the drafter re-caches its context under this block's conditioning first")          \
  X(bool, target_recache, "the target re-caches its context under this block's conditioning first")            \
  X(bool, scored, "the block's router reads its score: the draft is accepted when the score >= tau")        \
  X(double, tau, "scored: the threshold (a NaN score, a non-finite draft's, is below every tau)")             \
  X(bool, accept, "not scored: the router's decision, made without looking at the draft")

struct BlockPlan {
#define SDVG_PLAN_MEMBER_(type, name, doc) type name{};
  SDVG_PLAN_FIELDS(SDVG_PLAN_MEMBER_)
#undef SDVG_PLAN_MEMBER_
};

#define SDVG_PLAN_NAME_(type, name, doc) #name,
inline constexpr const char* kPlanFieldNames[] = {SDVG_PLAN_FIELDS(SDVG_PLAN_NAME_)};
#undef SDVG_PLAN_NAME_

#define SDVG_FIELD_NAME_(type, name, doc) #name,
inline constexpr const char* kConfigFieldNames[] = {SDVG_CONFIG_FIELDS(SDVG_FIELD_NAME_)};
#undef SDVG_FIELD_NAME_

struct Value {
  virtual ~Value() = default;
};
using Handle = std::shared_ptr<Value>;

struct Scored {
  bool valid = true;  // false when no reward model ran (random / pattern routers)
  double score = 0.0;
  std::vector<double> frame_scores;
};

struct BlockRecord {
  int index = 0;
  Decision decision = Decision::Rejected;
  Handle latents;        // the emitted block's latents
  Handle frames;         // its decoded frames
  Handle draft_latents;  // the drafter's proposal, if any
  bool has_score = false;
  double score = 0.0;
  std::vector<double> frame_scores;
  std::vector<double> emitted_scores;
  std::array<double, kNumStages> times{};  // seconds per stage (those known when emitted)
  int redrafts = 0;      // run-ahead drafts of this block thrown away after a rejection
};

// One stage call on the timeline: when it started and ended (seconds from the start of run()) and
// on which thread; `block` is the block being produced when the call was made.
struct Span {
  int block = 0;
  Stage stage = Stage::Draft;
  bool main_thread = true;
  double start_s = 0.0;
  double end_s = 0.0;
};

// What one run did. X(type, name, doc). The model forwards are counted where they are made (by the
// stages, in Python); the scheduler counts its own decisions.
#define SDVG_COUNTERS(X)                                                                                      \
  X(int64_t, target_forwards, "target forwards (denoising steps and commit forwards; counted by the stages)") \
  X(int64_t, drafter_forwards, "drafter forwards (denoising steps and commit forwards; counted by the stages)") \
  X(int64_t, skipped_drafter_forwards, "drafter steps not run (block 0's draft under the emitted context)")   \
  X(int64_t, skipped_target_commits, "target commits not run (the last block, accepted blocks left pending)") \
  X(int64_t, skipped_drafter_commits, "drafter commits not run (the last block)")                             \
  X(int64_t, redrafts, "run-ahead drafts thrown away after a rejection")                                      \
  X(int64_t, speculative_drafts, "run-ahead drafts made before the previous block's decision")                \
  X(double, scheduler_wall_s, "seconds from the start to the end of run()")                                   \
  X(double, stage_call_s, "seconds inside stage calls (all threads)")                                         \
  X(double, main_stage_s, "seconds inside stage calls on the main thread")

struct Counters {
#define SDVG_COUNTER_MEMBER_(type, name, doc) type name = 0;
  SDVG_COUNTERS(SDVG_COUNTER_MEMBER_)
#undef SDVG_COUNTER_MEMBER_
};

#define SDVG_COUNTER_NAME_(type, name, doc) #name,
inline constexpr const char* kCounterNames[] = {SDVG_COUNTERS(SDVG_COUNTER_NAME_)};
#undef SDVG_COUNTER_NAME_

// One executor per generation; stages may be called from two threads (main and drafter) when
// run_ahead is on, never the same stage concurrently. decode and score are told whose output they
// handle (`producer`) and for which block: a draft may be rejected, a target's block may not.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual Handle draft(int block) = 0;  // drafter denoises noise_b (K/V into its pending slot)
  virtual void drafter_commit_forward(int block, const Handle& latents) = 0;  // t = 0 forward
  virtual void drafter_cache_commit() = 0;
  virtual void drafter_cache_rollback(int64_t frame) = 0;
  virtual Handle target(int block) = 0;
  virtual void target_commit_forward(int block, const Handle& latents) = 0;
  virtual void target_cache_commit() = 0;
  virtual Handle decode(const Handle& latents, Role producer, int block) = 0;  // advances the VAE cache
  virtual Scored score(const Handle& frames, Role producer, int block) = 0;
  virtual Handle vae_snapshot() = 0;
  virtual void vae_restore(const Handle& snapshot) = 0;
  virtual void emit(const BlockRecord& block) = 0;
  // config.live: the plan of block b, asked once per block, in block order, from the thread that
  // reaches b first (the drafter's lane under run-ahead); it may wait (a live input's frames).
  virtual BlockPlan plan(int block);
  // The role re-caches its context under block b's conditioning (the block's plan asks it: a live
  // video's conditioning changed), before the role's first work on b.
  virtual void recache(Role role, int block);
};

class Scheduler {
 public:
  Scheduler(SchedulerConfig config, Executor& executor);
  ~Scheduler();
  // Runs the whole video; rethrows the first stage exception (after stopping the other thread).
  void run();
  // Ask a running scheduler to stop after the stage in flight (thread-safe).
  void cancel();
  bool cancelled() const { return cancelled_.load(); }
  const Counters& counters() const { return counters_; }
  // One record per planned block from first_record() on (config.record_blocks drops older ones as the
  // video goes); the handles of an emitted block are dropped (read them in emit).
  const std::deque<BlockRecord>& records() const { return records_; }
  int first_record() const { return records_base_; }
  // The stage calls, in the order they ended (both threads); read after run() returns. Under
  // config.record_blocks, those of blocks before first_record() are dropped (skip any left in place).
  const std::deque<Span>& trace() const { return trace_; }

 private:
  using Clock = std::chrono::steady_clock;
  template <class F>
  auto timed(int block, Stage stage, bool main_thread, F&& fn) -> decltype(fn());
  bool route(const BlockPlan& p, const Scored& s) const;
  void check_cancel() const;
  // The plan of block b: made once (the executor's, or the config's), then read by both threads.
  BlockPlan plan_of(int b);

  // main thread
  void run_main();
  // The oldest `count` held target commits (all: -1), in order, charged to `block`.
  void commit_held_targets(int block, int count = -1);
  Handle obtain_draft(int b, const BlockPlan& plan);
  // The role's re-cache for block b, where the plan asks it (charged to `charged`, the block being made).
  void recache(Role role, int b, int charged, bool main_thread);
  void settle(int b, bool accepted, const Handle& emitted);
  // drafter lane
  void drafter_loop();
  void drafter_commit(int b, const Handle& latents);
  Handle drafter_draft(int b);
  // The speculative commit of block b (committed context) is checked: on a rejection it is rolled
  // back and the emitted block committed instead. Returns whether it was rolled back.
  bool resolve_speculative_commit(int b);
  // Run-ahead: a forced block the lane does not draft, under a new conditioning, not the last: the lane
  // re-caches the drafter for it before its commit, and the main thread emits it only after that re-cache.
  bool lane_recaches(const BlockPlan& p) const;
  // shared state (guarded by mu_)
  bool wait_decision(int b, Handle* emitted);

  // One block in flight between the two threads; dropped once neither can read it again.
  struct Slot {
    bool planned = false;
    BlockPlan plan;
    Handle draft;           // run-ahead: the draft, until the main thread takes it
    bool draft_ready = false;
    int decided = -1;       // -1 unknown, 0 rejected / forced, 1 accepted
    Handle emitted;         // the emitted block's latents (what a committed drafter takes on a rejection)
    bool recached = false;  // run-ahead: the lane's drafter re-cached for this undrafted block
  };
  Slot& slot(int b);         // (under mu_) made on first use
  BlockRecord& record(int b);  // (under mu_) made on first use
  void prune();              // (under mu_) drop the slots no thread reads again

  SchedulerConfig cfg_;
  Executor& ex_;
  Counters counters_;
  std::deque<BlockRecord> records_;  // blocks records_base_.. (handles dropped once emitted)
  int records_base_ = 0;             // the block of records_.front()
  std::deque<Span> trace_;
  Clock::time_point start_{};
  struct HeldCommit {
    int block;
    Handle latents;
    bool recache;  // the target re-caches under the block's conditioning before this commit
  };
  std::vector<HeldCommit> pending_target_commits_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Slot> slots_;
  int planned_ = 0;                 // blocks planned so far (plans are made in block order)
  std::mutex plan_call_mu_;         // held while one thread makes a plan (never with mu_)
  int consumed_ = 0;  // drafts the main thread has taken (run-ahead's bounded queue)
  int emitted_upto_ = 0;            // blocks the main thread has emitted
  int lane_at_ = 0;                 // the block the drafter lane works on (INT_MAX once it is done)
  std::atomic<bool> cancelled_{false};
  std::exception_ptr drafter_error_;
  std::thread drafter_thread_;
};

}  // namespace sdvg
