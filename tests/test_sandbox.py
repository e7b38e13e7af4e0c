"""The Python sandbox tool: code runs isolated by namespaces in an empty working folder of its own without
network, CPU, memory, process and wall-clock limits stop it, and a failure is the model's error result.
Where the kernel does not allow the isolation, the sandbox refuses to start and these tests are skipped,
saying why. The escapes a hostile snippet tries are in tests/test_bad_input_sandbox.py."""

import ast
import os
import subprocess
import sys
import time

import pytest

from grpo_lightning.core.tools.calls import ToolCall, ToolRunner
from grpo_lightning.core.tools.sandbox import PythonSandbox, SandboxLimits
from grpo_lightning.core.tools.sandbox_namespaces import INSIDE_ID


@pytest.fixture(scope="module")
def box():
    try:
        return PythonSandbox(SandboxLimits(cpu_seconds=1, memory_bytes=256 * 2**20, wall_seconds=2))
    except ValueError as refusal:
        pytest.skip(f"the kernel does not allow the sandbox here: {refusal}")


def test_prints_come_back_from_an_empty_folder_of_its_own(box):
    assert box.python("print(6 * 7)") == "42\n"
    box.python("open('left.txt', 'w').write('x')")
    cwd, listing = box.python("import os; print(os.getcwd()); print(os.listdir('.'))").splitlines()
    assert listing == "[]" and cwd == "/tmp"  # a fresh file system each time: nothing left from the last
    ids = "import os; print(os.getuid(), os.getgid(), os.getgroups(), os.getpid())"
    assert box.python(ids) == f"{INSIDE_ID} {INSIDE_ID} [] 2\n"  # an unprivileged uid, the init's child
    capabilities = box.python("print(open('/proc/self/status').read())")
    for line in ("CapPrm:\t0000000000000000", "CapEff:\t0000000000000000", "CapBnd:\t0000000000000000"):
        assert line in capabilities
    assert "NoNewPrivs:\t1" in capabilities
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
    with pytest.raises(TimeoutError, match="past 2"):
        box.python("import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match="MemoryError"):
        box.python("x = bytearray(2**30)")
    assert time.perf_counter() - start < 6
    # The CPU limit, with a wall clock long enough not to stop it first on a busy machine.
    cpu_bound = PythonSandbox(SandboxLimits(cpu_seconds=1, wall_seconds=60))
    with pytest.raises(RuntimeError, match="killed by SIG(XCPU|KILL)"):
        cpu_bound.python("while True: pass")


def test_a_failure_is_the_models_error(box):
    [[(name, result)]] = ToolRunner([box.python])([[ToolCall("python", {"code": "1/0"})]])
    assert name == "python" and "ZeroDivisionError" in ast.literal_eval(result)["error"]  # TRL's str(dict)


def test_refuses_to_start_in_one_line_where_the_kernel_allows_no_user_namespace():
    """In a user namespace whose `user.max_user_namespaces` is 0, as a kernel without them: one line."""
    script = "from grpo_lightning.core.tools.sandbox import PythonSandbox\ntry:\n    PythonSandbox()\n" + (
        "except ValueError as refusal:\n    print(refusal)\nelse:\n    print('started')"
    )
    command = f'echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c "$0"'
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no user namespace to stand for such a kernel: {probe.stderr.decode().strip()}")
    said = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", command, script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=False,
    ).stdout.strip()
    assert said.startswith("PythonSandbox cannot isolate code on this machine (") and "\n" not in said
    assert "unshare(CLONE_NEWUSER): No space left on device" in said
