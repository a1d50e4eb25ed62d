"""Domain errors: what went wrong, in terms a servicer can map to a status.

Domain code raises these; the server layer turns each into its canonical gRPC
status with a google.rpc.ErrorInfo (and BadRequest / RetryInfo where set).
Nothing here imports gRPC.
"""

from __future__ import annotations


class AstraError(Exception):
    """Base of every error that crosses a service boundary.

    `reason` is an UPPER_SNAKE identifier of the failure, stable across
    releases; `metadata` carries its dynamic values; `field_violations` name
    the request fields at fault as (field path, description) pairs.
    """

    code = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        metadata: dict[str, str] | None = None,
        field_violations: list[tuple[str, str]] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.field_violations = list(field_violations or [])
        self.retry_after_s = retry_after_s


class InvalidArgument(AstraError):
    code = "INVALID_ARGUMENT"


class NotFound(AstraError):
    code = "NOT_FOUND"


class AlreadyExists(AstraError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(AstraError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(AstraError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(AstraError):
    code = "UNAVAILABLE"


class DataLoss(AstraError):
    code = "DATA_LOSS"


class PermissionDenied(AstraError):
    code = "PERMISSION_DENIED"


class Unauthenticated(AstraError):
    code = "UNAUTHENTICATED"


def invalid_field(
    field: str, description: str, *, reason: str = "INVALID_FIELD"
) -> InvalidArgument:
    """An INVALID_ARGUMENT naming one request field."""
    return InvalidArgument(
        f"{field}: {description}",
        reason=reason,
        metadata={"field": field},
        field_violations=[(field, description)],
    )
