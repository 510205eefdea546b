"""A process is named by its pid and start time (``machinlike._pids``), or watched through
what it holds (a pidfd, a descriptor), not by its bare pid alone: once it was SIGKILLed
and the kernel gave its pid to a new process, what it held comes back and it is not alive.

Shown for a shared-memory segment and a CUDA slab lent to a killed taker, a receiver's
mapping and opening of a killed owner's memory, and a member's published identity. The
reuse is real: the test writes ``/proc/sys/kernel/ns_last_pid`` (root only; it skips
elsewhere, saying why) so that the next process started gets the dead one's pid. With bare
pids (before), each of them stayed lent, mapped, open or alive for the newcomer's life.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from machinlike import _pids
from machinlike._shm import _segments
from machinlike.distributed._calls import cuda_ipc_area as _cuda_ipc_area, cuda_ipc_open as _cuda_ipc_open

pytestmark = pytest.mark.timeout(120)


def _start_with_pid(word: int) -> subprocess.Popen:
    """A process that holds the pid of identity ``word`` (a dead, reaped process's), started
    through ``ns_last_pid``; skips where that file cannot be written."""
    pid = _pids.pid_of(word)
    for _ in range(200):  # (another process of the host may take the pid first: again)
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as stream:
                stream.write(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"cannot set the next pid ({exc}): needs root in the initial user namespace")
        newcomer = subprocess.Popen(["sleep", "60"])
        # Start times count clock ticks (10 ms): a newcomer started within the dead one's
        # tick would be it (the pid space cycled in 10 ms: only here). Again, a tick later.
        if newcomer.pid == pid and _pids.identity(pid) != word:
            return newcomer
        newcomer.kill()
        newcomer.wait(timeout=10)
    pytest.skip(f"pid {pid} went to other processes 200 times: this host forks too fast for the test")


def _killed(child: subprocess.Popen) -> int:
    """SIGKILL ``child`` and reap it; its identity (read while it lived)."""
    word = _pids.identity(child.pid)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    return word


def test_an_identity_names_its_process_and_no_other_with_its_pid():
    own = _pids.own_identity()
    assert _pids.pid_of(own) == os.getpid() and own >> _pids.PID_BITS > 0 and own > 0
    assert _pids.pid_alive(own) and _pids.pid_alive(os.getpid())  # (a bare pid: as before)
    assert not _pids.pid_alive(own + (1 << _pids.PID_BITS))  # same pid, started another time
    child = subprocess.Popen(["sleep", "60"])
    word = _pids.identity(child.pid)
    assert _pids.pid_alive(word)
    _killed(child)
    assert not _pids.pid_alive(word) and not _pids.pid_alive(child.pid)


def test_a_forked_child_names_itself():
    read, write = os.pipe()
    _pids.own_identity()
    pid = os.fork()
    if not pid:  # (the child: writes its identity, then leaves without any cleanup of the parent's)
        os.write(write, str(_pids.own_identity()).encode())
        os._exit(0)
    os.close(write)
    told = int(os.read(read, 64))
    os.waitpid(pid, 0)
    os.close(read)
    assert _pids.pid_of(told) == pid and told != _pids.own_identity()


def test_a_segment_whose_killed_taker_pid_went_to_a_new_process_is_reclaimed():
    cache = _segments.SegmentCache(8 << 20)
    try:
        seg = cache.lease(1 << 20)
        # A real receiver maps the segment (writing its identity as the taker), then is SIGKILLed.
        receiver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import time
            from machinlike._shm._receive import lent_view
            held = lent_view({os.getpid()}, {seg.fd}, {seg.inode}, {seg.capacity}, 16)
            print("taken", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
        with receiver.stdout:  # (closed here: a pipe left to the garbage collector closes in a later test)
            assert receiver.stdout.readline().strip() == "taken"
        assert _pids.pid_of(int(seg.header[1])) == receiver.pid and cache.lent() == 1
        newcomer = _start_with_pid(_killed(receiver))
        try:
            assert cache.lent() == 0 and cache.stats["reclaimed"] == 1  # (bare pids: 1 and 0)
            assert cache.lease(1 << 20) is seg and cache.stats["created"] == 1
        finally:
            _killed(newcomer)
    finally:
        cache.close()


def test_a_mapping_of_a_killed_owners_segment_goes_though_its_pid_went_to_a_new_process():
    """A receiver's cached mapping of a peer's segment holds that memory: it went when its
    owner's bare pid was gone or the owner retired it, so an owner SIGKILLed (no retirement)
    whose pid was reused by then kept it mapped until evicted. The owner's descriptor tells."""
    from machinlike._shm import _receive

    _receive.forget_all()
    size = _segments.HEADER + 4096
    fd = os.memfd_create("pid-reuse-test")
    try:
        os.ftruncate(fd, size)
        owner = subprocess.Popen(["sleep", "60"], pass_fds=[fd])  # owns it at the same number
        key = (owner.pid, os.fstat(fd).st_ino)
        _receive.attach(owner.pid, fd, key[1], size, True)
        newcomer = _start_with_pid(_killed(owner))
        others = []
        try:
            for i in range(2 * _receive._LOOK_MIN):  # (the cache looks at its entries every so many new mappings)
                others.append(os.memfd_create(f"pid-reuse-other-{i}"))
                os.ftruncate(others[-1], 4096)
                _receive.attach(os.getpid(), others[-1], os.fstat(others[-1]).st_ino, 4096, False)
            assert key not in _receive._maps  # (before: still mapped)
        finally:
            _killed(newcomer)
            _receive.forget_all()
            for other in others:
                os.close(other)
    finally:
        _receive.forget_all()
        os.close(fd)


class _FakeSlab:
    """A slab without CUDA: what the area's bookkeeping reads."""

    def __init__(self, slot, ident, index, capacity):
        self.slot, self.ident, self.index, self.capacity = slot, ident, index, capacity
        self.storage, self.counter, self.views, self.ready, self.unsent = object(), (b"/none", 0), {}, None, False

    def settle_writes(self, timeout=None):
        return True

    def settled(self):
        return True


def test_a_cuda_slab_whose_killed_taker_pid_went_to_a_new_process_is_reclaimed(monkeypatch):
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _FakeSlab)
    monkeypatch.setattr(_cuda_ipc_area.torch.UntypedStorage, "_release_ipc_counter_cuda", lambda *a: None,
                        raising=False)
    area = _cuda_ipc_area.ExportArea(16 << 20)
    try:
        taker = subprocess.Popen(["sleep", "60"])
        lease = area.lease(0, 1 << 20, taker.pid)
        area.filled(lease)
        # What the receiver writes once it loads the message (``cuda_ipc._receive_group``,
        # which needs a GPU): its identity over the bare pid the sender wrote.
        area.words[lease.row, 1] = _pids.identity(taker.pid)
        assert area.lent() == 1 and area._lent_to(taker.pid, 0, 1 << 20)  # (found by its pid still)
        newcomer = _start_with_pid(_killed(taker))
        try:
            assert area.lent() == 0 and area.stats["reclaimed"] == 1  # (bare pids: 1 and 0)
        finally:
            _killed(newcomer)
    finally:
        area.close()


