"""machinlike.exception: remote exceptions keep their type and carry their traceback."""

from __future__ import annotations

import pickle
import threading
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
    freeze_traceback,
)


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")  # args != (a, b): pickle cannot rebuild it
        self.a, self.b = a, b


class DiskGone(OSError):
    def __init__(self, path, errno):
        super().__init__(errno, f"{path} is gone")
        self.path = path


class Keyworded(RuntimeError):
    def __init__(self, *, env_id, reason):
        super().__init__(f"env {env_id}: {reason}")
        self.env_id = env_id


class Custom(ValueError):
    pass


def _raise(exc):
    raise exc


def _carried(exc):
    try:
        _raise(exc)
    except BaseException as e:
        return pickle.loads(pickle.dumps(ExceptionWithTraceback(e, where="worker 7")))


def test_a_frozen_traceback_lets_go_of_its_frames_and_still_travels_as_text():
    # What a torch Future will hold must not reach frames (see freeze_traceback).
    def fail(payload):
        try:
            _raise(Custom("bad value"))
        except Custom as inner:
            raise NeedsTwoArgs(1, 2) from inner

    try:
        fail(list(range(3)))
    except NeedsTwoArgs as caught:
        exc = caught
    frozen = freeze_traceback(exc)
    assert frozen is exc and exc.__traceback__ is None and exc.__cause__.__traceback__ is None
    arrived = pickle.loads(pickle.dumps(ExceptionWithTraceback(exc, where="worker 7")))
    text = str(arrived.__cause__)
    assert type(arrived) is NeedsTwoArgs and (arrived.a, arrived.b) == (1, 2)
    assert "on worker 7, pid" in text and "in fail" in text and "in _raise" in text, text
    assert "Custom: bad value" in text and "direct cause" in text
    assert "_machinlike_traceback_text" not in vars(arrived)  # the record stays with the sender
    assert freeze_traceback(exc) is exc and "in fail" in ExceptionWithTraceback(exc).tb_text  # idempotent


def test_original_type_and_remote_traceback_as_cause():
    exc = _carried(Custom("bad value"))
    assert type(exc) is Custom and str(exc) == "bad value"
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "on worker 7, pid" in str(cause)
    assert "in _raise" in str(cause) and "Custom: bad value" in str(cause)


def test_an_exception_whose_init_takes_other_arguments_keeps_its_type_and_attributes():
    # (before: a RemoteError naming it, which ``except NeedsTwoArgs`` does not catch)
    exc = _carried(NeedsTwoArgs(1, 2))
    assert type(exc) is NeedsTwoArgs and str(exc) == "1-2" and (exc.a, exc.b) == (1, 2)
    assert "NeedsTwoArgs" in str(exc.__cause__)
    exc = _carried(DiskGone("/data", 28))
    assert type(exc) is DiskGone and exc.errno == 28 and exc.path == "/data"
    exc = _carried(Keyworded(env_id=3, reason="reset failed"))
    assert type(exc) is Keyworded and str(exc) == "env 3: reset failed" and exc.env_id == 3
    assert isinstance(exc.__cause__, RemoteTraceback)


def _crash_env():
    raise Keyworded(env_id=5, reason="out of memory")


def test_a_pool_workers_exception_with_a_keyword_init_arrives_as_itself():
    from machinlike.pool import Pool

    with Pool(1) as pool:
        with pytest.raises(Keyworded, match="env 5: out of memory") as info:
            pool.apply(_crash_env)
    assert info.value.env_id == 5 and "on pool worker" in str(info.value.__cause__)


def test_unrebuildable_type_becomes_remote_error_naming_it_and_keeping_its_builtin_base():
    local = type("LocalError", (Exception,), {})  # not importable by name: cannot be sent
    exc = _carried(local("oops"))
    assert isinstance(exc, RemoteError)
    assert exc.type_name.endswith("LocalError") and exc.message == "oops"
    assert "LocalError" in str(exc.__cause__)
    # ``except RuntimeError`` (or OSError, KeyError...) catches the stand-in as it would
    # have caught the original (before: a plain RemoteError, which it let through).
    for base in (RuntimeError, KeyError, ConnectionResetError, TimeoutError):
        local = type("LocalError", (base,), {})
        exc = _carried(local("oops"))
        assert isinstance(exc, RemoteError) and isinstance(exc, base) and "LocalError: " in str(exc) and "oops" in str(exc)
        assert type(pickle.loads(pickle.dumps(exc))) is type(exc)  # (it travels on as itself)
    local = type("LocalError", (UnicodeDecodeError,), {})  # a base that cannot be mixed in
    exc = _carried(local("utf-8", b"\xff", 0, 1, "bad"))
    assert type(exc) is RemoteError and "LocalError" in exc.type_name


class HoldsEnv(RuntimeError):
    def __init__(self, message):
        super().__init__(message)
        self.env = threading.Lock()  # (an environment, a socket: nothing that pickles)
        self.step = 7


def test_an_exception_holding_an_unpicklable_attribute_arrives_as_itself_without_it():
    exc = _carried(HoldsEnv("env stepped after close"))
    assert type(exc) is HoldsEnv and str(exc) == "env stepped after close" and exc.step == 7
    assert not hasattr(exc, "env") and any("env" in note and "left behind" in note for note in exc.__notes__)
    unpicklable = NeedsTwoArgs(1, 2)
    unpicklable.b = lambda: None  # an attribute that cannot be pickled
    exc = _carried(unpicklable)
    assert type(exc) is NeedsTwoArgs and str(exc) == "1-2" and exc.a == 1 and not hasattr(exc, "b")


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
