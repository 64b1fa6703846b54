"""Exceptions: one per Rust ``MlxError`` variant, each also a familiar builtin."""

from __future__ import annotations


class MlxError(Exception):
    """Base of every error the library raises. ``code`` is the C ABI status."""

    code: int = -1


class DeviceNotFoundError(MlxError, RuntimeError):
    """No device of the requested kind exists, or the name is not a backend."""

    code = 1


class BackendUnavailableError(DeviceNotFoundError):
    """The backend is part of the library but cannot run here (no driver, no compiler)."""

    code = 2


class CommandBufferError(MlxError, RuntimeError):
    """A command failed while it ran on the device."""

    code = 3


class ShaderCompilationError(MlxError, RuntimeError):
    """A kernel source did not compile."""

    code = 4


class BufferAllocationError(MlxError, MemoryError):
    """Memory could not be allocated."""

    code = 5


class InvalidArgumentError(MlxError, ValueError):
    """A parameter, shape, stride or buffer does not meet the operation's contract."""

    code = 6


class KernelNotFoundError(MlxError, LookupError):
    """No kernel of that name, or no form of it for this backend."""

    code = 7


class UnsupportedDtypeError(MlxError, TypeError):
    """A dtype the operation does not take."""

    code = 8


class ArgumentTypeError(MlxError, TypeError):
    """An argument of the wrong kind: a list where an array goes, a float or a bool where an
    integer goes, a string where a number goes. Raised by the Python layer only (the C ABI
    takes no untyped value)."""

    code = 6


class UnsupportedFeatureError(MlxError, NotImplementedError):
    """A feature the caller asked for that this build does not compute (dropout, a score
    transform its kernels do not apply yet, a head dim without a kernel, a backward pass).
    Raised by the Python layer only: nothing is computed without it."""

    code = 6


class InvalidHandleError(MlxError, ValueError):
    """A device, buffer or encoder that was closed, freed, or never valid."""

    code = 9


class InternalError(MlxError, RuntimeError):
    """A bug in mlx-native (a caught panic, a broken invariant). Please report it."""

    code = 10


def not_picklable(obj: object, holds: str, instead: str) -> ArgumentTypeError:
    """The error for pickling (or copying) an object that holds native state of this process."""
    return ArgumentTypeError(f"a {type(obj).__name__} cannot be pickled or copied: it holds {holds}. {instead}")


BY_CODE = {
    cls.code: cls
    for cls in (
        DeviceNotFoundError,
        BackendUnavailableError,
        CommandBufferError,
        ShaderCompilationError,
        BufferAllocationError,
        InvalidArgumentError,
        KernelNotFoundError,
        UnsupportedDtypeError,
        InvalidHandleError,
        InternalError,
    )
}
