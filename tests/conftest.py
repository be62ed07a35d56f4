"""Every `anyio` test runs on asyncio, uvloop and trio, except those marked `loop_agnostic`: they run once, on the
backend their name picks, so that together they still use all three. Under pytest-xdist, the tests of
tests/emulator/test_wire.py and tests/emulator/test_interop.py run alone: they bind fixed 127.0.0.x addresses, which
another worker's emulated NIC (it binds the first free one) may hold. The helpers in tests/support fail with pytest's
detailed assertion messages, as the tests do."""
import fcntl
import os
import zlib

import pytest

pytest.register_assert_rewrite("tests.support")  # before anything imports them
from tests.support.backends import BACKENDS  # noqa: E402

ALONE = ("test_wire.py", "test_interop.py")  # their tests bind fixed addresses


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("loop_agnostic"):
        backend = BACKENDS[zlib.crc32(metafunc.function.__name__.encode()) % len(BACKENDS)]
        metafunc.definition.add_marker(pytest.mark.parametrize("anyio_backend", [backend]))


@pytest.fixture(autouse=True)
def alone_on_fixed_addresses(request, tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "fixed-addresses.lock", "w") as lock:  # one per run
        fcntl.flock(lock, fcntl.LOCK_EX if request.path.name in ALONE else fcntl.LOCK_SH)
        yield
