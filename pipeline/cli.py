"""What the command-line jobs share: every usage problem ends in one `error:` line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2


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
