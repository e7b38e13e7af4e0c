"""A Python tool that runs the model's code in a separate, limited process. Off unless you build one.

Model output is code from an untrusted author: it never runs in the trainer's process. `PythonSandbox`
runs each snippet in a fresh `python -I` subprocess, with no network (a network namespace of its own,
`unshare --net`: Linux only; where it cannot be made the sandbox refuses to start rather than run with a
network), limits on CPU seconds, memory, processes and written file size (`resource.setrlimit`), an empty
temporary folder as its working directory (deleted afterwards), an emptied environment, and a wall-clock
timeout. It is a guard against accidents, not a security boundary against a determined attacker: the code
runs as the trainer's user and can read what that user can read. For untrusted models or shared machines,
run code in a sandbox service (a container or VM per call), as verl and PipelineRL do.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Annotated

from grpo_lightning.core.options import Range, check_fields


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one snippet may use."""

    cpu_seconds: Annotated[int, Range(">= 1")] = 5
    """CPU seconds (RLIMIT_CPU); the process is killed past them."""

    memory_bytes: Annotated[int, Range(">= 16777216")] = 512 * 2**20
    """Address space (RLIMIT_AS), 512 MiB by default."""

    wall_seconds: Annotated[float, Range("> 0")] = 10.0
    """Wall-clock seconds before the process is killed (a snippet that sleeps uses no CPU)."""

    max_output_chars: Annotated[int, Range(">= 1")] = 10_000
    """Characters of stdout and stderr kept (the tool result is cut further, `ToolOptions`)."""

    def __post_init__(self) -> None:
        check_fields(self)


def _no_network_prefix() -> list[str]:
    """The command prefix that gives a process no network, as this machine allows: `unshare --net`,
    with a user namespace where the user is not root; ValueError when neither works."""
    unshare = shutil.which("unshare")
    if unshare is not None:
        for prefix in ([unshare, "--net"], [unshare, "--net", "--map-root-user"]):
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
            if probe.returncode == 0:
                return prefix
    raise ValueError(
        "PythonSandbox needs `unshare --net` (util-linux, and unprivileged user namespaces where not root) "
        "to run code without a network, and it does not work here: run code in a sandbox service instead"
    )


class PythonSandbox:
    """Runs Python code in a limited subprocess without network; the tool is its method `python` (pass
    `PythonSandbox().python` among the tools), whose result is what the code printed.

    Off by default: nothing builds one unless you do, and passing it as a tool is asking for the model's
    code to run on this machine (under the limits of `SandboxLimits`, see the module's description for what
    they do not protect). Refuses to start where a process without network cannot be made.
    """

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._prefix = _no_network_prefix()

    def _limit(self) -> None:  # runs in the child, before Python starts
        cpu = self.limits.cpu_seconds
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (self.limits.memory_bytes,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()  # its own process group: the timeout kills what it started too

    def python(self, code: str) -> str:
        """Run Python code in a sandbox without network and return its printed output.

        Args:
            code: a Python program; what it prints is the result.
        """
        with tempfile.TemporaryDirectory(prefix="grpo_sandbox_") as folder:
            command = [*self._prefix, sys.executable, "-I", "-c", code]
            process = subprocess.Popen(
                command,
                cwd=folder,
                env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=self._limit,
            )
            try:
                output, _ = process.communicate(timeout=self.limits.wall_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.communicate()
                raise TimeoutError(f"the code ran past {self.limits.wall_seconds} s") from None
        text = output.decode("utf-8", errors="replace")[-self.limits.max_output_chars :]
        if process.returncode != 0:
            raise RuntimeError(f"exit status {process.returncode}: {text.strip()}")
        return text
