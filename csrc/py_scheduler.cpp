// Python executor for the C++ scheduler: each stage is a method of a Python object, entered with
// the GIL held only for the call itself; the KV-cache pointer moves go straight to the native
// caches. With CUDA, each role (drafter, target, VAE/reward) runs on its own stream; a handle
// carries an event recorded on its producer's stream, and a consumer's stream waits on it.
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <limits>
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
  // The caches of the roles `mode` runs are required (the scheduler moves their pointers itself).
  PyExecutor(Mode mode, py::object stages, py::object drafter_cache, py::object target_cache,
             at::Device drafter_device, at::Device target_device)
      : stages_(std::move(stages)),
        drafter_cache_obj_(std::move(drafter_cache)),
        target_cache_obj_(std::move(target_cache)),
        streams_(drafter_device, target_device) {
    drafter_cache_ = cache_of(drafter_cache_obj_, "drafter", mode != Mode::Target, mode);
    target_cache_ = cache_of(target_cache_obj_, "target", mode != Mode::Draft, mode);
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
  void drafter_cache_commit() override { used(drafter_cache_, "drafter").commit(); }
  void drafter_cache_rollback(int64_t frame) override { used(drafter_cache_, "drafter").rollback(frame); }
  Handle target(int b) override {
    return produce(Role::Target, [&] { return stages_.attr("target")(b); });
  }
  void target_commit_forward(int b, const Handle& x) override { consume_call(Role::Target, "target_commit", b, x); }
  void target_cache_commit() override { used(target_cache_, "target").commit(); }
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

  py::object stages_, drafter_cache_obj_, target_cache_obj_;
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
RouterKind from_py<RouterKind>(const char* field, py::handle v) {
  if (!py::isinstance<py::str>(v)) wrong_type(field, "a str (reward, random or pattern)", v);
  return parse_router(v.cast<std::string>());
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
template <class Item, class Check>
std::vector<Item> list_from_py(const char* field, py::handle v, const char* want, Check&& ok) {
  if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v)) wrong_type(field, want, v);
  std::vector<Item> out;
  size_t i = 0;
  for (py::handle item : v) {
    if (!ok(item))
      throw py::type_error(std::string("SchedulerConfig field '") + field + "' must be " + want + ", item " +
                           std::to_string(i) + " is " + type_name(item) + " " + py::repr(item).cast<std::string>());
    if constexpr (std::is_same_v<Item, bool>)
      out.push_back(item.ptr() == Py_True);
    else
      out.push_back(py::float_(py::reinterpret_borrow<py::object>(item)).cast<double>());
    ++i;
  }
  return out;
}
template <>
std::vector<double> from_py<std::vector<double>>(const char* field, py::handle v) {
  return list_from_py<double>(field, v, "a list of numbers", is_number);
}
template <>
std::vector<bool> from_py<std::vector<bool>>(const char* field, py::handle v) {
  return list_from_py<bool>(field, v, "a list of bools", [](py::handle x) { return PyBool_Check(x.ptr()); });
}

// Field values as Python reads them back (mode and router as their names).
template <class T>
py::object to_py(const T& v) {
  return py::cast(v);
}
py::object to_py(Mode m) { return py::str(mode_name(m)); }
py::object to_py(RouterKind r) { return py::str(router_name(r)); }
py::object to_py(const std::vector<bool>& v) {
  py::list out;
  for (bool b : v) out.append(py::bool_(b));
  return out;
}

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
              at::Device drafter_device, at::Device target_device)
      : executor_(config.mode, std::move(stages), std::move(drafter_cache), std::move(target_cache), drafter_device,
                  target_device),
        scheduler_(config, executor_) {}

  void run() {
    py::gil_scoped_release nogil;  // stage calls take the GIL back for themselves
    scheduler_.run();
  }
  void cancel() { scheduler_.cancel(); }
  Counters counters() const { return scheduler_.counters(); }
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
  m.attr("STAGE_NAMES") = names_tuple(kStageNames);
  m.attr("DECISION_NAMES") = names_tuple(kDecisionNames);
  m.attr("COUNTER_NAMES") = names_tuple(kCounterNames);

  py::class_<SchedulerConfig> config(m, "SchedulerConfig",
                                     "The native scheduler's configuration: every field is a required keyword");
  config.def(py::init(&config_from_kwargs),
             "SchedulerConfig(**fields): every name of FIELDS, none other; mode and router by name");
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

  py::class_<PyScheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&, py::object, py::object, py::object, at::Device, at::Device>(),
           py::arg("config"), py::arg("stages"), py::arg("drafter_cache"), py::arg("target_cache"),
           py::arg("drafter_device"), py::arg("target_device"))
      .def("run", &PyScheduler::run, "Run the whole video (releases the GIL; stages re-enter Python)")
      .def("cancel", &PyScheduler::cancel, "Stop after the stage in flight (thread-safe)")
      .def("counters", &PyScheduler::counters, "What the last run did (a Counters)")
      .def("block_times", &PyScheduler::block_times,
           "Each block's final seconds per stage (STAGE_NAMES), after the run")
      .def("trace", &PyScheduler::trace,
           "Every stage call of the last run: block, stage, thread (main|drafter), start_s, end_s (from the run's start)");
}

}  // namespace sdvg
