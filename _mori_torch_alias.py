"""The opt-in ``mori`` import alias: unmodified code that imports ``mori``,
``mori.io`` or ``mori.cpp`` (vLLM's MoRIIO connector, SGLang's mori backend)
gets mori_torch's objects.

Two ways to turn it on:

- ``MORI_TORCH_MORI_ALIAS=1`` in the environment. ``mori_torch_alias.pth``
  (installed with the package) calls :func:`install_from_environment` at
  every interpreter start, so worker processes started with ``spawn`` (as
  serving engines do) get the alias too.
- ``mori_torch.install_mori_alias()`` in the running process; it also sets
  the variable so that workers spawned afterwards inherit it.

It never shadows a real ``mori`` (amd-mori): if one is importable, the alias
refuses with an error naming where it lives.

This module is at the top level and imports only the standard library: the
start-up hook must not import torch (that happens at ``import mori``).
"""
import importlib.abc
import importlib.util
import os
import sys

ENV_VAR = "MORI_TORCH_MORI_ALIAS"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")

# Upstream's mori.cpp is its raw pybind module; these two names there are the
# C++ classes with CamelCase methods, which mori-torch does not reproduce.
_CPP_ONLY_UPSTREAM = ("IOEngine", "IOEngineSession")


class MoriAliasRefused(ImportError):
    """A real ``mori`` is installed; the alias will not shadow it."""


def _refusal(where: str) -> str:
    return (f"mori_torch refuses to alias `mori`: a real mori (amd-mori) is importable from {where}. "
            f"Use it directly, or uninstall it (pip uninstall amd-mori) to run on mori-torch; "
            f"unset {ENV_VAR} to silence this.")


def real_mori_location():
    """Where a real (non-alias) ``mori`` would be imported from, or None."""
    mod = sys.modules.get("mori")
    if mod is not None and not getattr(mod, "__mori_torch_alias__", False):
        return getattr(mod, "__file__", None) or repr(mod)
    for finder in sys.meta_path:
        if isinstance(finder, _MoriAliasFinder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find("mori", None)
        # A bare folder named mori (a namespace package: no origin) is not
        # amd-mori; a module or a package with an __init__ is.
        if spec is not None and spec.origin not in (None, "namespace"):
            return spec.origin
    return None


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a fresh module object; filled by exec_module

    def exec_module(self, module):
        import mori_torch.io as io  # imports torch: only now, at `import mori...`

        module.__mori_torch_alias__ = True
        if module.__name__ == "mori":
            import mori_torch

            module.__doc__ = "mori-torch standing in for amd-mori (MORI_TORCH_MORI_ALIAS / install_mori_alias)."
            module.__path__ = []  # a package: mori.io and mori.cpp come from this finder
            module.mori_torch = mori_torch
            return
        if module.__name__ == "mori.io":
            names = list(io.__all__)
        else:  # mori.cpp: upstream's pybind module; TransferStatus is what users import from it
            names = [n for n in io.__all__ if n not in _CPP_ONLY_UPSTREAM]
        for n in names:
            setattr(module, n, getattr(io, n))
        module.__all__ = names

        def __getattr__(name, _mod=module.__name__):
            if _mod == "mori.cpp" and name in _CPP_ONLY_UPSTREAM:
                raise AttributeError(f"mori.cpp.{name} (upstream's raw C++ binding) is not provided by mori-torch; "
                                     f"use mori.io.{name}")
            raise AttributeError(f"module {_mod!r} (mori-torch alias) has no attribute {name!r}")

        module.__getattr__ = __getattr__


class _MoriAliasFinder(importlib.abc.MetaPathFinder):
    _MODULES = ("mori", "mori.io", "mori.cpp")

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mori" and not fullname.startswith("mori."):
            return None
        if fullname == "mori":
            where = real_mori_location()
            if where is not None:
                raise MoriAliasRefused(_refusal(where))
        if fullname not in self._MODULES:
            return None  # e.g. mori.ops: not part of mori-torch, a plain ModuleNotFoundError
        return importlib.util.spec_from_loader(fullname, _AliasLoader(), is_package=(fullname == "mori"))


def installed() -> bool:
    return any(isinstance(f, _MoriAliasFinder) for f in sys.meta_path)


def _insert_finder() -> None:
    if not installed():
        sys.meta_path.insert(0, _MoriAliasFinder())


def install(propagate: bool = True) -> None:
    """Makes ``import mori`` / ``mori.io`` / ``mori.cpp`` give mori_torch's
    objects in this process (and, with ``propagate``, in processes it starts
    later, through the environment variable). Raises MoriAliasRefused if a
    real mori is importable."""
    where = real_mori_location()
    if where is not None:
        raise MoriAliasRefused(_refusal(where))
    _insert_finder()
    if propagate:
        os.environ[ENV_VAR] = "1"


def install_from_environment() -> None:
    """Start-up hook (mori_torch_alias.pth): installs the alias when the
    variable is on. A real mori is looked for at ``import mori``, not here:
    sys.path is not complete yet while .pth files are processed."""
    value = os.environ.get(ENV_VAR, "")
    if value.strip().lower() in _OFF:
        return
    if value.strip().lower() not in _ON:
        sys.stderr.write(f"mori_torch: ignoring {ENV_VAR}={value!r}; use 1 to turn the `mori` alias on or 0 for off\n")
        return
    _insert_finder()


__all__ = ["ENV_VAR", "MoriAliasRefused", "install", "install_from_environment", "installed", "real_mori_location"]
