"""mori_torch: point-to-point transfer engine for GPU and host memory.

`mori_torch.io` is a drop-in for AMD's `mori.io`; the native objects are the
TorchScript classes `torch.classes.mori.*`.
"""
import torch

from ._version import __version__  # noqa: F401

_REBUILD = "rebuild it in the source tree with `pip install --no-build-isolation -e .`"
try:
    from . import _C  # registers torch.classes.mori.* and torch.ops.mori.*
except ImportError as e:  # not built, or built against another torch (unresolved symbols)
    raise ImportError(f"mori_torch's extension mori_torch._C does not load under torch {torch.__version__}: "
                      f"{e}; {_REBUILD}") from e

if _C.TORCH_VERSION != torch.__version__:
    raise ImportError(
        f"mori_torch was built against torch {_C.TORCH_VERSION} but torch {torch.__version__} is installed; {_REBUILD}"
    )

# Kept as three statements in this order (isort would merge and reorder them).
# isort: off
from . import io  # noqa: E402,F401  (the mori.io-compatible API)
from . import ops  # noqa: E402,F401  (fake implementations of torch.ops.mori.*)
from . import log  # noqa: E402,F401  (native log levels, routing into Python's logging)
# isort: on


def pinned_host_bytes() -> int:
    """Bytes of host memory mori_torch's engines hold pinned right now (the
    TCP backend's staging buffers for GPU memory, the XGMI backend's kernel
    lists); 0 without GPU support. They are let go when the engines shut down."""
    return torch.classes.mori.Engine.pinned_host_bytes()


def pinned_segment_list_bytes() -> int:
    """Bytes of host memory pinned for long transfers' segment lists (1,365
    entries or more), which the XGMI copy kernel reads where they were built
    (a process-wide cache, kept once an XGMI backend has existed; at most
    64 MiB)."""
    return torch.classes.mori.Engine.pinned_segment_list_bytes()


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
