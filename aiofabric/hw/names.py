"""The bindings' constants by prefix: how codes become readable names and tables stay in step with the headers."""
from __future__ import annotations

from ..autogen import bnxt


def constants(prefix: str) -> dict[str, int]:
    """Name (without `prefix`) -> value of the bindings' constants that start with `prefix`, the generator's `_LAST`
    aliases left out."""
    return {name[len(prefix):]: value for name, value in vars(bnxt).items()
            if name.startswith(prefix) and not name.endswith("_LAST")}


def constant_names(prefix: str) -> dict[int, str]:
    """Value -> name (without `prefix`) of the constants `constants(prefix)` finds: for status and reason codes."""
    return {value: name for name, value in constants(prefix).items()}
