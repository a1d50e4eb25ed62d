"""Request field checks shared by the servicers: required identifiers and their length.

An identifier that is empty or too long is answered INVALID_ARGUMENT naming its field
(astra.errors.invalid_field), the same in every service.
"""

from __future__ import annotations

from astra.errors import invalid_field

MAX_ID_CHARS = 128


def check_id(value: str, field: str, limit: int = MAX_ID_CHARS) -> None:
    """A required identifier of at most `limit` characters, else INVALID_ARGUMENT naming it."""
    if not value:
        raise invalid_field(field, "required")
    if len(value) > limit:
        raise invalid_field(field, f"longer than {limit} characters")
