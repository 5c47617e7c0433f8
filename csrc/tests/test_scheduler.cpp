// Scheduler state machine against a fake executor (run with ctest).
//
// The fake models every cache: a drafted or target block's value is a hash of the block index
// and of the exact context its model's cache holds, so a draft made on a wrong context (a missed
// rollback, a commit of the wrong latent) changes every later value and is caught.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "../scheduler.h"

using namespace sdvg;


struct Int : Value {
  explicit Int(uint64_t v) : v(v) { ++alive; }
  ~Int() override { --alive; }
  uint64_t v;
  static inline std::atomic<int> alive{0};  // values the scheduler (or a test) still holds
};
static uint64_t val(const Handle& h) { return static_cast<Int*>(h.get())->v; }
static Handle mk(uint64_t v) { return std::make_shared<Int>(v); }
static uint64_t mix(uint64_t a, uint64_t b) { return (a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2))) * 1099511628211ULL; }

struct FakeCache {
  std::vector<uint64_t> committed;
  uint64_t pending = 0;
  uint64_t context_hash(int salt) const {
    uint64_t h = salt;
    for (auto v : committed) h = mix(h, v);
    return h;
  }
};

// The routers of a test's video (sdvg/generation/routers.py's kinds); the scheduler knows none of them.
enum class RouterKind { Reward, Random, Pattern };

struct Fake : Executor {
  int F = 3;
  FakeCache drafter, target_cache;
  std::vector<uint64_t> vae;  // latents decoded so far (the causal cache)
  std::vector<double> scores;  // score per block (drafts)
  std::mutex mu;
  std::vector<std::string> log;
  std::vector<BlockRecord> emitted;
  // The forwards, counted where they are made (as sdvg's stages do): 4 steps per denoise (plus the
  // context rebuild of a recompute target past block 0), one per full-context commit.
  int steps = 4;
  bool target_recompute = false;
  int64_t drafter_forwards = 0, target_forwards = 0;
  std::vector<std::string> producers;  // "decode drafter 2", "score target 3": whose output, which block
  int target_sleep_ms = 0;  // a slow target and decode (run-ahead queue test)
  int decode_sleep_ms = 0;
  bool log_scores = false;

  void note(const std::string& s) {
    std::lock_guard<std::mutex> lk(mu);
    log.push_back(s);
  }
  Handle draft(int b) override {
    note("draft " + std::to_string(b));
    std::lock_guard<std::mutex> lk(mu);
    drafter_forwards += steps;
    return mk(mix(drafter.context_hash(1), b));
  }
  void drafter_commit_forward(int b, const Handle& x) override {
    note("dcommit " + std::to_string(b));
    std::lock_guard<std::mutex> lk(mu);
    drafter_forwards += 1;
    drafter.pending = val(x);
  }
  void drafter_cache_commit() override { drafter.committed.push_back(drafter.pending); }
  void drafter_cache_rollback(int64_t frame) override {
    note("rollback " + std::to_string(frame));
    drafter.committed.resize(frame / F);
  }
  Handle target(int b) override {
    note("target " + std::to_string(b));
    if (target_sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(target_sleep_ms));
    target_forwards += steps + (target_recompute && b > 0 ? 1 : 0);
    return mk(mix(target_cache.context_hash(2), b));
  }
  void target_commit_forward(int b, const Handle& x) override {
    note("tcommit " + std::to_string(b));
    if (!target_recompute) target_forwards += 1;
    target_cache.pending = val(x);
  }
  void target_cache_commit() override { target_cache.committed.push_back(target_cache.pending); }
  // A re-cache rewrites every committed entry of the role's cache under block b's conditioning, so a
  // re-cache made at another point of the order gives another video.
  int recache_sleep_ms = 0;
  void recache(Role r, int b) override {
    if (recache_sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(recache_sleep_ms));
    FakeCache& c = r == Role::Drafter ? drafter : target_cache;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (auto& v : c.committed) v = mix(v, 1000 + b);
      (r == Role::Drafter ? drafter_forwards : target_forwards) += 1;
    }
    note(std::string(r == Role::Drafter ? "drecache " : "trecache ") + std::to_string(b));  // made (logged when done)
  }
  void produced_by(const char* stage, Role r, int b) {
    std::lock_guard<std::mutex> lk(mu);
    producers.push_back(std::string(stage) + " " + role_name(r) + " " + std::to_string(b));
  }
  Handle decode(const Handle& x, Role r, int b) override {
    produced_by("decode", r, b);
    if (decode_sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(decode_sleep_ms));
    vae.push_back(val(x));
    uint64_t h = 3;
    for (auto v : vae) h = mix(h, v);
    return mk(h);
  }
  Scored score(const Handle& frames, Role r, int b) override {
    produced_by("score", r, b);
    if (log_scores) note("score");
    Scored s;
    s.score = static_cast<double>(val(frames) % 1000) / 1000.0;
    s.frame_scores = {s.score, s.score + 1};
    return s;
  }
  Handle vae_snapshot() override { return mk(vae.size()); }
  void vae_restore(const Handle& s) override { vae.resize(val(s)); }
  void emit(const BlockRecord& r) override {
    std::lock_guard<std::mutex> lk(mu);
    emitted.push_back(r);
  }
  // A whole video's plan, as sdvg/generation/plan.py's FixedPlan makes it from the options (`video`).
  int num_blocks = 0;
  bool force_first_reject = false, reward = false;
  double tau = 0.0, accept_prob = 0.0;
  std::vector<double> uniforms;  // random router: the block's U(0,1) draw
  std::vector<bool> pattern;     // pattern router: the decision per block (cycled)
  RouterKind router = RouterKind::Reward;
  BlockPlan plan(int b) override {
    BlockPlan p;
    p.stop = b >= num_blocks;
    if (p.stop) return p;
    p.last = b == num_blocks - 1;
    p.forced = b == 0 && force_first_reject;
    p.scored = router == RouterKind::Reward;
    p.tau = tau;
    if (router == RouterKind::Random) p.accept = uniforms.at(b) < accept_prob;
    if (router == RouterKind::Pattern) p.accept = pattern.at(b % pattern.size());
    return p;
  }
  SchedulerConfig video(const struct Cfg& c);
};

