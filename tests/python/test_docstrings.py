"""Every public class, function, method and property of the Python API has a
docstring that help() shows. The walk covers each public module's __all__
(or, without one, its public names defined in that module) and every public
member a class defines itself.

The TorchScript classes (torch.classes.mori.*) are covered as far as torch
allows, which is not at all: torch's custom classes give Python no place for a
docstring. The class object (torch.ScriptClass) lists no methods, and a method
of an instance is a ScriptMethod whose __doc__ is None (it shows only its
name, owner and schema). Their documentation is the Python API of
mori_torch.io that wraps them, walked here."""
import enum
import importlib
import inspect
import pydoc

import pytest

import mori_torch

# mori_torch.benchmark is a command line (`python -m mori_torch.benchmark
# --help` documents it), not an API.
MODULES = ["mori_torch", "mori_torch.io", "mori_torch.ops", "mori_torch.paged_kv", "mori_torch.rendezvous",
           "mori_torch.rendezvous.etcd", "mori_torch.config"]


def public_names(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
                 and (inspect.isclass(v) or inspect.isfunction(v))]
    return names


def has_own_doc(obj):
    doc = obj.__doc__ if not inspect.isclass(obj) else obj.__dict__.get("__doc__")
    if not doc or not doc.strip():
        return False
    # dataclasses and NamedTuples write their signature as the docstring when there is none.
    return not (inspect.isclass(obj) and doc.startswith(obj.__name__ + "("))


def members(cls):
    """The public callables and properties that `cls` itself defines."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(cls, enum.EnumMeta) and isinstance(getattr(cls, name, None), cls):
            continue  # enum members are values, not API
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def undocumented(module_name):
    module = importlib.import_module(module_name)
    missing = [] if has_own_doc(module) else [module_name]
    for name in public_names(module):
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            continue
        if not has_own_doc(obj):
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            for mname, member in members(obj):
                if not (member.__doc__ or "").strip():
                    missing.append(f"{module_name}.{name}.{mname}")
    return missing


@pytest.mark.parametrize("module_name", MODULES)
def test_public_api_has_docstrings(module_name):
    missing = undocumented(module_name)
    assert not missing, f"{len(missing)} public names without a docstring: {missing}"


def test_help_shows_the_docstrings():
    text = pydoc.render_doc(mori_torch.io.IOEngine, renderer=pydoc.plaintext)
    for method in ("create_backend", "register_torch_tensor", "batch_read", "create_session", "wait_all"):
        doc = inspect.getdoc(getattr(mori_torch.io.IOEngine, method))
        assert doc.splitlines()[0] in text, method


def test_package_exposes_io_ops_and_version():
    assert mori_torch.io.IOEngine.__module__ == "mori_torch.io"
    assert mori_torch.ops.session_handle.__module__ == "mori_torch.ops"
    from mori_torch._version import __version__

    assert mori_torch.__version__ == __version__
