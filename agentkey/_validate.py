"""The checks options share: a flag, a number of seconds, a count of bytes, one of a few words.

Options are validated once, where they are built (``ServerOptions.__post_init__``, a
constructor), by these few functions, so every option says the same thing for the same
mistake: which field, what it must be, and what it got. A bool is never a number here
(``True`` is an ``int`` to Python, and ``lock_ttl=True`` is a bug, not one second); a
NaN or an infinity is never a number of seconds or bytes. A value of the wrong type is
named by its type only: an option passed in the wrong place may be a credential.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import SecretStr

from ._exceptions import ConfigurationError

__all__ = ["choice", "flag", "number", "replace", "secret", "text", "whole"]

_T = TypeVar("_T")
_S = TypeVar("_S", bound=str)


def _got(value: object) -> str:
    """What was passed, safe to print: a number, bool or None as itself, else its type."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def flag(name: str, value: object) -> bool:
    """``value`` when it is True or False; a ConfigurationError naming ``name`` else."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {_got(value)}")
    return value


def number(
    name: str,
    value: object,
    *,
    least: float = 0.0,
    above: bool = False,
    most: float = math.inf,
    unit: str = "seconds",
) -> float:
    """``value`` as a float: a finite number >= ``least`` (> with ``above``), <= ``most``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of {unit}, got {_got(value)}")
    out = float(value)
    low = out > least if above else out >= least
    if not (math.isfinite(out) and low and out <= most):
        bound = f"{'>' if above else '>='} {least:g}"
        if most != math.inf:
            bound += f" and <= {most:g}"
        raise ConfigurationError(f"{name} must be a finite number of {unit} {bound}, got {out!r}")
    return out


def whole(name: str, value: object, *, least: int = 0, unit: str = "bytes") -> int:
    """``value`` when it is an int (never a bool) >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigurationError(
            f"{name} must be a whole number of {unit} >= {least}, got {_got(value)}"
        )
    return value


def choice(name: str, value: object, options: tuple[_S, ...], meaning: str = "") -> _S:
    """``value`` when it is one of ``options`` (``meaning`` says what they mean)."""
    for option in options:
        if value == option and isinstance(value, str):
            return option
    words = " or ".join(repr(o) for o in options)
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else _got(value)
    raise ConfigurationError(
        f"{name} must be {words}{f' ({meaning})' if meaning else ''}, got {shown}"
    )


def replace(value: _T, changes: Mapping[str, Any]) -> _T:
    """A copy of the dataclass ``value`` with ``changes``, validated like the original."""
    names = {f.name for f in dataclasses.fields(value)}  # type: ignore[arg-type]
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ConfigurationError(
            f"{type(value).__name__} has no option(s) {', '.join(unknown)}; "
            f"valid options: {', '.join(sorted(names))}"
        )
    return dataclasses.replace(value, **changes)  # type: ignore[type-var]


def text(name: str, value: object) -> str:
    """``value`` when it is a non-empty str."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be a non-empty string, got {_got(value)}")
    return value


def secret(name: str, value: object) -> SecretStr | None:
    """``value`` (a str or a ``SecretStr``, never empty) as a ``SecretStr``; None stays None.

    The message names the field and the type passed, never the value.
    """
    if value is None:
        return None
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a str or pydantic.SecretStr, got {_got(value)}")
    if not value:
        raise ConfigurationError(f"{name} must not be empty")
    return SecretStr(value)
