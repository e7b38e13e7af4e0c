"""A Python tool that runs the model's code isolated by Linux namespaces, under limits. Off unless you build
one.

Model output is code from an untrusted author: it never runs in the trainer's process. `PythonSandbox` runs
each snippet in a fresh `python -I` process that `sandbox_namespaces.py` isolates with what the kernel gives
without a daemon or a container runtime (user, PID, mount, network, IPC and UTS namespaces); docs/tools.md,
"The Python sandbox", says what that guarantees and what it does not. Where the kernel refuses any of it
(unprivileged user namespaces turned off, a seccomp profile that forbids `unshare`), `PythonSandbox()`
refuses to start in one line: it never runs code with less isolation.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from grpo_lightning.core.options import Range, check_fields
from grpo_lightning.core.tools.sandbox_namespaces import SETUP_FAILED

LAUNCHER = Path(__file__).with_name("sandbox_namespaces.py")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one snippet may use."""

    cpu_seconds: Annotated[int, Range(">= 1")] = 5
    """CPU seconds of each of its processes (RLIMIT_CPU); a process is killed past them."""

    memory_bytes: Annotated[int, Range(">= 16777216")] = 512 * 2**20
    """Address space of each of its processes (RLIMIT_AS), 512 MiB by default: with `max_processes`, at
    most their product in all."""

    max_processes: Annotated[int, Range(">= 1")] = 16
    """Processes (and threads) the snippet may have at once, itself included (RLIMIT_NPROC, counted for its
    own uid in its own user namespace, so other snippets and the trainer do not count)."""

    file_bytes: Annotated[int, Range(">= 1")] = 16 * 2**20
    """Size of any file it writes (RLIMIT_FSIZE)."""

    tmpfs_bytes: Annotated[int, Range(">= 65536")] = 64 * 2**20
    """Size of its working folder `/tmp`, an empty memory file system of its own, gone with the snippet."""

    wall_seconds: Annotated[float, Range("> 0")] = 10.0
    """Wall-clock seconds before the snippet and every process it started are killed (a snippet that sleeps
    uses no CPU)."""

    max_output_chars: Annotated[int, Range(">= 1")] = 10_000
    """Characters of stdout and stderr kept, the last ones (the tool result is cut further,
    `ToolOptions.max_response_length`); the trainer reads the rest and drops it, never holding more than
    about this much."""

    def __post_init__(self) -> None:
        check_fields(self)


def _open_to_all(path: str) -> bool:
    """Whether every user may run `path`: each folder above it searchable by others, it readable and
    executable by them (the code runs as no user of this machine)."""
    path = os.path.realpath(path)
    folders = [str(parent) for parent in Path(path).parents]
    try:
        if not all(os.stat(folder).st_mode & stat.S_IXOTH for folder in folders):
            return False
        return os.stat(path).st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH
    except OSError:
        return False


def default_interpreter() -> str:
    """The Python the snippets run, by default: this one's base interpreter (a virtual environment's packages
    are not needed under `-I`) where every user may run it, else the system's `/usr/bin/python3`.
    ValueError where neither is open to all."""
    candidates = [getattr(sys, "_base_executable", None) or sys.executable, "/usr/bin/python3"]
    for candidate in candidates:
        if _open_to_all(candidate):
            return os.path.realpath(candidate)
    raise ValueError(
        f"PythonSandbox runs code as no user of this machine, and none of {candidates} is open to all "
        "(a folder above it is private, /root for one): pass PythonSandbox(interpreter=...) a Python every "
        "user may run"
    )


class PythonSandbox:
    """Runs Python code isolated by namespaces (see the module's description); the tool is its method
    `python` (pass `PythonSandbox().python` among the tools), whose result is what the code printed.

    Off by default: nothing builds one unless you do, and passing it as a tool is asking for the model's
    code to run on this machine. Refuses to start, in one line, where the kernel does not allow the
    isolation. `interpreter`: the Python the snippets run (`default_interpreter()`), one every user may run.
    """

    def __init__(self, limits: SandboxLimits | None = None, interpreter: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.interpreter = interpreter or default_interpreter()
        try:
            probe = self._run("print('isolated')")
        except (RuntimeError, TimeoutError) as error:
            probe = str(error)
        if probe != "isolated\n":
            raise ValueError(
                f"PythonSandbox cannot isolate code on this machine ({probe.strip()}): it needs Linux user "
                "namespaces (unprivileged ones where the trainer is not root: "
                "kernel.unprivileged_userns_clone, user.max_user_namespaces) and a seccomp profile that "
                "allows unshare; run code in a sandbox service instead"
            )

    def python(self, code: str) -> str:
        """Run Python code in an isolated sandbox without network and return its printed output.

        Args:
            code: a Python program; what it prints is the result.
        """
        return self._run(code)

    def _run(self, code: str) -> str:
        limits = self.limits
        config = {
            "code": code,
            "python": self.interpreter,
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "max_processes": limits.max_processes,
            "file_bytes": limits.file_bytes,
            "tmpfs_bytes": limits.tmpfs_bytes,
        }
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the launcher, builder and init in one group: one kill ends the sandbox
        )
        try:
            output, dropped, finished = self._read(process)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the init dies, and the kernel kills its namespace
            process.wait()
            process.stdout.close()
        text = output.decode("utf-8", errors="replace")[-limits.max_output_chars :]
        if dropped or len(output) > len(text.encode()):
            text = f"...(output cut: {dropped + len(output)} bytes in all)...\n{text}"
        if not finished:
            raise TimeoutError(f"the code ran past {limits.wall_seconds:g} s")
        status = process.returncode
        if status == SETUP_FAILED and text.startswith("sandbox: "):
            raise RuntimeError(f"the sandbox could not start: {text.strip()}")
        if status > 128:
            raise RuntimeError(f"killed by {signal.Signals(status - 128).name}: {text.strip()}")
        if status != 0:
            raise RuntimeError(f"exit status {status}: {text.strip()}")
        return text

    def _read(self, process: subprocess.Popen) -> tuple[bytes, int, bool]:
        """What the code printed, the last `4 * max_output_chars` bytes of it, how many bytes were dropped
        before those, and whether it ended (all its processes' ends of the pipe closed) before
        `wall_seconds`."""
        keep = 4 * self.limits.max_output_chars  # a character is 4 bytes at most in UTF-8
        deadline = time.monotonic() + self.limits.wall_seconds
        fd = process.stdout.fileno()
        output, dropped = bytearray(), 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(output), dropped, False
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # every process of the sandbox has ended (each held the pipe)
                try:
                    process.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    return bytes(output), dropped, False
                return bytes(output), dropped, True
            output += chunk
            if len(output) > keep:
                dropped += len(output) - keep
                del output[: len(output) - keep]
