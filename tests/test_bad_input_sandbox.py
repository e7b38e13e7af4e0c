"""The escapes a hostile snippet tries from `PythonSandbox`, each as the trainer would meet it: read the
trainer's secrets, reach its network or the host's services, signal it, outlive the call or hold it, fill
its memory, fork without end. Each must fail; where the kernel does not allow the isolation the sandbox
refuses to start and these are skipped, saying why."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid

import pytest

from grpo_lightning.core.tools.sandbox import PythonSandbox, SandboxLimits
from grpo_lightning.core.tools.sandbox_namespaces import HIDDEN


@pytest.fixture(scope="module")
def box():
    try:
        return PythonSandbox(SandboxLimits(cpu_seconds=2, memory_bytes=256 * 2**20, wall_seconds=5))
    except ValueError as refusal:
        pytest.skip(f"the kernel does not allow the sandbox here: {refusal}")


def ran(box: PythonSandbox, code: str) -> str:
    """What `code` printed, or the error the sandbox gave it (an escape that crashes is no escape)."""
    try:
        return box.python(code)
    except (RuntimeError, TimeoutError) as error:
        return str(error)


class Listener:
    """A TCP or unix-socket server on this host that counts the connections it accepts."""

    def __init__(self, family: int, address) -> None:
        self.server = socket.socket(family, socket.SOCK_STREAM)
        self.server.bind(address)
        self.server.listen()
        self.server.settimeout(0.2)
        self.accepted, self.stopped = 0, False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stopped:
            try:
                connection, _ = self.server.accept()
            except OSError:
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self.stopped = True
        self.thread.join(2)
        self.server.close()


def test_the_trainers_environment_cannot_be_read(tmp_path):
    """A trainer started with `HF_TOKEN` in its environment: the code reads /proc/<pid>/environ of every
    process it can name, the trainer's pid and its own ancestors."""
    code = """
import os
pids = {os.getppid(), TRAINER_PID}
pid = os.getppid()
while pid > 1:  # every ancestor the code's /proc shows
    pid = int(open(f"/proc/{pid}/status").read().split("PPid:")[1].split()[0])
    pids.add(pid)
for pid in pids:
    try:
        print(pid, open(f"/proc/{pid}/environ", "rb").read())
    except OSError as error:
        print(pid, error)
"""
    trainer = f"""
import os, sys
from grpo_lightning.core.tools.sandbox import PythonSandbox, SandboxLimits
from grpo_lightning.core.tools.sandbox_namespaces import HIDDEN
try:
    box = PythonSandbox(SandboxLimits(wall_seconds=20))
except ValueError as refusal:
    sys.exit(f"skip: {{refusal}}")
print(box.python({code!r}.replace("TRAINER_PID", str(os.getpid()))))
"""
    environment = {**os.environ, "HF_TOKEN": "hf_canary_d41d8cd9", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, env=environment, timeout=120
    )
    if run.stderr.startswith("skip: "):
        pytest.skip(run.stderr)
    assert run.returncode == 0 and "environ" not in run.stderr, run.stderr
    assert "hf_canary" not in run.stdout, run.stdout


SETNS = """
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
for path in {paths}:
    try:
        namespace = open(path)
    except OSError as error:
        print("open", path, error)
        continue
    print("setns", path, libc.setns(namespace.fileno(), 0x40000000), ctypes.get_errno())
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("CONNECTED")
except OSError as error:
    print("no connection:", error)
"""


def test_a_server_on_the_hosts_127_0_0_1_cannot_be_reached(box):
    """Directly, and after `setns` into the trainer's network namespace (its own /proc file and PID 1's)."""
    listener = Listener(socket.AF_INET, ("127.0.0.1", 0))
    try:
        port = listener.server.getsockname()[1]
        paths = [f"/proc/{os.getpid()}/ns/net", "/proc/1/ns/net", f"/proc/{os.getppid()}/ns/net"]
        said = ran(box, SETNS.format(paths=paths, port=port))
        time.sleep(0.3)
        assert "CONNECTED" not in said and listener.accepted == 0, said
    finally:
        listener.close()


