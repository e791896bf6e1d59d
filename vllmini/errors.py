"""The package's exceptions: one base class, so callers can catch everything vllmini raises on purpose."""


class VllminiError(Exception):
    """Base class of every error vllmini raises on purpose."""


class OutOfBlocksError(VllminiError):
    """The block pool has no free block left for the request."""
