// Python executor for the C++ scheduler: each stage is a method of a typed Python object (a
// `StageCalls` subclass, through a pybind11 trampoline), entered with the GIL held only for the call itself; the KV-cache pointer moves go straight to the native
// caches. With CUDA, each role (drafter, target, VAE/reward) runs on its own stream; a handle
// carries an event recorded on its producer's stream, and a consumer's stream waits on it.
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kv_cache.h"
#include "scheduler.h"

#ifdef SDVG_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace sdvg {
namespace {

// The lanes that own a CUDA stream each: the drafter, the target, the VAE and reward.
enum class Lane { Drafter = 0, Target = 1, Vae = 2 };

struct PyHandle : Value {
  explicit PyHandle(py::object o) : obj(std::move(o)) {}
  ~PyHandle() override {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
  int id = 0;     // stream log: the handle's number, from its producer's record
  int lane = -1;  // stream log: the lane that produced it
#ifdef SDVG_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> ready;  // recorded on the producer's stream
#endif
};

// Copies a reference to the handle's object: only with the GIL held (checked, every call: the
// drafter thread runs beside the main one and Python's reference counts are not atomic).
py::object unwrap(const Handle& h) {
  if (!PyGILState_Check()) throw std::logic_error("sdvg scheduler: Python object used without the GIL");
  return h ? static_cast<PyHandle*>(h.get())->obj : py::none();
}

// ------------------------------------------------------------------ the typed Python boundary
// One emitted block as Python reads it (`StageCalls.emit`): every field the scheduler records.
struct EmittedBlock {
  int index = 0;
  std::string decision;
  py::object latents, frames, draft_latents;  // draft_latents: None outside sdvg mode or when skipped
  py::object score;                           // float, or None when the draft was not scored
  std::vector<double> frame_scores, emitted_scores;
  std::map<std::string, double> times;  // seconds per STAGE_NAMES entry, those known when emitted
  int redrafts = 0;                     // run-ahead drafts of this block thrown away after a rejection
};

// The stages a Python object implements for the scheduler (subclass `sdvg._C.StageCalls` and
// override every method; sdvg.generation.calls.StageCalls is sdvg's). Each runs on the calling
// thread's current stream (the role's own, with CUDA) with the GIL held.
class StageCalls {
 public:
  virtual ~StageCalls() = default;
  virtual py::object draft(int block) = 0;
  virtual void drafter_commit(int block, py::object latents) = 0;
  virtual py::object target(int block) = 0;
  virtual void target_commit(int block, py::object latents) = 0;
  virtual py::object decode(py::object latents, const std::string& producer, int block) = 0;
  virtual std::optional<Scored> score(py::object frames, const std::string& producer, int block) = 0;
  virtual py::object vae_snapshot() = 0;
  virtual void vae_restore(py::object snapshot) = 0;
  virtual void emit(const EmittedBlock& block) = 0;
  // Every video's block plan (sdvg/generation/plan.py), asked once per block in order.
  virtual BlockPlan plan(int block) {
    throw std::logic_error("sdvg scheduler: the scheduler asks StageCalls.plan(" + std::to_string(block) +
                           ") for every block, but this StageCalls does not override plan");
  }
  // The role ("drafter" | "target") re-caches its context under block b's conditioning (the block's plan asks it).
  virtual void recache(const std::string& role, int block) {
    throw std::logic_error("sdvg scheduler: a live plan asks StageCalls.recache(" + role + ", " +
                           std::to_string(block) + "), but this StageCalls does not override recache");
  }
};

// pybind11's trampoline: a Python subclass's methods are the overrides.
class PyStageCalls : public StageCalls {
 public:
  using StageCalls::StageCalls;
  py::object draft(int block) override { PYBIND11_OVERRIDE_PURE(py::object, StageCalls, draft, block); }
  void drafter_commit(int block, py::object latents) override {
    PYBIND11_OVERRIDE_PURE(void, StageCalls, drafter_commit, block, latents);
  }
  py::object target(int block) override { PYBIND11_OVERRIDE_PURE(py::object, StageCalls, target, block); }
  void target_commit(int block, py::object latents) override {
    PYBIND11_OVERRIDE_PURE(void, StageCalls, target_commit, block, latents);
  }
  py::object decode(py::object latents, const std::string& producer, int block) override {
    PYBIND11_OVERRIDE_PURE(py::object, StageCalls, decode, latents, producer, block);
  }
  std::optional<Scored> score(py::object frames, const std::string& producer, int block) override {
    PYBIND11_OVERRIDE_PURE(std::optional<Scored>, StageCalls, score, frames, producer, block);
  }
  py::object vae_snapshot() override { PYBIND11_OVERRIDE_PURE(py::object, StageCalls, vae_snapshot, ); }
  void vae_restore(py::object snapshot) override {
    PYBIND11_OVERRIDE_PURE(void, StageCalls, vae_restore, snapshot);
  }
  void emit(const EmittedBlock& block) override { PYBIND11_OVERRIDE_PURE(void, StageCalls, emit, block); }
  BlockPlan plan(int block) override { PYBIND11_OVERRIDE(BlockPlan, StageCalls, plan, block); }
  void recache(const std::string& role, int block) override {
    PYBIND11_OVERRIDE(void, StageCalls, recache, role, block);
  }
};

const char* lane_name(Lane r) { return r == Lane::Drafter ? "drafter" : r == Lane::Target ? "target" : "vae"; }

// Per-lane CUDA streams (a no-op on the CPU and in CPU builds). Made after `prepare`: every lane's
// stream first waits for what the setup queued on each device's current stream (the KV caches
// zeroed, the prompt K/V, the VAE cache). With a `log` (tests, any device) every lane exists and
// each stream operation is written down instead of made: "setup -> drafter", "record target #4",
// "wait vae on target #4" (the consumer's stream waits for the handle's producer event).
class StreamSet {
 public:
  StreamSet(at::Device drafter, at::Device target, bool log) : logging_(log) {
    if (logging_) {
      for (Lane r : {Lane::Drafter, Lane::Target, Lane::Vae}) note(std::string("setup -> ") + lane_name(r));
      return;
    }
#ifdef SDVG_WITH_CUDA
    if (drafter.is_cuda()) {
      streams_[0] = c10::cuda::getStreamFromPool(false, drafter.index());
      streams_[2] = c10::cuda::getStreamFromPool(false, drafter.index());
    }
    if (target.is_cuda()) streams_[1] = c10::cuda::getStreamFromPool(false, target.index());
    for (auto& s : streams_) {
      if (!s) continue;
      at::cuda::CUDAEvent setup;  // the setup's work on this device, in the order it was queued
      setup.record(c10::cuda::getCurrentCUDAStream(s->device_index()));
      setup.block(*s);
    }
#else
    (void)drafter;
    (void)target;
#endif
  }
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> lk(mu_);
    return log_;
  }
  bool active(Lane r) const {
#ifdef SDVG_WITH_CUDA
    return streams_[static_cast<int>(r)].has_value();
#else
    (void)r;
    return false;
#endif
  }

