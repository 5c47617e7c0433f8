"""Build sdvg and its native core sdvg._C against the installed torch.

SDVG_CUDA=auto (default) builds the CUDA variant when torch was built with CUDA, a
CUDA toolkit is found and a GPU is visible; SDVG_CUDA=1 forces it (e.g. to compile on
a machine without a GPU), SDVG_CUDA=0 forces the CPU build.
"""
import ast
import os
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent

INSTALL_REQUIRES = ["torch>=2.11", "diffusers>=0.42,<1", "transformers>=5,<6", "tokenizers>=0.21",
                    "huggingface_hub>=1,<3", "safetensors>=0.4", "numpy>=1.26", "matplotlib>=3.8", "imageio>=2.31",
                    "imageio-ffmpeg>=0.5", "tqdm>=4.66", "PyYAML>=6", "Pillow>=10"]
SOURCES = ["csrc/kv_slots.cpp", "csrc/kv_cache.cpp", "csrc/scheduler.cpp", "csrc/py_scheduler.cpp", "csrc/bindings.cpp"]


def want_cuda() -> bool:
    choice = os.environ.get("SDVG_CUDA", "auto").lower()
    if choice in ("0", "false", "no"):
        return False
    have_toolkit = cpp_extension.CUDA_HOME is not None
    import torch

    if choice in ("1", "true", "yes"):
        if not have_toolkit:
            raise SystemExit("SDVG_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME=/usr/local/cuda")
        return True
    return have_toolkit and torch.version.cuda is not None and torch.cuda.is_available()


def cuda_library_includes() -> list[str]:
    """cuBLAS/cuSPARSE headers that torch's CUDA headers include come from the nvidia pip wheels
    when the toolkit on the machine lacks them."""
    import site

    dirs = []
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cusparse/include", "nvidia/cublas/include"):
            path = os.path.join(base, sub)
            if os.path.isdir(path):
                dirs.append(path)
    return dirs


def version() -> str:
    """`sdvg.__version__`, the one place the version is written (read without importing the package)."""
    tree = ast.parse((HERE / "sdvg" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__version__":
            return ast.literal_eval(node.value)
    raise SystemExit("sdvg/__init__.py has no __version__")


# What an index shows: the licence (LICENSE, Apache-2.0), the audience, the platform sdvg is tested on.
CLASSIFIERS = [
    "Development Status :: 3 - Alpha",
    "Intended Audience :: Science/Research",
    "Intended Audience :: Developers",
    "Environment :: GPU :: NVIDIA CUDA",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: C++",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Topic :: Multimedia :: Video",
]


def extension():
    args = {"cxx": ["-O3"]}  # torch picks the C++ standard it needs
    if want_cuda():
        args["nvcc"] = ["-O3"]
        return cpp_extension.CUDAExtension(
            "sdvg._C", SOURCES, extra_compile_args=args, define_macros=[("SDVG_WITH_CUDA", "1")],
            include_dirs=cuda_library_includes(),
        )
    return cpp_extension.CppExtension("sdvg._C", SOURCES, extra_compile_args=args)


setup(
    name="sdvg",
    version=version(),
    description="Speculative decoding for block-autoregressive video diffusion",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=CLASSIFIERS,
    keywords=["video diffusion", "speculative decoding", "Wan2.1", "Self-Forcing", "diffusers", "realtime video"],
    packages=find_packages(include=["sdvg", "sdvg.*", "build_engines", "build_engines.*"]),
    package_data={"sdvg": ["assets/*.json", "data/*.txt", "data/README.md"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
    # every package sdvg imports, as ranges that keep an installed torch (>= 2.11): exactly requirements.txt
    # (tests/test_requirements.py). The ImageReward scorer is transformers' BLIP classes: no image-reward.
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # `--evaluator drift`; install with the runtime lock as constraint (requirements-eval.txt). vbench
        # is no extra: it pins transformers 4.33.2 and numpy < 2 (its own environment: requirements-vbench.txt)
        "eval": ["pyiqa==0.1.16"],
        "onnx": ["onnx", "onnxruntime", "onnxscript"],
        # sdvg serve (docs/server.md): the ASGI stack, the websocket client the tests use, the wire format
        "serve": ["fastapi>=0.110", "uvicorn>=0.52.1", "websockets>=13", "msgpack>=1.0", "pydantic>=2",
                  "prometheus-client>=0.20", "python-multipart>=0.0.9", "pillow"],
        # sdvg serve --ray-replicas N: the same app as a Ray Serve deployment (docs/server.md, "Ray Serve")
        "serve-ray": ["ray[serve]>=2.40"],
        # quantization fp8 through torchao's Float8Tensor (without it: torch._scaled_mm directly; docs/engines.md)
        "fp8": ["torchao==0.18.0"],
        # TensorRT plans (build_engines --format tensorrt) and the cuda-python executor
        "tensorrt": ["tensorrt-cu13>=11", "cuda-python>=13"],
        # build_engines --format torch-tensorrt: the release built for requirements-torch.txt's torch
        # (2.14.x); with another torch installed, pip would replace it (requirements-torch-tensorrt.txt)
        "torch-tensorrt": ["torch-tensorrt==2.14.0", "torch>=2.14,<2.15", "tensorrt-cu13>=11.1,<11.2",
                           "cuda-python>=13"],
    },
    entry_points={"console_scripts": ["sdvg=sdvg.cli.main:main"]},
)