// A test's video: the scheduler's config and the options its fixed plan is made from.
struct Cfg : SchedulerConfig {
  RouterKind router = RouterKind::Reward;
  double tau = 0.0, accept_prob = 0.0;
  std::vector<double> uniforms;
  std::vector<bool> pattern;
  bool force_first_reject = false, skip_first_draft = false;
};

// The fake plans the video of `c`; the config the scheduler gets (skips_first_draft resolved as
// GenerationOptions.skips_first_draft resolves it).
SchedulerConfig Fake::video(const Cfg& c) {
  num_blocks = c.num_blocks;
  force_first_reject = c.force_first_reject;
  router = c.router;
  tau = c.tau;
  accept_prob = c.accept_prob;
  uniforms = c.uniforms;
  pattern = c.pattern;
  SchedulerConfig out = c;
  out.skips_first_draft = c.mode == Mode::Sdvg && c.skip_first_draft && c.force_first_reject && !c.own_context;
  return out;
}

// The scheduler has no defaults of its own: every test states the configuration it relies on.
static Cfg base_cfg(int n) {
  Cfg c;
  c.mode = Mode::Sdvg;
  c.num_blocks = n;
  c.frames_per_block = 3;
  c.drafter_steps = 4;
  c.drafter_recompute = false;
  c.target_recompute = false;
  c.run_ahead_blocks = 1;
  c.router = RouterKind::Reward;
  c.tau = 0.0;
  c.force_first_reject = true;
  c.own_context = false;
  c.skip_first_draft = true;
  c.lazy_target_commit = true;
  c.score_emitted = false;
  c.run_ahead = false;
  return c;
}

static Cfg pattern_cfg(std::vector<bool> pattern, bool run_ahead, bool own = false, int n = 6) {
  Cfg c = base_cfg(n);
  c.router = RouterKind::Pattern;
  c.pattern = std::move(pattern);
  c.run_ahead = run_ahead;
  c.own_context = own;
  return c;
}

static std::vector<uint64_t> latents(const Fake& f) {
  std::vector<uint64_t> out;
  for (auto& r : f.emitted) out.push_back(val(r.latents));
  return out;
}

static void test_sequential_call_order() {
  Fake f;
  Scheduler s(f.video(pattern_cfg({false, true, false}, false, false, 3)), f);
  s.run();
  const std::vector<std::string> want = {
      "target 0",                       // block 0: draft skipped (committed context), forced
      "dcommit 0", "tcommit 0",         // both caches take the target's block
      "draft 1", "dcommit 1",           // accepted: the drafter keeps its draft; target commit deferred
      "draft 2", "tcommit 1", "target 2",  // rejected: flush the deferred commit, then the target runs
  };
  CHECK(f.log == want);
  CHECK(f.emitted.size() == 3);
  CHECK(f.emitted[0].decision == Decision::Forced && !f.emitted[0].has_score);
  CHECK(f.emitted[1].decision == Decision::Accepted && val(f.emitted[1].latents) == val(f.emitted[1].draft_latents));
  CHECK(f.emitted[2].decision == Decision::Rejected);
  const auto& c = s.counters();
  CHECK(f.target_forwards == 4 + 1 + 1 + 4);
  CHECK(f.drafter_forwards == 4 + 4 + 2);
  CHECK(c.skipped_drafter_forwards == 4);
  // decode and score are told whose output they handle: the forced block and the rejected block's
  // target output, the drafts of blocks 1 and 2
  const std::vector<std::string> producers = {"decode target 0", "decode drafter 1", "score drafter 1",
                                              "decode drafter 2", "score drafter 2", "decode target 2"};
  CHECK(f.producers == producers);
  CHECK(c.skipped_target_commits == 1);  // block 2 is last
  CHECK(c.skipped_drafter_commits == 1);
}

