"""Which weight-quantization methods each vLLM release loads, keyed by the first release a row describes (a release
uses the last row at or below it). 'methods': what the release loads from a checkpoint's quantization_config (its
quant_method); 'online': what its quantization option accepts for an unquantized checkpoint (absent: the same list,
as vLLM validates --quantization against the same QUANTIZATION_METHODS); 'deprecated': methods the release refuses
unless an opt-in flag kvfleet does not set. 'schemes': the method that loads each of kvfleet's weight schemes on
vLLM; a row's own 'schemes' gives the names that release used where they differ. Rows start where the method of one
of kvfleet's schemes, the deprecation rule, or the presence of gguf or of the deprecated fp_quant changed, each at
the first release whose own __init__.py shows it (kvfleet/sizing/data/vllm_release_markers.json); each row's lists
are that release's, and releases before the next row may list methods no kvfleet scheme maps to differently.
kvfleet.sizing.quantization reads it.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# The rows are data, each with its source: quantization.json beside this module (shipped as package data).
QUANTIZATION: dict[str, Any] = json.loads(
    resources.files(__package__).joinpath("quantization.json").read_text(encoding="utf-8")
)
