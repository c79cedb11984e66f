"""Exclude patterns: the regexes that keep named parts of a program out of a transformation
(FP8 autocast's `fp8_exclude`, `jaxmp.quantize`'s `exclude`), checked where they are given."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def compile_exclude(exclude: Any, argument: str = "fp8_exclude") -> tuple[re.Pattern[str], ...]:
    """`exclude` (None, a regex or a sequence of them) as compiled regexes; a ValueError or
    TypeError naming `argument` (`fp8_exclude` of FP8 autocast, `exclude` of
    `jaxmp.quantize`)."""
    if exclude is None:
        return ()
    patterns = [exclude] if isinstance(exclude, str) else exclude
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            f"`{argument}` must be a regex or a sequence of regexes (strings), got {exclude!r}."
        )
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(
                f"`{argument}` must hold valid regexes, got {pattern!r} ({e})."
            ) from None
    return tuple(compiled)
