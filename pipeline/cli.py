"""What the command-line jobs share: settings checked before anything loads, and every
usage problem ending in one `error:` line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from pipeline.errors import ConfigError, KnapSpecError

if TYPE_CHECKING:
    import torch

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# What a job reports as one line instead of a traceback: its message says what to fix.
USAGE_ERRORS: tuple[type[BaseException], ...] = (KnapSpecError, OSError, ValueError)


class Parser(argparse.ArgumentParser):
    """argparse, but its errors end in the same one `error:` line as every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {number}")
    return number


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {number}")
    return number


def usage_error(error: BaseException) -> int:
    """Print an input or configuration problem as one `error:` line; the exit code to return.
    Its message says what to fix: a traceback would add nothing."""
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_reporting_errors(
    run: Callable[[], int],
    errors: tuple[type[BaseException], ...] = USAGE_ERRORS,
    interrupted: str = "interrupted",
) -> int:
    """`run()`'s exit code; a usage problem is one `error:` line (exit 2), Ctrl-C another (130)."""
    try:
        return run()
    except errors as e:
        return usage_error(e)
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED


def check_device(device: str, dtype: str) -> torch.device:
    """The device asked for, checked before a model loads: it exists, and runs `dtype`."""
    import torch

    from pipeline.model.linear import resolve_compute_mode

    try:
        checked = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}") from None
    if checked.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
    resolve_compute_mode(dtype, checked)
    return checked


def check_model(model: str | None) -> None:
    """A bad checkpoint folder fails here, not after the imports of a load."""
    from pipeline.model import checkpoint

    if model is not None and model != checkpoint.EMBEDDED_MODEL:
        checkpoint.resolve_checkpoint(model)