def test_host_services_on_unix_sockets_cannot_be_reached(box):
    """Sockets open to every user where host services keep them (/run, /tmp): hidden by the sandbox's own
    empty file systems. Abstract sockets belong to the network namespace."""
    name = f"grpo-sandbox-test-{uuid.uuid4().hex[:8]}"
    where = [
        folder
        for folder in ("/tmp", *HIDDEN)
        if os.path.isdir(folder) and not os.path.islink(folder) and os.access(folder, os.W_OK)
    ]
    folders = [tempfile.mkdtemp(prefix=name, dir=folder) for folder in where]
    listeners = []
    try:
        for folder in folders:
            os.chmod(folder, 0o777)
            listeners.append(Listener(socket.AF_UNIX, os.path.join(folder, "s.sock")))
            os.chmod(os.path.join(folder, "s.sock"), 0o777)
        listeners.append(Listener(socket.AF_UNIX, f"\0{name}"))
        targets = [os.path.join(folder, "s.sock") for folder in folders] + [f"\0{name}"]
        code = f"""
import socket
for target in {targets!r}:
    try:
        socket.socket(socket.AF_UNIX).connect(target)
        print("CONNECTED", repr(target))
    except OSError as error:
        print("no connection:", error)
"""
        said = ran(box, code)
        time.sleep(0.3)
        assert "CONNECTED" not in said and [each.accepted for each in listeners] == [0] * len(listeners), said
    finally:
        for listener in listeners:
            listener.close()
        for folder in folders:
            for entry in os.listdir(folder):
                os.remove(os.path.join(folder, entry))
            os.rmdir(folder)


def test_a_fork_bomb_is_bounded(box):
    code = """
import os, time
started = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
    except OSError:
        break
print("started", started)
"""
    said = ran(box, code)
    assert "started" in said, said
    started = int(said.split("started")[1].split()[0])
    assert started < 16, said
    assert SandboxLimits().max_processes == 16


def test_the_trainer_cannot_be_signalled(box):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append("SIGTERM"))
    try:
        code = f"""
import os, signal
for pid in ({os.getpid()}, os.getppid()):  # never 1 or -1: without isolation those reach the whole host
    try:
        os.kill(pid, signal.SIGTERM)
        print("sent", pid)
    except OSError as error:
        print(pid, error)
"""
        ran(box, code)
        time.sleep(0.5)
        assert received == []
    finally:
        signal.signal(signal.SIGTERM, previous)


def processes_with(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    if marker.encode() in file.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_nothing_outlives_the_call_nor_holds_it(box):
    """A daemon (double fork, `setsid`) and a grandchild that keeps the output pipe open while it sleeps:
    the call returns when the code's process ends, and none of them is left on the host."""
    marker = f"grpo_sandbox_daemon_{uuid.uuid4().hex[:8]}"
    code = f"""
import subprocess, sys
for _ in range(2):
    sleeper = [sys.executable, "-c", "import time; time.sleep(20)  # {marker}"]
    subprocess.Popen(sleeper, start_new_session=True)
print("left")
"""
    start = time.perf_counter()
    try:
        said = ran(box, code)
        took = time.perf_counter() - start
        time.sleep(0.5)
        left = processes_with(marker)
        assert said == "left\n" and took < 5 and left == [], (said, took, left)
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_output_past_the_bound_is_not_held_by_the_trainer():
    """400 MB printed: the trainer keeps about `max_output_chars` of it, never the whole."""
    try:
        box = PythonSandbox(SandboxLimits(wall_seconds=60, max_output_chars=1000))
    except ValueError as refusal:
        pytest.skip(f"the kernel does not allow the sandbox here: {refusal}")
    code = "import sys\nfor _ in range(400):\n    sys.stdout.buffer.write(b'x' * 2**20)\nprint('end')"
    tracemalloc.start()
    try:
        said = box.python(code)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert said.endswith("xxxxend\n") and "output cut: 419430404 bytes in all" in said
    assert peak < 8 * 2**20, peak
