"""The event loops an anyio test runs on (tests/conftest.py runs every one on all of them unless told otherwise), and
how a test or a module names the ones it runs on."""
from typing import Any

import pytest

BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"),
            pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
            pytest.param(("trio", {}), id="trio")]


def only(*names: str) -> list[Any]:
    """The backends of BACKENDS with these ids: an `anyio_backend` fixture's params."""
    return [backend for backend in BACKENDS if backend.id in names]


def on(*names: str) -> pytest.MarkDecorator:
    """Run a test on these backends only."""
    return pytest.mark.parametrize("anyio_backend", only(*names))