  // The consumer's stream waits for the handle's producer; tensors are marked as used there.
  // Called with the GIL held, inside the stage call's own GIL scope (THPVariable_Check may call
  // PyObject_IsInstance, which needs the GIL while the drafter thread runs beside this one).
  void consume(Lane r, const Handle& h) const {
    if (!h) return;
    auto* p = static_cast<PyHandle*>(h.get());
    if (logging_) {
      if (p->lane >= 0)
        note(std::string("wait ") + lane_name(r) + " on " + lane_name(static_cast<Lane>(p->lane)) + " #" +
             std::to_string(p->id));
      return;
    }
    consume_on_device(r, p);
  }
  void produced(Lane r, const Handle& h) const {
    if (!h) return;
    auto* p = static_cast<PyHandle*>(h.get());
    if (logging_) {
      std::lock_guard<std::mutex> lk(mu_);
      p->id = ++count_;
      p->lane = static_cast<int>(r);
      log_.push_back(std::string("record ") + lane_name(r) + " #" + std::to_string(p->id));
      return;
    }
    produced_on_device(r, p);
  }

 private:
  void note(std::string line) const {
    std::lock_guard<std::mutex> lk(mu_);
    log_.push_back(std::move(line));
  }
#ifdef SDVG_WITH_CUDA
 public:
  c10::cuda::CUDAStream stream(Lane r) const { return *streams_[static_cast<int>(r)]; }

