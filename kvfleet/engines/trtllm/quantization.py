"""Which weight-quantization methods each TensorRT-LLM release loads, keyed by the first release a row describes (a
release uses the last row at or below it). 'methods': what the release loads from a checkpoint's quantization_config
(its quant_method); 'online': what its quantization option accepts for an unquantized checkpoint (absent: the same
list, as vLLM validates --quantization against the same QUANTIZATION_METHODS); 'deprecated': methods the release
refuses unless an opt-in flag kvfleet does not set. 'schemes': the method that loads each of kvfleet's weight
schemes on TensorRT-LLM; a row's own 'schemes' gives the names that release used where they differ. Rows marked
approx were not pinned to a release. kvfleet.sizing.quantization reads it.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# The rows are data, each with its source: quantization.json beside this module (shipped as package data).
QUANTIZATION: dict[str, Any] = json.loads(
    resources.files(__package__).joinpath("quantization.json").read_text(encoding="utf-8")
)