def test_an_opening_of_a_killed_sender_goes_though_its_pid_went_to_a_new_process(monkeypatch):
    """A receiver's opening of a sender's slab holds the sender's GPU memory: it went when
    /proc said the sender's bare pid was gone, so a pid reused by then kept it open until
    evicted. The sender's pidfd (kept with its control page) tells the exit itself."""
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _FakeSlab)
    monkeypatch.setattr(_cuda_ipc_area.torch.UntypedStorage, "_release_ipc_counter_cuda", lambda *a: None,
                        raising=False)
    area = _cuda_ipc_area.ExportArea(16 << 20)
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    try:
        sender = subprocess.Popen(["sleep", "60"], pass_fds=[area.fd])  # holds the page at the same number
        words = cache.control(sender.pid, area.fd, area.inode)  # (through /proc/<sender>/fd: watched by a pidfd)
        slab = area.lease(0, 10, os.getpid()).slab
        cache.open((sender.pid, b"h", 0), 2 << 20, words, slab.slot, slab.ident, object)
        assert len(cache) == 1 and cache.forget_dead() == 0
        newcomer = _start_with_pid(_killed(sender))
        try:
            assert cache.forget_dead() == 1 and len(cache) == 0 and cache._pidfds == {}  # (before: 0, 1)
        finally:
            _killed(newcomer)
    finally:
        cache.forget_all()
        area.close()


def test_a_members_identity_names_its_process_and_not_the_one_its_pid_went_to():
    """A member's published identity (``process_identity``) holds its start time: a member
    SIGKILLed while nobody watched it (a world that crashed whole, and the start-up of the
    next one reading its seats) is not alive in the process that took its pid."""
    from machinlike.distributed._membership import processes

    own = processes.process_identity()
    assert processes.pid_in(own) == os.getpid() and own.endswith(f"/{os.getpid()}+{_pids.start_of(os.getpid())}")
    assert processes.alive_here(own) and processes.running_here(own)
    member = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from machinlike.distributed._membership.processes import process_identity
        print(process_identity(), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    with member.stdout:
        published = member.stdout.readline().strip()
    assert processes.pid_in(published) == member.pid and processes.alive_here(published)
    bare = published.partition("+")[0]  # (what identities held before: still read, by pid alone)
    newcomer = _start_with_pid(_killed(member))
    try:
        assert processes.alive_here(published) is False and processes.running_here(published) is False
        assert processes.alive_here(bare) is True  # (the newcomer's: what a bare pid said of the dead member)
    finally:
        _killed(newcomer)