 private:
  void consume_on_device(Lane r, PyHandle* p) const {
    if (!active(r)) return;
    if (p->ready) p->ready->block(stream(r));
    if (THPVariable_Check(p->obj.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(p->obj.ptr());
      if (t.is_cuda()) t.record_stream(stream(r));
    }
  }
  void produced_on_device(Lane r, PyHandle* p) const {
    if (!active(r)) return;
    auto ev = std::make_shared<at::cuda::CUDAEvent>();
    ev->record(stream(r));
    p->ready = std::move(ev);
  }
#else
  void consume_on_device(Lane, PyHandle*) const {}
  void produced_on_device(Lane, PyHandle*) const {}
#endif

  bool logging_ = false;
  mutable std::mutex mu_;
  mutable std::vector<std::string> log_;
  mutable int count_ = 0;
#ifdef SDVG_WITH_CUDA
  std::array<std::optional<c10::cuda::CUDAStream>, 3> streams_;
#endif
};

// Makes the lane's stream current for the duration of a stage call.
class LaneScope {
 public:
  LaneScope(const StreamSet& s, Lane r) {
#ifdef SDVG_WITH_CUDA
    if (s.active(r)) guard_.emplace(s.stream(r));
#else
    (void)s;
    (void)r;
#endif
  }

 private:
#ifdef SDVG_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

class PyExecutor : public Executor {
 public:
  // The caches of the roles `mode` runs are required (the scheduler moves their pointers itself).
  PyExecutor(Mode mode, py::object stages, py::object drafter_cache, py::object target_cache,
             at::Device drafter_device, at::Device target_device, bool log_streams)
      : stages_obj_(std::move(stages)),
        drafter_cache_obj_(std::move(drafter_cache)),
        target_cache_obj_(std::move(target_cache)),
        streams_(drafter_device, target_device, log_streams) {
    if (!py::isinstance<StageCalls>(stages_obj_))
      throw py::type_error("stages must be an sdvg._C.StageCalls subclass instance (sdvg.generation.calls."
                           "StageCalls), got " + py::str(py::type::handle_of(stages_obj_).attr("__name__"))
                                                     .cast<std::string>());
    stages_ = stages_obj_.cast<StageCalls*>();
    drafter_cache_ = cache_of(drafter_cache_obj_, "drafter", mode != Mode::Target, mode);
    target_cache_ = cache_of(target_cache_obj_, "target", mode != Mode::Draft, mode);
  }
  ~PyExecutor() override {
    py::gil_scoped_acquire gil;
    stages_obj_ = py::object();
    drafter_cache_obj_ = py::object();
    target_cache_obj_ = py::object();
  }

  Handle draft(int b) override {
    return produce(Lane::Drafter, [&] { return stages_->draft(b); });
  }
  void drafter_commit_forward(int b, const Handle& x) override {
    consume_call(Lane::Drafter, x, [&] { stages_->drafter_commit(b, unwrap(x)); });
  }
  void drafter_cache_commit() override { used(drafter_cache_, "drafter").commit(); }
  void drafter_cache_rollback(int64_t frame) override { used(drafter_cache_, "drafter").rollback(frame); }
  Handle target(int b) override {
    return produce(Lane::Target, [&] { return stages_->target(b); });
  }
  void target_commit_forward(int b, const Handle& x) override {
    consume_call(Lane::Target, x, [&] { stages_->target_commit(b, unwrap(x)); });
  }
  void target_cache_commit() override { used(target_cache_, "target").commit(); }
  std::vector<std::string> stream_log() const { return streams_.log(); }
  Handle decode(const Handle& x, Role producer, int b) override {
    return produce(Lane::Vae, [&] {
      streams_.consume(Lane::Vae, x);
      return stages_->decode(unwrap(x), role_name(producer), b);
    });
  }
  Scored score(const Handle& frames, Role producer, int b) override {
    LaneScope scope(streams_, Lane::Vae);
    py::gil_scoped_acquire gil;
    streams_.consume(Lane::Vae, frames);
    std::optional<Scored> out = stages_->score(unwrap(frames), role_name(producer), b);
    if (out) return *out;
    Scored none;  // no reward model ran
    none.valid = false;
    none.score = std::nan("");
    return none;
  }
  Handle vae_snapshot() override {
    py::gil_scoped_acquire gil;
    return std::make_shared<PyHandle>(stages_->vae_snapshot());
  }
  void vae_restore(const Handle& s) override {
    py::gil_scoped_acquire gil;
    stages_->vae_restore(unwrap(s));
  }
  // On the VAE lane, after the block's tensors are ready there: the host copies of `emit` and the
  // emitted pixels a recompute role re-encodes later are ordered after their producers.
  void emit(const BlockRecord& r) override {
    LaneScope scope(streams_, Lane::Vae);
    py::gil_scoped_acquire gil;
    for (const Handle* h : {&r.latents, &r.frames, &r.draft_latents}) streams_.consume(Lane::Vae, *h);
    EmittedBlock e;
    e.index = r.index;
    e.decision = decision_name(r.decision);
    e.latents = unwrap(r.latents);
    e.frames = unwrap(r.frames);
    e.draft_latents = unwrap(r.draft_latents);
    e.score = r.has_score ? py::object(py::float_(r.score)) : py::none();
    e.frame_scores = r.frame_scores;
    e.emitted_scores = r.emitted_scores;
    for (int i = 0; i < kNumStages; ++i) e.times[stage_name(static_cast<Stage>(i))] = r.times[i];
    e.redrafts = r.redrafts;
    stages_->emit(e);
  }
  // On the calling thread (the lane ahead, or the main thread), with the GIL for the call only.
  BlockPlan plan(int b) override {
    py::gil_scoped_acquire gil;
    return stages_->plan(b);
  }
  // On the role's lane, after what that lane made before (its cache's last commit).
  void recache(Role role, int b) override {
    LaneScope scope(streams_, role == Role::Drafter ? Lane::Drafter : Lane::Target);
    py::gil_scoped_acquire gil;
    stages_->recache(role_name(role), b);
  }

