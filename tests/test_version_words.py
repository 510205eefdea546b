"""Version words (server/_version_words): a same-host puller of a model or gradient server
whose model holds the newest version learns it from the host's shared memory, without a
call; anything that could make that answer wrong (a newer version, a closed server, a
host that died, a World stopped, a host on another machine) makes the call, as before."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from machinlike import _shm
from machinlike.exception import PeerLostError
from machinlike.server._version_words import NO_VERSION, WORDS, Board, HostWords, Offer, PullerWords, as_word
from machinlike.testing import run_world

needs_words = pytest.mark.skipif(not _shm.recycled.supported(), reason="no version words on this architecture")


# ----------------------------------------------------------------- one process
@needs_words
def test_a_board_hands_out_bounded_words_and_a_freed_word_gets_a_new_tag():
    board = Board()
    taken = [board.take(i) for i in range(WORDS)]
    assert None not in taken and board.take(1) is None  # bounded: the caller then makes calls
    index, tag = taken[3]
    words = board.page.numpy()
    assert (words[2 * index], words[2 * index + 1]) == (tag, 3)
    board.give_back([index])
    assert words[2 * index] == 0
    again = board.take(9)
    assert again is not None and again[0] == index and again[1] > max(t for _, t in taken)


def test_only_int64_versions_are_written_as_themselves():
    assert as_word(7) == 7 and as_word(-(1 << 63) + 1) == -(1 << 63) + 1
    assert as_word(1 << 63) == as_word(None) == as_word("v2") == as_word(True) == as_word(2.0) == NO_VERSION


@needs_words
def test_host_words_are_freed_at_close_and_when_collected_unclosed():
    board = Board.here()
    assert board is not None
    free = len(board._free)
    words = HostWords()
    offer = words.offer("m", 5, "host", 1)
    assert offer.page is board.page and board.page.numpy()[2 * offer.slot + 1] == 5
    words.store("m", 6)
    assert board.page.numpy()[2 * offer.slot + 1] == 6 and len(board._free) == free - 1
    words.close()
    assert board.page.numpy()[2 * offer.slot] == 0 and len(board._free) == free
    assert words.offer("m", 7, "host", 1).page is None  # closed: no word any more
    unclosed = HostWords()
    unclosed.offer("m", 1, "host", 1)
    unclosed.offer("n", 1, "host", 1)
    assert len(board._free) == free - 2
    del unclosed  # (a World stopped under its server: the server is collected)
    assert len(board._free) == free


def test_a_puller_asks_without_a_world_and_refuses_a_page_that_is_a_copy():
    words = PullerWords()
    assert words.answer("m", 3) == (False, True)
    words.keep("m", Offer(torch.zeros(2 * WORDS, dtype=torch.int64), 0, 1, "host", 1))  # no World: not kept
    assert words.answer("m", 3) == (False, True)
    import pickle

    assert pickle.loads(pickle.dumps(words))._seen == {}


# ------------------------------------------------------------ across processes
def _hosted(world):
    from machinlike.server import PushPullModelServerImpl

    g = world.create_rpc_group("g", world.get_members())
    impl = PushPullModelServerImpl("server", g) if world.rank == 0 else None
    g.barrier()
    return g, impl


def _pulls_of(impl):
    return impl.stats()["ordered"]["pulls"]


def _words_body(world):
    g, impl = _hosted(world)
    out = None
    if world.rank == 1:  # the learner
        server = g.get_paired("server").to_here()
        learner = torch.nn.Linear(4, 2)
        assert server.push(learner)
        g.barrier()  # (1) version 1 made
        g.barrier()  # (1b) the host counted
        g.barrier()  # (2) the actor pulled it and then nothing new, many times
        with torch.no_grad():
            learner.weight.fill_(2.0)
        assert server.push(learner)
        g.barrier()  # (3) version 2 made
        g.barrier()  # (4)
    elif world.rank == 2:  # the actor
        server = g.get_paired("server").to_here()
        actor = torch.nn.Linear(4, 2)
        g.barrier()  # (1)
        g.barrier()  # (1b)
        assert server.pull(actor) and actor.pp_version == 1
        unchanged = [server.pull(actor) for _ in range(1000)]
        g.barrier()  # (2)
        g.barrier()  # (3)
        newer = server.pull(actor)  # at once: the word moved with the push
        out = (any(unchanged), newer, actor.pp_version, float(actor.weight.detach().min()))
        g.barrier()  # (4)
    else:  # the host: how many calls reached it
        g.barrier()  # (1)
        made = _pulls_of(impl)  # (the learner's first push read the spec: a pull too)
        g.barrier()  # (1b)
        g.barrier()  # (2)
        pulled = _pulls_of(impl)
        g.barrier()  # (3)
        g.barrier()  # (4)
        out = (pulled - made, _pulls_of(impl) - pulled)
    g.barrier()
    return out


@needs_words
def test_a_same_host_pull_with_nothing_new_makes_no_call_and_a_newer_version_is_seen_at_once():
    (first, then), _, (any_new, newer, version, value) = run_world(_words_body, 3, timeout=120)
    assert not any_new and newer and version == 2 and value == 2.0
    # The actor's first pull asked for the word (one call); the 1,000 after it made none,
    # and the pull after the push one more (the word said version 2, the actor held 1).
    assert (first, then) == (1, 1)


def _closed_body(world):
    from machinlike.server import PushPullModelServerImpl

    g, impl = _hosted(world)
    out = None
    if world.rank == 1:
        server = g.get_paired("server").to_here()
        model = torch.nn.Linear(4, 2)
        assert server.push(model) and not server.pull(model)
        g.barrier()  # (1) the host closes
        g.barrier()  # (2)
        try:
            server.pull(model)
        except KeyError as err:  # (the services are gone and no member hosts it: as without words)
            out = str(err)
        g.barrier()  # (2b) the host makes the server again, empty
        g.barrier()  # (3)
        fresh = torch.nn.Linear(4, 2)
        assert server.push(fresh) and fresh.pp_version == 1 and not server.pull(fresh)  # (asks for the new word)
        g.barrier()  # (4)
        assert not any(server.pull(fresh) for _ in range(50))
        g.barrier()  # (5)
    else:
        g.barrier()  # (1)
        impl.close()
        g.barrier()  # (2)
        g.barrier()  # (2b)
        impl = PushPullModelServerImpl("server", g)
        g.barrier()  # (3)
        g.barrier()  # (4)
        before = _pulls_of(impl)
        g.barrier()  # (5)
        out = _pulls_of(impl) - before
    g.barrier()
    return out


@needs_words
def test_a_pull_after_the_host_closed_its_server_makes_the_call_and_a_new_server_has_a_new_word():
    calls, failure = run_world(_closed_body, 2, timeout=90)
    assert "no member hosts ordered server 'server/ordered'" in failure
    assert calls == 0  # the freed word was noticed, the new one asked for and used


def _killed_body(world):
    g, impl = _hosted(world)
    if world.rank == 0:
        g.pair("pid", os.getpid())
        g.barrier()
        time.sleep(60)  # SIGKILLed by rank 1 after its first pulls
        return None
    g.barrier()
    server = g.get_paired("server").to_here()
    model = torch.nn.Linear(4, 2)
    assert server.push(model) and not server.pull(model) and not server.pull(model)  # (the word answers)
    os.kill(g.get_paired("pid").to_here(), signal.SIGKILL)
    start = time.monotonic()
    while True:  # "nothing new" until the loss is declared, then the host is named
        try:
            assert not server.pull(model, timeout=10)
        except PeerLostError as err:
            return time.monotonic() - start, err.member
        if time.monotonic() - start > 20:
            return time.monotonic() - start, None


@needs_words
def test_a_pull_after_the_host_was_sigkilled_names_it_within_the_loss_bound():
    results = run_world(_killed_body, 2, timeout=90, return_exceptions=True, liveness=2.0)
    seconds, named = results[1]
    assert named is not None and seconds < 5.0


def _pushed_after_kill_body(world):
    g, impl = _hosted(world)
    if world.rank == 0:
        g.pair("pid", os.getpid())
        g.barrier()
        time.sleep(60)  # SIGKILLed by rank 1
        return None
    g.barrier()
    server = g.get_paired("server").to_here()
    model = torch.nn.Linear(4, 2)
    assert server.push(model) and not server.pull(model)  # (the word answers)
    os.kill(g.get_paired("pid").to_here(), signal.SIGKILL)
    with pytest.raises(PeerLostError):
        server.push(model, timeout=10)  # (its lane closes at once: before the World's verdict)
    with pytest.raises(PeerLostError, match="'0'"):
        server.pull(model, timeout=10)  # not "nothing new" from the word (cold trial 24)
    return True


@needs_words
def test_a_pull_after_a_push_found_the_host_gone_fails_too():
    assert run_world(_pushed_after_kill_body, 2, timeout=90, return_exceptions=True)[1] is True


def _remote_body(world):
    g, impl = _hosted(world)
    out = None
    if world.rank == 1:
        server = g.get_paired("server").to_here()
        model = torch.nn.Linear(4, 2)
        assert server.push(model)
        assert not any(server.pull(model) for _ in range(5))
        g.barrier()
    else:
        g.barrier()
        out = _pulls_of(impl)
    g.barrier()
    return out


def test_a_host_whose_page_arrives_as_a_copy_is_asked_each_time():
    # Without same-host shared memory the page travels by value: a copy never changes, so
    # it is refused and every pull makes its call (as between hosts).
    calls, _ = run_world(_remote_body, 2, timeout=90, same_host_shm=False)
    assert calls == 1 + 5  # (the push's read of the spec, then each pull)
