"""What the command-line jobs share: settings checked before anything loads, and every
usage problem ending in one `error:` line and exit code 2.

The jobs import it by its bare name: a script runs with its own folder first on the path.
Nothing that runs inside Ray (actors, Ray Data tasks) imports it, so a cluster's workers,
which do not have jobs/ on their path, never need it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pipeline.errors import ConfigError, KnapSpecError
from pipeline.logs import configure_logging

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


def positive_float(value: str) -> float:
    return _number(value, lambda number: number > 0, "a number > 0")


def fraction(value: str) -> float:
    return _number(value, lambda number: 0 <= number <= 1, "a number in [0, 1]")


def non_negative_float(value: str) -> float:
    return _number(value, lambda number: number >= 0, "a number >= 0")


def _number(value: str, allowed: Callable[[float], bool], expected: str) -> float:
    """`value` as a number that `allowed` accepts (NaN fails every test), else argparse's error
    saying what was `expected`."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if not allowed(number):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {number}")
    return number


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {number}")
        return number

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)

# A latency-table store of its own for every job started with it: one shared by a cluster's
# nodes, or one kept apart from the user's (the tests'). The jobs read it and hand the folder
# on in their configs, to Ray workers too; nothing below them reads the environment.
CALIBRATION_DIR_ENV = "KNAPSPEC_CALIBRATION_DIR"


def add_calibration_dir_argument(group, environ: Mapping[str, str], flag: str = "--calibration-dir") -> None:
    """The store folder option, its default taken from `environ` (the job's `os.environ`)."""
    default = environ.get(CALIBRATION_DIR_ENV)
    group.add_argument(
        flag,
        type=Path,
        default=Path(default).expanduser() if default else None,
        help=f"latency-table store folder (default: ${CALIBRATION_DIR_ENV}, else the cache's calibration/)",
    )


def add_log_arguments(parser) -> None:
    """--quiet (warnings only) and --verbose (Ray's and Ray Data's own lines too: RAY_CHATTER)."""
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    parser.add_argument(
        "--verbose", action="store_true", help="Ray's and Ray Data's own lines too (progress blocks, datasets' plans)"
    )


# Ray's and Ray Data's lines in a job's driver that say less than the job's own, and the level
# they are kept from: Ray Data's progress block (every 10 s where the output is not a terminal,
# each dataset's first at once), each dataset's start, plan and end, the sink's rows written,
# the local cluster's start, and the notice, a warning though nothing is wrong, that the cluster
# uses token authentication. The job's `[k/n]` lines and closing table say what a reader needs;
# `--verbose` keeps these.
RAY_CHATTER = {
    "ray.data._internal.progress": logging.WARNING,
    "ray.data._internal.execution.streaming_executor": logging.WARNING,
    "ray.data.dataset": logging.WARNING,  # ("Data sink ... finished": the job's closing lines say more)
    "ray._private.worker": logging.WARNING,
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
}


def configure_job_logging(args: argparse.Namespace) -> None:
    """The job's log (pipeline/logs.py) as add_log_arguments' flags ask: Ray's and Ray Data's
    chatter (RAY_CHATTER) kept out unless --verbose."""
    configure_logging(args.quiet)
    if args.verbose:
        return
    import ray.data  # noqa: F401 — (its import sets up its loggers: after it, these levels stay)

    for name, level in RAY_CHATTER.items():
        logging.getLogger(name).setLevel(level)


def add_sampling_arguments(
    group,
    seed_help: str | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    repetition_scope: str = "all",
) -> None:
    """Sampling and repetition control, as every job takes them (`sampling_params` reads them
    back); the defaults given are the job's own."""
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, help=seed_help)
    add_repetition_arguments(group, repetition_penalty, no_repeat_ngram_size, repetition_scope)


def add_repetition_arguments(
    group, repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0, repetition_scope: str = "all"
) -> None:
    from pipeline.decoding.repetition import REPETITION_SCOPES

    group.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=repetition_penalty,
        help="divide the positive logits (multiply the negative) of tokens already seen, as transformers "
        f"does; 1.0 is off (default {repetition_penalty})",
    )
    group.add_argument(
        "--no-repeat-ngram-size",
        type=non_negative_int,
        default=no_repeat_ngram_size,
        help=f"never repeat an n-gram of this size, as transformers does; 0 is off (default {no_repeat_ngram_size})",
    )
    group.add_argument(
        "--repetition-scope",
        choices=REPETITION_SCOPES,
        default=repetition_scope,
        help="the tokens repetition control looks at: all (prompt and answer, as transformers) or the answer "
        f"only (default {repetition_scope})",
    )


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the arguments `add_sampling_arguments` (or, greedy, only
    `add_repetition_arguments`) added."""
    from pipeline.decoding.sampling import SamplingParams

    return SamplingParams(
        temperature=getattr(args, "temperature", 0.0),
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0),
        seed=getattr(args, "seed", None),
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        repetition_scope=args.repetition_scope,
        end_on_sentence_after=getattr(args, "end_on_sentence_after", None),
    )


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


def load_documents(path: Path, ids: Sequence[str]) -> dict[str, str]:
    """The texts of `ids`, in that order, from a .jsonl file of {"id", "text"} rows (the
    sample documents the measuring jobs read)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[str(row["id"])] = row["text"]
    missing = [i for i in ids if i not in rows]
    if missing:
        raise ConfigError(f"ids not found in {path}: {', '.join(missing)}")
    return {i: rows[i] for i in ids}