 private:
  // Runs `call` on the lane's stream with the GIL held: every Python object it makes (the
  // arguments, the result) is created and released under the GIL, also on the drafter thread.
  template <class Call>
  Handle produce(Lane r, Call&& call) {
    Handle h;
    {
      LaneScope scope(streams_, r);
      py::gil_scoped_acquire gil;
      h = std::make_shared<PyHandle>(call());
    }
    streams_.produced(r, h);
    return h;
  }
  template <class Call>
  void consume_call(Lane r, const Handle& x, Call&& call) {
    LaneScope scope(streams_, r);
    py::gil_scoped_acquire gil;
    streams_.consume(r, x);
    call();
  }
  static KVCache* cache_of(const py::object& obj, const char* role, bool needed, Mode mode) {
    if (obj.is_none()) {
      if (needed)
        throw std::logic_error(std::string("sdvg scheduler: mode '") + mode_name(mode) + "' runs the " + role +
                               ", but " + role + "_cache is None");
      return nullptr;
    }
    if (!py::isinstance<KVCache>(obj))
      throw py::type_error(std::string(role) + "_cache must be an sdvg._C.KVCache or None, got " +
                           py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
    return obj.cast<KVCache*>();
  }
  // Checked at construction; a call for a role without a cache is a scheduler bug.
  static KVCache& used(KVCache* cache, const char* role) {
    if (!cache)
      throw std::logic_error(std::string("sdvg scheduler: the ") + role + " cache is used, but none was given");
    return *cache;
  }

  py::object stages_obj_, drafter_cache_obj_, target_cache_obj_;
  StageCalls* stages_ = nullptr;  // stages_obj_'s C++ base (the trampoline dispatches to Python)
  KVCache* drafter_cache_ = nullptr;
  KVCache* target_cache_ = nullptr;
  StreamSet streams_;
};

// ---------------------------------------------------------------- SchedulerConfig(**kwargs)
std::string type_name(py::handle v) { return py::str(py::type::handle_of(v).attr("__name__")).cast<std::string>(); }

[[noreturn]] void wrong_type(const char* field, const char* want, py::handle v) {
  throw py::type_error(std::string("SchedulerConfig field '") + field + "' must be " + want + ", got " +
                       type_name(v) + " " + py::repr(v).cast<std::string>());
}

bool is_number(py::handle v) { return !PyBool_Check(v.ptr()) && (PyFloat_Check(v.ptr()) || PyIndex_Check(v.ptr())); }

// One converter per field type, strict: a bool is not an int, an int is not a bool, None is neither.
template <class T>
T from_py(const char* field, py::handle v);

template <>
Mode from_py<Mode>(const char* field, py::handle v) {
  if (!py::isinstance<py::str>(v)) wrong_type(field, "a str (sdvg, target or draft)", v);
  return parse_mode(v.cast<std::string>());
}
template <>
int from_py<int>(const char* field, py::handle v) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) wrong_type(field, "an int", v);
  auto i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow || x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    throw py::value_error(std::string("SchedulerConfig field '") + field + "' = " + py::repr(v).cast<std::string>() +
                          " is out of range");
  return static_cast<int>(x);
}
template <>
double from_py<double>(const char* field, py::handle v) {
  if (!is_number(v)) wrong_type(field, "a number", v);
  return py::float_(py::reinterpret_borrow<py::object>(v)).cast<double>();
}
template <>
bool from_py<bool>(const char* field, py::handle v) {
  if (!PyBool_Check(v.ptr())) wrong_type(field, "a bool", v);
  return v.ptr() == Py_True;
}
// Field values as Python reads them back (mode as its name).
template <class T>
py::object to_py(const T& v) {
  return py::cast(v);
}
py::object to_py(Mode m) { return py::str(mode_name(m)); }

template <size_t N>
py::tuple names_tuple(const char* const (&names)[N]) {
  py::tuple t(N);
  for (size_t i = 0; i < N; ++i) t[i] = py::str(names[i]);
  return t;
}

template <size_t N>
std::string joined(const char* const (&names)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) s += (i ? ", " : "") + std::string(names[i]);
  return s;
}

SchedulerConfig config_from_kwargs(const py::kwargs& kw) {
  std::vector<std::string> unknown, missing;
  for (auto item : kw) {
    const auto key = py::str(item.first).cast<std::string>();
    bool known = false;
    for (const char* f : kConfigFieldNames) known |= key == f;
    if (!known) unknown.push_back(key);
  }
  for (const char* f : kConfigFieldNames)
    if (!kw.contains(f)) missing.emplace_back(f);
  auto quoted = [](const std::vector<std::string>& keys) {
    std::string s = keys.size() == 1 ? "field " : "fields ";
    for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", '" : "'") + keys[i] + "'";
    return s;
  };
  if (!unknown.empty())
    throw py::value_error("SchedulerConfig: unknown " + quoted(unknown) + "; the fields are " +
                          joined(kConfigFieldNames));
  if (!missing.empty())
    throw py::value_error("SchedulerConfig: missing " + quoted(missing) + "; every field is required: " +
                          joined(kConfigFieldNames));
  SchedulerConfig c;
#define SDVG_FROM_PY_(type, name, doc) c.name = from_py<type>(#name, kw[#name]);
  SDVG_CONFIG_FIELDS(SDVG_FROM_PY_)
#undef SDVG_FROM_PY_
  c.validate();
  return c;
}

