"""Typed errors. Each maps to one gRPC status code, in one place (`grpc_status`)."""
from __future__ import annotations


class ForgeError(Exception):
    """Base class for errors that reach a client. `code` names a grpc.StatusCode member."""

    code = "INTERNAL"


class InvalidArgument(ForgeError):
    """The request is malformed: a bad parameter, an over-long prompt."""

    code = "INVALID_ARGUMENT"


class ModelNotFound(ForgeError):
    code = "NOT_FOUND"


class QueueFull(ForgeError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ForgeError):
    """The service is loading or draining."""

    code = "UNAVAILABLE"


class DeadlineExceeded(ForgeError):
    code = "DEADLINE_EXCEEDED"


class DeviceUnavailable(ForgeError):
    """The requested device cannot be used: no GPU, or its libraries (cuda-python, NVRTC) are missing."""

    code = "FAILED_PRECONDITION"


class CudaError(ForgeError):
    """A CUDA driver, NVRTC or kernel call failed; the message names the call and the error."""

    code = "INTERNAL"


class ModelLoadError(ForgeError):
    """A checkpoint could not be loaded: truncated, corrupt, or of an unsupported kind.

    The message always names the file and the reason."""

    code = "FAILED_PRECONDITION"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load {path}: {reason}")
        self.path = path
        self.reason = reason


def grpc_status(error: BaseException):
    """The grpc.StatusCode for an error; anything untyped is INTERNAL."""
    import grpc

    code = error.code if isinstance(error, ForgeError) else "INTERNAL"
    return getattr(grpc.StatusCode, code)
