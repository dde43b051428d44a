"""Builds mori_torch._C against the torch already installed.

Install with `pip install --no-build-isolation -e .` (or without -e): build
isolation would fetch a different torch than the one the extension must match.
A torch with CUDA (or ROCm) gives a CUDAExtension, a CPU-only torch a
CppExtension. MORI_TORCH_FORCE_CPU=1 forces the CPU-only build.
"""
import glob
import os

import shutil

import torch
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def _fix_cuda_home():
    # torch derives CUDA_HOME from `which nvcc`; a wrapper script in
    # /usr/local/bin then yields /usr/local, which has no CUDA libraries.
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or torch.version.cuda is None:
        return
    nvcc = shutil.which("nvcc")
    derived = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
    if derived and os.path.exists(os.path.join(derived, "include", "cuda_runtime.h")):
        return
    for cand in ("/usr/local/cuda", f"/usr/local/cuda-{torch.version.cuda}"):
        if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = cand
            return


_fix_cuda_home()
from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(*patterns):
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.join(ROOT, p)))
    return [os.path.relpath(s, ROOT) for s in out]


force_cpu = os.environ.get("MORI_TORCH_FORCE_CPU", "0") == "1"
with_cuda = not force_cpu and torch.version.cuda is not None and CUDA_HOME is not None
with_hip = not force_cpu and torch.version.hip is not None and ROCM_HOME is not None
gpu = with_cuda or with_hip

if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    # No GPU to detect the architecture from (CI, build hosts): build one,
    # Hopper (H100/H200); set TORCH_CUDA_ARCH_LIST to choose others.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"

cpp_sources = sources(
    "csrc/base/*.cpp", "csrc/core/*.cpp", "csrc/stream/*.cpp", "csrc/gpu/*.cpp", "csrc/backends/*.cpp", "csrc/backends/*/*.cpp", "csrc/torch/*.cpp"
)
gpu_sources = sources("csrc/gpu/*.cu") if gpu else []

define_macros = [("MORI_WITH_GPU", "1" if gpu else "0")]
extra_compile_args = {"cxx": ["-O2", "-Wno-unused-parameter"]}
if with_cuda:
    extra_compile_args["nvcc"] = ["-O2"]

Extension = CUDAExtension if gpu else CppExtension
ext = Extension(
    name="mori_torch._C",
    sources=cpp_sources + gpu_sources,
    include_dirs=[os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
    extra_compile_args=extra_compile_args,
    libraries=["dl"],
)

# The import-time check compares against this (see mori_torch/__init__.py).
build_info = os.path.join(ROOT, "mori_torch", "_build_info.py")
with open(build_info, "w") as f:
    f.write("# Written by setup.py: the torch this extension was compiled against.\n")
    f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
    f.write(f"TORCH_CUDA = {torch.version.cuda!r}\n")
    f.write(f"TORCH_HIP = {torch.version.hip!r}\n")
    f.write(f"WITH_GPU = {gpu!r}\n")

ALIAS_PTH = "mori_torch_alias.pth"


class BuildPyWithAliasHook(build_py):
    """Installs mori_torch_alias.pth beside the packages: site.py runs it at
    every interpreter start, which is how MORI_TORCH_MORI_ALIAS=1 reaches
    spawned worker processes. An editable install builds into a temporary
    unpacked wheel, whose root is `install`'s install_lib."""

    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        dest = self.get_finalized_command("install").install_lib if editable else self.build_lib
        self.copy_file(os.path.join(ROOT, ALIAS_PTH), os.path.join(dest, ALIAS_PTH))


setup(
    name="mori_torch",
    version="0.1.0",
    description="Point-to-point GPU/host memory transfer engine for PyTorch (MORI-IO compatible)",
    packages=find_packages(include=["mori_torch", "mori_torch.*"]),
    py_modules=["_mori_torch_alias"],  # the `mori` alias; stdlib only, imported at start-up by the .pth
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithAliasHook},
    python_requires=">=3.9",
)