BlockPlan plan_from_kwargs(const py::kwargs& kw) {
  std::vector<std::string> unknown;
  for (auto item : kw) {
    const auto key = py::str(item.first).cast<std::string>();
    bool known = false;
    for (const char* f : kPlanFieldNames) known |= key == f;
    if (!known) unknown.push_back(key);
  }
  if (!unknown.empty())
    throw py::value_error("BlockPlan: unknown field '" + unknown.front() + "'; the fields are " +
                          joined(kPlanFieldNames));
  BlockPlan p;
  auto as_plan_error = [](const std::string& what) {  // the converters speak of SchedulerConfig fields
    const std::string prefix = "SchedulerConfig field";
    return what.rfind(prefix, 0) == 0 ? "BlockPlan field" + what.substr(prefix.size()) : what;
  };
  try {
#define SDVG_PLAN_FROM_PY_(type, name, doc) \
  if (kw.contains(#name)) p.name = from_py<type>(#name, kw[#name]);
    SDVG_PLAN_FIELDS(SDVG_PLAN_FROM_PY_)
#undef SDVG_PLAN_FROM_PY_
  } catch (const py::type_error& e) {
    throw py::type_error(as_plan_error(e.what()));
  } catch (const py::value_error& e) {
    throw py::value_error(as_plan_error(e.what()));
  }
  if (p.tau != p.tau) throw py::value_error("BlockPlan: tau must not be NaN");
  return p;
}

std::string config_repr(const SchedulerConfig& c) {
  std::string s = "SchedulerConfig(";
  const char* sep = "";
#define SDVG_REPR_(type, name, doc)                                                   \
  s += sep + std::string(#name) + "=" + py::repr(to_py(c.name)).cast<std::string>(); \
  sep = ", ";
  SDVG_CONFIG_FIELDS(SDVG_REPR_)
#undef SDVG_REPR_
  return s + ")";
}

py::dict counters_dict(const Counters& c) {
  py::dict d;
#define SDVG_COUNTER_ITEM_(type, name, doc) d[#name] = c.name;
  SDVG_COUNTERS(SDVG_COUNTER_ITEM_)
#undef SDVG_COUNTER_ITEM_
  return d;
}

class PyScheduler {
 public:
  PyScheduler(const SchedulerConfig& config, py::object stages, py::object drafter_cache, py::object target_cache,
              at::Device drafter_device, at::Device target_device, bool log_streams)
      : executor_(config.mode, std::move(stages), std::move(drafter_cache), std::move(target_cache), drafter_device,
                  target_device, log_streams),
        scheduler_(config, executor_) {}
  std::vector<std::string> stream_log() const { return executor_.stream_log(); }

  void run() {
    py::gil_scoped_release nogil;  // stage calls take the GIL back for themselves
    scheduler_.run();
  }
  void cancel() { scheduler_.cancel(); }
  Counters counters() const { return scheduler_.counters(); }
  py::list trace() const {
    py::list out;
    for (const auto& sp : scheduler_.trace()) {
      if (sp.block < scheduler_.first_record()) continue;  // a dropped block's span left in place
      py::dict d;
      d["block"] = sp.block;
      d["stage"] = stage_name(sp.stage);
      d["thread"] = sp.main_thread ? "main" : "drafter";
      d["start_s"] = sp.start_s;
      d["end_s"] = sp.end_s;
      out.append(d);
    }
    return out;
  }
  int first_record() const { return scheduler_.first_record(); }
  py::list block_times() const {
    py::list out;
    for (const auto& r : scheduler_.records()) {
      py::dict t;
      for (int i = 0; i < kNumStages; ++i) t[stage_name(static_cast<Stage>(i))] = r.times[i];
      out.append(t);
    }
    return out;
  }

 private:
  PyExecutor executor_;
  Scheduler scheduler_;
};

}  // namespace

void register_scheduler(py::module_& m) {
  m.attr("STAGE_NAMES") = names_tuple(kStageNames);
  m.attr("DECISION_NAMES") = names_tuple(kDecisionNames);
  m.attr("COUNTER_NAMES") = names_tuple(kCounterNames);

  py::class_<SchedulerConfig> config(m, "SchedulerConfig",
                                     "The native scheduler's configuration: every field is a required keyword");
  config.def(py::init(&config_from_kwargs),
             "SchedulerConfig(**fields): every name of FIELDS, none other; mode by name");
  config.attr("FIELDS") = names_tuple(kConfigFieldNames);
#define SDVG_CONFIG_PROPERTY_(type, name, doc) \
  config.def_property_readonly(#name, [](const SchedulerConfig& c) { return to_py(c.name); }, doc);
  SDVG_CONFIG_FIELDS(SDVG_CONFIG_PROPERTY_)
#undef SDVG_CONFIG_PROPERTY_
  config.def("__repr__", &config_repr);

  py::class_<Counters> counters(m, "Counters", "What one run did (the fields of COUNTER_NAMES)");
  counters.def(py::init<>());
#define SDVG_COUNTER_PROPERTY_(type, name, doc) counters.def_readwrite(#name, &Counters::name, doc);
  SDVG_COUNTERS(SDVG_COUNTER_PROPERTY_)
#undef SDVG_COUNTER_PROPERTY_
  counters.def("as_dict", &counters_dict, "The fields as a dict, in COUNTER_NAMES order");
  counters.def("__repr__", [](const Counters& c) {
    std::string s = "Counters(";
    const char* sep = "";
    for (auto item : counters_dict(c)) {
      s += sep + py::str(item.first).cast<std::string>() + "=" + py::repr(item.second).cast<std::string>();
      sep = ", ";
    }
    return s + ")";
  });

  py::class_<BlockPlan> plan(m, "BlockPlan",
                             "What the scheduler is told before each block (StageCalls.plan); every "
                             "field a keyword, zero / False unless given");
  plan.def(py::init(&plan_from_kwargs), "BlockPlan(**fields): names of FIELDS only");
  plan.attr("FIELDS") = names_tuple(kPlanFieldNames);
#define SDVG_PLAN_PROPERTY_(type, name, doc) \
  plan.def_property_readonly(#name, [](const BlockPlan& p) { return to_py(p.name); }, doc);
  SDVG_PLAN_FIELDS(SDVG_PLAN_PROPERTY_)
#undef SDVG_PLAN_PROPERTY_

  m.attr("ROLE_NAMES") = names_tuple(kRoleNames);
  py::class_<Scored>(m, "Scored", "A draft's score: the aggregated score and one score per frame")
      .def(py::init([](double score, std::vector<double> frame_scores) {
             Scored s;
             s.score = score;
             s.frame_scores = std::move(frame_scores);
             return s;
           }),
           py::arg("score"), py::arg("frame_scores"))
      .def_readonly("score", &Scored::score)
      .def_readonly("frame_scores", &Scored::frame_scores);

  py::class_<EmittedBlock>(m, "EmittedBlock", "One block as the scheduler emits it (StageCalls.emit)")
      .def_readonly("index", &EmittedBlock::index)
      .def_readonly("decision", &EmittedBlock::decision, "forced | accepted | rejected | target | draft")
      .def_readonly("latents", &EmittedBlock::latents)
      .def_readonly("frames", &EmittedBlock::frames)
      .def_readonly("draft_latents", &EmittedBlock::draft_latents)
      .def_readonly("score", &EmittedBlock::score, "the draft's aggregated score, or None")
      .def_readonly("frame_scores", &EmittedBlock::frame_scores)
      .def_readonly("emitted_scores", &EmittedBlock::emitted_scores)
      .def_readonly("times", &EmittedBlock::times, "seconds per stage (STAGE_NAMES), those known when emitted")
      .def_readonly("redrafts", &EmittedBlock::redrafts, "run-ahead drafts thrown away after a rejection");

  py::class_<StageCalls, PyStageCalls>(m, "StageCalls",
                                       "The stages the scheduler calls: subclass and override every method")
      .def(py::init<>())
      .def("draft", &StageCalls::draft, py::arg("block"))
      .def("drafter_commit", &StageCalls::drafter_commit, py::arg("block"), py::arg("latents"))
      .def("target", &StageCalls::target, py::arg("block"))
      .def("target_commit", &StageCalls::target_commit, py::arg("block"), py::arg("latents"))
      .def("decode", &StageCalls::decode, py::arg("latents"), py::arg("producer"), py::arg("block"))
      .def("score", &StageCalls::score, py::arg("frames"), py::arg("producer"), py::arg("block"))
      .def("vae_snapshot", &StageCalls::vae_snapshot)
      .def("vae_restore", &StageCalls::vae_restore, py::arg("snapshot"))
      .def("emit", &StageCalls::emit, py::arg("block"))
      .def("plan", &StageCalls::plan, py::arg("block"),
           "block b's BlockPlan, asked once per block in order (a live session's may wait for input)")
      .def("recache", &StageCalls::recache, py::arg("role"), py::arg("block"),
           "the role re-caches its context under block b's conditioning (the block's plan asks it)");

  py::class_<PyScheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&, py::object, py::object, py::object, at::Device, at::Device, bool>(),
           py::arg("config"), py::arg("stages"), py::arg("drafter_cache"), py::arg("target_cache"),
           py::arg("drafter_device"), py::arg("target_device"), py::arg("log_streams") = false)
      .def("stream_log", &PyScheduler::stream_log,
           "log_streams=True: every stream operation, written down instead of made (tests): 'setup -> LANE', "
           "'record LANE #N', 'wait LANE on PRODUCER #N'")
      .def("run", &PyScheduler::run, "Run the whole video (releases the GIL; stages re-enter Python)")
      .def("cancel", &PyScheduler::cancel, "Stop after the stage in flight (thread-safe)")
      .def("counters", &PyScheduler::counters, "What the last run did (a Counters)")
      .def("first_record", [](const PyScheduler& p) { return p.first_record(); },
           "the block of block_times()[0] (config.record_blocks drops older records)")
      .def("block_times", &PyScheduler::block_times,
           "Each block's final seconds per stage (STAGE_NAMES), after the run")
      .def("trace", &PyScheduler::trace,
           "Every stage call of the last run: block, stage, thread (main|drafter), start_s, end_s (from the run's start)");
}

}  // namespace sdvg
