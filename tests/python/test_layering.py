"""Include arrows point down the layers of docs/ARCHITECTURE.md ("Layering"): base/ (error type,
configuration table) at the bottom, the GPU shim above it, then the core.
A header of a higher layer included from a lower one fails here."""
import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
# The project directories each layer may include from.
ALLOWED = {
    "base": {"base"},
    "gpu": {"base", "gpu"},
}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_includes_only_layers_below(layer):
    bad = []
    for f in sorted((CSRC / layer).iterdir()):
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), flags=re.M):
            top = inc.split("/")[0]
            if "/" in inc and top not in ALLOWED[layer]:
                bad.append(f"{f.name}: {inc}")
    assert not bad, f"csrc/{layer} includes from a higher layer: {bad}"
