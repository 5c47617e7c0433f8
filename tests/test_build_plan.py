"""The TensorRT build at real size on one H200, checked without TensorRT: the build plan of
`python -m build_engines --dry-run` (meta device), its refusals before any work, the optimisation
profiles, the opset-23 export with one Attention node per attention (and its fallback), the build
step against a fake TensorRT (profiles, the ONNX file deleted after parse, the plan written through
a memoryview)."""
import re
import sys
import types

import pytest
import torch

from build_engines import plan as build_plan
from build_engines.__main__ import cli
from sdvg.config import get_preset
from sdvg.engines.signatures import dit_signature, preset_signatures

GIB = 2**30


def _dry(capsys, *flags):
    code = cli(["--preset", "real-size", "--device", "cuda:0", "--dry-run", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_real_size_dry_run_fits_one_h200(capsys):
    code, out, err = _dry(capsys)
    assert code == 0, err
    rows = {m[0]: [float(x) for x in m[1:]] for m in
            re.findall(r"^  (\w+)\s+cuda:0\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    assert list(rows) == ["drafter_dit_3f", "drafter_dit_3f_cached", "target_dit_3f", "target_dit_3f_cached",
                          "vae_decode", "reward_9f", "reward_12f"]
    # one engine at a time, the ONNX file deleted after parse: the disk holds the plans so far + one engine's weights
    weights = [r[0] for r in rows.values()]
    disks = [r[2] for r in rows.values()]
    assert disks == pytest.approx([sum(weights[:i + 1]) for i in range(len(weights))], abs=0.1)
    target = rows["target_dit_3f_cached"]
    assert target[0] == pytest.approx(26.61, abs=0.01)  # 14.29B params x 2 B
    assert target[4] == pytest.approx(3 * 26.61, abs=0.1)  # DiT on the host + parsed weights + serialized plan
    for kind, limit in (("disk", 64.0), ("gpu", 139.0), ("host", 128.0)):
        peak = float(re.search(rf"peak {kind}\s+([\d.]+) GiB of {limit:.1f} GiB.*: fits", out).group(1))
        assert peak <= limit
    assert "peak disk    60.2 GiB" in out and "peak gpu     74.4 GiB" in out and "peak host    79.8 GiB" in out


@pytest.mark.parametrize("flag,kind,engine", [("--disk-gib", "disk", "reward_12f"), ("--gpu-gib", "gpu",
                                                                                      "target_dit_3f_cached"),
                                              ("--host-gib", "host", "target_dit_3f")])
def test_a_limit_too_small_is_refused_with_the_number_and_the_fix(capsys, flag, kind, engine):
    code, out, err = _dry(capsys, flag, "40")
    assert code == 2 and "DOES NOT FIT" in out
    assert re.search(rf"error: {kind}: engine {engine} needs [\d.]+ GiB at its peak, over {flag} 40 \(40.0 GiB\) by "
                     rf"[\d.]+ GiB; fix: ", err), err
    assert build_plan.FIXES[kind] in err


def test_a_real_build_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    import build_engines.__main__ as main

    monkeypatch.setattr(main, "load_pipeline", lambda args: pytest.fail("the pipeline was loaded"))
    code = cli(["--preset", "tiny", "--format", "onnx", "--gpu-gib", "139", "--host-gib", "0.001",
                "--out", str(tmp_path / "engines")])
    assert code == 2 and "error: host: engine" in capsys.readouterr().err
    assert not (tmp_path / "engines").exists()
    limits = build_plan.measured_limits(build_plan.flag_limits(139, 1e9, 128), tmp_path / "new" / "folder")
    assert limits["disk"].source.startswith("free disk at ") and limits["disk"].nbytes < 1e9 * GIB


def test_limits_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli(["--preset", "tiny", "--dry-run", "--disk-gib", "0"])
    assert "must be a positive number of GiB" in capsys.readouterr().err


# ------------------------------------------------------------------------------ profiles
def test_cached_engines_have_a_profile_per_context_mode():
    preset = get_preset("real-size")
    by = {s.name: s for s in preset_signatures(preset)}
    tgt, dr = by["target_dit_3f_cached"], by["drafter_dit_3f_cached"]
    # the target runs a recompute context: its first profile is tuned for 4,680 visible tokens
    assert tgt.profile_bounds() == (
        ("recompute", (("visible_tokens", 1560, 4680, 4680), ("cache_tokens", 1560, 9360, 9360))),
        ("full", (("visible_tokens", 1560, 18720, 37440), ("cache_tokens", 1560, 42120, 42120))))
    assert tgt.sizes("opt") == {"visible_tokens": 4680, "cache_tokens": 9360}  # the export's example inputs
    assert tgt.sizes("max") == {"visible_tokens": 37440, "cache_tokens": 42120}
    assert dr.profile_bounds()[0][0] == "full"  # the drafter's own context first
    assert tgt.profile_for({"visible_tokens": 4680, "cache_tokens": 9360}) == 0
    assert tgt.profile_for({"visible_tokens": 6240, "cache_tokens": 9360}) == 1
    with pytest.raises(ValueError) as e:
        tgt.profile_for({"visible_tokens": 40000, "cache_tokens": 42120})
    assert all(s in str(e.value) for s in ("40000", "--num-blocks")), e.value
    assert by["target_dit_3f"].profile_bounds() == ()


# ------------------------------------------------------------------------------ opset 23
def test_export_opset_and_its_fallback(monkeypatch):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from build_engines import export

    assert export.export_opset()[0] == 23  # onnx 1.23.2 / onnxruntime 1.32.0 here
    monkeypatch.setattr(ort, "__version__", "1.22.1")
    opset, why = export.export_opset()
    assert opset == 18 and "onnxruntime 1.22.1 cannot run Attention-23 (onnxruntime >= 1.23 can)" in why
    monkeypatch.setattr(ort, "__version__", "1.32.0")

    def no_schema(*a):
        raise onnx.defs.SchemaError("no Attention")

    monkeypatch.setattr(onnx.defs, "get_schema", no_schema)
    opset, why = export.export_opset()
    assert opset == 18 and f"onnx {onnx.__version__} has no Attention-23" in why


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nn.functional.scaled_dot_product_attention(o, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("opset,attention_nodes", [(23, 2), (18, 0)])
def test_attention_exports_as_one_node_at_opset_23_and_decomposed_at_18(tmp_path, opset, attention_nodes):
    """Both opsets run in onnxruntime and equal eager (the block-causal bool mask included)."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    prog = torch.onnx.export(_Attend().eval(), (q, k, v, mask), dynamo=True, opset_version=opset, verbose=False)
    prog.save(str(tmp_path / "a.onnx"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "a.onnx")).graph.node]
    assert ops.count("Attention") == attention_nodes
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), (q, k, v, mask))})[0]
    assert abs(got - _Attend()(q, k, v, mask).numpy()).max() < 1e-5


@pytest.mark.slow
def test_tiny_cached_engine_at_opset_23_has_one_attention_per_attention_and_verifies(tiny_pipe, tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from build_engines.export import VERIFY_TOLERANCE, export_onnx, verify_onnx
    from sdvg.engines.signatures import engine_spec

    comps = tiny_pipe.components
    sig = dit_signature(comps.preset, "target", 3, True, comps.target.dtype)
    spec = engine_spec(comps, sig)
    path = export_onnx(spec, tmp_path / "model.onnx", 23)
    model = onnx.load(str(path))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [23]
    ops = [n.op_type for n in model.graph.node]
    # two attentions per block (self-attention over the cache and the block, cross-attention to the prompt)
    assert ops.count("Attention") == 2 * comps.preset.target.num_layers
    assert "Softmax" not in ops
    assert verify_onnx(spec, path) <= VERIFY_TOLERANCE["fp32"]  # at the first profile's opt and at the minimum


# ------------------------------------------------------------------------------ the build step, faked
class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        self.shapes[name] = (lo, opt, hi)


class _HostMemory:
    """A buffer that is not bytes: what `IHostMemory` is (the plan must go through a memoryview)."""

    def __init__(self, data):
        self._data = bytearray(data)

    def __buffer__(self, flags):  # Python >= 3.12
        return memoryview(self._data)

    def __bytes__(self):
        raise AssertionError("bytes(plan): a host copy of the whole plan")


def _fake_trt(monkeypatch, tmp_path, sig):
    events = []
    config = types.SimpleNamespace(profiles=[], set_memory_pool_limit=lambda *a: None)
    config.add_optimization_profile = lambda p: config.profiles.append(p) or len(config.profiles) - 1
    network = types.SimpleNamespace(num_inputs=len(sig.inputs), get_input=lambda i: types.SimpleNamespace(
        name=sig.inputs[i].name))

    class Parser:
        num_errors = 0

        def __init__(self, net, logger):
            pass

        def parse_from_file(self, path):
            events.append(("parse", path))
            return True

    def build(net, cfg):
        events.append(("build", sorted(p.name for p in tmp_path.iterdir())))
        return bytearray(b"PLAN" * 1000)

    builder = types.SimpleNamespace(create_network=lambda flags: network, create_builder_config=lambda: config,
                                    create_optimization_profile=_Profile, build_serialized_network=build)
    trt = types.SimpleNamespace(Logger=type("L", (), {"WARNING": 0, "__init__": lambda s, lvl: None}),
                                Builder=lambda logger: builder, OnnxParser=Parser,
                                NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=0),
                                MemoryPoolType=types.SimpleNamespace(WORKSPACE=0))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return events, config


def test_build_engine_deletes_the_onnx_after_parse_and_adds_a_profile_per_mode(monkeypatch, tmp_path, tiny_preset):
    from build_engines.trt import build_engine, write_plan

    sig = dit_signature(tiny_preset, "target", 3, True)
    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(b"graph")
    (tmp_path / "model.onnx.data").write_bytes(b"weights")
    events, config = _fake_trt(monkeypatch, tmp_path, sig)
    plan = build_engine(onnx_path, tmp_path / "model.plan", sig, delete_onnx_after_parse=True)
    assert events[0] == ("parse", str(onnx_path))
    assert events[1] == ("build", [])  # the ONNX file and its .data were gone before the build
    assert plan.read_bytes() == b"PLAN" * 1000
    assert len(config.profiles) == 2
    for i, profile in enumerate(config.profiles):
        lo, opt, hi = (sig.profile_sizes(i, w) for w in ("min", "opt", "max"))
        assert profile.shapes["kv_0"] == tuple(sig.inputs[-1].dims(b) for b in (lo, opt, hi))
        assert profile.shapes["cache_index"] == ((lo["visible_tokens"],), (opt["visible_tokens"],),
                                                 (hi["visible_tokens"],))
        assert "latents" not in profile.shapes
    if sys.version_info >= (3, 12):  # a buffer with no bytes(): written through a memoryview
        assert write_plan(_HostMemory(b"abc"), tmp_path / "x.plan") == 3
        assert (tmp_path / "x.plan").read_bytes() == b"abc"


def test_sdvg_memory_tensorrt_reports_engine_weights_and_scratch_per_device(capsys, tmp_path):
    import json

    from sdvg.cli import main as sdvg_main

    argv = ["memory", "--preset", "real-size", "--device", "cuda:0", "--target-device", "cuda:1", "--json"]
    assert sdvg_main(argv + ["--backend", "tensorrt"]) == 0
    d = json.loads(capsys.readouterr().out)
    items = {(it["device"], it["what"]): it for it in d["items"]}
    w = get_preset("real-size").target.num_params() * 2 / GIB
    assert items[("cuda:1", "target engine weights")]["gib"] == pytest.approx(2 * w)  # _3f and _3f_cached: twice
    assert ("cuda:1", "target weights") not in items  # the torch DiT's replaced weights are released
    kept = items[("cuda:1", "target torch weights kept")]["gib"]
    assert 4.0 < kept < 4.5  # mostly the 40 layers' cross-attention K/V projections (2 x 5120^2 x 2 B each)
    assert "unknown here" in items[("cuda:1", "target engine scratch")]["arithmetic"]
    assert {(dev, what) for dev, what in items if what.endswith("engine scratch")} == {
        ("cuda:0", "drafter engine scratch"), ("cuda:1", "target engine scratch"), ("cuda:0", "vae engine scratch"),
        ("cuda:0", "reward engine scratch")}
    # with a built folder the engine weights are the plan files' sizes
    folder = tmp_path / "engines" / "target_dit_3f-0123"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"key": {"stage": "target_dit_3f", "artifact": "tensorrt"},
                                                      "file": "engine.plan", "size": 3 * GIB}))
    assert sdvg_main(argv + ["--backend", "tensorrt", "--engines", str(tmp_path / "engines")]) == 0
    d = json.loads(capsys.readouterr().out)
    row = next(it for it in d["items"] if it["what"] == "target engine weights")
    assert row["gib"] == pytest.approx(3.0) and "target_dit_3f 3.00 GiB (plan files)" in row["arithmetic"]
