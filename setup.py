"""Builds mori_torch._C against the torch already installed.

Install with `pip install --no-build-isolation -e .` (or without -e): build
isolation would hide the installed torch, and the extension must match the
torch that imports it, so under isolation this script stops at once with a
message saying so (flash-attn's way). A torch with CUDA (or ROCm) gives a
CUDAExtension, a CPU-only torch a CppExtension. MORI_TORCH_FORCE_CPU=1 forces
the CPU-only build. Nothing is written into the source tree: the build facts
(torch version, GPU or not) are compiled into the extension (_C.TORCH_VERSION,
_C.WITH_GPU).
"""
import glob
import os
import re
import shutil
import sys

NEEDS_INSTALLED_TORCH = (
    "mori_torch compiles against the torch already installed, and pip's build isolation hides it.\n"
    "Install torch first, then build without isolation:\n"
    "    pip install --no-build-isolation .        (or -e . for an editable install)"
)
try:
    import torch
except ImportError:
    # pyproject.toml does not list torch as a build requirement, so under
    # build isolation this is where we land, before anything is compiled.
    sys.exit("error: " + NEEDS_INSTALLED_TORCH)
from setuptools import find_packages, setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402


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
    "csrc/base/*.cpp", "csrc/core/*.cpp", "csrc/stream/*.cpp", "csrc/gpu/*.cpp", "csrc/backends/*.cpp",
    "csrc/backends/*/*.cpp", "csrc/torch/*.cpp"
)
gpu_sources = sources("csrc/gpu/*.cu") if gpu else []

# The torch this build compiles against, as bare tokens that module.cpp
# stringizes into _C.TORCH_VERSION (a quoted string would not survive the
# nvcc/ninja command lines intact); mori_torch/__init__.py compares it at import.
if not re.fullmatch(r"[0-9A-Za-z.+]+", torch.__version__):
    sys.exit(f"error: cannot record torch version {torch.__version__!r} in the build (unexpected characters)")
define_macros = [("MORI_WITH_GPU", "1" if gpu else "0"), ("MORI_TORCH_BUILT_AGAINST", torch.__version__)]
# -fopenmp-simd: `#pragma omp simd` loops only (no OpenMP runtime), see
# csrc/core/transfer_args.cpp.
extra_compile_args = {"cxx": ["-O2", "-fopenmp-simd", "-Wno-unused-parameter"]}
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


def read_version():
    # Read, not imported: importing mori_torch needs the extension being built.
    with open(os.path.join(ROOT, "mori_torch", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

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
    version=read_version(),
    description="Point-to-point GPU/host memory transfer engine for PyTorch (MORI-IO compatible)",
    packages=find_packages(include=["mori_torch", "mori_torch.*"]),
    py_modules=["_mori_torch_alias"],  # the `mori` alias; stdlib only, imported at start-up by the .pth
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithAliasHook},
    python_requires=">=3.9",
    # The extension runs only with the torch it was compiled against.
    install_requires=[f"torch=={torch.__version__}"],
)
