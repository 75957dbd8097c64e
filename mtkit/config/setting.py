"""``setting(default, help)``: a config field whose explanation is data, read by the docs generator."""

import dataclasses
from typing import TypeVar

T = TypeVar("T")


def setting(default: T, help: str, *, repr: bool = True) -> T:
    """A field of a config section: its default, and why it is there (``docs/config.md`` shows the text).

    ``repr=False`` keeps a secret (an API key) out of the section's repr.
    """
    return dataclasses.field(default=default, repr=repr, metadata={"help": help})