static void test_trailing_accepts_cost_the_target_nothing() {
  Fake f;
  Scheduler s(f.video(pattern_cfg({false, true, true, true, true}, false, false, 5)), f);  // 0 forced, then all accepted
  s.run();
  int tcommits = 0;
  for (auto& l : f.log) tcommits += l.rfind("tcommit", 0) == 0;
  CHECK(tcommits == 1);  // only block 0, before the accepted run
  CHECK(s.counters().skipped_target_commits == 4);
  CHECK(f.target_forwards == 5);
}

static void test_run_ahead_equals_sequential(bool own) {
  std::vector<std::vector<bool>> patterns = {
      {false, true, false, true, true, false}, {false}, {true}, {false, false, true}};
  for (auto& p : patterns) {
    Fake a, b;
    Scheduler sa(a.video(pattern_cfg(p, false, own)), a);
    sa.run();
    Scheduler sb(b.video(pattern_cfg(p, true, own)), b);
    sb.run();
    CHECK(latents(a) == latents(b));
    CHECK(a.drafter.committed == b.drafter.committed);
    CHECK(a.target_cache.committed == b.target_cache.committed);
    for (size_t i = 0; i < a.emitted.size(); ++i) {
      CHECK(a.emitted[i].decision == b.emitted[i].decision);
      CHECK(val(a.emitted[i].frames) == val(b.emitted[i].frames));
    }
    CHECK(a.target_forwards == b.target_forwards);
    CHECK(a.producers == b.producers);
    CHECK(sa.counters().skipped_target_commits == sb.counters().skipped_target_commits);
    if (own) CHECK(sb.counters().redrafts == 0);  // `own`: the drafter never waits, never redrafts
  }
}

static void test_run_ahead_rolls_back_on_rejection() {
  Fake f;
  Scheduler s(f.video(pattern_cfg({false, true, false, true}, true, false, 4)), f);
  s.run();
  // Block 2 is rejected: the speculative commit of draft 2 is rolled back to frame 6, the
  // target's block 2 is committed instead, and draft 3 is made again.
  bool rolled = false;
  for (auto& l : f.log) rolled |= l == "rollback 6";
  CHECK(rolled);
  CHECK(s.counters().redrafts == 1);
  CHECK(f.emitted[3].redrafts == 1);
  CHECK(s.counters().speculative_drafts >= 2);
  Fake g;
  Scheduler q(g.video(pattern_cfg({false, true, false, true}, false, false, 4)), g);
  q.run();
  CHECK(latents(f) == latents(g));
  CHECK(f.drafter.committed == g.drafter.committed);
}

static void test_run_ahead_rolls_back_past_a_start_frames_prefix() {
  Fake f;
  Cfg c = pattern_cfg({false, true, false, true}, true, false, 4);
  c.prefix_frames = 3;  // a start frame's 3 latent frames before block 0: block 2 starts at frame 3 + 2 * 3
  Scheduler s(f.video(c), f);
  s.run();
  bool rolled = false, unshifted = false;
  for (auto& l : f.log) {
    rolled |= l == "rollback 9";
    unshifted |= l == "rollback 6";
  }
  CHECK(rolled && !unshifted);
}

static void test_reward_router_and_records() {
  Fake f;
  Cfg c = base_cfg(4);
  c.tau = 0.5;
  Scheduler s(f.video(c), f);
  s.run();
  for (int b = 1; b < 4; ++b) {
    const auto& r = f.emitted[b];
    CHECK(r.has_score && r.frame_scores.size() == 2);
    CHECK((r.decision == Decision::Accepted) == (r.score >= 0.5));
    CHECK(r.times[static_cast<int>(Stage::Draft)] > 0.0);
  }
}

static void test_stage_error_propagates_from_drafter_thread() {
  struct Failing : Fake {
    Handle draft(int b) override {
      if (b == 2) throw std::runtime_error("draft failed");
      return Fake::draft(b);
    }
  } f;
  Scheduler s(f.video(pattern_cfg({false, true}, true, false, 5)), f);
  bool threw = false;
  try {
    s.run();
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "draft failed";
  }
  CHECK(threw);
  CHECK(f.emitted.size() >= 1 && f.emitted.size() <= 2);  // blocks settled before the failure are kept
}

