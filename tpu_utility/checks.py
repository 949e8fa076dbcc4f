"""Argument checks shared by every public function, so a refusal reads the same anywhere."""
from __future__ import annotations

from typing import Any, Optional


def check_int(value: Any, name: str, *, low: int = 1, high: Optional[int] = None,
              who: str = "", why: str = "", none_ok: bool = False) -> None:
    """Refuse anything but an int in [low, high] (bools too), naming the argument.

    Example:
        >>> check_int(0, "epochs")
        Traceback (most recent call last):
        ...
        ValueError: epochs must be a positive int, got 0
        >>> check_int(5, "num_it", low=30, why=" (the suggestions need 30 points)")
        Traceback (most recent call last):
        ...
        ValueError: num_it must be an int >= 30 (the suggestions need 30 points), got 5
    """
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = (f"an int in {low}..{high}" if high is not None
                 else "a positive int" if low == 1 else f"an int >= {low}")
        or_none = " or None" if none_ok else ""
        prefix = f"{who}: " if who else ""
        raise ValueError(f"{prefix}{name} must be {bound}{or_none}{why}, got {value!r}")
