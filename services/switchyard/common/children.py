"""Child processes that die with their parent: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``).

A process started by ``switchyard up`` (redis-server, the three services) or by
the orchestrator (its CPU-pool workers) asks the kernel to send it a signal
when its parent ends, however it ends: ``kill -9`` of the parent included,
which runs no clean-up of its own (prctl(2): "the parent-death signal is sent
upon subsequent termination of the parent thread"; it is kept across execve).

Two uses:

- :func:`dying_with_parent` returns the command for :class:`subprocess.Popen`
  behind a stub that asks for the signal and then execs it (set before the
  program starts, so it cannot be lost; no ``preexec_fn``, which crashed
  children forked beside busy gRPC threads);
- :func:`die_with_parent` is called by a Python child itself (a pool initializer).

Both close the race where the parent dies before the call: the child then
checks that its parent is still the process that started it, and ends itself
with the same signal if not. The signal is sent when the *thread* that forked
the child ends, so start children from the main thread (``subprocess`` and
``ProcessPoolExecutor`` with the ``spawn`` context both do, when submitted to
from it). Elsewhere than Linux both are no-ops.

:func:`pid_alive` tells whether another process (a lease's holder, a launcher, a
writer of a temporary file) still runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import sys
import threading
from typing import Callable, Sequence

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""

_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    try:  # resolved once here: die_with_parent (a Python child's own call) and SUPPORTED read it
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        _prctl = None

SUPPORTED = _prctl is not None
"""Whether this platform has a parent-death signal."""


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Ask for ``sig`` when the parent ends; if ``parent_pid`` already ended, send it now.

    Args:
        parent_pid: the pid of the process that started this one (read before the fork or spawn).
        sig: the signal (SIGTERM: a graceful stop; SIGKILL for a process with nothing to save).

    Returns whether the signal is set (False where unsupported).
    """
    if _prctl is None:
        return False
    if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # the parent died before the call: re-parented already
        os.kill(os.getpid(), sig)
    return True


_STUB = (
    "import ctypes, os, signal, sys\n"
    "sig, parent = int(sys.argv[1]), int(sys.argv[2])\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0) == 0 and os.getppid() != parent:\n"
    "    os.kill(os.getpid(), sig)\n"
    "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)
"""What :func:`dying_with_parent` runs before the command, in the child: ``prctl(PR_SET_PDEATHSIG)``, the
parent check of :func:`die_with_parent`, the signals this Python's start ignored (SIGPIPE, SIGXFSZ) set back to
their defaults, as :class:`subprocess.Popen` does for a command it execs (``restore_signals``; an ignored
signal stays ignored across execve), then ``execvp`` of the command (same pid; the parent-death signal is
kept)."""


def dying_with_parent(command: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``command`` as a :class:`subprocess.Popen` argument list whose process gets ``sig`` when this process
    ends: a Python stub (``-I -S``: no site, no environment) asks for the signal, then execs ``command`` in
    the same process. ``command`` itself where unsupported, and when called off the main thread: the kernel
    would send ``sig`` as that thread ends, stopping the child early (such a child is left to its starter's
    own stop).

    Not a ``preexec_fn``: Python code run between fork and exec runs the interpreter's at-fork hooks in the
    child, and gRPC's, in a process whose gRPC threads were busy, crashed the child with SIGSEGV before its
    program started (2 to 3 children in 20 started beside a running gRPC server; a model server restarted by
    a test, a Redis started by a service).

    Raises:
        FileNotFoundError: ``command[0]`` is no executable file (as :class:`subprocess.Popen` raises it, in this
            process; the stub's exec would fail in the child, exit status 1, with nothing said here).
    """
    command = list(command)
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return command
    if command and shutil.which(command[0]) is None:  # as Popen would, here rather than in the stub's exec
        raise FileNotFoundError(errno.ENOENT, "no such executable file", command[0])
    return [sys.executable, "-I", "-S", "-c", _STUB, str(int(sig)), str(os.getpid()), *command]


def pid_alive(pid: int) -> bool:
    """True while a process ``pid`` exists on this host (another user's counts: signal 0 is refused it).
    A pid <= 0 (a corrupt record) is no process: ``kill`` would signal a process group."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
