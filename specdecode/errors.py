"""Exceptions that specdecode raises on purpose.

Every error meant for the user derives from `SpecDecodeError`, so the command line can
print its message as one line and exit with status 2. They derive from `ValueError`
because each one means "this input cannot be used". Bugs raise whatever Python raises.
"""


class SpecDecodeError(ValueError):
    """Base class: an error whose message is meant to be shown to the user as is."""


class ModelError(SpecDecodeError):
    """A model cannot be found, fetched, verified or converted."""


class UnknownModelError(ModelError):
    """A model name is neither in the registry nor a usable path."""


class ChecksumError(ModelError):
    """An assembled model file does not have the size or SHA-256 it must have."""
