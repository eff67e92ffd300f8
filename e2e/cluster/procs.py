"""Start, identify and stop the processes of the local stack, by recorded pid only.

Data flow: :func:`spawn` starts a binary in its own session (so it outlives ``make cluster-up``
and a Ctrl-C in the terminal does not reach it), with stdout and stderr in ``<logs>/<name>.log``,
and returns a :class:`ProcRecord` (name, pid, executable, start time). The cluster module stores
the records in ``state.json``; later :func:`is_running` and :func:`stop` act on a pid only while
``/proc/<pid>`` still shows the same executable and start time, so a reused pid is never
signalled. Nothing here ever kills by name.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LOG_TAIL_LINES = 25
LOG_LINE_MAX = 400
EXEC_SETTLE_S = 5.0


@dataclass(frozen=True)
class ProcRecord:
    """One started process: what the harness needs to find it again and only it."""

    name: str
    pid: int
    exe: str  # argv[0] as started (absolute path)
    start_ticks: int  # field 22 of /proc/<pid>/stat: start time since boot, in clock ticks
    log: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ProcRecord:
        return cls(
            name=str(data["name"]),
            pid=int(str(data["pid"])),
            exe=str(data["exe"]),
            start_ticks=int(str(data["start_ticks"])),
            log=str(data["log"]),
        )


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None when the pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 overall; 20th after "pid (comm)"


def _argv0(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode(errors="replace") if raw else None


def is_running(rec: ProcRecord) -> bool:
    """True while the recorded pid is alive (not a zombie) and is still the same process."""
    fields = _stat_fields(rec.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return _start_ticks(rec.pid) == rec.start_ticks and _argv0(rec.pid) == rec.exe


def spawn(
    name: str,
    argv: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    netns: str | None = None,
) -> ProcRecord:
    """Start ``argv`` detached in a new session, output appended to ``<log_dir>/<name>.log``;
    with ``netns``, inside that network namespace (setns before exec, so the pid and argv are
    the program's own, as for any other record)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    preexec = None
    if netns is not None:
        from e2e.cluster import podnet

        podnet.preload_libc()
        preexec = functools.partial(podnet.enter_netns, netns)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            close_fds=True,
            preexec_fn=preexec,
        )
    _CHILDREN[proc.pid] = proc
    # Popen returns once exec has begun, but the kernel fills /proc/<pid>/cmdline a moment
    # later; until then the new process would not look like ours to is_running().
    deadline = time.monotonic() + EXEC_SETTLE_S
    while _argv0(proc.pid) != argv[0] and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    ticks = _start_ticks(proc.pid)
    if ticks is None:  # exited at once; keep a record so the caller reports its log
        ticks = -1
    return ProcRecord(name=name, pid=proc.pid, exe=argv[0], start_ticks=ticks, log=str(log_path))


# Popen objects of processes this Python process started, so it can reap its own children
# (otherwise they would linger as zombies until it exits).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pid, None)


def exit_code(rec: ProcRecord, wait_s: float = 2.0) -> int | None:
    """Exit status when this process started ``rec`` and it has exited; else None.

    A process that no longer looks running may still be exiting: the kernel empties its
    /proc cmdline before it becomes a zombie that `waitpid` can reap (seen once in the e2e
    suite: a crashed component reported "not running" without its exit status). So a child of
    ours that is not running is waited for, up to ``wait_s``."""
    child = _CHILDREN.get(rec.pid)
    if child is None:
        return None
    if is_running(rec):
        return child.poll()
    try:
        return child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


def stop(rec: ProcRecord, *, grace_s: float = 10.0) -> str:
    """SIGTERM the recorded process (SIGKILL after ``grace_s``); return what happened."""
    return stop_together([rec], grace_s=grace_s)[0]


def _kill(rec: ProcRecord, grace_s: float) -> str:
    """SIGKILL a process that outlived its SIGTERM's ``grace_s``; wait up to 5 s for it to go."""
    os.kill(rec.pid, signal.SIGKILL)
    for _ in range(50):
        _reap(rec.pid)
        if not is_running(rec):
            break
        time.sleep(0.1)
    return f"killed {rec.name} (pid {rec.pid}) after {grace_s:.0f}s without exiting on SIGTERM"


def stop_together(recs: list[ProcRecord], *, grace_s: float) -> list[str]:
    """SIGTERM every recorded process at once, SIGKILL those still running ``grace_s`` later;
    what happened to each, in order. A teardown of N processes then takes the slowest one's
    time, not the sum (routers that sit out their grace were 5 s each, one after another)."""
    said: dict[int, str] = {}
    for i, rec in enumerate(recs):
        _reap(rec.pid)
        if not is_running(rec):
            said[i] = f"{rec.name} (pid {rec.pid}) had already exited"
        else:
            os.kill(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while len(said) < len(recs) and time.monotonic() < deadline:
        for i, rec in enumerate(recs):
            _reap(rec.pid)
            if i not in said and not is_running(rec):
                said[i] = f"stopped {rec.name} (pid {rec.pid})"
        time.sleep(0.1)
    for i, rec in enumerate(recs):
        if i not in said:
            _reap(rec.pid)
            gone = not is_running(rec)
            said[i] = f"stopped {rec.name} (pid {rec.pid})" if gone else _kill(rec, grace_s)
    return [said[i] for i in range(len(recs))]


def log_tail(rec: ProcRecord, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the process's log (empty string when there is none)."""
    try:
        with open(rec.log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    tail = text.splitlines()[-lines:]
    return "\n".join(
        line if len(line) <= LOG_LINE_MAX else line[:LOG_LINE_MAX] + " ..." for line in tail
    )
