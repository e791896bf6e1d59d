"""The package's exceptions: one base class for everything vllmini raises on purpose; each subclass also
derives from the builtin callers would expect (ValueError, TypeError, IndexError, ...)."""


class VllminiError(Exception):
    """Base class of every error vllmini raises on purpose."""


class InvalidArgumentError(VllminiError, ValueError):
    """A value out of range, a wrong shape, or an unknown option."""


class InvalidTypeError(VllminiError, TypeError):
    """An argument of the wrong type or dtype."""


class BlockIdError(VllminiError, IndexError):
    """A block id outside the pool, or one that is not allocated."""


class InvalidIndexError(VllminiError, IndexError):
    """An index other than a block id (a token, a layer) outside its range."""


class OutOfBlocksError(VllminiError):
    """The block pool has no free block left for the request."""


class CheckpointError(VllminiError, ValueError):
    """A checkpoint, config or tokenizer file that is missing or cannot be read; the message names it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or directory that is not there; the message names it."""


class KernelBuildError(VllminiError, RuntimeError):
    """A CUDA source that does not compile, for NVRTC or for the CPU emulator."""


class KernelSourceNotFoundError(VllminiError, FileNotFoundError):
    """A kernel source (or the kernels/ folder) that is not there; the message says where it looked."""


class KernelLaunchError(VllminiError, RuntimeError):
    """A kernel launch that failed, hung past its time limit, or was interrupted."""


class InvalidBlockTableError(VllminiError, ValueError):
    """A block table entry outside the pool: found by the host check, or on the GPU by the in-kernel guard."""


class EngineStateError(VllminiError, RuntimeError):
    """An engine call that does not fit the engine's current state (e.g. generate() on a busy engine)."""
