"""The stacks of the ranks that did not finish: each rank's own, under a header naming it.

    launch()                                   rank r
    --------                                   ------
    StackFiles(): a private folder, its lock   arm(path): faulthandler on SIGUSR2, into
      held (flock) while this launcher lives       <folder>/<r> (a file of its own); on
                                                 SIGUSR1 to stderr, for anyone who asks
    timeout ─► for each rank still running, one at a time:
                 header "rank r (name), pid p: <what it was doing>" to stderr
                 SIGUSR2 ─────────────────────► faulthandler writes every thread's stack
                 the file stops growing ─► copied to stderr under its header
    a later launch removes the folders whose lock nobody holds (a launcher SIGKILLed)

Why files, one rank at a time: every rank used to write to the same inherited stderr at
once, so the dumps came interleaved character by character, with nothing saying which rank
a stack was. faulthandler is kept for the writing: it answers even when the rank's main
thread is stuck in C++ (a store or RPC wait) where a Python handler would never run.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["StackFiles", "arm", "condense", "timed_out"]

_SETTLE_S = 0.05  # a dump is complete once its file has not grown for this long
_WAIT_S = 2.0  # at most this long per rank (a rank that is gone writes nothing)

_armed: List[IO[str]] = []  # the rank's open stack file (kept: faulthandler writes to its descriptor)


def _why_none(pid: int) -> str:
    """Why process ``pid`` wrote no stacks: gone, or alive in a state no signal handler runs in."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            state = stream.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "it ended before it could write them"
    if state in ("T", "t"):
        return "its process is stopped (SIGSTOP or a debugger): it runs no handler until continued"
    if state == "Z":
        return "it ended before it could write them"
    if state == "D":
        return "its process waits in the kernel, uninterruptibly (disk, NFS): the handler never ran"
    return "it wrote nothing in time (stuck in native code that holds the GIL, or not yet armed)"


