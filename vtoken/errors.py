"""Errors raised by vtoken. The CLI turns any `VTokenError` into a one-line message and exit 2."""


class VTokenError(Exception):
    """Base class: bad input or a violated contract, with the offending value in the message."""


class ConfigError(VTokenError):
    """An invalid parameter or configuration value (budget, block size, policy name, ...)."""


class TraceError(VTokenError):
    """A trace file that cannot be read: format, missing field, bad value (with file and line)."""


class EndpointError(VTokenError):
    """A live server that cannot be reached or answered something unusable."""


class InvariantError(VTokenError):
    """A substrate invariant (I1-I4) does not hold; the message carries the numbers."""

    def __init__(self, invariant: str, message: str, **where: int) -> None:
        super().__init__(f"{invariant} violated: {message}")
        self.invariant = invariant
        self.where = where


class NothingMeasuredError(VTokenError):
    """A run that measured nothing: no request completed, no check ran, or an asked-for fault
    was never injected. Its figures would be zeros and NaN, so it is refused instead."""
