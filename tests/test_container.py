"""The container recipe (docker/Dockerfile, docker/entrypoint.sh) without Docker: what it declares (a CUDA
devel image that builds the CUDA core for Ada and Hopper with no GPU visible, `sdvg serve` behind the
entry point, a healthcheck on /health), its entry point's token rules, its healthcheck command, and
(slow) its Python layer built as its `RUN pip install` lines say, in this interpreter, with the ENV they see."""
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


def instructions() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, rest.strip()))
    return stages[1:]  # the ARGs before the first FROM are the image's parameters


def env_of(stage) -> dict[str, str]:
    out = {}
    for word, rest in stage:
        if word == "ENV":
            out.update(kv.split("=", 1) for kv in shlex.split(rest))
    return out


def test_the_recipe_builds_the_cuda_core_and_serves_behind_a_healthcheck():
    build, run = instructions()
    assert build[0][0] == "FROM" and build[0][1].startswith("nvidia/cuda:${CUDA_IMAGE}-devel-")  # nvcc is there
    env = env_of(build)
    assert env["SDVG_CUDA"] == "1" and {"8.9", "9.0"} <= set(env["TORCH_CUDA_ARCH_LIST"].split(";"))
    pips = [rest for word, rest in build if word == "RUN" and rest.startswith("pip install")]
    assert "-r requirements-torch.txt" in pips[0] and "-r requirements.txt -c requirements-lock.txt" in pips[1]
    assert pips[-1].endswith('--no-build-isolation -c requirements-lock.txt ".[serve]"')
    copied = next(rest for word, rest in build if word == "COPY" and "requirements" in rest).split()[:-1]
    assert all((ROOT / name).is_file() for name in copied), copied
    final = dict(run)
    assert final["ENTRYPOINT"] == '["/usr/local/bin/sdvg-serve"]' and "docker/entrypoint.sh /usr/local/bin/sdvg-serve" \
        in [rest for word, rest in run if word == "COPY"]
    assert "/health" in final["HEALTHCHECK"] and final["EXPOSE"] == env_of(run)["SDVG_SERVE_PORT"] == "8000"
    assert env_of(run)["HF_HUB_OFFLINE"] == "1"  # the server loads from the mounted cache, never downloads
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "build", "**/*.so", ".git"} <= set(ignored)  # the context is the sources, not the built tree


def _entrypoint(tmp_path, env: dict, *args) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with a stand-in `sdvg` on the PATH that prints the arguments it was given and, after a
    '|', the SDVG_SERVE_TOKEN it finds in its environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sdvg").write_text('#!/bin/sh\necho "sdvg $* | ${SDVG_SERVE_TOKEN:-}"\n')
    (bin_dir / "sdvg").chmod(0o755)
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=30)


