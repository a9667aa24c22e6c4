"""Typed errors. Each maps to one gRPC status code, in one place (`grpc_status`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

# Kinds: a prompt (with max_tokens) longer than the context or the KV cache; a bound the
# server's flags set (--max-messages, --max-total-tokens, ...); a full queue (QueueFull).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
LIMIT_EXCEEDED = "limit_exceeded"
QUEUE_FULL = "queue_full"


class ForgeError(Exception):
    """Base class for errors that reach a client. `code` names a grpc.StatusCode member.

    Two optional marks travel as trailing metadata (`error_metadata`) for a client to act on
    without parsing the message: `kind`, what went wrong (e.g. context_length_exceeded), and
    `field`, the request field at fault as a GenerateRequest path (e.g. stopping.max_tokens)."""

    code = "INTERNAL"
    kind: str | None = None
    field: str | None = None

    def __init__(self, *args: object, field: str | None = None, kind: str | None = None) -> None:
        super().__init__(*args)
        if field is not None:
            self.field = field
        if kind is not None:
            self.kind = kind


class InvalidArgument(ForgeError):
    """The request is malformed: a bad parameter, an over-long prompt."""

    code = "INVALID_ARGUMENT"


class Unsupported(ForgeError):
    """The request asks for something this model or server cannot do (not a malformed request)."""

    code = "FAILED_PRECONDITION"


class ModelNotFound(ForgeError):
    code = "NOT_FOUND"


class QueueFull(ForgeError):
    """A bounded queue is full, or a bounded wait for the server's CPU ran out: worth retrying later.
    The only error answered RESOURCE_EXHAUSTED by Forge itself, and marked so (trailing metadata
    `forge-error-kind: queue_full`) that a client can tell it from gRPC's own RESOURCE_EXHAUSTED for
    an over-large message."""

    code = "RESOURCE_EXHAUSTED"
    kind = QUEUE_FULL


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


class StartupError(Exception):
    """A server cannot start for a reason its operator must fix: a port it cannot listen on.
    The entry points log the message (as they do a model that cannot load) and exit 2."""


class ModelLoadError(ForgeError):
    """A checkpoint could not be loaded: truncated, corrupt, or of an unsupported kind.

    The message always names the file and the reason."""

    code = "FAILED_PRECONDITION"

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load {path}: {reason}")
        self.path = path
        self.reason = reason


# Trailing-metadata keys: the kind of a typed error, and the request field it is about.
ERROR_KIND_KEY = "forge-error-kind"
ERROR_FIELD_KEY = "forge-error-field"
# Bound on a status message on the wire. gRPC sends it percent-encoded in the grpc-message trailer,
# and a client refuses trailers over its metadata limit (8 KiB by default) with RESOURCE_EXHAUSTED.
MAX_DETAILS_WIRE_BYTES = 2000
EXCERPT_CHARS = 200


def excerpt(value: str, limit: int = EXCERPT_CHARS) -> str:
    """A user-supplied string for an error message: repr'd, cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} chars)"


def _wire_bytes(char: str) -> int:
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8"))


def bounded_details(message: str, limit: int = MAX_DETAILS_WIRE_BYTES) -> str:
    """`message` cut so that its percent-encoded form fits in `limit` bytes, saying how long it was."""
    # Every character costs at least one byte on the wire; a lone surrogate cannot be sent at all.
    head = message[:limit].encode("utf-8", "replace").decode("utf-8")
    if len(message) <= limit and sum(map(_wire_bytes, head)) <= limit:
        return head
    suffix = f"… (message truncated; {len(message)} chars)"
    budget, size, at = limit - sum(map(_wire_bytes, suffix)), 0, 0
    for at, char in enumerate(head):
        size += _wire_bytes(char)
        if size > budget:
            break
    return head[:at] + suffix


def error_metadata(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a typed error: its kind and its field, where it has them."""
    if not isinstance(error, ForgeError):
        return ()
    return tuple((key, value) for key, value in ((ERROR_KIND_KEY, error.kind), (ERROR_FIELD_KEY, error.field))
                 if value)


@contextlib.contextmanager
def blame(field: str | None) -> Iterator[None]:
    """Typed errors raised inside that name no field of their own are about `field`."""
    try:
        yield
    except ForgeError as error:
        if error.field is None:
            error.field = field
        raise


def grpc_status(error: BaseException):
    """The grpc.StatusCode for an error; anything untyped is INTERNAL."""
    import grpc

    code = error.code if isinstance(error, ForgeError) else "INTERNAL"
    return getattr(grpc.StatusCode, code)
