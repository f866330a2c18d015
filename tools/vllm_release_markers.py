"""Pin the vLLM releases behind kvfleet's release boundaries by reading the released artifacts on PyPI.

Each marker is a fact about files of the ``vllm`` package (a default, a function, a list entry) that one boundary
in kvfleet/sizing rests on. For every marker the script finds the first release whose files show it and the
release before it, which does not, by bisecting the final releases on PyPI from 0.6.0 on (a marker is written so
that once it holds it keeps holding; the newest release is always read), and records the matching line.
The answer is written to kvfleet/sizing/data/vllm_release_markers.json, which tests/sizing/test_release_markers.py
holds the code's boundaries to.

A release is read from its sdist where PyPI has one. Some releases (0.15.0, 0.15.1) only have wheels of about
500 MB; from those only the members needed are read, by HTTP range requests into the wheel's zip. Downloads and
the members read from wheels are cached (``--cache``, by default a directory under the system's temporary one).
``--write`` with ``--only`` merges: the markers read replace their entries in the stored file and the others are
kept as they were (the stored file and this reading must reach the same newest release).

This is a maintenance tool: it needs the network, and no test runs it.

    .venv/bin/python tools/vllm_release_markers.py [--write] [--only NAME ...] [--cache DIR] [-v]
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import io
import json
import re
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INDEX_URL = "https://pypi.org/pypi/vllm/json"
OUT = Path(__file__).resolve().parents[1] / "kvfleet" / "sizing" / "data" / "vllm_release_markers.json"
FLOOR = (0, 6, 0)  # kvfleet models vLLM from 0.6.0 on
TIMEOUT_S = 120

Release = tuple[int, ...]

# ---- releases and artifacts --------------------------------------------------------------------------------------


def release_key(text: str) -> Release | None:
    """(0, 10, 1, 1) for 0.10.1.1, (0, 6, 1, 0, 1) for 0.6.1.post1; None for pre-releases and other forms."""
    m = re.fullmatch(r"(\d+(?:\.\d+)*)(?:\.post(\d+))?", text)
    if m is None:
        return None
    nums = tuple(int(x) for x in m[1].split("."))
    nums = nums + (0,) * (4 - len(nums))
    return nums + ((int(m[2]),) if m[2] else ())


@dataclass(frozen=True)
class Artifact:
    """The file of one release that is read: its sdist, else a wheel (x86_64 first)."""

    version: str
    filename: str
    url: str
    sha256: str
    size: int

    @property
    def is_sdist(self) -> bool:
        return self.filename.endswith(".tar.gz")

    def as_json(self) -> dict[str, Any]:
        return {"filename": self.filename, "sha256": self.sha256, "size": self.size, "url": self.url}


def pick_artifact(version: str, files: Sequence[dict[str, Any]], index_url: str) -> Artifact | None:
    """The sdist, else the x86_64 wheel, else any wheel; yanked files are skipped."""

    def rank(f: dict[str, Any]) -> int:
        name = str(f["filename"])
        if f.get("yanked"):
            return 9
        if f["packagetype"] == "sdist" and name.endswith(".tar.gz"):
            return 0
        if name.endswith(".whl"):
            return 1 if "x86_64" in name else 2
        return 9

    usable = [f for f in files if rank(f) < 9]
    if not usable:
        return None
    f = min(usable, key=rank)
    return Artifact(
        version=version,
        filename=str(f["filename"]),
        url=urllib.parse.urljoin(index_url, str(f["url"])),  # the index may give addresses relative to itself
        sha256=str(f["digests"]["sha256"]),
        size=int(f["size"]),
    )


def fetch_index(index_url: str = INDEX_URL) -> dict[str, Any]:
    with urllib.request.urlopen(index_url, timeout=TIMEOUT_S) as resp:
        data: dict[str, Any] = json.load(resp)
    return data


def releases_from(index: Mapping[str, Any], index_url: str = INDEX_URL, floor: Release = FLOOR) -> list[Artifact]:
    """Every final release from ``floor`` on with a readable artifact, oldest first."""
    out: list[tuple[Release, Artifact]] = []
    for version, files in index["releases"].items():
        key = release_key(version)
        if key is None or key < floor:
            continue
        art = pick_artifact(version, files, index_url)
        if art is not None:
            out.append((key, art))
    return [a for _, a in sorted(out, key=lambda kv: kv[0])]


class HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests: enough for zipfile to read a wheel's central directory
    and the few members asked for, without downloading the rest."""

    def __init__(self, url: str, size: int, *, chunk: int = 1 << 20) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self.pos = 0
        self.chunk = chunk
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, n: int) -> bytes:
        if n not in self._blocks:
            start = n * self.chunk
            end = min(self.size, start + self.chunk) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                if resp.status != 206:
                    raise OSError(f"{self.url}: the server ignored the range request (HTTP {resp.status})")
                data = resp.read()
            if len(data) != end - start + 1:
                raise OSError(f"{self.url}: asked for bytes {start}-{end}, got {len(data)}")
            self._blocks[n] = data
        return self._blocks[n]

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.size - self.pos
        size = min(size, self.size - self.pos)
        out = bytearray()
        while size > 0:
            n, off = divmod(self.pos, self.chunk)
            piece = self._block(n)[off : off + size]
            out += piece
            self.pos += len(piece)
            size -= len(piece)
        return bytes(out)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class ReleaseReader:
    """Reads files of the ``vllm`` package out of one release's artifact, through the cache."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.cache.mkdir(parents=True, exist_ok=True)
        self._tars: dict[str, tarfile.TarFile] = {}
        self._zips: dict[str, zipfile.ZipFile] = {}

    def _sdist(self, art: Artifact) -> tarfile.TarFile:
        if art.version not in self._tars:
            path = self.cache / art.filename
            if not path.exists():
                tmp = path.with_name(path.name + ".part")
                digest = hashlib.sha256()
                with urllib.request.urlopen(art.url, timeout=TIMEOUT_S) as resp, tmp.open("wb") as out:
                    while chunk := resp.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != art.sha256:
                    tmp.unlink()
                    raise OSError(f"{art.filename}: sha256 differs from the index's")
                tmp.rename(path)
            # Kept open: the markers read several members of each release; close() closes it.
            self._tars[art.version] = tarfile.open(path, "r:gz")  # noqa: SIM115
        return self._tars[art.version]

    def _wheel(self, art: Artifact) -> zipfile.ZipFile:
        if art.version not in self._zips:
            self._zips[art.version] = zipfile.ZipFile(HttpRangeFile(art.url, art.size))
        return self._zips[art.version]

    def close(self) -> None:
        for tar in self._tars.values():
            tar.close()
        for wheel in self._zips.values():
            wheel.close()

    def read(self, art: Artifact, path: str) -> str | None:
        """The text of ``path`` (relative to the package's parent, e.g. vllm/config/cache.py); None if absent."""
        cached = self.cache / "members" / art.filename / path
        missing = cached.with_name(cached.name + ".absent")
        if cached.exists():
            return cached.read_text(encoding="utf-8")
        if missing.exists():
            return None
        data: bytes | None
        if art.is_sdist:
            root = art.filename.removesuffix(".tar.gz")
            try:
                member = self._sdist(art).extractfile(f"{root}/{path}")
            except KeyError:
                member = None
            data = member.read() if member is not None else None
        else:
            try:
                data = self._wheel(art).read(path)  # zipfile checks the member's CRC
            except KeyError:
                data = None
        cached.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            missing.touch()
            return None
        cached.write_bytes(data)
        return data.decode("utf-8")


# ---- reading source ----------------------------------------------------------------------------------------------

Files = Mapping[str, str | None]  # path -> text, None where the release has no such file
Match = tuple[str, str]  # (path, the line that shows the marker)
Predicate = Callable[[Files], Match | None]


def block(lines: Sequence[str], header: str) -> list[str]:
    """The lines of the first def/class whose header matches ``header``, up to the next line indented no deeper."""
    rx = re.compile(header)
    for i, line in enumerate(lines):
        if rx.search(line):
            indent = len(line) - len(line.lstrip())
            out = [line]
            for nxt in lines[i + 1 :]:
                stripped = nxt.lstrip()
                if stripped and len(nxt) - len(stripped) <= indent and not stripped.startswith((")", "]")):
                    break
                out.append(nxt)
            return out
    return []


def find_line(files: Files, pattern: str, *, within: str | None = None) -> Match | None:
    """The first line matching ``pattern`` in the files (in their order), searched only inside the def/class
    matching ``within`` when given."""
    rx = re.compile(pattern)
    for path, text in files.items():
        if text is None:
            continue
        lines = text.splitlines()
        for line in block(lines, within) if within else lines:
            if rx.search(line):
                return path, line.strip()
    return None


def line_matching(pattern: str, *, within: str | None = None) -> Predicate:
    return lambda files: find_line(files, pattern, within=within)


def all_of(*predicates: Predicate) -> Predicate:
    """Holds where every predicate holds; reports the first one's line (the others are conditions)."""

    def check(files: Files) -> Match | None:
        found = [p(files) for p in predicates]
        return found[0] if all(found) else None

    return check


def none_of(files: Files, pattern: str) -> bool:
    return find_line(files, pattern) is None


def assigned_strings(text: str, name: str) -> tuple[list[str], str] | None:
    """The strings of the module-level assignment to ``name`` (a list, a ``Literal[...]`` or a dict's keys) and the
    assignment's first line; None where the module assigns no such name."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        if isinstance(value, ast.Subscript):  # Literal["awq", ...]
            value = value.slice
        elts: list[ast.expr | None] = list(value.keys) if isinstance(value, ast.Dict) else getattr(value, "elts", [])
        strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return strings, lines[node.lineno - 1].strip()
    return None


# vllm/model_executor/layers/quantization/__init__.py: the Literal QuantizationMethods from 0.8 on, a dict of
# config classes (QUANTIZATION_METHODS) before.
QUANT_INIT = "vllm/model_executor/layers/quantization/__init__.py"


def quantization_methods(text: str) -> tuple[list[str], str] | None:
    for name in ("QuantizationMethods", "QUANTIZATION_METHODS"):
        found = assigned_strings(text, name)
        if found is not None and found[0]:
            return found
    return None


def deprecated_methods(text: str) -> list[str]:
    found = assigned_strings(text, "DEPRECATED_QUANTIZATION_METHODS")
    return found[0] if found is not None else []


def methods_include(*any_of: str) -> Predicate:
    """The release lists one of ``any_of`` among its quantization methods."""

    def check(files: Files) -> Match | None:
        text = files.get(QUANT_INIT)
        found = quantization_methods(text) if text else None
        if found is None:
            return None
        hit = next((m for m in found[0] if m in any_of), None)
        return (QUANT_INIT, f'{found[1]} ... "{hit}" ...') if hit else None

    return check


def methods_exclude(method: str) -> Predicate:
    """The release's quantization methods no longer list ``method``."""

    def check(files: Files) -> Match | None:
        text = files.get(QUANT_INIT)
        found = quantization_methods(text) if text else None
        if found is None or method in found[0]:
            return None
        return QUANT_INIT, f'{found[1]} ... ] (no "{method}")'

    return check


def rope_no_factor_types(files: Files) -> tuple[str, list[str]] | None:
    """The rope types whose ``factor`` _get_and_verify_max_len does not apply, as one line, with the types."""
    for path, text in files.items():
        if text is None:
            continue
        body = "\n".join(block(text.splitlines(), r"def _get_and_verify_max_len\b"))
        m = re.search(r"if rope_type not in \(([^)]*)\)", body)
        if m:
            types = re.findall(r'"([^"]+)"', m[1])
            return path, types
    return None


def rope_types_include(rope_type: str) -> Predicate:
    def check(files: Files) -> Match | None:
        found = rope_no_factor_types(files)
        if found is None or rope_type not in found[1]:
            return None
        return found[0], "if rope_type not in (" + ", ".join(f'"{t}"' for t in found[1]) + "):"

    return check


# ---- markers ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """One fact a kvfleet boundary rests on, as the release's own files show it."""

    name: str
    meaning: str
    paths: tuple[str, ...]  # the files read (several where the file moved or the fact spans files)
    holds: Predicate
    test: str  # the check, in words
    boundary: str  # what in kvfleet/engines/vllm it pins; "not modelled: ..." for facts kept for the record
    # Record the release's quantization method lists (kvfleet/engines/vllm/quantization.py).
    lists_quantization: bool = False
    before: str | None = None  # a fact that held only until another marker's first release: bisect below it


_KV_UTILS = ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_utils.py")  # moved in 0.33.0
_KV_SPECS = ("vllm/v1/kv_cache_interface.py",)
_CONFIG = ("vllm/config/vllm.py", "vllm/config/__init__.py", "vllm/config.py")  # split out of config.py in 0.10/0.11
_MODEL_CONFIG = ("vllm/config/model.py", "vllm/config/__init__.py", "vllm/config.py")
_ARG_UTILS = ("vllm/engine/arg_utils.py",)
_ENVS = ("vllm/envs.py",)
_GROUPING = r"def _get_kv_cache_(config|groups)_uniform_page_size"


def _v1_runner_gone(files: Files) -> Match | None:
    """Model Runner V2 is the only GPU runner: v1/worker/gpu_model_runner.py is gone."""
    if files.get("vllm/v1/worker/gpu_model_runner.py") is None:
        return find_line({k: v for k, v in files.items() if k.endswith("gpu/model_runner.py")}, r"^class \w+")
    return None


MARKERS: tuple[Marker, ...] = (
    Marker(
        name="v1-engine-default",
        meaning="the V1 engine is the default (VLLM_USE_V1 defaults to 1)",
        paths=(*_ENVS, "vllm/v1/engine/core.py"),
        holds=lambda files: (
            find_line(files, r'os\.getenv\("VLLM_USE_V1", "1"\)')
            or (find_line(files, r"^class EngineCore\b") if none_of(files, r'"VLLM_USE_V1"') else None)
        ),
        test='envs.py reads VLLM_USE_V1 with default "1" (once V0 is gone: no VLLM_USE_V1, beside the V1 engine)',
        boundary="VLLM_PROFILES V1 row (hybrid_kv_cache False)",
    ),
    Marker(
        name="hybrid-kv-cache-manager",
        meaning=(
            "the V1 hybrid KV-cache manager groups full and sliding-window layers apart, so sliding-window layers "
            "hold only their window; the specs are unified to full attention only where it is disabled "
            "(SchedulerConfig.disable_hybrid_kv_cache_manager, default False; turned on only off CUDA/ROCm or with "
            "a KV connector or KV events)"
        ),
        paths=_KV_UTILS,
        holds=line_matching(r"if .*disable_hybrid_kv_cache_manager"),
        test="get_kv_cache_config unifies the specs only under disable_hybrid_kv_cache_manager (before: always)",
        boundary="VLLM_PROFILES hybrid_kv_cache",
    ),
    Marker(
        name="chunked-local-attention-spec",
        meaning=(
            "chunked local attention (Llama 4) has its own KV spec that holds one chunk; before it those layers "
            "got FullAttentionSpec"
        ),
        paths=_KV_SPECS,
        holds=line_matching(r"^class ChunkedLocalAttentionSpec\b"),
        test="kv_cache_interface.py defines ChunkedLocalAttentionSpec",
        boundary="VLLM_PROFILES hybrid_chunked_local",
    ),
    Marker(
        name="v1-mamba-by-default",
        meaning=(
            "V1 runs Mamba/hybrid state models by default (MambaSpec in the hybrid allocator); before it "
            "_is_v1_supported_oracle fell back to V0 for them unless VLLM_USE_V1=1 was set"
        ),
        paths=(*_KV_SPECS, *_ARG_UTILS),
        holds=lambda files: (
            find_line(files, r"^class MambaSpec\b") if none_of(files, r'feature_name="Mamba"') else None
        ),
        test='kv_cache_interface.py defines MambaSpec and arg_utils.py has no _warn_or_fallback(feature_name="Mamba")',
        boundary="VLLM_PROFILES mamba_state_cache",
    ),
    Marker(
        name="hybrid-group-ratio",
        meaning=(
            "hybrid grouping uses the largest per-type layer count as the group size when it is below a ratio of "
            "the smallest (before: always the smallest count)"
        ),
        paths=_KV_UTILS,
        holds=line_matching(r"if max_num_layers < min_num_layers \* [0-9.]+", within=_GROUPING),
        test="_get_kv_cache_groups_uniform_page_size compares max_num_layers with min_num_layers x a ratio",
        boundary="VLLM_PROFILES hybrid_group_ratio (the ratio read from the line)",
    ),
    Marker(
        name="hybrid-group-ratio-1.5",
        meaning="the grouping ratio is 1.5 (it was 1.25 when it came)",
        paths=_KV_UTILS,
        holds=line_matching(r"if max_num_layers < min_num_layers \* 1\.5\b", within=_GROUPING),
        test="the comparison's ratio is 1.5",
        boundary="VLLM_PROFILES hybrid_group_ratio 1.5",
    ),
    Marker(
        name="triton-top-k-top-p",
        meaning=(
            "the V1 runner's top-k/top-p mask runs the Triton kernel (no vocabulary sort) on CUDA when Triton is "
            "present, for batches of 8 rows or more until 0.29 and for every batch from 0.30; the profiling "
            "sampler run (max_num_seqs rows, top_k and top_p set) takes it"
        ),
        paths=("vllm/v1/sample/ops/topk_topp_sampler.py",),
        holds=line_matching(r"return apply_top_k_top_p_triton\(", within=r"def apply_top_k_top_p\("),
        test="topk_topp_sampler.apply_top_k_top_p returns apply_top_k_top_p_triton(...)",
        boundary="VLLM_PROFILES sort_sampler",
    ),
    Marker(
        name="flashinfer-sampler-default",
        meaning=(
            "the V1 runner samples top-k/top-p with FlashInfer by default on CUDA (VLLM_USE_FLASHINFER_SAMPLER "
            "defaults to 1; flashinfer-python is a dependency of the wheel since 0.11.1), falling back to the "
            "PyTorch path where the GPU is unsupported; no vocabulary sort either way"
        ),
        paths=_ENVS,
        holds=line_matching(r"VLLM_USE_FLASHINFER_SAMPLER: bool = True"),
        test="envs.py declares VLLM_USE_FLASHINFER_SAMPLER: bool = True",
        boundary="not modelled: sort_sampler stays False; the no-sort bytes per logit are fitted",
    ),
    Marker(
        name="flashinfer-sampler-opt-in",
        meaning=(
            "the FlashInfer top-k/top-p sampler is opt-in (VLLM_USE_FLASHINFER_SAMPLER=1); before it, it ran "
            "whenever flashinfer was installed (an optional extra of the wheel then), else the PyTorch sort"
        ),
        paths=("vllm/v1/sample/ops/topk_topp_sampler.py",),
        holds=line_matching(r"Users must opt in explicitly via VLLM_USE_FLASHINFER_SAMPLER=1"),
        test="TopKTopPSampler.__init__ uses forward_cuda only under VLLM_USE_FLASHINFER_SAMPLER",
        boundary="not modelled: kvfleet takes the pip wheel's default before it (no flashinfer: the PyTorch sort)",
        before="flashinfer-sampler-default",
    ),
    Marker(
        name="v2-model-runner-default-some",
        meaning=(
            "Model Runner V2 becomes the default for some models (VLLM_USE_V2_MODEL_RUNNER unset: listed dense, "
            "unquantized generative architectures); its profiling sampler run leaves top-k/top-p off (all "
            "requests at their defaults) until 0.33.0"
        ),
        paths=(*_ENVS, "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py"),
        holds=lambda files: (
            find_line(files, r"VLLM_USE_V2_MODEL_RUNNER: bool \| None = None") or _v1_runner_gone(files)
        ),
        test="envs.py leaves VLLM_USE_V2_MODEL_RUNNER unset by default (or the V1 runner is gone)",
        boundary="not modelled: the no-sort bytes per logit are fitted across runners",
    ),
    Marker(
        name="v2-model-runner-default",
        meaning="Model Runner V2 is the default for every generative model it supports",
        paths=(*_CONFIG, "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py"),
        holds=lambda files: (
            find_line(files, r"def use_v2_model_runner\b")
            if none_of(files, r"if not self\._is_default_v2_model_runner_model\(\)")
            and find_line(files, r"VLLM_USE_V2_MODEL_RUNNER")
            else _v1_runner_gone(files)
        ),
        test="VllmConfig.use_v2_model_runner without the _is_default_v2_model_runner_model restriction",
        boundary="VLLM_PROFILES v2_runner all (in_flight_batches under pipeline parallelism); the no-sort bytes per "
        "logit are fitted across runners",
    ),
    Marker(
        name="v2-cudagraph-estimate",
        meaning="Model Runner V2 estimates CUDA-graph memory before the cache is sized (before: its "
        "profile_cudagraph_memory returned 0, so graphs came out of the 1 - utilization headroom)",
        paths=("vllm/v1/worker/gpu/model_runner.py",),
        holds=lambda files: find_line(
            files, r"return _profile_cudagraph_memory\(self\)", within=r"def profile_cudagraph_memory\b"
        ),
        test="gpu/model_runner.py profile_cudagraph_memory returns _profile_cudagraph_memory(self)",
        boundary="VLLM_PROFILES v2_counts_cuda_graphs",
    ),
    Marker(
        name="budget-counts-persistent-allocations",
        meaning="the KV budget subtracts everything resident after profiling (free memory at start minus free memory "
        "after, total_consumed), so buffers allocated between model loading and profiling count; before, only the "
        "weights, the non-torch increase and the torch peak during profiling did",
        paths=("vllm/utils/mem_utils.py", "vllm/utils/__init__.py", "vllm/utils.py"),
        holds=lambda files: find_line(files, r"result\.total_consumed = "),
        test="memory_profiling sets result.total_consumed",
        boundary="VLLM_PROFILES persistent_buffers_counted (Model Runner V2's penalty buffers)",
    ),
    Marker(
        name="v2-profiling-sampler-full-params",
        meaning=(
            "Model Runner V2's profiling sampler run adds a pass with SamplingParams.for_sampler_warmup (top-k, "
            "top-p, min-p, penalties, logprobs), so the profiled peak pays for the fp32 logits pipeline"
        ),
        paths=("vllm/v1/worker/gpu/model_runner.py",),
        holds=line_matching(r"SamplingParams\.for_sampler_warmup\(\)", within=r"def _dummy_sampler_run\b"),
        test="v1/worker/gpu/model_runner.py _dummy_sampler_run uses SamplingParams.for_sampler_warmup()",
        boundary="VLLM_PROFILES sampler_extra_bytes_per_logit",
    ),
    Marker(
        name="cuda-graph-memory-profiled",
        meaning=(
            "CUDA-graph memory is estimated and subtracted before the KV cache is sized, by default "
            "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1); the log line this release prints says "
            '"default since v0.21.0"'
        ),
        paths=_ENVS,
        holds=line_matching(r"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: bool = True"),
        test="envs.py declares VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: bool = True",
        boundary="VLLM_PROFILES counts_cuda_graphs",
    ),
    Marker(
        name="gpu-memory-utilization-0.92",
        meaning="gpu_memory_utilization defaults to 0.92 (0.9 before)",
        paths=("vllm/config/cache.py",),
        holds=line_matching(
            r"gpu_memory_utilization: float = Field\(default=0\.92\b|DEFAULT_GPU_MEMORY_UTILIZATION\b.*= 0\.92\b"
        ),
        test="CacheConfig.gpu_memory_utilization defaults to 0.92 (DEFAULT_GPU_MEMORY_UTILIZATION from 0.34.0)",
        boundary="VLLM_PROFILES gpu_memory_utilization",
    ),
    Marker(
        name="kv-tokens-from-concurrency",
        meaning=(
            'the "GPU KV cache size: N tokens" line logs max_concurrency x max_model_len (before: num_blocks // '
            "groups x block_size, which undercounts hybrid models)"
        ),
        paths=_KV_UTILS,
        holds=line_matching(r"int\(max_concurrency \* max_model_len\)"),
        test="kv_cache_utils.py computes the logged tokens as int(max_concurrency * max_model_len)",
        boundary="VLLM_PROFILES hybrid_tokens_from_concurrency",
    ),
    Marker(
        name="sliding-window-in-flight-tokens",
        meaning=(
            "sliding-window and chunked-local layers reserve VllmConfig.max_in_flight_tokens (max_concurrent_batches "
            "x max_num_batched_tokens: 2 batches with async scheduling, on by default since 0.14) beyond their "
            "window, instead of one max_num_batched_tokens"
        ),
        paths=_CONFIG,
        holds=line_matching(r"def max_in_flight_tokens\b"),
        test="VllmConfig defines max_in_flight_tokens",
        boundary="VLLM_PROFILES sliding_in_flight_batches",
    ),
    Marker(
        name="hybrid-prefix-caching-by-default",
        meaning=(
            "prefix caching is on by default for hybrid attention/Mamba models, whose state layers then run in "
            'mamba_cache_mode "align" (2 state pages per request); 0.26.0-0.27.1 supported it but left it off by '
            "default (and chose mode 'all' where a model supported it)"
        ),
        paths=(*_ARG_UTILS, *_MODEL_CONFIG),
        holds=all_of(
            line_matching(r"default_prefix_caching = model_config\.is_prefix_caching_supported$"),
            line_matching(r"Generative hybrid models support prefix caching"),
        ),
        test=(
            "arg_utils.py: default_prefix_caching = model_config.is_prefix_caching_supported (no 'and not "
            "is_hybrid'), and ModelConfig.is_prefix_caching_supported is True for generative hybrid models"
        ),
        boundary="VLLM_PROFILES mamba_align_by_default",
    ),
    Marker(
        name="kv-dtype-must-match-model",
        meaning=(
            "an explicit bfloat16/float16 kv_cache_dtype must equal the model's dtype, or VllmConfig refuses the "
            "configuration (_reject_mismatched_float_kv_cache, run from __post_init__)"
        ),
        paths=_CONFIG,
        holds=all_of(
            line_matching(r"def _reject_mismatched_float_kv_cache\b"),
            line_matching(r"self\._reject_mismatched_float_kv_cache\(\)", within=r"def __post_init__\b"),
        ),
        test="VllmConfig defines _reject_mismatched_float_kv_cache and __post_init__ calls it",
        boundary="VLLM_PROFILES kv_dtype_must_match_model",
    ),
    Marker(
        name="extensible-kv-cache-default",
        meaning=(
            "the extensible KV cache (sized after warm-up and CUDA-graph capture from measured free memory) is on "
            "by default on CUDA and ROCm, and gpu_memory_utilization defaults to None, which resolves to 1.0 with "
            "it (DEFAULT_GPU_MEMORY_UTILIZATION, 0.92, without it)"
        ),
        paths=("vllm/config/cache.py",),
        holds=all_of(
            line_matching(r"gpu_memory_utilization: float \| None = Field\(default=None\b"),
            line_matching(r"^\s+enable_extensible_kv_cache: bool\b"),
            line_matching(r"return 1\.0\b", within=r"def resolved_gpu_memory_utilization\b"),
        ),
        test=(
            "CacheConfig.gpu_memory_utilization defaults to None, CacheConfig has enable_extensible_kv_cache, and "
            "resolved_gpu_memory_utilization returns 1.0 with it"
        ),
        boundary="VLLM_PROFILES extensible_kv_cache, gpu_memory_utilization 1.0",
    ),
    Marker(
        name="default-block-size-64",
        meaning=(
            "the default KV block size is 64 tokens (CacheConfig.DEFAULT_BLOCK_SIZE); it was 16: "
            "CacheConfig.DEFAULT_BLOCK_SIZE from 0.18.0, before that the CUDA platform's check_and_update_config "
            "where block_size was unset (from 0.6.5), and EngineArgs.block_size in 0.6.0-0.6.4"
        ),
        paths=("vllm/config/cache.py",),
        holds=line_matching(r"DEFAULT_BLOCK_SIZE(: ClassVar\[int\])? = 64\b"),
        test="CacheConfig.DEFAULT_BLOCK_SIZE is 64",
        boundary="VLLM_PROFILES block_size 64",
    ),
    Marker(
        name="longrope-default-original-length",
        meaning=(
            "with no --max-model-len, LongRoPE models default to original_max_position_embeddings (vLLM PR 27431)"
        ),
        paths=_MODEL_CONFIG,
        holds=line_matching(r"For LongRoPE, default to original_max_position_embeddings"),
        test="_get_and_verify_max_len's LongRoPE default",
        boundary="VLLM_ROPE_RULES longrope_default_original",
    ),
    Marker(
        name="yarn-not-rescaled",
        meaning=(
            "YaRN variants no longer multiply max_position_embeddings by factor, nor start from "
            "original_max_position_embeddings (vLLM PR 56446)"
        ),
        paths=_MODEL_CONFIG,
        holds=rope_types_include("yarn"),
        test="_get_and_verify_max_len's rope_type exclusion tuple lists yarn",
        boundary="VLLM_ROPE_RULES no_factor_types / yarn_from_original",
    ),
    Marker(
        name="batch-large-tier",
        meaning=(
            "the V1 server defaults give large GPUs 8,192 batched tokens (H100/H200 by name, vLLM PR 12369; by "
            "memory from 0.8.5)"
        ),
        paths=_ARG_UTILS,
        holds=line_matching(r'"h100" in device_name or "h200" in device_name|device_memory >= 70 \* GiB_bytes'),
        test="arg_utils.py tests the device name for h100/h200, or its memory against 70 GiB",
        boundary="VLLM_BATCH_DEFAULTS first V1 rule (from the later of this and v1-engine-default)",
    ),
    Marker(
        name="batch-seqs-by-tier",
        meaning="max_num_seqs defaults by tier: 1,024 on the large tier, 256 elsewhere (1,024 everywhere before)",
        paths=_ARG_UTILS,
        holds=line_matching(r"default_max_num_seqs = 256|UsageContext\.OPENAI_API_SERVER: 256"),
        test="arg_utils.py gives the small tier max_num_seqs 256",
        boundary="VLLM_BATCH_DEFAULTS small-tier max_num_seqs",
    ),
    Marker(
        name="batch-70gib-tier",
        meaning="the large tier is any GPU with >= 70 GiB (vLLM PR 17073), not H100/H200 by name",
        paths=_ARG_UTILS,
        holds=line_matching(r"device_memory >= 70 \* GiB_bytes"),
        test="arg_utils.py compares the device's total memory with 70 GiB",
        boundary="VLLM_BATCH_DEFAULTS large tier by memory",
    ),
    Marker(
        name="batch-a100-excluded",
        meaning="A100s never get the large tier (vLLM PR 17885: larger budgets cut their throughput)",
        paths=_ARG_UTILS,
        holds=line_matching(r'"a100" not in device_name'),
        test='arg_utils.py excludes "a100" device names from the large tier',
        boundary="VLLM_BATCH_DEFAULTS large tier excluded_names",
    ),
    Marker(
        name="batch-160gib-tier",
        meaning=">= 160 GiB GPUs (B200/B300) get 16,384 batched tokens and 1,024 sequences",
        paths=_ARG_UTILS,
        holds=line_matching(r"device_memory >= 160 \* GiB_bytes"),
        test="arg_utils.py has a >= 160 GiB tier",
        boundary="VLLM_BATCH_DEFAULTS 160 GiB tier",
    ),
    Marker(
        name="batch-gb10-excluded",
        meaning="GB10 (DGX Spark, compute capability 12.1) never gets the large tier",
        paths=_ARG_UTILS,
        holds=line_matching(r"and not is_gb10"),
        test="arg_utils.py excludes GB10 from the 70 GiB tier",
        boundary="VLLM_BATCH_DEFAULTS large tier excluded_names gb10",
    ),
    Marker(
        name="fp8-moe-block-refine",
        meaning=(
            "block-FP8 MoE experts whose tensor-parallel shard is not whole blocks are refined to gcd(block_n, "
            "block_k, shard, hidden) >= 32 for the Triton MoE kernels instead of refused (fp8.py's create_weights "
            "raised 'The output_size of gate's and up's weight = ... is not divisible by weight quantization "
            "block_n' before)"
        ),
        paths=(
            "vllm/model_executor/layers/fused_moe/oracle/fp8.py",
            "vllm/model_executor/layers/quantization/fp8.py",
            "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
        ),
        holds=line_matching(r"def refine_fp8_moe_block_shape\("),
        test="refine_fp8_moe_block_shape is defined",
        boundary="parallel.RULES fp8-block-moe until / fp8-block-moe-refined since",
    ),
    Marker(
        name="bnb-fp32-absmax",
        meaning=(
            "bitsandbytes double-quantized absmax is dequantized to fp32 at load (dequantize_dq, vLLM PR 19742); "
            "holds on in releases that no longer load bitsandbytes at all"
        ),
        paths=(
            "vllm/model_executor/model_loader/bitsandbytes_loader.py",
            "vllm/model_executor/model_loader/loader.py",
            QUANT_INIT,
        ),
        holds=lambda files: find_line(files, r"def _?dequantize_dq\(") or methods_exclude("bitsandbytes")(files),
        test="the bitsandbytes loader defines dequantize_dq (or the release no longer lists bitsandbytes)",
        boundary="quantization.VLLM_BNB_FP32_ABSMAX_SINCE",
    ),
    Marker(
        name="quant-nvfp4",
        meaning='ModelOpt NVFP4 checkpoints load (method "nvfp4", renamed "modelopt_fp4" in 0.9.0)',
        paths=(QUANT_INIT,),
        holds=methods_include("nvfp4", "modelopt_fp4"),
        test="QUANTIZATION_METHODS lists nvfp4 or modelopt_fp4",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-modelopt_fp4",
        meaning='NVFP4 checkpoints load as "modelopt_fp4"',
        paths=(QUANT_INIT,),
        holds=methods_include("modelopt_fp4"),
        test="QUANTIZATION_METHODS lists modelopt_fp4",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-mxfp4",
        meaning="MXFP4 checkpoints (gpt-oss) load",
        paths=(QUANT_INIT,),
        holds=methods_include("mxfp4"),
        test="QUANTIZATION_METHODS lists mxfp4",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-deprecated-refused",
        meaning=(
            "methods in DEPRECATED_QUANTIZATION_METHODS are refused without --allow-deprecated-quantization "
            "(ModelConfig._verify_quantization)"
        ),
        paths=(QUANT_INIT,),
        holds=line_matching(r"^DEPRECATED_QUANTIZATION_METHODS\b"),
        test="quantization/__init__.py defines DEPRECATED_QUANTIZATION_METHODS",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-gguf-removed",
        meaning="gguf is no longer a quantization method",
        paths=(QUANT_INIT,),
        holds=methods_exclude("gguf"),
        test="QUANTIZATION_METHODS no longer lists gguf",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-bitsandbytes-removed",
        meaning="bitsandbytes is no longer a quantization method (RFC vllm-project/vllm#39583)",
        paths=(QUANT_INIT,),
        holds=methods_exclude("bitsandbytes"),
        test="QUANTIZATION_METHODS no longer lists bitsandbytes",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
    Marker(
        name="quant-fp_quant-removed",
        meaning=(
            "fp_quant is no longer a quantization method (listed from 0.11.1, on DEPRECATED_QUANTIZATION_METHODS "
            "from 0.14.0)"
        ),
        paths=(QUANT_INIT,),
        # Releases before 0.11.1 do not list it either: only a release that deprecates methods can have dropped it.
        holds=all_of(methods_exclude("fp_quant"), line_matching(r"^DEPRECATED_QUANTIZATION_METHODS\b")),
        test="QUANTIZATION_METHODS no longer lists fp_quant, in a release that defines DEPRECATED_QUANTIZATION_METHODS",
        boundary="kvfleet/engines/vllm/quantization.py row",
        lists_quantization=True,
    ),
)


# ---- bisection -------------------------------------------------------------------------------------------------


@dataclass
class Finding:
    marker: Marker
    first: Artifact | None = None
    previous: Artifact | None = None
    match: Match | None = None
    note: str = ""
    checked: dict[str, bool] = field(default_factory=dict)  # release -> whether it showed the marker


def evaluate(reader: ReleaseReader, marker: Marker, art: Artifact) -> Match | None:
    return marker.holds({path: reader.read(art, path) for path in marker.paths})


def _marker(name: str) -> Marker:
    return next(m for m in MARKERS if m.name == name)


def bisect(reader: ReleaseReader, marker: Marker, releases: Sequence[Artifact], log: Callable[[str], None]) -> Finding:
    """The first release showing the marker, assuming that once it shows it stays; the newest release and the
    oldest are always read."""
    finding = Finding(marker)
    memo: dict[int, Match | None] = {}

    def at(i: int) -> Match | None:
        if i not in memo:
            memo[i] = evaluate(reader, marker, releases[i])
            finding.checked[releases[i].version] = memo[i] is not None
            log(f"  {marker.name} @ {releases[i].version}: {'yes' if memo[i] else 'no'}")
        return memo[i]

    if at(len(releases) - 1) is None:
        finding.note = f"not shown by the newest release ({releases[-1].version})"
        return finding
    if at(0) is not None:
        finding.first, finding.match = releases[0], at(0)
        finding.note = f"already shown by the oldest release read ({releases[0].version})"
        return finding
    lo, hi = 0, len(releases) - 1  # lo lacks it, hi shows it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) is None:
            lo = mid
        else:
            hi = mid
    finding.first, finding.previous, finding.match = releases[hi], releases[lo], at(hi)
    return finding


def _verify(reader: ReleaseReader, finding: Finding, releases: Sequence[Artifact], log: Callable[[str], None]) -> None:
    """Reads every release: the bisection's answer stands only if the marker is absent before its first release
    and present from it on; any release that breaks that goes into the finding's note."""
    first = releases.index(finding.first) if finding.first is not None else len(releases)
    odd = []
    for i, art in enumerate(releases):
        shown = evaluate(reader, finding.marker, art) is not None
        finding.checked[art.version] = shown
        if shown != (i >= first):
            odd.append(art.version)
    log(f"  {finding.marker.name}: every release read, {len(odd)} out of order")
    if odd:
        finding.note = (finding.note + "; " if finding.note else "") + "not monotonic at " + ", ".join(odd)


def quantization_lists(reader: ReleaseReader, art: Artifact) -> dict[str, list[str]]:
    text = reader.read(art, QUANT_INIT) or ""
    found = quantization_methods(text)
    return {"methods": found[0] if found else [], "deprecated": deprecated_methods(text)}


def report(
    findings: Sequence[Finding], lists: Mapping[str, dict[str, list[str]]], index_url: str, newest: str
) -> dict[str, Any]:
    used: dict[str, Any] = {}
    entries = []
    for f in findings:
        entries.append(
            {
                "name": f.marker.name,
                "meaning": f.marker.meaning,
                "boundary": f.marker.boundary,
                "file": f.match[0] if f.match else f.marker.paths[0],
                "test": f.marker.test,
                "first_release": f.first.version if f.first else None,
                "previous_release": f.previous.version if f.previous else None,
                "line": f.match[1] if f.match else None,
                "note": f.note or (f"read up to the first release of {f.marker.before}" if f.marker.before else ""),
                "checked": dict(sorted(f.checked.items(), key=lambda kv: release_key(kv[0]) or ())),
            }
        )
        for a in (f.first, f.previous):
            if a is not None:
                used[a.version] = a.as_json()

    def by_release(d: Mapping[str, Any]) -> dict[str, Any]:
        return dict(sorted(d.items(), key=lambda kv: release_key(kv[0]) or ()))

    return {
        "about": (
            "The first vLLM release whose own files show each marker, and the release before it, which does not, "
            "read from the artifacts on PyPI by tools/vllm_release_markers.py: a bisection of the final releases "
            f"from {'.'.join(map(str, FLOOR))} to {newest} (sdists where PyPI has them, else the needed members of "
            "the wheel, read by HTTP range requests); 'checked' lists every release read and whether it showed the "
            "marker. 'quantization_lists' holds QUANTIZATION_METHODS and DEPRECATED_QUANTIZATION_METHODS of the "
            "releases that start a row of kvfleet/engines/vllm/quantization.py."
        ),
        "index": index_url,
        "read": dt.date.today().isoformat(),
        "newest_release": newest,
        "markers": entries,
        "quantization_lists": by_release(lists),
        "artifacts": by_release(used),
    }


def merge(stored: Mapping[str, Any], fresh: Mapping[str, Any]) -> dict[str, Any]:
    """``fresh`` (a report of some markers) written over ``stored`` (the file as it was): the markers read replace
    their stored entries and the others are kept, in the order of MARKERS; a stored marker the tool no longer has is
    dropped. The quantization lists and artifacts kept are those the merged markers still use."""
    for key in ("index", "newest_release"):
        if stored.get(key) != fresh[key]:
            raise ValueError(
                f"{OUT.name} was read with {key} {stored.get(key)!r}, this reading with {fresh[key]!r}: the kept "
                "markers would not match; read every marker (drop --only)"
            )
    entries = {m["name"]: m for m in stored.get("markers", [])} | {m["name"]: m for m in fresh["markers"]}
    markers = [entries[m.name] for m in MARKERS if m.name in entries]
    named = {m.name: m for m in MARKERS}
    floor = min(fresh["quantization_lists"], key=lambda v: release_key(v) or ())
    listed = {floor} | {m["first_release"] for m in markers if named[m["name"]].lists_quantization}
    used = {m[k] for m in markers for k in ("first_release", "previous_release")}
    lists = {**stored.get("quantization_lists", {}), **fresh["quantization_lists"]}
    artifacts = {**stored.get("artifacts", {}), **fresh["artifacts"]}

    def by_release(d: Mapping[str, Any], keep: set[str]) -> dict[str, Any]:
        return dict(sorted(((k, v) for k, v in d.items() if k in keep), key=lambda kv: release_key(kv[0]) or ()))

    return {
        **fresh,
        "markers": markers,
        "quantization_lists": by_release(lists, listed),
        "artifacts": by_release(artifacts, used),
    }


def read_markers(
    reader: ReleaseReader,
    markers: Sequence[Marker],
    releases: Sequence[Artifact],
    *,
    verify: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> list[Finding]:
    """Bisects each marker; one bounded by ``before`` only over the releases before that marker's first one."""
    findings: list[Finding] = []
    firsts: dict[str, Artifact | None] = {}
    for m in markers:
        span = releases
        if m.before is not None:
            if m.before not in firsts:
                firsts[m.before] = bisect(reader, _marker(m.before), releases, log).first
            end = firsts[m.before]
            span = releases[: releases.index(end)] if end is not None else releases
        findings.append(bisect(reader, m, span, log))
        firsts[m.name] = findings[-1].first
        if verify:
            _verify(reader, findings[-1], span, log)
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUT.name} into kvfleet/sizing/data")
    parser.add_argument("--only", nargs="+", default=None, help="marker names to read (default: all)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "vllm-pypi")
    parser.add_argument("--index", default=INDEX_URL)
    parser.add_argument(
        "--verify", action="store_true", help="read every release in the span, not a bisection (downloads them all)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every release read")
    args = parser.parse_args(argv)
    unknown = set(args.only or ()) - {m.name for m in MARKERS}
    if unknown:
        parser.error(f"unknown markers: {', '.join(sorted(unknown))}")

    def log(msg: str) -> None:
        if args.verbose:
            print(msg, file=sys.stderr)

    markers = [m for m in MARKERS if args.only is None or m.name in args.only]
    releases = releases_from(fetch_index(args.index), args.index)
    reader = ReleaseReader(args.cache)
    try:
        findings = read_markers(reader, markers, releases, verify=args.verify, log=log)
        lists = {releases[0].version: quantization_lists(reader, releases[0])}
        for f in findings:
            if f.marker.lists_quantization and f.first is not None:
                lists[f.first.version] = quantization_lists(reader, f.first)
    finally:
        reader.close()
    for f in findings:
        first = f.first.version if f.first else "-"
        prev = f.previous.version if f.previous else "-"
        where = f"{f.match[0]}: {f.match[1]}" if f.match else f.note
        print(f"{f.marker.name}: {first} (not {prev}) {where}")
        if f.note and f.match:
            print(f"  note: {f.note}")
    if args.write:
        out = report(findings, lists, args.index, releases[-1].version)
        if args.only is not None and OUT.exists():
            stored = json.loads(OUT.read_text(encoding="utf-8"))
            try:
                out = merge(stored, out)
            except ValueError as err:
                print(f"not written: {err}", file=sys.stderr)
                return 1
            dropped = sorted({m["name"] for m in stored["markers"]} - {m["name"] for m in out["markers"]})
            if dropped:
                print(f"dropped markers the tool no longer has: {', '.join(dropped)}")
        OUT.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {OUT}")
    return 0 if all(f.first is not None and f.previous is not None for f in findings) else 1


if __name__ == "__main__":
    sys.exit(main())
