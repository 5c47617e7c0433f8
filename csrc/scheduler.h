// The SDVG routing loop in C++: decisions, ordering, run-ahead, statistics.
//
// The scheduler knows nothing about tensors or Python: every piece of compute is a stage of an
// `Executor` (drafter denoise, target denoise, commit forwards, VAE decode, reward, VAE cache
// snapshot/restore, KV-cache pointer moves) and values travel as opaque handles. The same loop
// therefore runs eager modules, compiled modules or engines, and is unit-tested with fakes.
//
// Sequential order (run_ahead = false) is the reference loop of sdvg/reference.py, step for step.
// With run_ahead, a drafter thread drafts block b+1 while block b is decoded, scored and
// committed, assuming b is accepted; if b is rejected the drafter's KV pointer is rolled back,
// the target's block is committed instead and b+1 is drafted again. Under the `own` drafter
// context the drafter never waits. Every model sees the same sequence of operations on its own
// cache as in sequential order, so the output is identical.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sdvg {

enum class Mode { Sdvg = 0, Target = 1, Draft = 2 };
enum class RouterKind { Reward = 0, Random = 1, Pattern = 2 };
enum class Decision { Forced = 0, Accepted = 1, Rejected = 2, Target = 3, Draft = 4 };
enum class Stage { Draft = 0, Decode, Score, Target, DrafterCommit, TargetCommit, Count };
constexpr int kNumStages = static_cast<int>(Stage::Count);

const char* decision_name(Decision d);
const char* stage_name(Stage s);

struct SchedulerConfig {
  Mode mode = Mode::Sdvg;
  int num_blocks = 9;
  int frames_per_block = 3;
  int num_steps = 4;
  RouterKind router = RouterKind::Reward;
  double tau = -0.7;
  double accept_prob = 0.731;
  std::vector<double> uniforms;  // random router: one U(0,1) draw per block
  std::vector<bool> pattern;     // pattern router: decision per block (cycled)
  bool force_first_reject = true;
  bool own_context = false;  // drafter context policy: own drafts (true) or the emitted blocks
  bool skip_first_draft = true;
  bool lazy_target_commit = true;
  bool score_emitted = false;
  bool run_ahead = false;

  void validate() const;
  bool skips_first_draft() const {
    return mode == Mode::Sdvg && skip_first_draft && force_first_reject && !own_context;
  }
  bool forced(int b) const { return mode == Mode::Sdvg && b == 0 && force_first_reject; }
};

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
  int redrafts = 0;
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

struct Counters {
  int64_t target_forwards = 0;
  int64_t drafter_forwards = 0;
  int64_t skipped_drafter_forwards = 0;
  int64_t skipped_target_commits = 0;
  int64_t skipped_drafter_commits = 0;
  int64_t redrafts = 0;           // run-ahead drafts thrown away after a rejection
  int64_t speculative_drafts = 0;  // run-ahead drafts made before the previous decision
  double wall_s = 0.0;
  double stage_call_s = 0.0;  // time inside stage calls (all threads)
  double main_stage_s = 0.0;  // time inside stage calls on the main thread
};

// One executor per generation; stages may be called from two threads (main and drafter) when
// run_ahead is on, never the same stage concurrently.
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
  virtual Handle decode(const Handle& latents) = 0;  // advances the VAE cache
  virtual Scored score(const Handle& frames) = 0;
  virtual Handle vae_snapshot() = 0;
  virtual void vae_restore(const Handle& snapshot) = 0;
  virtual void emit(const BlockRecord& block) = 0;
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
  const std::vector<BlockRecord>& records() const { return records_; }
  // Every stage call, in the order they ended (both threads); read after run() returns.
  const std::vector<Span>& trace() const { return trace_; }

 private:
  using Clock = std::chrono::steady_clock;
  template <class F>
  auto timed(int block, Stage stage, bool main_thread, F&& fn) -> decltype(fn());
  bool route(int b, const Scored& s) const;
  void check_cancel() const;

  // main thread
  void run_main();
  void flush_target_commits(int block);
  Handle obtain_draft(int b);
  void settle(int b, bool accepted, const Handle& emitted);
  // drafter lane
  void drafter_loop();
  void drafter_commit(int b, const Handle& latents);
  Handle drafter_draft(int b);
  // shared state (guarded by mu_)
  bool wait_decision(int b, Handle* emitted);

  SchedulerConfig cfg_;
  Executor& ex_;
  Counters counters_;
  std::vector<BlockRecord> records_;
  std::vector<Span> trace_;
  Clock::time_point start_{};
  std::vector<std::pair<int, Handle>> pending_target_commits_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Handle> drafts_;
  std::vector<char> draft_ready_;
  std::vector<int> decided_;  // -1 unknown, 0 rejected / forced, 1 accepted
  std::vector<Handle> emitted_;
  std::atomic<bool> cancelled_{false};
  std::exception_ptr drafter_error_;
  std::thread drafter_thread_;
};

}  // namespace sdvg
