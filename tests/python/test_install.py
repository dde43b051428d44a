"""Installing: plain `pip install .` stops before compiling, with one message
that says to use --no-build-isolation; building writes nothing into the
source tree; the wheel's metadata requires the torch it is built against; the
import refuses a torch other than the one the extension was compiled for."""
import email.parser
import glob
import os
import subprocess
import sys
import time

import torch

import mori_torch
from mori_torch._version import __version__

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree_state():
    """The source tree's files as git sees them, ignored ones included (a
    generated file or an egg-info directory would show), bytecode caches aside."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted(line for line in out.splitlines() if "__pycache__" not in line and " build/" not in line)


def test_build_isolation_stops_at_once_with_one_clear_message(tmp_path):
    before = tree_state()
    t0 = time.monotonic()
    # `pip wheel` builds exactly what `pip install .` builds, and installs nothing.
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                          "-w", str(tmp_path / "wheels"), ROOT], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PIP_NO_BUILD_ISOLATION"})
    elapsed = time.monotonic() - t0
    assert out.returncode != 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "pip's build isolation hides it" in text, text
    assert "pip install --no-build-isolation ." in text, text
    assert not glob.glob(str(tmp_path / "wheels" / "*.whl"))
    assert elapsed < 120, f"the check should fire before compiling; took {elapsed:.0f} s"
    assert tree_state() == before


def test_metadata_requires_the_torch_it_is_built_against(tmp_path):
    before = tree_state()
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    (meta_file,) = glob.glob(str(tmp_path / "*.dist-info" / "METADATA"))
    with open(meta_file) as f:
        meta = email.parser.Parser().parse(f)
    assert meta["Version"] == __version__ == mori_torch.__version__
    assert f"torch=={torch.__version__}" in meta.get_all("Requires-Dist")
    assert tree_state() == before, "generating the metadata wrote into the source tree"


def test_build_facts_come_from_the_extension():
    assert mori_torch._C.TORCH_VERSION == torch.__version__
    assert isinstance(mori_torch._C.WITH_GPU, bool)
    assert not os.path.exists(os.path.join(ROOT, "mori_torch", "_build_info.py"))


def test_import_refuses_another_torch():
    # The check compares the extension's torch with the running one; here the
    # running one pretends to be another release.
    code = "import torch; torch.__version__ = '0.0.1'; import mori_torch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode != 0
    assert (f"mori_torch was built against torch {torch.__version__} but torch 0.0.1 is installed; "
            "rebuild it in the source tree with `pip install --no-build-isolation -e .`") in out.stderr, out.stderr
