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