// The trace holds one span per stage call; on each thread the spans follow one another; with
// run-ahead the drafter's spans run beside the main thread's (stages that sleep make it visible).
static void test_trace_spans() {
  struct Slow : Fake {
    static void nap() { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }
    Handle draft(int b) override { nap(); return Fake::draft(b); }
    Handle target(int b) override { nap(); return Fake::target(b); }
    Handle decode(const Handle& x, Role r, int b) override { nap(); return Fake::decode(x, r, b); }
  };
  for (bool run_ahead : {false, true}) {
    Slow f;
    Scheduler s(f.video(pattern_cfg({false, true, true, false, true, true}, run_ahead)), f);
    s.run();
    const auto& tr = s.trace();
    size_t logged = 0, unlogged = 0;  // stage calls the fake logs (rollbacks are pointer moves, not stages)
    for (auto& l : f.log) logged += l.rfind("rollback", 0) != 0;
    for (auto& sp : tr) unlogged += sp.stage == Stage::Decode || sp.stage == Stage::Score;
    CHECK(tr.size() == logged + unlogged);
    double overlap = 0.0;
    std::vector<Span> main_spans;
    for (auto& sp : tr) {
      CHECK(sp.start_s >= 0.0 && sp.end_s >= sp.start_s && sp.end_s <= s.counters().scheduler_wall_s + 1e-9);
      CHECK(sp.main_thread == (run_ahead ? sp.stage != Stage::Draft && sp.stage != Stage::DrafterCommit : true));
      if (sp.main_thread) main_spans.push_back(sp);
    }
    // spans of one thread never overlap (each thread calls one stage at a time)
    for (bool main : {true, false}) {
      double last_end = 0.0;
      std::vector<Span> mine;
      for (auto& sp : tr) if (sp.main_thread == main) mine.push_back(sp);
      std::sort(mine.begin(), mine.end(), [](const Span& a, const Span& b) { return a.start_s < b.start_s; });
      for (auto& sp : mine) {
        CHECK(sp.start_s >= last_end - 1e-9);
        last_end = sp.end_s;
      }
    }
    for (auto& d : tr) {
      if (d.main_thread) continue;
      for (auto& m : main_spans) overlap += std::max(0.0, std::min(d.end_s, m.end_s) - std::max(d.start_s, m.start_s));
    }
    CHECK(run_ahead ? overlap > 0.003 : overlap == 0.0);
  }
}

