"""The package as the README installs it, `pip install .` into a fresh venv: the runtime dependencies only. The test
extra would hide a missing one (trio brings sniffio along, for one), so this venv has none of it: every module
imports, the CLI runs, and `connect` works with this venv's python on both ends, against both SSH servers."""
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import aiofabric
from tests.support import CHECKOUT
from tests.support.ssh_servers import BOTH_SERVERS, assert_no_leftovers

pytestmark = pytest.mark.anyio
# The installed copy alone: a PYTHONPATH naming the checkout (as a developer's shell may) would hide what pip left out.
INSTALLED_ONLY = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the in-process SSH server is asyncssh's


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """`pip install` of a copy of the checkout (pip builds in the source tree) into a new venv, from the package
    indexes pip is configured with. Built once for the module: some 10 s."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(CHECKOUT / name, source / name)
    shutil.copytree(CHECKOUT / "aiofabric", source / "aiofabric", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    process = subprocess.run([str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--disable-pip-version-check", str(source)], capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, f"pip install . failed:\n{process.stderr[-3000:]}"
    return root / "venv"


def test_every_module_imports_and_the_cli_runs_with_the_runtime_dependencies_only(venv):
    modules = [module.name for module in pkgutil.walk_packages(aiofabric.__path__, "aiofabric.")
               if not module.name.endswith("__main__")]  # importing __main__ runs the command line
    code = ("import importlib, importlib.util, sys\n"
            "extra = [name for name in ('pytest', 'trio', 'uvloop') if importlib.util.find_spec(name)]\n"
            "assert not extra, f'test extra installed: {extra}'\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "from importlib.resources import files\n"  # package data: the --json lines' schema
            "assert files('aiofabric.tools').joinpath('schemas/result.schema.json').is_file(), 'no schema'\n"
            "for name in ('wirecore.h', 'wirecodec.c', 'wirequeues.c'):\n"  # the emulator's compiled core
            "    assert files('aiofabric.sim').joinpath(name).is_file(), f'no {name}'\n"
            "import aiofabric\n"
            "assert aiofabric.__file__.startswith(sys.prefix), aiofabric.__file__\n")
    process = subprocess.run([str(venv / "bin" / "python"), "-c", code, "aiofabric", *modules], capture_output=True,
                             text=True, timeout=120, cwd=venv, env=INSTALLED_ONLY)  # not the checkout's directory
    assert process.returncode == 0, process.stderr[-3000:]
    assert "aiofabric.peer.ssh" in modules
    process = subprocess.run([str(venv / "bin" / "aiofabric"), "info", "--json"], capture_output=True, text=True,
                             timeout=120, cwd=venv, env=INSTALLED_ONLY)
    line = json.loads(process.stdout)
    assert process.returncode == 0 and line["ok"] and line["schema_version"] == 1, process.stderr[-3000:]


@BOTH_SERVERS
async def test_connect_from_the_runtime_install_to_its_python(venv, server):
    python = str(venv / "bin" / "python")
    with anyio.fail_after(120):  # not subprocess.run: the asyncssh server runs on this event loop
        process = await anyio.run_process([str(venv / "bin" / "aiofabric"), "connect", "127.0.0.1",
                                           *server.cli_flags(python), "--size", "1048576", "--json"], check=False,
                                          cwd=venv, env=INSTALLED_ONLY)
    stdout = process.stdout.decode().strip()
    result = json.loads(stdout.splitlines()[-1]) if stdout else {}
    assert process.returncode == 0 and result["verified"] and result["bytes"] == 1048576, process.stderr[-3000:]
    await assert_no_leftovers(server.port)
