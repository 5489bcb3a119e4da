"""The calibration store: one JSON file per calibration key under the cache directory, so
every worker on a node reuses one measurement instead of repeating it; and the engine's
calibrator over it. A calibration missing from the store is measured (profiling/microbench.py).
What an engine's timed steps teach is written back beside the measured table (`record`),
and the next engine on the device plans from the corrected table.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.knapspec.latency import LatencyModel
from pipeline.model import checkpoint
from profiling import microbench
from profiling.record import DEFAULT_LAYOUT, Calibration, CalibrationFormatError, CalibrationKey, StepCostCorrection

if TYPE_CHECKING:
    from pipeline.decoding.step_cost import StepCost
    from pipeline.model.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)


def default_store_root() -> Path:
    """The cache directory's `calibration` (a job's --calibration-dir names another)."""
    return checkpoint.default_cache_dir() / "calibration"


class CalibrationStore:
    """Calibrations on disk, one JSON file per CalibrationKey."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_store_root()

    def path_for(self, key: CalibrationKey) -> Path:
        return self.root / key.file_name()

    def get(self, key: CalibrationKey) -> Calibration | None:
        """The stored calibration for `key`; None when there is none or it cannot be used."""
        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            calibration = Calibration.load(path)
        except (CalibrationFormatError, OSError) as e:
            logger.warning("ignoring calibration %s, it will be re-measured: %s", path, e)
            return None
        if calibration.key != key:
            logger.warning("ignoring calibration %s: it is for %s, not %s", path, calibration.key, key)
            return None
        return calibration

    def put(self, calibration: Calibration) -> Path:
        path = self.path_for(calibration.key)
        calibration.save(path)
        logger.info("stored calibration %s", path)
        return path

    def load_or_measure(
        self, model: SublayerModel, key: CalibrationKey, force: bool = False, **measure_kwargs
    ) -> Calibration:
        """The stored calibration for `key`, measuring `model` (and storing it) when there is none.

        `force` re-measures regardless. A file lock makes concurrent callers on one node
        measure once: the others wait, then read it, and the device is never timed by two
        processes at once (each would slow the other's numbers).
        """
        from filelock import FileLock

        if key.dtype != model.mode.value:
            raise ValueError(f"calibration key is for dtype {key.dtype!r}, but the model runs {model.mode.value!r}")
        if key.attention != model.attention_route:
            raise ValueError(
                f"calibration key is for {key.attention!r} attention, but the model runs {model.attention_route!r}"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path_for(key)) + ".lock"):
            if not force:
                stored = self.get(key)
                if stored is not None:
                    logger.info("using calibration %s from %s", self.path_for(key), stored.created_at)
                    return stored
            # Looked up when called, so that tests can substitute microbench.measure.
            calibration = microbench.measure(model, model_name=key.model, layout=key.layout, **measure_kwargs)
            if calibration.key != key:
                logger.warning("measured %s, asked for %s; storing it under what was measured", calibration.key, key)
            self.put(calibration)
        return calibration


class StoreCalibrator:
    """An engine's calibrator over a store (pipeline.engine.Calibrator): this device's table
    for the model (the whole model, one process), measured and stored when there is none or
    when forced, as corrected by the steps earlier engines timed."""

    def __init__(self, root: Path | None = None) -> None:
        self.store = CalibrationStore(root)

    def __call__(self, model: SublayerModel, model_name: str, force: bool) -> LatencyModel:
        calibration = self.store.load_or_measure(model, self._key(model, model_name), force=force)
        if calibration.correction is not None:
            logger.info(
                "planning from the table as corrected by %d timed steps (%s)",
                calibration.correction.steps,
                calibration.correction.updated_at,
            )
        return calibration.corrected_latency

    def record(self, model: SublayerModel, model_name: str, cost: StepCost, steps: int) -> bool:
        """Keep `cost`, fitted to `steps` timed steps, with the stored table it corrects; False
        when the store holds no table for this device and model (nothing to correct)."""
        from filelock import FileLock

        key = self._key(model, model_name)
        path = self.store.path_for(key)
        if not path.is_file():
            return False
        with FileLock(str(path) + ".lock"):
            stored = self.store.get(key)
            if stored is None:
                return False
            correction = StepCostCorrection(cost, steps, Calibration.now())
            self.store.put(dataclasses.replace(stored, correction=correction))
        return True

    @staticmethod
    def _key(model: SublayerModel, model_name: str) -> CalibrationKey:
        return CalibrationKey.for_model(model, model_name, layout=DEFAULT_LAYOUT)


def store_calibrator(root: Path | None = None) -> StoreCalibrator:
    """The engine's calibrator over the store at `root` (default: the cache directory's)."""
    return StoreCalibrator(root)
