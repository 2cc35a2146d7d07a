"""Exception kinds for caller mistakes. Internal invariants use ``assert``;
expected refusals are ``None`` or a result object, never an exception."""

from __future__ import annotations


class FabricError(Exception):
    """Base of every error kvfabric raises on purpose."""


class InvalidInput(FabricError, ValueError):
    """A request, key, value or message that the caller got wrong."""


class ConfigError(FabricError, ValueError):
    """A configuration key or value that is refused; names the key, value and what is allowed."""


class IntegrityError(FabricError, AssertionError):
    """``check_integrity`` found violated invariants; ``violations`` lists them all."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        super().__init__(
            f"{len(violations)} integrity violation(s):\n" + "\n".join(f"- {v}" for v in violations)
        )