static std::string config_error(const SchedulerConfig& c) {
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

static bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// What a run's std::logic_error says ("" when it runs through).
static std::string run_logic_error(Scheduler& s) {
  try {
    s.run();
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "";
}

// A config left as constructed has no blocks, frames or steps: validate() and the scheduler refuse it.
static void test_zero_config_is_invalid() {
  const SchedulerConfig zero;
  CHECK(zero.num_blocks == 0 && zero.frames_per_block == 0 && zero.drafter_steps == 0);
  CHECK(!zero.own_context && !zero.skips_first_draft && !zero.lazy_target_commit);
  CHECK(!zero.score_emitted && !zero.run_ahead);
  const std::string why = config_error(zero);
  CHECK(contains(why, "num_blocks 0 must be >= 1"));
  CHECK(contains(why, "frames_per_block 0 must be >= 1"));
  CHECK(contains(why, "drafter_steps 0 must be >= 1"));
  CHECK(contains(why, "run_ahead_blocks 0 must be >= 1"));
  Fake f;
  bool threw = false;
  try {
    Scheduler s(zero, f);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(config_error(base_cfg(1)).empty());
}

static void test_bad_config() {
  Cfg c = base_cfg(3);
  c.num_blocks = 0;
  CHECK(contains(config_error(c), "num_blocks 0"));
  c = base_cfg(3);
  c.live = true;
  CHECK(contains(config_error(c), "must be 0 for a live video"));
}

// A whole video's plan must end it: a block planned past num_blocks is an error, not a longer video.
static void test_plan_past_the_video_is_refused() {
  struct Endless : Fake {
    BlockPlan plan(int b) override {
      BlockPlan p = Fake::plan(0);  // never stops, never last
      p.forced = b == 0;
      return p;
    }
  } f;
  Scheduler s(f.video(pattern_cfg({false}, false, false, 2)), f);
  CHECK(contains(run_logic_error(s), "block 2 planned past the video's 2 blocks"));
}

// The random router's decision comes in the plan (the draw under the probability), as any router's
// that does not look at the draft; the scheduler holds no draws of its own.
static void test_random_router_decides_in_the_plan() {
  Fake f;
  Cfg c = base_cfg(4);
  c.router = RouterKind::Random;
  c.accept_prob = 0.5;
  c.uniforms = {0.9, 0.3, 0.7, 0.1};
  Scheduler s(f.video(c), f);
  s.run();
  CHECK(f.emitted.size() == 4);
  CHECK(f.emitted[1].decision == Decision::Accepted && f.emitted[2].decision == Decision::Rejected);
  CHECK(f.emitted[3].decision == Decision::Accepted);
}

// The name lists follow the enums; parsing refuses an unknown name and lists the choices.
static void test_names() {
  const std::vector<std::string> stages(std::begin(kStageNames), std::end(kStageNames));
  CHECK((stages ==
         std::vector<std::string>{"draft", "decode", "score", "target", "drafter_commit", "target_commit", "recache"}));
  CHECK(std::string(stage_name(Stage::TargetCommit)) == "target_commit");
  CHECK(std::string(decision_name(Decision::Rejected)) == "rejected");
  CHECK(std::string(mode_name(Mode::Draft)) == "draft");
  for (const char* m : kModeNames) CHECK(std::string(mode_name(parse_mode(m))) == m);
  std::string why;
  try {
    parse_mode("fast");
  } catch (const std::invalid_argument& e) {
    why = e.what();
  }
  CHECK(why == "unknown mode 'fast'; choose sdvg, target or draft");
  CHECK(std::size(kCounterNames) == 10 && std::string(kCounterNames[7]) == "scheduler_wall_s");
  CHECK(std::size(kConfigFieldNames) == 16 && std::string(kConfigFieldNames[0]) == "mode");
  CHECK(std::size(kPlanFieldNames) == 8 && std::string(kPlanFieldNames[0]) == "stop");
}

// A recompute target: each target denoise past block 0 adds one context forward; committing a block
// hands its latents over (the stage is called) but runs no forward and moves no pointer.
static void test_recompute_target_counts() {
  Fake f;
  f.steps = 5;
  f.target_recompute = true;
  Cfg c = pattern_cfg({false, true, false}, false, true, 3);
  c.target_recompute = true;
  Scheduler s(f.video(c), f);
  s.run();
  CHECK(f.target_forwards == 5 + (5 + 1));  // block 0 (no context yet), block 2 (rejected)
  CHECK(f.target_cache.committed.empty());              // no pointer move
  int tcommits = 0;
  for (auto& l : f.log) tcommits += l.rfind("tcommit", 0) == 0;
  CHECK(tcommits == 2);  // blocks 0 and 1 handed over (block 2 is last)
}

// Under `own` with run-ahead, the drafter runs exactly `run_ahead_blocks` drafts beyond the block
// the main thread is deciding when the target is slow (and never more).
static void test_run_ahead_queue_is_bounded() {
  for (int ahead : {1, 2, 3}) {
    Fake f;
    f.target_sleep_ms = 30;
    f.decode_sleep_ms = 30;  // the main thread takes a draft, then decodes it before scoring it
    f.log_scores = true;
    Cfg c = pattern_cfg({false}, true, true, 8);  // every block rejected: the target always runs
    c.run_ahead_blocks = ahead;
    Scheduler s(f.video(c), f);
    s.run();
    int scored = 0, lead = 0;
    for (auto& l : f.log) {
      if (l == "score") ++scored;
      if (l.rfind("draft ", 0) == 0) lead = std::max(lead, std::stoi(l.substr(6)) - scored);
    }
    CHECK(lead == ahead);
    CHECK(s.counters().redrafts == 0);
  }
}

// ------------------------------------------------------------------ live videos (config.live)
// A fake whose plans come from a list (past its end: stop); each plan call is logged with its block.
struct Planned : Fake {
  std::vector<BlockPlan> plans;
  std::vector<int> plan_calls;
  BlockPlan plan(int b) override {
    {
      std::lock_guard<std::mutex> lk(mu);
      plan_calls.push_back(b);
    }
    note("plan " + std::to_string(b));
    if (b >= static_cast<int>(plans.size())) {
      BlockPlan stop;
      stop.stop = true;
      return stop;
    }
    return plans[b];
  }
};

static Cfg live_cfg(bool run_ahead, bool own) {
  Cfg c = pattern_cfg({true}, run_ahead, own, 1);
  c.live = true;
  c.num_blocks = 0;
  return c;
}

static BlockPlan pattern_plan(bool accept, bool last = false) {
  BlockPlan p;
  p.accept = accept;
  p.last = last;
  return p;
}

static std::vector<std::string> stage_log(const Fake& f) {  // the log without the plan calls
  std::vector<std::string> out;
  for (auto& l : f.log)
    if (l.rfind("plan ", 0) != 0) out.push_back(l);
  return out;
}

// A live video planned exactly as the config would plan it is the same video, call for call.
static void test_live_plans_equal_the_config_plan() {
  const std::vector<bool> p = {false, true, false, true, true, false};
  for (bool own : {false, true}) {
    for (bool run_ahead : {false, true}) {
      Fake a;
      Scheduler sa(a.video(pattern_cfg(p, run_ahead, own)), a);
      sa.run();
      Planned b;
      for (size_t i = 0; i < p.size(); ++i) {
        b.plans.push_back(pattern_plan(p[i], i + 1 == p.size()));
        b.plans.back().forced = i == 0;
      }
      Scheduler sb(b.video(live_cfg(run_ahead, own)), b);
      sb.run();
      CHECK(latents(a) == latents(b));
      CHECK(a.drafter.committed == b.drafter.committed && a.target_cache.committed == b.target_cache.committed);
      if (!run_ahead) CHECK(a.log == stage_log(b));
      CHECK((b.plan_calls == std::vector<int>{0, 1, 2, 3, 4, 5}));  // once per block, in order; none past last
      CHECK(sa.counters().skipped_target_commits == sb.counters().skipped_target_commits);
    }
  }
}

// Per-block routers and forced blocks; a stop ends the video there, with nothing skipped (no last block).
static void test_live_per_block_plan_and_stop() {
  auto plans = [] {
    std::vector<BlockPlan> v(8);
    for (int b : {0, 1, 2, 3}) v[b].scored = true;  // the reward router: score >= tau
    v[0].forced = true;                     // block 0 (tau 0: accepted unless forced)
    v[1].tau = 0.0;                         // every score >= 0 is accepted
    v[2].tau = 2.0;                         // nothing reaches 2: rejected
    v[3].forced = true;                     // a forced block mid-video (a prompt switch)
    v[4] = pattern_plan(false);             // routers that decide without the draft: their decision
    v[5] = pattern_plan(true);              // (a random router's draw under its probability, say)
    v[6] = pattern_plan(true);
    v[7].stop = true;
    return v;
  };
  const std::vector<Decision> want = {Decision::Forced, Decision::Accepted, Decision::Rejected, Decision::Forced,
                                      Decision::Rejected, Decision::Accepted, Decision::Accepted};
  std::vector<uint64_t> first;
  for (bool own : {false, true}) {
    for (bool run_ahead : {false, true}) {
      Planned f;
      f.plans = plans();
      Scheduler s(f.video(live_cfg(run_ahead, own)), f);
      s.run();
      CHECK(f.emitted.size() == want.size());
      for (size_t i = 0; i < f.emitted.size() && i < want.size(); ++i) CHECK(f.emitted[i].decision == want[i]);
      CHECK((f.plan_calls == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
      CHECK(s.counters().skipped_target_commits == 0 && s.counters().skipped_drafter_commits == 0);
      // the forced block 3 under the committed context has no draft (skip_first_draft), as block 0
      bool drafted3 = false;
      for (auto& l : f.log) drafted3 |= l == "draft 3";
      CHECK(drafted3 == own);
      CHECK(s.counters().skipped_drafter_forwards == (own ? 0 : 2 * f.steps));
      if (!run_ahead) {
        first = own ? first : latents(f);
      } else if (!own) {
        CHECK(latents(f) == first);  // run-ahead: the same video
      }
    }
  }
}

// Under `committed` run-ahead the drafter does not draft a re-caching block over an undecided
// speculative commit: it waits for the decision, rolls back there, and never redrafts that block.
static void test_live_run_ahead_waits_before_a_recache() {
  Planned f;
  f.plans = {pattern_plan(false), pattern_plan(true), pattern_plan(false), pattern_plan(true), pattern_plan(true)};
  f.plans[0].forced = true;
  f.plans[3].drafter_recache = true;  // block 2 is rejected, block 3 re-caches
  Scheduler s(f.video(live_cfg(true, false)), f);
  s.run();
  const auto at = [&](const std::string& line) {
    return std::find(f.log.begin(), f.log.end(), line) - f.log.begin();
  };
  CHECK(at("rollback 6") < at("draft 3"));  // block 2's speculative commit undone before block 3 is drafted
  CHECK(std::count(f.log.begin(), f.log.end(), std::string("draft 3")) == 1);
  CHECK(f.emitted.size() == 5 && f.emitted[3].redrafts == 0);
  Planned g;  // sequential: the same video
  g.plans = f.plans;
  Scheduler q(g.video(live_cfg(false, false)), g);
  q.run();
  CHECK(latents(f) == latents(g) && f.drafter.committed == g.drafter.committed);
}

// Under `committed` run-ahead, a forced block that re-caches (a prompt switch) is not drafted: the
// lane re-caches the drafter for it beside the target's block, and the block is emitted only once
// that re-cache is made, as the sequential order has it (a live record counts its re-cache forwards).
static void test_live_run_ahead_recaches_an_undrafted_block_before_its_emission() {
  struct Recaching : Planned {
    void emit(const BlockRecord& r) override {
      note("emit " + std::to_string(r.index));
      Planned::emit(r);
    }
  };
  auto plans = [] {
    std::vector<BlockPlan> v = {pattern_plan(true), pattern_plan(true), pattern_plan(true), pattern_plan(true),
                                pattern_plan(true, true)};
    v[0].forced = true;
    v[2].forced = v[2].drafter_recache = true;  // the first block under a new prompt
    v[4].forced = v[4].drafter_recache = true;  // the last block: never committed, nothing to re-cache for
    return v;
  };
  Recaching f;
  f.plans = plans();
  f.recache_sleep_ms = 100;  // slower than the target's block and its decode
  Scheduler s(f.video(live_cfg(true, false)), f);
  s.run();
  const auto at = [&](const std::string& line) {
    return std::find(f.log.begin(), f.log.end(), line) - f.log.begin();
  };
  CHECK(at("drecache 2") < at("emit 2") && at("drecache 2") < at("dcommit 2"));
  CHECK(std::count(f.log.begin(), f.log.end(), std::string("drecache 2")) == 1);
  CHECK(at("drecache 4") == static_cast<long>(f.log.size()));  // none for the last block
  CHECK(at("draft 2") == static_cast<long>(f.log.size()));
  Recaching g;  // sequential: the drafter re-caches on the main thread, after the target's block; the same video
  g.plans = plans();
  Scheduler q(g.video(live_cfg(false, false)), g);
  q.run();
  CHECK(latents(f) == latents(g) && f.drafter.committed == g.drafter.committed);
  const auto at_g = [&](const std::string& line) {
    return std::find(g.log.begin(), g.log.end(), line) - g.log.begin();
  };
  CHECK(at_g("target 2") < at_g("drecache 2") && at_g("drecache 2") < at_g("dcommit 2"));
  CHECK(std::count(g.log.begin(), g.log.end(), std::string("drecache 2")) == 1);
  const double want = s.records()[2].times[static_cast<int>(Stage::Recache)];
  CHECK(want >= 0.1);  // timed under its own stage, where it was made (the lane's 100 ms)
}

// The target re-caches before its first work on a block whose plan asks it: its denoise when the
// block is rejected, or its commit when the block is accepted, held lazily or not; then exactly once.
static void test_target_recaches_before_its_first_work_on_the_block() {
  auto run = [](Planned& f, bool lazy, bool run_ahead, std::vector<bool> accept) {
    for (size_t b = 0; b < accept.size(); ++b) f.plans.push_back(pattern_plan(accept[b], b + 1 == accept.size()));
    f.plans[0].forced = true;
    f.plans[2].target_recache = f.plans[2].drafter_recache = true;  // block 2: a new prompt
    Cfg c = live_cfg(run_ahead, true);
    c.lazy_target_commit = lazy;
    Scheduler s(f.video(c), f);
    s.run();
  };
  const auto position = [](const Planned& f, const std::string& line) {
    return std::find(f.log.begin(), f.log.end(), line) - f.log.begin();
  };
  for (bool run_ahead : {false, true}) {
    // block 2 rejected: the held commit of block 1 under its own conditioning, then the re-cache, then the denoise
    Planned r;
    run(r, true, run_ahead, {false, true, false, true});
    CHECK(position(r, "tcommit 1") < position(r, "trecache 2") && position(r, "trecache 2") < position(r, "target 2"));
    CHECK(std::count(r.log.begin(), r.log.end(), std::string("trecache 2")) == 1);
    // block 2 accepted and held: the re-cache comes before its commit, made when block 3 is rejected
    Planned a;
    run(a, true, run_ahead, {false, true, true, false, true});
    CHECK(position(a, "tcommit 1") < position(a, "trecache 2") && position(a, "trecache 2") < position(a, "tcommit 2"));
    CHECK(position(a, "tcommit 2") < position(a, "target 3"));
    // the same video with every commit made at once
    Planned e;
    run(e, false, run_ahead, {false, true, true, false, true});
    CHECK(latents(a) == latents(e) && a.target_cache.committed == e.target_cache.committed);
    CHECK(a.target_forwards == e.target_forwards);
    // the drafter re-caches before its draft of block 2, once
    CHECK(position(a, "drecache 2") < position(a, "draft 2"));
    CHECK(std::count(a.log.begin(), a.log.end(), std::string("drecache 2")) == 1);
  }
}

// An unbounded video holds at most max_held_target_commits lazy commits: the oldest is committed
// past it, the target's cache ends up the same.
static void test_held_target_commits_are_capped() {
  std::vector<bool> p(12, true);
  p[0] = false;
  p[10] = false;  // the target runs again at block 10
  for (bool run_ahead : {false, true}) {
    Fake a, b;
    Scheduler sa(a.video(pattern_cfg(p, run_ahead, false, 12)), a);
    sa.run();
    Cfg c = pattern_cfg(p, run_ahead, false, 12);
    c.max_held_target_commits = 2;
    Scheduler sb(b.video(c), b);
    sb.run();
    CHECK(latents(a) == latents(b) && a.target_cache.committed == b.target_cache.committed);
    // capped: block 1's commit is made when block 3 is held (3 held > 2), before block 4 is drafted
    const auto at = [&](const std::string& line) { return std::find(b.log.begin(), b.log.end(), line) - b.log.begin(); };
    CHECK(at("tcommit 1") < at("target 10"));
    if (!run_ahead) CHECK(at("tcommit 1") < at("draft 4") && at("draft 3") < at("tcommit 1"));
    const auto at_a = [&](const std::string& line) { return std::find(a.log.begin(), a.log.end(), line) - a.log.begin(); };
    CHECK(at_a("tcommit 1") > at_a("draft 9"));  // uncapped: held until the target runs
  }
}

// The scheduler holds a block's tensors only while a thread can still use them: a long video keeps
// a bounded number alive (the emitted blocks are handed over and dropped by the fake).
static void test_long_live_video_holds_bounded_state() {
  struct Dropping : Planned {
    int most_alive = 0;
    void emit(const BlockRecord& r) override {
      std::lock_guard<std::mutex> lk(mu);
      most_alive = std::max(most_alive, Int::alive.load());
      BlockRecord kept = r;  // the decision and scores, not the tensors
      kept.latents = kept.frames = kept.draft_latents = nullptr;
      emitted.push_back(kept);
    }
  };
  for (bool run_ahead : {false, true}) {
    for (bool own : {false, true}) {
      Dropping f;
      for (int b = 0; b < 200; ++b) {
        f.plans.push_back(pattern_plan(b % 3 != 1));
        f.plans.back().forced = b == 0;
      }
      const int before = Int::alive.load();
      Scheduler s(f.video(live_cfg(run_ahead, own)), f);
      s.run();
      CHECK(f.emitted.size() == 200);
      CHECK(f.most_alive - before < 16);  // not one per block
    }
  }
}

// config.record_blocks keeps the records and spans of the last N emitted blocks (a long live video's
// times and trace stay bounded); the video and the kept records are those of a run that keeps all.
static void test_record_blocks_bounds_records_and_trace() {
  for (bool run_ahead : {false, true}) {
    for (bool own : {false, true}) {
      auto plans = [] {
        std::vector<BlockPlan> v;
        for (int b = 0; b < 200; ++b) {
          v.push_back(pattern_plan(b % 3 != 1, b == 199));
          v.back().forced = b == 0;
        }
        return v;
      };
      Planned all, kept;
      all.plans = kept.plans = plans();
      Scheduler sa(all.video(live_cfg(run_ahead, own)), all);
      sa.run();
      Cfg c = live_cfg(run_ahead, own);
      c.record_blocks = 8;
      Scheduler sk(kept.video(c), kept);
      sk.run();
      CHECK(latents(all) == latents(kept));
      CHECK(sa.first_record() == 0 && sa.records().size() == 200);
      CHECK(sk.first_record() >= 200 - 8 - 2 && sk.first_record() <= 200 - 8);
      CHECK(sk.records().size() == static_cast<size_t>(200 - sk.first_record()));
      for (size_t i = 0; i < sk.records().size(); ++i) {
        const BlockRecord& r = sk.records()[i];
        CHECK(r.index == sk.first_record() + static_cast<int>(i));
        CHECK(r.decision == sa.records()[r.index].decision);
      }
      size_t spans = 0;
      for (const Span& sp : sk.trace()) spans += sp.block >= sk.first_record();
      CHECK(sk.trace().size() <= spans + 8);  // a few dropped spans may wait behind later ones
      CHECK(spans < sa.trace().size() / 10);
    }
  }
}

static void test_live_config() {
  Cfg c = live_cfg(false, false);
  CHECK(config_error(c).empty());
  c.num_blocks = 4;
  CHECK(contains(config_error(c), "must be 0 for a live video"));
  c = base_cfg(3);
  c.max_held_target_commits = -1;
  CHECK(contains(config_error(c), "max_held_target_commits -1 must be >= 0"));
  c = base_cfg(3);
  c.record_blocks = -1;
  CHECK(contains(config_error(c), "record_blocks -1 must be >= 0"));
  struct Unplanned : Fake {  // an executor without plans, asked for one: a clear error
    BlockPlan plan(int b) override { return Executor::plan(b); }
  } f;
  Scheduler s(f.video(base_cfg(2)), f);
  CHECK(contains(run_logic_error(s), "this executor plans no blocks"));
}

int main() {
  test_live_plans_equal_the_config_plan();
  test_live_per_block_plan_and_stop();
  test_live_run_ahead_waits_before_a_recache();
  test_live_run_ahead_recaches_an_undrafted_block_before_its_emission();
  test_target_recaches_before_its_first_work_on_the_block();
  test_held_target_commits_are_capped();
  test_long_live_video_holds_bounded_state();
  test_record_blocks_bounds_records_and_trace();
  test_live_config();
  test_sequential_call_order();
  test_trailing_accepts_cost_the_target_nothing();
  test_run_ahead_equals_sequential(false);
  test_run_ahead_equals_sequential(true);
  test_run_ahead_rolls_back_on_rejection();
  test_run_ahead_rolls_back_past_a_start_frames_prefix();
  test_recompute_target_counts();
  test_run_ahead_queue_is_bounded();
  test_reward_router_and_records();
  test_stage_error_propagates_from_drafter_thread();
  test_trace_spans();
  test_zero_config_is_invalid();
  test_bad_config();
  test_plan_past_the_video_is_refused();
  test_random_router_decides_in_the_plan();
  test_names();
  return check_report("scheduler");
}
