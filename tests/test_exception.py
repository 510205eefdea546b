"""machinlike.exception: remote exceptions keep their type and carry their traceback."""

from __future__ import annotations

import pickle
import signal

import pytest

from machinlike.exception import (
    ExceptionWithTraceback,
    PeerLostError,
    ProcessExitedError,
    RemoteError,
    RemoteTraceback,
    WorkerLostError,
    describe_exitcode,
)


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")  # args != (a, b): pickle cannot rebuild it


class Custom(ValueError):
    pass


def _raise(exc):
    raise exc


def _carried(exc):
    try:
        _raise(exc)
    except BaseException as e:
        return pickle.loads(pickle.dumps(ExceptionWithTraceback(e, where="worker 7")))


def test_original_type_and_remote_traceback_as_cause():
    exc = _carried(Custom("bad value"))
    assert type(exc) is Custom and str(exc) == "bad value"
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "on worker 7, pid" in str(cause)
    assert "in _raise" in str(cause) and "Custom: bad value" in str(cause)


def test_unrebuildable_type_becomes_remote_error_naming_it():
    exc = _carried(NeedsTwoArgs(1, 2))
    assert isinstance(exc, RemoteError)
    assert exc.type_name.endswith("NeedsTwoArgs") and exc.message == "1-2"
    assert "NeedsTwoArgs" in str(exc.__cause__)


def test_exception_never_raised_still_says_where():
    exc = pickle.loads(pickle.dumps(ExceptionWithTraceback(KeyError("k"), where="member 'a'")))
    assert isinstance(exc, KeyError)
    assert "member 'a'" in str(exc.__cause__)


def test_unwrap_without_pickling():
    carrier = ExceptionWithTraceback(OSError(5, "io"), where="here")
    exc = carrier.unwrap()
    assert isinstance(exc, OSError) and exc.errno == 5
    assert isinstance(exc.__cause__, RemoteTraceback)


@pytest.mark.parametrize(
    "code, text",
    [(0, "exited with code 0"), (3, "exited with code 3"),
     (-signal.SIGKILL, "killed by signal SIGKILL (9)"),
     (-signal.SIGSEGV, "killed by signal SIGSEGV (11)"), (None, "is still running")],
)
def test_describe_exitcode(code, text):
    assert describe_exitcode(code) == text


def test_process_errors_pickle_and_name_the_cause():
    err = pickle.loads(pickle.dumps(WorkerLostError("pool worker 1", 42, -9, "task 3 lost")))
    assert isinstance(err, ProcessExitedError) and isinstance(err, RuntimeError)
    assert err.signal_name == "SIGKILL" and err.exitcode == -9 and err.pid == 42
    assert str(err) == "pool worker 1 (pid 42) killed by signal SIGKILL (9): task 3 lost"
    peer = pickle.loads(pickle.dumps(PeerLostError("2", "connection refused")))
    assert isinstance(peer, ConnectionError) and peer.member == "2"
    assert "'2'" in str(peer) and "connection refused" in str(peer)
