"""The Python sandbox tool: code runs in a subprocess in an empty temporary folder without network, and
CPU, memory and wall-clock limits stop it; a failure is the model's error result."""

import json
import os
import time

import pytest

from grpo_lightning.core.tools import sandbox
from grpo_lightning.core.tools.calls import ToolCall, ToolRunner
from grpo_lightning.core.tools.sandbox import PythonSandbox, SandboxLimits


@pytest.fixture(scope="module")
def box():
    return PythonSandbox(SandboxLimits(cpu_seconds=1, memory_bytes=256 * 2**20, wall_seconds=2))


def test_prints_come_back_from_an_empty_folder_that_is_removed(box):
    assert box.python("print(6 * 7)") == "42\n"
    cwd, listing = box.python("import os; print(os.getcwd()); print(os.listdir('.'))").splitlines()
    assert listing == "[]" and cwd != os.getcwd() and not os.path.exists(cwd)
    assert box.python("import os; print(sorted(os.environ))").strip() in (
        "['HOME', 'PATH', 'TMPDIR']",
        "['HOME', 'LC_CTYPE', 'PATH', 'TMPDIR']",  # Python may set LC_CTYPE itself
    )


def test_no_network(box):
    code = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)"
    with pytest.raises(RuntimeError, match="Network is unreachable|OSError"):
        box.python(code)
    interfaces = box.python("import socket; print(sorted(n for _, n in socket.if_nameindex()))")
    assert interfaces.strip() == "['lo']"


def test_limits_stop_the_code(box):
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="exit status -9"):  # SIGKILL at the CPU limit
        box.python("while True: pass")
    with pytest.raises(TimeoutError, match="past 2"):
        box.python("import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match="MemoryError"):
        box.python("x = bytearray(2**30)")
    assert time.perf_counter() - start < 6


def test_a_failure_is_the_models_error(box):
    [[(name, result)]] = ToolRunner([box.python])([[ToolCall("python", {"code": "1/0"})]])
    assert name == "python" and "ZeroDivisionError" in json.loads(result)["error"]


def test_refuses_to_start_without_a_network_namespace(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"^PythonSandbox needs `unshare --net`"):
        PythonSandbox()
