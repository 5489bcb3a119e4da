"""A calibration: a fitted latency model plus what it was fitted from, and what it holds for.

A calibration holds for one device, model, compute dtype and parallel layout: the same
model runs at different speeds on another GPU, in another dtype, or split over more
stages. Its key names them; `device_name` is how a device is named in it. A calibration
is saved as one JSON file (profiling/calibration.py keeps them in a store).

What the microbenchmarks measured is kept as measured. An engine's own timed steps correct
it (decoding/step_cost.py's online fit); the fit is kept beside the table as a
`StepCostCorrection`, and `corrected_latency` is the table the next engine plans from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.decoding.step_cost import StepCost
from pipeline.knapspec.batch_latency import corrected_table
from pipeline.knapspec.latency import LatencyModel
from pipeline.model.short_attention import MATMUL_ROUTE

if TYPE_CHECKING:
    from pipeline.model.sublayer_model import SublayerModel

# Bumped whenever a field changes meaning; older files are re-measured, never misread.
FORMAT_VERSION = 2  # 2: the DP search's cost (search_base, search_per_token)
DEFAULT_LAYOUT = "pp1-tp1"
_SLUG_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_SLUG = 80


class CalibrationFormatError(ValueError):
    """A calibration file that is not (or no longer) in this version's format."""


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name, e.g. "AMD EPYC 7B13", as the OS reports it."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            # x86 calls it "model name"; some ARM kernels only give "Hardware" or "Model".
            if name.strip() in ("model name", "Hardware", "Model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def device_name(device: torch.device | str) -> str:
    """What a calibration is valid for: the accelerator's name, or the CPU's and its thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        # The same CPU with another thread count is another device for latency purposes.
        return f"{cpu_model_name()}, {torch.get_num_threads()} threads"
    return device.type


@dataclass(frozen=True)
class CalibrationKey:
    device: str
    model: str
    dtype: str
    layout: str = DEFAULT_LAYOUT
    # How decode and verify attention runs (SublayerModel.attention_route): the fused kernel's
    # costs are not the matmuls', so a table measured with one must not plan for the other.
    attention: str = MATMUL_ROUTE

    @classmethod
    def for_model(cls, model: SublayerModel, model_name: str, layout: str = DEFAULT_LAYOUT) -> CalibrationKey:
        return cls(
            device=device_name(model.device),
            model=model_name,
            dtype=model.mode.value,
            layout=layout,
            attention=model.attention_route,
        )

    def file_name(self) -> str:
        """A readable, filesystem-safe name; the hash keeps keys that slug alike apart. The
        matmuls' keys hash as before the attention route was part of a key (their stored
        tables were measured that way), the kernel's get names of their own."""
        parts = dataclasses.astuple(self)
        if self.attention == MATMUL_ROUTE:
            parts = parts[:-1]
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
        model = Path(self.model).name or self.model
        route = "" if self.attention == MATMUL_ROUTE else f"-{self.attention}"
        slug = _SLUG_CHARS.sub("-", f"{model}-{self.dtype}{route}-{self.layout}-{self.device}").strip("-.")
        return f"{slug[:_MAX_SLUG]}-{digest}.json"


@dataclass(frozen=True)
class StepCostCorrection:
    """A step cost fitted to an engine's timed steps on this device, and when."""

    cost: StepCost
    steps: int  # timed steps the fit had seen
    updated_at: str  # ISO 8601, UTC

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self.cost), "steps": self.steps, "updated_at": self.updated_at}

    @classmethod
    def from_dict(cls, data: Mapping) -> StepCostCorrection:
        fields = dict(data)
        steps, updated_at = int(fields.pop("steps")), str(fields.pop("updated_at"))
        cost = StepCost(**{name: float(value) for name, value in fields.items()})
        if not all(math.isfinite(v) and v >= 0 for v in cost.as_tuple()):
            raise ValueError(f"step cost coefficients must be finite and >= 0, got {cost}")
        return cls(cost, steps, updated_at)


@dataclass(frozen=True)
class Calibration:
    latency: LatencyModel
    device: str
    model: str
    dtype: str
    layout: str
    num_threads: int
    torch_version: str
    created_at: str  # ISO 8601, UTC
    context_lengths: tuple[int, ...]
    t_attn_measured: tuple[float, ...]  # median seconds of one attention item at each context length
    reference_context: int  # the context the verify forwards ran at
    t_verify_measured: tuple[float, ...]  # [k - 1]: median seconds of a full forward of k tokens
    repeats: int
    fit_residuals: Mapping[str, float] = field(default_factory=dict)  # relative RMS per fitted quantity
    correction: StepCostCorrection | None = None  # what timed steps taught since (None: nothing yet)
    attention: str = MATMUL_ROUTE  # files from before the kernel lack it: they were the matmuls'

    def __post_init__(self) -> None:
        object.__setattr__(self, "context_lengths", tuple(int(n) for n in self.context_lengths))
        object.__setattr__(self, "t_attn_measured", tuple(float(t) for t in self.t_attn_measured))
        object.__setattr__(self, "t_verify_measured", tuple(float(t) for t in self.t_verify_measured))
        object.__setattr__(self, "fit_residuals", {str(k): float(v) for k, v in self.fit_residuals.items()})
        if len(self.context_lengths) != len(self.t_attn_measured):
            raise ValueError(
                f"{len(self.context_lengths)} context lengths but {len(self.t_attn_measured)} attention timings"
            )

    @property
    def key(self) -> CalibrationKey:
        return CalibrationKey(self.device, self.model, self.dtype, self.layout, self.attention)

    @property
    def corrected_latency(self) -> LatencyModel:
        """The table to plan from: the measured one, corrected by the timed steps where there were any."""
        return self.latency if self.correction is None else corrected_table(self.latency, self.correction.cost)

    @staticmethod
    def now() -> str:
        return datetime.now(timezone.utc).isoformat(timespec="seconds")

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["latency"] = self.latency.to_dict()
        for name in ("context_lengths", "t_attn_measured", "t_verify_measured"):
            data[name] = list(data[name])
        data["fit_residuals"] = dict(self.fit_residuals)
        data["correction"] = None if self.correction is None else self.correction.to_dict()
        return {"format": FORMAT_VERSION, **data}

    @classmethod
    def from_dict(cls, data: Mapping) -> Calibration:
        if not isinstance(data, Mapping):
            raise CalibrationFormatError(f"a calibration is a JSON object, not {type(data).__name__}")
        if data.get("format") != FORMAT_VERSION:
            raise CalibrationFormatError(f"calibration format {data.get('format')!r}, expected {FORMAT_VERSION}")
        fields = dict(data)
        del fields["format"]
        try:
            fields["latency"] = LatencyModel.from_dict(fields["latency"])
            if fields.get("correction") is not None:
                fields["correction"] = StepCostCorrection.from_dict(fields["correction"])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationFormatError(f"malformed calibration: {e}") from None

    def save(self, path: Path) -> None:
        """Write atomically: a reader on another worker never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(f.name, path)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CalibrationFormatError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data)
