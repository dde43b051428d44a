"""mori_torch: point-to-point transfer engine for GPU and host memory.

`mori_torch.io` is a drop-in for AMD's `mori.io`; the native objects are the
TorchScript classes `torch.classes.mori.*`.
"""
import torch

try:
    from . import _build_info
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "mori_torch is not built: run `pip install --no-build-isolation -e .` in the source tree"
    ) from e

if _build_info.TORCH_VERSION != torch.__version__:
    raise ImportError(
        f"mori_torch was built against torch {_build_info.TORCH_VERSION} but torch {torch.__version__} "
        "is installed; rebuild with `pip install --no-build-isolation -e .`"
    )

from . import _C  # noqa: E402,F401  (registers torch.classes.mori.* and torch.ops.mori.*)
from . import ops  # noqa: E402,F401  (fake implementations of torch.ops.mori.*)

__version__ = "0.1.0"


def pinned_host_bytes() -> int:
    """Bytes of host memory mori_torch holds pinned right now (the TCP
    backend's staging buffers for GPU memory); 0 without GPU support."""
    return torch.classes.mori.Engine.pinned_host_bytes()


def install_mori_alias() -> None:
    """Makes unmodified code that imports ``mori``, ``mori.io`` or
    ``mori.cpp`` (vLLM's MoRIIO connector, SGLang's mori backend) get
    mori_torch's objects, in this process and in processes it starts later
    (it sets MORI_TORCH_MORI_ALIAS=1, which the installed start-up hook
    honours). Raises ``MoriAliasRefused`` (an ImportError) if a real mori
    (amd-mori) is importable: the alias never shadows it."""
    import _mori_torch_alias

    _mori_torch_alias.install()


def __getattr__(name: str):
    # mori_torch.config (the settings table) loads on first use, so that
    # `python -m mori_torch.config` runs it as a script without a warning.
    if name == "config":
        import importlib

        return importlib.import_module(".config", __name__)
    raise AttributeError(f"module 'mori_torch' has no attribute {name!r}")
