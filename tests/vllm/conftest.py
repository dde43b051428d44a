"""Tests of MoriTorchConnector against the real vLLM 0.33.0 package; they
run in the project's environment once scripts/setup_vllm_env.sh has added
vLLM to it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm  # noqa: E402

from vllm_helpers import model_dir  # noqa: E402

assert vllm.__version__ == "0.33.0", f"these tests pin vllm 0.33.0, found {vllm.__version__}"


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("model")))
