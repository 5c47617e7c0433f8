// Python bindings of sdvg._C.
#include <torch/extension.h>

#include "kv_cache.h"
#include "kv_slots.h"

#ifdef SDVG_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;
using namespace sdvg;

namespace sdvg {
void register_scheduler(py::module_& m);
}

namespace {

py::dict build_info() {
  py::dict info;
#ifdef SDVG_WITH_CUDA
  info["cuda"] = true;
  info["cuda_runtime_version"] = CUDART_VERSION;
#else
  info["cuda"] = false;
#endif
  info["torch_version"] = TORCH_VERSION;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sdvg native core: KV-cache slot tables and buffers, the SDVG scheduler";
  register_scheduler(m);
  m.def("build_info", &build_info, "How this extension was compiled");

  py::class_<SlotLayout>(m, "SlotLayout")
      .def(py::init([](int64_t max_frames, int64_t sink_frames, int64_t window_frames, int64_t slack_frames) {
             SlotLayout l;
             l.max_frames = max_frames;
             l.sink_frames = sink_frames;
             l.window_frames = window_frames;
             l.slack_frames = slack_frames;
             return l;
           }),
           py::arg("max_frames"), py::arg("sink_frames") = 0, py::arg("window_frames") = 0,
           py::arg("slack_frames") = 0)
      .def_readonly("max_frames", &SlotLayout::max_frames)
      .def_readonly("sink_frames", &SlotLayout::sink_frames)
      .def_readonly("window_frames", &SlotLayout::window_frames)
      .def_readonly("slack_frames", &SlotLayout::slack_frames);

  py::class_<FrameSlotTable>(m, "FrameSlotTable")
      .def(py::init<const SlotLayout&>())
      .def_property_readonly("num_slots", &FrameSlotTable::num_slots)
      .def_property_readonly("committed_frames", &FrameSlotTable::committed_frames)
      .def_property_readonly("pending_frames", &FrameSlotTable::pending_frames)
      .def_property_readonly("high_water", &FrameSlotTable::high_water)
      .def("slot_of", &FrameSlotTable::slot_of)
      .def("write", &FrameSlotTable::write)
      .def("commit", &FrameSlotTable::commit)
      .def("discard", &FrameSlotTable::discard)
      .def("rollback", &FrameSlotTable::rollback)
      .def("can_rollback", [](const FrameSlotTable& t, int64_t f) { return t.can_rollback(f); })
      .def("visible_frames", &FrameSlotTable::visible_frames)
      .def("visible_slots", &FrameSlotTable::visible_slots);

  m.def(
      "kv_cache_nbytes",
      [](int64_t num_layers, int64_t batch, int64_t heads, int64_t head_dim, int64_t tokens_per_frame,
         const SlotLayout& layout, int64_t element_size) {
        return kv_cache_nbytes({num_layers, batch, heads, head_dim, tokens_per_frame}, layout, element_size);
      },
      py::arg("num_layers"), py::arg("batch"), py::arg("heads"), py::arg("head_dim"), py::arg("tokens_per_frame"),
      py::arg("layout"), py::arg("element_size"));

  py::class_<KVCache>(m, "KVCache")
      .def(py::init([](int64_t num_layers, int64_t batch, int64_t heads, int64_t head_dim, int64_t tokens_per_frame,
                       const SlotLayout& layout, at::ScalarType dtype, at::Device device) {
             return new KVCache({num_layers, batch, heads, head_dim, tokens_per_frame}, layout, dtype, device);
           }),
           py::arg("num_layers"), py::arg("batch"), py::arg("heads"), py::arg("head_dim"),
           py::arg("tokens_per_frame"), py::arg("layout"), py::arg("dtype"), py::arg("device"))
      .def("begin_write", &KVCache::begin_write, py::arg("num_frames"))
      .def("write", &KVCache::write, py::arg("layer"), py::arg("k"), py::arg("v"))
      .def("write_tokens", &KVCache::write_tokens, py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("tokens"))
      .def("visible", &KVCache::visible, py::arg("layer"))
      .def("commit", &KVCache::commit)
      .def("rollback", &KVCache::rollback, py::arg("frame"))
      .def("layer_buffer", &KVCache::layer_buffer)
      .def_property_readonly("buffer", &KVCache::buffer)
      .def_property_readonly("nbytes", &KVCache::nbytes)
      .def_property_readonly("num_slots", [](const KVCache& c) { return c.table().num_slots(); })
      .def_property_readonly("committed_frames", [](const KVCache& c) { return c.table().committed_frames(); })
      .def_property_readonly("pending_frames", [](const KVCache& c) { return c.table().pending_frames(); })
      .def("visible_frames", [](const KVCache& c) { return c.table().visible_frames(); })
      .def("visible_slots", [](const KVCache& c) { return c.table().visible_slots(); })
      .def("can_rollback", [](const KVCache& c, int64_t f) { return c.table().can_rollback(f); });
}
