"""The project's error hierarchy.

Fatal problems (bad configuration, an unsupported checkpoint) raise; problems
with one input row become that row's error message and never stop a batch.
"""


class KnapSpecError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(KnapSpecError, ValueError):
    """A setting, argument or input path is invalid; the message says which and why."""


class UnsupportedModelError(ConfigError):
    """The checkpoint is of an architecture or format this engine cannot run."""


class RowError(KnapSpecError):
    """One input row cannot be processed; becomes that row's `error` column."""


class NonFiniteLogits(RowError):
    """The model's logits for a request hold NaN or an infinity: its numbers overflowed, and
    whatever token they pick would be garbage. The request ends with this error."""


class DeviceFault(RuntimeError):
    """The process's device or model state is broken past this request (a sticky CUDA error,
    a lost tensor-parallel rank): every later request would fail too, so the replica exits
    and is restarted. Not a KnapSpecError: no row is at fault."""


# What a CUDA error that poisons its context says: every later kernel of the process fails too.
_STICKY_DEVICE_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "misaligned address",
    "NCCL error",
)


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` leaves its process unable to serve another request (DeviceFault, or a
    sticky CUDA error); an out-of-memory error or a request's own problem is not."""
    if isinstance(error, DeviceFault):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in _STICKY_DEVICE_ERRORS)