def test_the_entry_point_passes_the_token_file_or_the_variable_never_the_token_in_argv(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    r = _entrypoint(tmp_path, {"SDVG_SERVE_TOKEN_FILE": str(token)}, "--preset", "tiny")
    assert r.returncode == 0  # the server reads the file itself (--token-file); `ps` never shows the secret
    assert r.stdout.strip() == f"sdvg serve --host 0.0.0.0 --port 8000 --token-file {token} --preset tiny |"
    r = _entrypoint(tmp_path, {"SDVG_SERVE_TOKEN": "abc", "SDVG_SERVE_PORT": "9000"})
    assert r.returncode == 0 and r.stdout.strip() == "sdvg serve --host 0.0.0.0 --port 9000 | abc"  # read from the env


@pytest.mark.parametrize("case,says", [
    ("none", "error: no token: the server listens on every interface"),
    ("missing", "SDVG_SERVE_TOKEN_FILE={file} cannot be read (no such file, not a file, or no permission); mount"),
    ("folder", "SDVG_SERVE_TOKEN_FILE={file} cannot be read"),
    ("empty", "SDVG_SERVE_TOKEN_FILE={file} is empty; write the token into it"),
    ("both", "both SDVG_SERVE_TOKEN and SDVG_SERVE_TOKEN_FILE are set; keep one"),
])
def test_the_entry_point_refuses_before_the_server_starts(tmp_path, case, says):
    file = tmp_path / "token"
    env = {}
    if case == "folder":
        file.mkdir()
    elif case in ("empty", "both"):
        file.write_text("\n" if case == "empty" else "t")
    if case != "none":
        env["SDVG_SERVE_TOKEN_FILE"] = str(file)
    if case == "both":
        env["SDVG_SERVE_TOKEN"] = "u"
    env["HF_TOKEN"] = "hf_not_the_servers"  # huggingface_hub's token is never taken for the server's
    r = _entrypoint(tmp_path, env)
    assert r.returncode == 2 and says.format(file=file) in r.stderr and r.stdout == ""  # sdvg never ran


def test_the_healthcheck_passes_on_health_and_fails_without_a_server():
    command = dict(instructions()[1])["HEALTHCHECK"].split(" CMD ", 1)[1]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = str(server.server_address[1])
        env = dict(os.environ, SDVG_SERVE_PORT=port, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        assert subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=30).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    env["SDVG_SERVE_PORT"] = port  # nothing listens there now
    assert subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=30).returncode != 0


@pytest.mark.slow
@pytest.mark.skipif(not Path(CUDA_HOME, "bin", "nvcc").is_file(), reason=f"no nvcc under {CUDA_HOME} (set CUDA_HOME)")
@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU torch: the CUDA core builds against a CUDA torch")
def test_the_python_layer_builds_as_the_recipe_says_a_cuda_core_without_a_gpu(tmp_path):
    """The build stage's pip lines in this interpreter: the torch layer is this venv's (the same pin), the
    requirements line resolves against it without fetching anything, and the sdvg line, run as written
    with the stage's ENV and no GPU visible (plus --target, --no-deps, --no-index: installed beside, offline),
    compiles the CUDA core (TORCH_CUDA_ARCH_LIST cut to 9.0 here: one architecture, ~1.5 min on 2 cores),
    which the recipe's own check then accepts."""
    build = instructions()[0]
    env = {**os.environ, **{k: v for k, v in env_of(build).items() if k != "PATH"}}
    env.update(TORCH_CUDA_ARCH_LIST="9.0", MAX_JOBS="2", CUDA_VISIBLE_DEVICES="", CUDA_HOME=CUDA_HOME,
               PATH=f"{CUDA_HOME}/bin:{Path(sys.executable).parent}:{os.environ['PATH']}")
    runs = [rest for word, rest in build if word == "RUN"]
    pips = [shlex.split(r) for r in runs if r.startswith("pip install")]
    pinned = (ROOT / "requirements-torch.txt").read_text().split("torch==")[1].split()[0]
    assert "requirements-torch.txt" in pips[0] and torch.__version__.split("+")[0] == pinned  # the torch layer
    r = subprocess.run([sys.executable, "-m", *pips[1], "--dry-run", "--no-index"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Would install" not in r.stdout, r.stdout + r.stderr  # all there, at the lock
    src = tmp_path / "src"  # the build context: the tracked sources (.dockerignore leaves the built tree out)
    for rel in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split():
        if rel.startswith(("results/", "tests/")) or not (ROOT / rel).is_file():
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", *pips[-1], "--target", str(site), "--no-deps", "--no-index", "-q"],
                       cwd=src, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    check = next(r for r in runs if "build_record" in r).split("&&", 1)[1].strip()  # `cd / && python -c ...`
    r = subprocess.run(["sh", "-c", check], cwd="/", env={**env, "PYTHONPATH": str(site)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "'native_cuda': True" in r.stdout, r.stdout + r.stderr[-3000:]
    where = subprocess.run([sys.executable, "-c", "import sdvg._native as n; print(n.__file__)"], cwd="/",
                           env={**env, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where  # the core just built, not this checkout's
