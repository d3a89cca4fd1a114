"""The one error type of the converter."""

from __future__ import annotations


class ConversionError(Exception):
    """A conversion cannot proceed.

    The message is one line that names the file, the key or tensor, and what
    was expected versus what was found. The CLI prints it as
    ``dflash-convert: error: <message>`` and exits with status 2.
    """

    def __init__(self, message: str) -> None:
        message = " ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
