"""The calibration store: one JSON file per calibration key under the cache directory, so
every worker on a node reuses one measurement instead of repeating it; and the engine's
calibrator over it. A calibration missing from the store is measured (profiling/microbench.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.knapspec.latency import LatencyModel
from pipeline.model import checkpoint
from profiling import microbench
from profiling.record import DEFAULT_LAYOUT, Calibration, CalibrationFormatError, CalibrationKey

if TYPE_CHECKING:
    from pipeline.model.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)


def default_store_root() -> Path:
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


def store_calibrator(root: Path | None = None) -> Callable[[SublayerModel, str, bool], LatencyModel]:
    """An engine's calibrator (pipeline.engine.Calibrator): this device's stored table for
    the model, measured and stored when there is none, or when forced."""

    def calibrate(model: SublayerModel, model_name: str, force: bool) -> LatencyModel:
        key = CalibrationKey.for_model(model, model_name, layout=DEFAULT_LAYOUT)  # the whole model, one process
        return CalibrationStore(root).load_or_measure(model, key, force=force).latency

    return calibrate