def arm(path: Optional[str]) -> None:
    """(In a rank) write every thread's stack to stderr on SIGUSR1 (``kill -USR1 PID`` by
    hand), and into ``path`` on SIGUSR2 (the launcher's timeout; None: not armed)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if path is None:
        return
    try:
        stream = open(path, "w")
    except OSError:  # (its folder is gone: this rank runs on, with no stacks for a timeout)
        return
    _armed.append(stream)
    faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True)


_PREFIX = "machinlike-stacks-"
_MAKING = "machinlike-making-"
_LOCK = "launcher.lock"


class StackFiles:
    """The launcher's side: a private folder with one stack file per rank, and a lock file
    the launcher holds (``flock``) while it lives: the folders of launchers killed before
    they could remove theirs are removed by the next one (a held lock is never taken, in
    any PID namespace that shares the folder)."""

    def __init__(self) -> None:
        _remove_orphans()
        # Made under another name and renamed once locked: a folder of the prefix without
        # its lock held is an orphan to any other launcher.
        making = tempfile.mkdtemp(prefix=_MAKING)
        self._lock: Optional[int] = os.open(os.path.join(making, _LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._folder: Optional[str] = os.path.join(os.path.dirname(making),
                                                   _PREFIX + os.path.basename(making)[len(_MAKING):])
        os.rename(making, self._folder)

    def path(self, rank: int) -> Optional[str]:
        return None if self._folder is None else os.path.join(self._folder, str(rank))

    def dump(self, ranks: Sequence[int], processes: Sequence[Any], doing: Sequence[str],
             out: Optional[IO[str]] = None) -> None:
        """Have each of ``ranks`` (alive) write its stacks, one after the other, and copy
        them to ``out`` (None: this process's stderr, as it is now) under a header naming
        the rank and what it was doing (``doing``)."""
        out = sys.stderr if out is None else out
        for rank, process, what in zip(ranks, processes, doing):
            out.write(f"\n===== launch: {process.name}, pid {process.pid}: {what}; its threads: =====\n")
            out.flush()
            text = self._collect(rank, process.pid)
            out.write(condense(text) if text else f"(no stacks: {_why_none(process.pid)})\n")
            out.flush()

    def _collect(self, rank: int, pid: int) -> str:
        path = self.path(rank)
        if path is None:
            return ""
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + _WAIT_S
        size, steady = -1, 0.0
        while time.monotonic() < deadline:
            now = _size(path)
            if now > 0 and now == size:
                if time.monotonic() - steady >= _SETTLE_S:
                    break
            else:
                size, steady = now, time.monotonic()
            time.sleep(0.01)  # (a failure path: nothing to wait on but the file)
        try:
            with open(path) as stream:
                return stream.read()
        except OSError:
            return ""

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def timed_out(processes: List[Any], results: Dict[int, Any], timeout: Optional[float], stacks: StackFiles) -> None:
    """``launch``'s run passed ``timeout``: dump the stacks of every rank still running
    (``results``: the ranks that reported), then raise.

    Raises:
        TimeoutError: always, naming the ranks that did not finish.
    """
    alive = [r for r, p in enumerate(processes) if p is not None and p.is_alive()]
    doing = ["returned its result, and waits in World.stop" if r in results else "still running the function"
             for r in alive]
    stacks.dump(alive, [processes[r] for r in alive], doing)
    late = [processes[r].name for r in alive if r not in results]
    stopping = [processes[r].name for r in alive if r in results]
    also = f"; {', '.join(stopping)} returned and waited in World.stop" if stopping else ""
    raise TimeoutError(f"launch: {', '.join(late) or 'no rank'} did not finish within {timeout:g} s "
                       f"({len(results)} of {len(processes)} ranks reported{also}); the stacks of every rank "
                       f"still running are on stderr above, each under its name")


def _library_dirs() -> Tuple[str, ...]:
    """Folders whose frames are nobody's own code here: machinlike's, torch's, the stdlib's."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # machinlike/
    dirs = [package, sysconfig.get_paths()["stdlib"]]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if isinstance(torch_file, str):
        dirs.append(os.path.dirname(torch_file))
    return tuple(os.path.join(d, "") for d in dirs)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')


def condense(text: str) -> str:
    """A rank's faulthandler dump, shortest first where it matters: the main thread, then
    every thread that runs code of the user's, whole; then one line per thread of
    machinlike's or torch's own (a rank has a dozen, each waiting in its loop).

    Why: a timeout's dump was about 110 lines per rank, the user's frame somewhere in it.
    """
    blocks = [b for b in text.strip("\n").split("\n\n") if b.strip()]
    library = _library_dirs()
    kept: List[Tuple[int, str]] = []
    brief: List[str] = []
    for block in blocks:
        lines = block.splitlines()
        frames = [m for m in (_FRAME.match(line) for line in lines[1:]) if m is not None]
        main = not frames or not (frames[-1]["file"].endswith("threading.py") and frames[-1]["func"] == "_bootstrap")
        if main or not all(f["file"].startswith(library) for f in frames):
            kept.append((0 if main else 1, block))
            continue
        top = frames[0]
        where = [f for f in frames if not f["file"].endswith("threading.py")]
        start = where[-1] if where else frames[-1]
        head = lines[0].split(" (most recent call first)")[0]
        brief.append(f"{head}: {top['func']} ({os.path.basename(top['file'])}:{top['line']}), "
                     f"its loop {start['func']} ({os.path.basename(start['file'])})")
    kept.sort(key=lambda item: item[0])  # (stable: the main thread first, the others as dumped)
    out = "\n\n".join(block for _, block in kept)
    if brief:
        threads = f"{len(brief)} thread{'s' if len(brief) != 1 else ''}"
        out += (f"\n\n{threads} of machinlike and torch, one line each (`kill -USR1 <pid>` on "
                f"a live rank prints every thread whole on its stderr):\n  " + "\n  ".join(brief))
    return out + "\n"


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _remove_orphans() -> None:
    """Remove the stack folders whose launcher is gone: its lock can be taken."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        folder = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(folder, _LOCK), os.O_RDWR)
        except OSError:
            continue  # not ours to judge (being made, or not a launcher's)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its launcher lives
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
