"""Package attributes loaded on first use (PEP 562): a package imports cheaply and pulls a module in only when one of
its names is asked for. Standard library only: the emulator process imports the top package too."""
from __future__ import annotations

import importlib
from typing import Any, Callable, MutableMapping


def lazy_attributes(namespace: MutableMapping[str, Any], homes: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The package's `__getattr__`: each name in `homes` (relative module -> names) is imported from its module on
    first use and kept in `namespace` (the package's globals()), so later lookups skip it."""
    module_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, namespace["__name__"]), name)
        namespace[name] = value
        return value
    return __getattr__
