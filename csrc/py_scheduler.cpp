// Python executor for the C++ scheduler: each stage is a method of a Python object, entered with
// the GIL held only for the call itself; the KV-cache pointer moves go straight to the native
// caches. With CUDA, each role (drafter, target, VAE/reward) runs on its own stream; a handle
// carries an event recorded on its producer's stream, and a consumer's stream waits on it.
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>

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

enum class Role { Drafter = 0, Target = 1, Vae = 2 };

struct PyHandle : Value {
  explicit PyHandle(py::object o) : obj(std::move(o)) {}
  ~PyHandle() override {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
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

// Per-role CUDA streams (a no-op on the CPU and in CPU builds).
class StreamSet {
 public:
  StreamSet(at::Device drafter, at::Device target) {
#ifdef SDVG_WITH_CUDA
    if (drafter.is_cuda()) {
      streams_[0] = c10::cuda::getStreamFromPool(false, drafter.index());
      streams_[2] = c10::cuda::getStreamFromPool(false, drafter.index());
    }
    if (target.is_cuda()) streams_[1] = c10::cuda::getStreamFromPool(false, target.index());
#else
    (void)drafter;
    (void)target;
#endif
  }
  bool active(Role r) const {
#ifdef SDVG_WITH_CUDA
    return streams_[static_cast<int>(r)].has_value();
#else
    (void)r;
    return false;
#endif
  }

#ifdef SDVG_WITH_CUDA
  c10::cuda::CUDAStream stream(Role r) const { return *streams_[static_cast<int>(r)]; }
  // The consumer's stream waits for the handle's producer; tensors are marked as used there.
  // Called with the GIL held, inside the stage call's own GIL scope (THPVariable_Check may call
  // PyObject_IsInstance, which needs the GIL while the drafter thread runs beside this one).
  void consume(Role r, const Handle& h) const {
    if (!h || !active(r)) return;
    auto* p = static_cast<PyHandle*>(h.get());
    if (p->ready) p->ready->block(stream(r));
    if (THPVariable_Check(p->obj.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(p->obj.ptr());
      if (t.is_cuda()) t.record_stream(stream(r));
    }
  }
  void produced(Role r, const Handle& h) const {
    if (!h || !active(r)) return;
    auto ev = std::make_shared<at::cuda::CUDAEvent>();
    ev->record(stream(r));
    static_cast<PyHandle*>(h.get())->ready = std::move(ev);
  }
#else
  void consume(Role, const Handle&) const {}
  void produced(Role, const Handle&) const {}
#endif

 private:
#ifdef SDVG_WITH_CUDA
  std::array<std::optional<c10::cuda::CUDAStream>, 3> streams_;
#endif
};

// Makes the role's stream current for the duration of a stage call.
class RoleScope {
 public:
  RoleScope(const StreamSet& s, Role r) {
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
  PyExecutor(py::object stages, py::object drafter_cache, py::object target_cache, at::Device drafter_device,
             at::Device target_device)
      : stages_(std::move(stages)),
        drafter_cache_obj_(std::move(drafter_cache)),
        target_cache_obj_(std::move(target_cache)),
        streams_(drafter_device, target_device) {
    if (!drafter_cache_obj_.is_none()) drafter_cache_ = drafter_cache_obj_.cast<KVCache*>();
    if (!target_cache_obj_.is_none()) target_cache_ = target_cache_obj_.cast<KVCache*>();
  }
  ~PyExecutor() override {
    py::gil_scoped_acquire gil;
    stages_ = py::object();
    drafter_cache_obj_ = py::object();
    target_cache_obj_ = py::object();
  }

  Handle draft(int b) override {
    return produce(Role::Drafter, [&] { return stages_.attr("draft")(b); });
  }
  void drafter_commit_forward(int b, const Handle& x) override { consume_call(Role::Drafter, "drafter_commit", b, x); }
  void drafter_cache_commit() override { cache_op(drafter_cache_, "drafter_cache_commit", [](KVCache* c) { c->commit(); }); }
  void drafter_cache_rollback(int64_t frame) override {
    if (drafter_cache_) {
      drafter_cache_->rollback(frame);
    } else {
      py::gil_scoped_acquire gil;
      if (py::hasattr(stages_, "drafter_cache_rollback")) stages_.attr("drafter_cache_rollback")(frame);
    }
  }
  Handle target(int b) override {
    return produce(Role::Target, [&] { return stages_.attr("target")(b); });
  }
  void target_commit_forward(int b, const Handle& x) override { consume_call(Role::Target, "target_commit", b, x); }
  void target_cache_commit() override { cache_op(target_cache_, "target_cache_commit", [](KVCache* c) { c->commit(); }); }
  Handle decode(const Handle& x) override {
    return produce(Role::Vae, [&] {
      streams_.consume(Role::Vae, x);
      return stages_.attr("decode")(unwrap(x));
    });
  }
  Scored score(const Handle& frames) override {
    RoleScope scope(streams_, Role::Vae);
    py::gil_scoped_acquire gil;
    streams_.consume(Role::Vae, frames);
    py::object out = stages_.attr("score")(unwrap(frames));
    Scored s;
    if (out.is_none()) {
      s.valid = false;
      s.score = std::nan("");
      return s;
    }
    auto tup = out.cast<py::tuple>();
    s.score = tup[0].cast<double>();
    s.frame_scores = tup[1].cast<std::vector<double>>();
    return s;
  }
  Handle vae_snapshot() override {
    py::gil_scoped_acquire gil;
    return std::make_shared<PyHandle>(stages_.attr("vae_snapshot")());
  }
  void vae_restore(const Handle& s) override {
    py::gil_scoped_acquire gil;
    stages_.attr("vae_restore")(unwrap(s));
  }
  void emit(const BlockRecord& r) override {
    py::gil_scoped_acquire gil;
    py::dict d;
    d["index"] = r.index;
    d["decision"] = decision_name(r.decision);
    d["latents"] = unwrap(r.latents);
    d["frames"] = unwrap(r.frames);
    d["draft_latents"] = unwrap(r.draft_latents);
    d["score"] = r.has_score ? py::object(py::float_(r.score)) : py::none();
    d["frame_scores"] = r.frame_scores;
    d["emitted_scores"] = r.emitted_scores;
    d["redrafts"] = r.redrafts;
    py::dict times;
    for (int i = 0; i < kNumStages; ++i) times[stage_name(static_cast<Stage>(i))] = r.times[i];
    d["times"] = times;
    stages_.attr("emit")(d);
  }

 private:
  // Runs `call` on the role's stream with the GIL held: every Python object it makes (the
  // arguments, the result) is created and released under the GIL, also on the drafter thread.
  template <class Call>
  Handle produce(Role r, Call&& call) {
    Handle h;
    {
      RoleScope scope(streams_, r);
      py::gil_scoped_acquire gil;
      h = std::make_shared<PyHandle>(call());
    }
    streams_.produced(r, h);
    return h;
  }
  void consume_call(Role r, const char* name, int b, const Handle& x) {
    RoleScope scope(streams_, r);
    py::gil_scoped_acquire gil;
    streams_.consume(r, x);
    stages_.attr(name)(b, unwrap(x));
  }
  template <class F>
  void cache_op(KVCache* cache, const char* fallback, F&& op) {
    if (cache) {
      op(cache);
      return;
    }
    py::gil_scoped_acquire gil;
    if (py::hasattr(stages_, fallback)) stages_.attr(fallback)();
  }

  py::object stages_, drafter_cache_obj_, target_cache_obj_;
  KVCache* drafter_cache_ = nullptr;
  KVCache* target_cache_ = nullptr;
  StreamSet streams_;
};

SchedulerConfig config_from_dict(const py::dict& d) {
  SchedulerConfig c;
  auto get = [&](const char* k) { return d.contains(k) ? py::object(d[k]) : py::object(); };
  if (auto v = get("mode")) {
    const auto m = v.cast<std::string>();
    if (m == "sdvg") c.mode = Mode::Sdvg;
    else if (m == "target") c.mode = Mode::Target;
    else if (m == "draft") c.mode = Mode::Draft;
    else throw std::invalid_argument("unknown mode '" + m + "'; choose sdvg, target or draft");
  }
  if (auto v = get("router")) {
    const auto r = v.cast<std::string>();
    if (r == "reward") c.router = RouterKind::Reward;
    else if (r == "random") c.router = RouterKind::Random;
    else if (r == "pattern") c.router = RouterKind::Pattern;
    else throw std::invalid_argument("unknown router '" + r + "'; choose reward, random or pattern");
  }
  if (auto v = get("num_blocks")) c.num_blocks = v.cast<int>();
  if (auto v = get("frames_per_block")) c.frames_per_block = v.cast<int>();
  if (auto v = get("num_steps")) c.num_steps = v.cast<int>();
  if (auto v = get("tau")) c.tau = v.cast<double>();
  if (auto v = get("accept_prob")) c.accept_prob = v.cast<double>();
  if (auto v = get("uniforms")) c.uniforms = v.cast<std::vector<double>>();
  if (auto v = get("pattern")) c.pattern = v.cast<std::vector<bool>>();
  if (auto v = get("force_first_reject")) c.force_first_reject = v.cast<bool>();
  if (auto v = get("own_context")) c.own_context = v.cast<bool>();
  if (auto v = get("skip_first_draft")) c.skip_first_draft = v.cast<bool>();
  if (auto v = get("lazy_target_commit")) c.lazy_target_commit = v.cast<bool>();
  if (auto v = get("score_emitted")) c.score_emitted = v.cast<bool>();
  if (auto v = get("run_ahead")) c.run_ahead = v.cast<bool>();
  return c;
}

class PyScheduler {
 public:
  PyScheduler(const py::dict& config, py::object stages, py::object drafter_cache, py::object target_cache,
              at::Device drafter_device, at::Device target_device)
      : executor_(std::move(stages), std::move(drafter_cache), std::move(target_cache), drafter_device,
                  target_device),
        scheduler_(config_from_dict(config), executor_) {}

  void run() {
    py::gil_scoped_release nogil;  // stage calls take the GIL back for themselves
    scheduler_.run();
  }
  void cancel() { scheduler_.cancel(); }
  py::dict counters() const {
    const Counters& c = scheduler_.counters();
    py::dict d;
    d["target_forwards"] = c.target_forwards;
    d["drafter_forwards"] = c.drafter_forwards;
    d["skipped_drafter_forwards"] = c.skipped_drafter_forwards;
    d["skipped_target_commits"] = c.skipped_target_commits;
    d["skipped_drafter_commits"] = c.skipped_drafter_commits;
    d["redrafts"] = c.redrafts;
    d["speculative_drafts"] = c.speculative_drafts;
    d["scheduler_wall_s"] = c.wall_s;
    d["stage_call_s"] = c.stage_call_s;
    d["main_stage_s"] = c.main_stage_s;
    return d;
  }
  py::list trace() const {
    py::list out;
    for (const auto& sp : scheduler_.trace()) {
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
  py::class_<PyScheduler>(m, "Scheduler")
      .def(py::init<const py::dict&, py::object, py::object, py::object, at::Device, at::Device>(),
           py::arg("config"), py::arg("stages"), py::arg("drafter_cache"), py::arg("target_cache"),
           py::arg("drafter_device"), py::arg("target_device"))
      .def("run", &PyScheduler::run, "Run the whole video (releases the GIL; stages re-enter Python)")
      .def("cancel", &PyScheduler::cancel, "Stop after the stage in flight (thread-safe)")
      .def("counters", &PyScheduler::counters)
      .def("block_times", &PyScheduler::block_times)
      .def("trace", &PyScheduler::trace,
           "Every stage call of the last run: block, stage, thread (main|drafter), start_s, end_s (from the run's start)");
}

}  // namespace sdvg
