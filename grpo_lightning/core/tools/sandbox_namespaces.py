"""The process that isolates one `PythonSandbox` snippet with Linux namespaces, then runs it. Standard library
only: it runs as a script (`python -I -S sandbox_namespaces.py CONFIG`), never imported by the trainer.

Three processes, each with one job:

- the launcher (this script's first process, in the trainer's namespaces) forks the *builder* and, once the
  builder has its own user namespace, writes that namespace's uid and gid maps: the code's uid and gid
  inside (`INSIDE_ID`) are `nobody` outside (65534) where the trainer is root, else the trainer's own uid,
  and nothing else is mapped (no root inside);
- the builder makes a mount, network, PID, IPC and UTS namespace and forks the *init*, PID 1 of the new PID
  namespace;
- the init mounts a `/proc` of its own PID namespace, empty tmpfs over `/tmp` (the code's working folder,
  `tmpfs_bytes` large) and over the folders where host services keep sockets and shared files (`HIDDEN`),
  then forks the code's process, which drops every capability (bounding and ambient sets emptied), sets
  `no_new_privs`, changes to `INSIDE_ID`, sets its resource limits and execs `python -I -c CODE`. When the
  code's process ends, the init exits with its status, and the kernel kills everything left in the PID
  namespace (daemons, `setsid` grandchildren).

Any step that fails ends the launcher with `SETUP_FAILED` and one line `sandbox: <step>: <reason>` on stderr:
the sandbox never runs code with less isolation than this.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 125  # the launcher's exit status where the namespaces could not be made
INSIDE_ID = 1000  # the code's uid and gid inside its user namespace
HIDDEN = ("/run", "/var/run", "/var/tmp", "/var/lock", "/dev/shm", "/dev/mqueue")  # sockets, shared memory

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the sandbox that the kernel refused."""


def _checked(result: int, step: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(errno)}")


def _mount(source: str, target: str, kind: str | None, flags: int, data: str | None) -> None:
    encoded = [None if v is None else v.encode() for v in (source, target, kind, data)]
    _checked(
        _libc.mount(*encoded[:3], ctypes.c_ulong(flags), encoded[3]), f"mount {kind or source} on {target}"
    )


def _prctl(option: int, value: int, step: str, third: int = 0) -> None:
    _checked(_libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(third), 0, 0), step)


def _exit_status(status: int) -> int:
    """A wait status as an exit status: a signal's number plus 128, as a shell reports it."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _setup_failed(error: Exception) -> None:
    os.write(2, f"sandbox: {error}\n".encode(errors="replace"))
    os._exit(SETUP_FAILED)


def _write_maps(pid: int) -> None:
    """The builder's uid and gid maps: `INSIDE_ID` is nobody outside where this process is root (it may map
    any id), else this process's own ids (all an unprivileged process may map)."""
    root = os.geteuid() == 0
    uid, gid = (65534, 65534) if root else (os.geteuid(), os.getegid())
    if not root:
        with open(f"/proc/{pid}/setgroups", "w") as file:
            file.write("deny")
    for name, outside in (("uid_map", uid), ("gid_map", gid)):
        with open(f"/proc/{pid}/{name}", "w") as file:
            file.write(f"{INSIDE_ID} {outside} 1\n")


def _run_code(config: dict) -> None:
    """In the code's process: drop every privilege, set the limits, exec the code."""
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last_cap + 1):
        _prctl(PR_CAPBSET_DROP, cap, "drop the capability bounding set")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear the ambient capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs", 0)
    with open("/proc/self/setgroups") as file:
        if file.read().strip() == "allow":  # "deny" where an unprivileged launcher mapped the ids
            os.setgroups([])
    os.setresgid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    os.setresuid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    limits = {
        resource.RLIMIT_CPU: config["cpu_seconds"],
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_NPROC: config["max_processes"],
        resource.RLIMIT_FSIZE: config["file_bytes"],
        resource.RLIMIT_NOFILE: 256,
        resource.RLIMIT_CORE: 0,
    }
    for limit, value in limits.items():
        resource.setrlimit(limit, (value, value))
    os.chdir("/tmp")
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp"}
    python = config["python"]
    os.execve(python, [python, "-I", "-c", config["code"]], environment)


def _init(config: dict) -> None:
    """PID 1 of the sandbox: its mounts, then the code's process; exits with the code's status, and the
    kernel then kills whatever the code left behind."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "tie the sandbox to its builder")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for folder in HIDDEN:
        if os.path.isdir(folder) and not os.path.islink(folder):
            _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    work = f"size={config['tmpfs_bytes']},mode=0700,uid={INSIDE_ID},gid={INSIDE_ID}"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, work)
    code = os.fork()
    if code == 0:
        try:
            _run_code(config)
        except (OSError, SetupError) as error:
            _setup_failed(error)
    while True:  # PID 1 reaps every orphan until the code's process ends
        pid, status = os.wait()
        if pid == code:
            os._exit(_exit_status(status))


def _build(config: dict, unshared: int, mapped: int, launcher: int) -> None:
    """The builder: a user namespace, mapped by the launcher, then the other namespaces and their init."""
    try:
        _checked(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        os.write(unshared, b"1")
        if os.read(mapped, 1) != b"1":
            raise SetupError("the launcher could not map the user namespace's ids")
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        _checked(_libc.unshare(flags), "unshare(mount, network, PID, IPC, UTS namespaces)")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "tie the builder to its launcher")
        if os.getppid() != launcher:
            os._exit(SETUP_FAILED)
    except (OSError, SetupError) as error:
        _setup_failed(error)
    os.close(unshared)
    os.close(mapped)
    init = os.fork()
    if init == 0:
        try:
            _init(config)
        except (OSError, SetupError) as error:
            _setup_failed(error)
    _, status = os.waitpid(init, 0)
    os._exit(_exit_status(status))


def main() -> None:
    config = json.loads(sys.argv[1])
    unshared_read, unshared_write = os.pipe()
    mapped_read, mapped_write = os.pipe()
    launcher = os.getpid()
    builder = os.fork()
    if builder == 0:
        os.close(unshared_read)
        os.close(mapped_write)
        _build(config, unshared_write, mapped_read, launcher)
    os.close(unshared_write)
    os.close(mapped_read)
    if os.read(unshared_read, 1) == b"1":
        try:
            _write_maps(builder)
            os.write(mapped_write, b"1")
        except OSError as error:
            os.write(2, f"sandbox: map the user namespace's ids: {error.strerror}\n".encode())
    os.close(mapped_write)
    _, status = os.waitpid(builder, 0)
    os._exit(_exit_status(status))


if __name__ == "__main__":
    main()
