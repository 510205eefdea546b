"""A child's failure report that fits its pipe, so that the child can end without a reader.

::

    child fails ─► report (pickled exception + traceback text), N bytes
        N fits the pipe's buffer                ─► written as it is
        N fits once the buffer is enlarged      ─► F_SETPIPE_SZ (up to fs.pipe-max-size), written
        else                                    ─► a stand-in: the exception's type name and
                                                   message (cut), the traceback's last part,
                                                   a note saying what was left out

Why: the parent reads the report only in ``join()`` or ``exception``; a write larger than
the pipe's buffer (64 KiB by default) blocked the child in its last step, so ``is_alive()``
stayed True and its sentinel never fired for a supervisor that polls them, and one that
then terminated the "hung" child lost the real error (cold trial 30: an exception carrying
a 400 KB tensor). The buffer is enlarged only for such a report, never for every process:
a user's pipe buffers count against ``fs.pipe-user-pages-soft``, past which Linux gives
every new pipe of the user a single page.
"""

from __future__ import annotations

import fcntl
from typing import Callable, Tuple

from .exception import ExceptionWithTraceback, RemoteError

__all__ = ["fit_report"]

_HEADROOM = 4096  # bytes kept free: multiprocessing's frame header, a partly filled page
_MESSAGE = 4096  # characters of the message a stand-in keeps
_TRACEBACK = 16384  # characters of the traceback's end a stand-in keeps
_DEFAULT_ROOM = 16384  # where the buffer cannot be asked (not Linux): the least of the usual sizes
# The most a report's pipe is enlarged to: fs.pipe-max-size's default, and a bound where
# it does not bind (a root process may pass it).
_MOST = 1 << 20


def _room(fd: int, wanted: int) -> int:
    """The pipe's buffer in bytes, enlarged to ``wanted`` where the system allows it."""
    get = getattr(fcntl, "F_GETPIPE_SZ", None)
    put = getattr(fcntl, "F_SETPIPE_SZ", None)
    if get is None or put is None:
        return _DEFAULT_ROOM
    try:
        room = fcntl.fcntl(fd, get)
    except OSError:
        return _DEFAULT_ROOM
    if room >= wanted or wanted > _MOST:
        return room
    try:
        return fcntl.fcntl(fd, put, wanted)
    except OSError:  # over fs.pipe-max-size, or the user's pipe pages are used up
        return room


def _cut(text: str, keep: int, tail: bool) -> str:
    if len(text) <= keep:
        return text
    return "[...]\n" + text[-keep:] if tail else text[:keep] + " [...]"


def _cut_traceback(text: str) -> str:
    """The traceback's last ``_TRACEBACK`` characters, each line cut first (the message's
    line is most often what made the report large, and the stack is what to keep)."""
    lines = [line if len(line) <= 1000 else line[:1000] + " [...]" for line in text.split("\n")]
    return _cut("\n".join(lines), _TRACEBACK, True)


def fit_report(fd: int, data: bytes, record: Tuple, encode: Callable[[Tuple], bytes]) -> bytes:
    """``data`` (the pickled ``record``) if it fits the pipe ``fd``, else a smaller record's.

    Args:
        fd: The report pipe's write end.
        data: ``encode(record)``.
        record: ``("exception", ExceptionWithTraceback)`` or ``("exit", code, detail, text)``.
        encode: Pickles a record.
    """
    room = _room(fd, len(data) + _HEADROOM)
    if len(data) + _HEADROOM <= room:
        return data
    said = (f"the child's report ({len(data):,} bytes) did not fit its pipe ({room:,} bytes), which the parent "
            f"reads only in join() or exception: it was cut so that the child could end")
    if record[0] == "exit":
        _, code, detail, text = record
        return encode(("exit", code, _cut(detail, _MESSAGE, False), _cut_traceback(text) + f"\n({said})"))
    carrier: ExceptionWithTraceback = record[1]
    original = carrier.exc
    named = RemoteError.standing_in(original)  # (for the type's name and its builtin base)
    # (the words go in the message: a RemoteError pickles as its name and message, no notes)
    message = f"{_cut(named.message, _MESSAGE, False)} [{said}; what came is its type's name and message, " \
              f"without its attributes]"
    smaller = ExceptionWithTraceback(type(named)(named.type_name, message))
    smaller.tb_text = _cut_traceback(carrier.tb_text)
    return encode(("exception", smaller))
