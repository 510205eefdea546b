"""Liveness at scale: the control plane's cost per member, and detection, at N = 64 .. 4,096.

Run:  python benchmarks/liveness_scale.py [--sizes 64,256,1024] [--designs all,ring]
                                          [--liveness 2] [--window 8] [--hosts 4]
                                          [--churn 10 --churn-seconds 60]

One real TCPStore server (libuv, in a process of its own, so that its CPU and bytes are
read from ``/proc/<pid>/stat`` and ``/proc/<pid>/io``) and N simulated members. A member
here is the project's own membership: a :class:`Membership` (Registry, Roster, EventLog,
Monitor with its liveness thread, Departures) on a store client of its own, that enters,
announces, beats, watches, declares and frees exactly as a World's does. What it lacks is
the RPC agent: members are threads, ``--hosts`` processes hold N / hosts each, and a
member's process identity is that of a simulated remote host, so its death is seen only by
its silent heartbeat (the remote path). Same-host deaths use members whose identity is a
real child process of this machine: its SIGKILL is seen through ``/proc``.

Each (N, design) runs in a fresh interpreter with a hard timeout: join all N (``--joiners``
threads per host join its members, 16 by default; timed from "go" until every member
sees N members, with the store's and the hosts' CPU and the requests per member
meanwhile), a steady window (store requests and key reads
counted by a proxy store around every member's client, the store's CPU and bytes), then
``--kills`` silent deaths and as many same-host SIGKILLs, one at a time; the time from a
death to each survivor's "lost" event gives p50 and p99 over (survivor, death) pairs,
and "first named" (the median over deaths of the earliest survivor: about when its
declarer posted it; the rest is the fan-out, through the departure bell). The members of
one host process share one bell thread, as members of one process do (see
machinlike/distributed/_membership/bell.py): one waiter per process at the store, not
one per member as a deployment of N processes has.

With ``--churn R``, a last phase follows: for ``--churn-seconds``, each second R members
die silently (at random among all, a joiner once 5 s in) and R new members join. Every
death must be named by every member present at it that lives on, within ``liveness`` +
5 s; it prints the deaths' times to be named to all (p50, p99, max), the (survivor,
death) pairs missed, the false losses, and samples of the hosts' memory, threads and descriptors, the
store's memory and its keys. A view remembers 16,384 departed members and the store
keeps 18,432 departures' records; ``--gone-kept`` and ``--departures-kept`` lower both, so
that minutes of churn reach the bounds and the memory can be seen to level off.

Designs (``MACHINLIKE_LIVENESS_WATCH``, see machinlike/distributed/_membership/watch.py): ``all``,
every member reads every heartbeat (before issue 37); ``ring``, each reads its 3
successors (and more past silent ones) and the log counter in one request.

The last line reads ``liveness scale: N=1024 requests/s per member R, key reads/s per
member K, store CPU C%, join J s, detection p99 D s`` (the ring, the largest N run).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch.distributed as dist

CLK = os.sysconf("SC_CLK_TCK")

# torch's store server looks up each new client's host name (getnameinfo, on its one
# thread); this machine's resolver drops about one query in thirty, and the server then
# stalls for the resolver's timeout (5 s by default: "The hostname of the client socket
# cannot be retrieved. err=-3"). The benchmark's processes run with a 1 s resolver
# timeout (RES_OPTIONS, set in main), connect every member beforehand from many threads
# (the stalls overlap), and report that time apart from the join.
CONNECTORS = 32
# --gone-kept, for the hosts (a benchmark's own knob: no World reads it).
GONE_KEPT_ENV = "LIVENESS_SCALE_GONE_KEPT"


def _client(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60), use_libuv=True)


def _connect_all(names: List[str], port: int) -> Dict[str, Tuple[dist.TCPStore, List[dist.TCPStore]]]:
    """Three connections per member: its own, and the ones its liveness watch and its RPC
    agent group clone (the simulation has no agent, but the worker ids live there); the
    departure bell's, one per process, is made when the first member joins."""
    out: Dict[str, Tuple[dist.TCPStore, List[dist.TCPStore]]] = {}
    pending = list(names)
    take = threading.Lock()

    def connector() -> None:
        while True:
            with take:
                if not pending:
                    return
                name = pending.pop()
            made = (_client("127.0.0.1", port), [_client("127.0.0.1", port), _client("127.0.0.1", port)])
            with take:
                out[name] = made

    threads = [threading.Thread(target=connector) for _ in range(CONNECTORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


# ----------------------------------------------------------------- counting proxy
class _Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.keys = 0
        self.notes = 0  # of the requests, those on the notes of silence (m/hush/<name>)

    def note(self, keys: int, key: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.keys += keys
            if "m/hush/" in key:
                self.notes += 1


class CountingStore(dist.Store):
    """A store that counts the requests and keys its caller sends, then forwards them.

    ``spare`` holds connections made beforehand, handed out by :meth:`clone`.
    """

    def __init__(self, inner: dist.TCPStore, counts: _Counts, spare: Optional[List[dist.TCPStore]] = None) -> None:
        super().__init__()
        self._inner = inner
        self._counts = counts
        self._spare = spare if spare is not None else []

    def clone(self) -> "CountingStore":
        # A connection made beforehand, else a new client (not torch's clone: 250 ms each,
        # holding the GIL; see _watch).
        inner = self._spare.pop() if self._spare else _client(self._inner.host, self._inner.port)
        return CountingStore(inner, self._counts)

    # The server's address: members of one process on one store share a departure bell.
    @property
    def host(self) -> str:
        return self._inner.host

    @property
    def port(self) -> int:
        return self._inner.port

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def set(self, key, value) -> None:
        self._counts.note(1, key)
        self._inner.set(key, value)

    def get(self, key):
        self._counts.note(1)
        return self._inner.get(key)

    def add(self, key, value):
        self._counts.note(1)
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._counts.note(1, key)
        return self._inner.compare_set(key, expected, desired)

    def append(self, key, value) -> None:
        self._counts.note(1)
        self._inner.append(key, value)

    def check(self, keys) -> bool:
        self._counts.note(len(keys))
        return self._inner.check(keys)

    def multi_get(self, keys):
        self._counts.note(len(keys))
        return self._inner.multi_get(keys)

    def delete_key(self, key) -> bool:
        self._counts.note(1)
        return self._inner.delete_key(key)

    def wait(self, keys, timeout=None) -> None:
        self._counts.note(len(keys))
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def num_keys(self) -> int:
        self._counts.note(0)
        return self._inner.num_keys()


# --------------------------------------------------------------------- the server
def _serve(port_out: Any, stop: Any) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60), use_libuv=True)
    port_out.send(store.port)
    stop.wait()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def _io(pid: int) -> Tuple[int, int]:
    with open(f"/proc/{pid}/io") as f:
        rows = dict(line.split(": ") for line in f.read().splitlines())
    return int(rows["rchar"]), int(rows["wchar"])


# ------------------------------------------------------------------ churn's book
class _ChurnBook:
    """One host's record of the deaths of the churn phase, bounded by the deaths in flight.

    The driver says a member is about to die (``died``: this host's members then are the
    ones that must name it), then settles it once its bound has passed (``settle``: what
    was missed, when the first and the last of them named it), which forgets it. A loss
    of a member the driver never killed is a false declaration. (A member that joins
    reads the log from its start, and is told of the losses before it too: not counted.)
    """

    def __init__(self, dead: List[str]) -> None:
        self.dead = set(dead)  # killed before the churn, and the churn's victims once said
        self.expected: Dict[str, set] = {}
        self.named: Dict[str, set] = {}
        self.times: Dict[str, Tuple[float, float]] = {}
        self.false: set = set()

    def died(self, victim: str, present: List[str]) -> None:
        self.dead.add(victim)
        self.expected[victim] = set(present) - {victim}
        self.named[victim] = set()

    def note(self, observer: str, victim: str, at: float) -> None:
        expected = self.expected.get(victim)
        if expected is not None:
            if observer in expected:
                self.named[victim].add(observer)
                first, last = self.times.get(victim, (at, at))
                self.times[victim] = (min(first, at), max(last, at))
        elif victim not in self.dead:
            self.false.add(victim)

    def settle(self, victim: str, alive: set) -> Tuple[int, int, float, float]:
        """(members that had to name it and live on, of those the ones that did not, the
        first and the last time one of them did; NaN: none)."""
        expected = self.expected.pop(victim, set()) & alive
        named = self.named.pop(victim, set())
        first, last = self.times.pop(victim, (float("nan"), float("nan")))
        return len(expected), len(expected - named), first, last


# ----------------------------------------------------------------------- a host
def _host(index: int, names: List[str], port: int, liveness: float, design: str, switch: float,
          joiners: int, conn: Any) -> None:
    """One process holding ``names`` as simulated members (and the members that join it
    during the churn); obeys ``conn``'s commands."""
    os.environ["MACHINLIKE_LIVENESS_WATCH"] = design
    # Hundreds of member threads share one GIL here, as no real member does (one member,
    # one process). Each thread waiting for the GIL wakes once per switch interval to ask
    # for it: at 1 ms (this benchmark's setting before session 18) 1,024 members made
    # 430k context switches/s, the box spent 80% of its time in the kernel and the joins
    # took 116-156 s; at CPython's 5 ms they took 28-33 s. Too long an interval starves
    # members instead (a turn comes every threads x interval at worst): keep N / --hosts
    # at 128 or so (see --switch-interval).
    sys.setswitchinterval(switch)
    from machinlike.distributed._membership import roster as _roster
    if os.environ.get(GONE_KEPT_ENV):
        _roster.GONE_KEPT = int(os.environ[GONE_KEPT_ENV])  # (the bound is read at each departure)
    from machinlike.distributed._membership import endpoint as _endpoint
    from machinlike.distributed._store import Keys
    from machinlike.distributed._membership import process_identity
    from machinlike.distributed._membership import Membership

    local = threading.local()
    real_identity = _endpoint.process_identity
    # Each member thread names its own (simulated) process; see the module doc.
    _endpoint.process_identity = lambda: getattr(local, "identity", None) or real_identity()
    keys = Keys.elastic_world("0")
    counts = _Counts()
    members: Dict[str, Membership] = {}
    seen: Dict[Tuple[str, str], float] = {}  # (observer, lost member) -> time.time()
    joined_at: Dict[str, float] = {}
    children: Dict[str, subprocess.Popen] = {}
    worker_of: Dict[str, str] = {}  # member -> its RPC worker name (the churn's census looks for its entry)
    lock = threading.Lock()
    total = int(conn.recv())  # N
    # Every member's two connections, made before the clock starts: made while the
    # store is busy, one in about thirty stalled 5 s in torch's client (see _client).
    began = time.monotonic()
    clients = _connect_all(names, port)
    book: Optional[_ChurnBook] = None  # set for the churn phase
    added = [0, 0]  # churn joins done, failed
    conn.send(time.monotonic() - began)  # imports done: the driver's "go" times the joins alone

    def start(name: str) -> None:
        made = clients.get(name)
        if made is None:
            # A churn joiner connects as it joins: a churn of minutes cannot hold all its
            # joiners' connections beforehand (three each: the store's descriptors and
            # this host's ports run out at about 20,000).
            made = clients[name] = (_client("127.0.0.1", port), [_client("127.0.0.1", port) for _ in range(2)])
        store = CountingStore(made[0], counts, made[1])
        if name.startswith("here-"):  # a same-host member: a real process /proc can watch
            child = subprocess.Popen(["sleep", "100000"])
            children[name] = child
            local.identity = f"{process_identity().rpartition('/')[0]}/{child.pid}"
        else:
            local.identity = f"simhost-{index}/1:1/{abs(hash(name)) % 10 ** 6}"
        m = Membership(store, keys, "the benchmark's store", name, liveness, elastic=False)
        known = [0]  # joins this member has seen (nobody leaves while the world fills)

        def on_change(event: Any, observer: str = name) -> None:
            if event.kind == "lost":
                with lock:
                    if book is not None:
                        book.note(observer, event.member, time.time())
                    else:
                        seen[(observer, event.member)] = time.time()
            elif event.kind == "join":
                known[0] += 1
                if known[0] == total:
                    joined_at[observer] = time.time()

        m.subscribe(on_change)
        m.enter(None, time.monotonic() + 60)
        worker_of[name] = m.endpoint.worker
        m.announce()
        with lock:
            members[name] = m

    while True:
        cmd, arg = conn.recv()
        if cmd == "join":
            pending = list(names)
            take = threading.Lock()

            def joiner() -> None:
                while True:
                    with take:
                        if not pending:
                            return
                        name = pending.pop()
                    start(name)

            threads = [threading.Thread(target=joiner) for _ in range(joiners or len(names))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            conn.send(len(members))
        elif cmd == "positions":
            conn.send(next(iter(members.values())).registry.add(keys.log_count(), 0))
        elif cmd == "joined":
            conn.send(dict(joined_at))
        elif cmd == "counts":
            with counts.lock:
                conn.send((counts.requests, counts.keys, _cpu(os.getpid()), counts.notes))
        elif cmd == "kill":
            with lock:
                m = members.pop(arg)
            killed = time.time()
            if arg in children:
                children[arg].send_signal(signal.SIGKILL)
            m._closing.set()  # its liveness thread stops at its next tick, saying nothing
            clients.pop(arg, None)  # (its connections close once its thread has ended, as a dead process's do)
            conn.send(killed)
        elif cmd == "churn":
            with lock:
                book = _ChurnBook(arg)
            conn.send(True)
        elif cmd == "add":  # a churn member joins, on a thread of its own (the driver goes on)

            def add(name: str = arg) -> None:
                try:
                    start(name)
                    done = 0
                except Exception:
                    done = 1
                with lock:  # (joins run on threads of their own)
                    added[done] += 1

            threading.Thread(target=add, daemon=True).start()
            conn.send(True)
        elif cmd == "died":
            with lock:
                book.died(arg, list(members))
            conn.send(True)
        elif cmd == "settle":
            with lock:
                conn.send(book.settle(arg, set(members)))
        elif cmd == "churned":  # (joins done, failed), falsely named, memory, cut off, threads, descriptors
            with lock:
                conn.send((tuple(added), sorted(book.false), _rss(os.getpid()),
                           sorted(n for n, m in members.items() if m.roster.cut_off),
                           threading.active_count(), len(os.listdir("/proc/self/fd"))))
        elif cmd == "seen":
            with lock:
                conn.send({(o, v): t for (o, v), t in seen.items() if v == arg})
        elif cmd == "log":
            # Positions this host's members filled with SKIP, and its members' pidfd wakes.
            every = list(members.values())
            conn.send((sum(m.events.skipped for m in every), sum(m.monitor.pid_wakes for m in every),
                       sum(m.bell.wakes for m in every)))
            del every  # (a name left bound here kept every member of that moment alive for good)
        elif cmd == "workers":
            conn.send({name: worker_of[name] for name in arg if name in worker_of})
        elif cmd == "spared":
            conn.send(sum(m.monitor.spared for m in members.values()))
        elif cmd == "false":
            # Members named lost that were never killed, and members of this host cut off
            # (declared lost by the others while they lived): each misses every later death.
            with lock:
                named = {v for (_, v) in seen}
            conn.send((sorted(named - set(arg)), sorted(n for n, m in members.items() if m.roster.cut_off)))
        elif cmd == "stop":
            for m in members.values():
                m._closing.set()
            for m in members.values():
                m.bell.stop(2.0)  # (the last member here rings: this process's bell thread ends)
            for child in children.values():
                child.kill()
            conn.send(True)
            return


# ------------------------------------------------------------------- one config
def _pct(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _first(names: Optional[List[str]]) -> str:
    """' (a, b, ...)' for a non-empty list of names, else ''."""
    return f" ({', '.join(names)}{', ...' if len(names) >= 10 else ''})" if names else ""


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _ask(conn: Any, cmd: str, arg: Any = None) -> Any:
    """Send a host one command and return its answer."""
    conn.send((cmd, arg))
    return conn.recv()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CENSUS = 200  # the churn's first victims whose store records are looked for at its end


def _census(probe: dist.TCPStore, victims: List[str], workers: Dict[str, str]) -> Dict[str, int]:
    """Of ``victims`` (gone since the churn's start), how many still have each record in
    the store (their departures are reaped ``MACHINLIKE_DEPARTURES_KEPT`` departures on);
    ``workers``: their RPC worker names (``worker``: the entry ``m/t/<worker>``)."""
    from machinlike.distributed._store import Keys

    keys = Keys.elastic_world("0")
    records = {"inc": keys.incarnations, "live": keys.live, "hb": keys.heartbeat, "hush": keys.silence,
               "probe": keys.probe_request,
               "lost": lambda m: keys.lost(m, 1), "lostpost": lambda m: keys.lost_posted(m, 1),
               "gone": lambda m: keys.gone(m, 1), "worker": lambda m: keys.worker(workers.get(m, "?"))}
    return {kind: sum(1 for v in victims if probe.check([key(v)])) for kind, key in records.items()}


def _churn(conns: List[Any], owner: Dict[str, Any], pool: List[str], dead: List[str], extras: List[str],
           rate: float, seconds: float, liveness: float, server_pid: int, port: int) -> Dict[str, Any]:
    """``rate`` joins and ``rate`` silent deaths a second for ``seconds``; every death must be
    named by every member present at it that lives on, within ``liveness`` + 5 s."""

    def ask_all(cmd: str, arg: Any = None) -> List[Any]:
        for c in conns:  # (all first, then the answers: one wait for the slowest host, not eight in a row)
            c.send((cmd, arg))
        return [c.recv() for c in conns]

    ask_all("churn", dead)
    rng = random.Random(37)
    pool = list(pool)  # who may die: the members there before, and joiners 5 s after their join
    joining: Deque[Tuple[float, str]] = collections.deque()
    events = min(int(rate * seconds), len(extras))
    probe = _client("127.0.0.1", port)
    settle_after = liveness + 5.0
    pending: Deque[Tuple[float, str, float]] = collections.deque()  # (due, victim, killed at)
    delays: List[float] = []  # a death to the last member present at it naming it
    firsts_named: List[float] = []  # a death to the first (about when its declarer posted it)
    owed = missed = unnamed = 0
    unnamed_names: List[str] = []  # the first few (where they stand in the ring says why)
    victims: List[str] = []
    # (s since start, hosts' RSS, store RSS, store keys, hosts' threads, hosts' descriptors)
    samples: List[Tuple[float, int, int, int, int, int]] = []

    def settle_due(until: float) -> None:
        nonlocal owed, missed, unnamed
        while pending and pending[0][0] <= until:
            _, victim, killed = pending.popleft()
            answers = ask_all("settle", victim)
            owed += sum(a[0] for a in answers)
            missed += sum(a[1] for a in answers)
            firsts = [a[2] for a in answers if a[2] == a[2]]
            lasts = [a[3] for a in answers if a[3] == a[3]]
            if lasts:
                delays.append(max(lasts) - killed)
                firsts_named.append(min(firsts) - killed)
            else:
                unnamed += 1
                if len(unnamed_names) < 10:
                    unnamed_names.append(victim)

    def sample(t0: float) -> None:
        rows = ask_all("churned")
        samples.append((time.monotonic() - t0, sum(r[2] for r in rows), _rss(server_pid), probe.num_keys(),
                        sum(r[4] for r in rows), sum(r[5] for r in rows)))

    counted = [sum(col) for col in zip(*ask_all("counts"))]  # (requests, keys, CPU, notes) before
    start = time.monotonic()
    sample(start)
    every = max(1.0, seconds / 6)
    next_sample = start + every
    for i in range(events):
        due = start + i / rate
        while True:
            now = time.monotonic()
            settle_due(now)
            if now >= next_sample:
                sample(start)
                next_sample += every
            if now >= due:
                break
            time.sleep(min(0.01, due - now))
        while joining and joining[0][0] <= now:
            pool.append(joining.popleft()[1])
        # A random member dies (swapped to the end: O(1)); deaths at random among all,
        # as in a deployment (none of the members there before are spared for long).
        pick = rng.randrange(len(pool))
        pool[pick], pool[-1] = pool[-1], pool[pick]
        victim = pool.pop()
        victims.append(victim)
        ask_all("died", victim)  # (its host's members present now must name it)
        pending.append((time.monotonic() + settle_after, victim, _ask(owner[victim], "kill", victim)))
        _ask(owner[extras[i]], "add", extras[i])
        joining.append((time.monotonic() + 5.0, extras[i]))
    ran = time.monotonic() - start
    during = [sum(col) - b for col, b in zip(zip(*ask_all("counts")), counted)]  # (the churn's own)
    while pending:
        time.sleep(max(0.0, pending[0][0] - time.monotonic()))
        settle_due(time.monotonic())
    sample(start)
    rows = ask_all("churned")
    return dict(churn_events=events, churn_rate=events / ran if ran > 0 else float("nan"), churn_s=ran,
                churn_joined=sum(r[0][0] for r in rows), churn_join_failed=sum(r[0][1] for r in rows),
                churn_owed=owed, churn_missed=missed, churn_unnamed=unnamed, churn_unnamed_names=unnamed_names,
                churn_requests_per_s=during[0] / ran if ran > 0 else float("nan"),
                churn_note_requests_per_s=during[3] / ran if ran > 0 else float("nan"),
                churn_named_p50_s=_pct(delays, 0.5), churn_named_p99_s=_pct(delays, 0.99),
                churn_named_max_s=max(delays) if delays else float("nan"),
                churn_first_p50_s=_pct(firsts_named, 0.5), churn_first_p99_s=_pct(firsts_named, 0.99),
                churn_false=sorted({v for r in rows for v in r[1]}),
                churn_cut_off=sorted(n for r in rows for n in r[3]), churn_samples=samples,
                churn_census=_census(probe, victims[:CENSUS],
                                     {k: w for r in ask_all("workers", victims[:CENSUS]) for k, w in r.items()}))


def run_one(n: int, design: str, liveness: float, window: float, hosts: int, kills: int,
            switch: float = 0.005, joiners: int = 16, churn: float = 0.0,
            churn_seconds: float = 60.0) -> Dict[str, Any]:
    ctx = mp.get_context("spawn")
    port_in, port_out = ctx.Pipe()
    stop = ctx.Event()
    server = ctx.Process(target=_serve, args=(port_out, stop), daemon=True)
    server.start()
    port = port_in.recv()
    names = [f"m{i:05d}" for i in range(n - kills)] + [f"here-{i}" for i in range(kills)]
    shares = [names[h::hosts] for h in range(hosts)]
    extras = [f"c{i:05d}" for i in range(int(churn * churn_seconds))]  # the churn's joiners
    conns, procs = [], []
    for h in range(hosts):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_host, args=(h, shares[h], port, liveness, design, switch, joiners, theirs),
                        daemon=True)
        p.start()
        conns.append(mine)
        procs.append(p)
    owner = {name: conns[h] for h in range(hosts) for name in shares[h] + extras[h::hosts]}

    try:
        for c in conns:
            c.send(n)
        connect = max(c.recv() for c in conns)
        _say(f"N={n} {design}: connected in {connect:.1f} s; joining")
        before = [_ask(c, "counts") for c in conns]
        store_cpu0 = _cpu(server.pid)
        go = time.time()
        for c in conns:
            c.send(("join", None))
        for c in conns:
            c.recv()
        started = time.time() - go
        deadline = time.monotonic() + 60
        joined: Dict[str, float] = {}
        while time.monotonic() < deadline:
            joined = {}
            for c in conns:
                joined.update(_ask(c, "joined"))
            if len(joined) >= n:
                break
            time.sleep(0.25)
        join = max(joined.values()) - go if len(joined) >= n else float("nan")
        # The joins' cost (up to when the last was seen, about: the poll's last look).
        spent = time.time() - go
        after = [_ask(c, "counts") for c in conns]
        join_store_cpu = 100 * (_cpu(server.pid) - store_cpu0) / spent
        join_requests = sum(a[0] - b[0] for a, b in zip(after, before))
        join_hosts_cpu = 100 * sum(a[2] - b[2] for a, b in zip(after, before)) / spent
        positions = int(_ask(conns[0], "positions"))
        skipped = sum(_ask(c, "log")[0] for c in conns)
        _say(f"N={n} {design}: the joins returned in {started:.2f} s; {len(joined)} joined and seen by all in "
             f"{join:.2f} s ({positions} log positions for {n} joins, {skipped} skipped; store CPU "
             f"{join_store_cpu:.0f}%, hosts' CPU {join_hosts_cpu:.0f}%, {join_requests / n:.1f} requests per member); "
             f"measuring")
        time.sleep(2.0)  # settle: every member's ring (or table) is built

        def sample() -> Tuple[int, int, float, float, int, int]:
            req = keys = 0
            host_cpu = 0.0
            for c in conns:
                r, k, cpu, _ = _ask(c, "counts")
                req, keys, host_cpu = req + r, keys + k, host_cpu + cpu
            rb, wb = _io(server.pid)
            return req, keys, host_cpu, _cpu(server.pid), rb, wb

        t0, a = time.monotonic(), sample()
        time.sleep(window)
        t1, b = time.monotonic(), sample()
        span = t1 - t0
        out: Dict[str, Any] = dict(
            n=n, design=design, liveness=liveness, connect_s=connect, joins_started_s=started, join_s=join,
            joined=len(joined), join_store_cpu_pct=join_store_cpu, join_hosts_cpu_pct=join_hosts_cpu,
            join_requests_per_member=join_requests / n,
            requests_per_s=(b[0] - a[0]) / span, key_reads_per_s=(b[1] - a[1]) / span,
            hosts_cpu_pct=100 * (b[2] - a[2]) / span, store_cpu_pct=100 * (b[3] - a[3]) / span,
            store_in_Bps=(b[4] - a[4]) / span, store_out_Bps=(b[5] - a[5]) / span)
        out["requests_per_member_s"] = out["requests_per_s"] / n
        out["key_reads_per_member_s"] = out["key_reads_per_s"] / n
        out["member_cpu_pct"] = out["hosts_cpu_pct"] / n
        _say(f"N={n} {design}: {out['requests_per_member_s']:.2f} requests/s per member; killing")
        # Detection: silent remote deaths, then same-host SIGKILLs, one at a time.
        dead = 0
        for kind, victims in (("remote", names[:kills]), ("here", names[n - kills:])):
            pairs: List[float] = []
            named_all: List[float] = []
            firsts: List[float] = []
            missed = 0
            for v in victims:
                killed = _ask(owner[v], "kill", v)
                dead += 1
                expected = n - dead  # every survivor names it
                end = time.monotonic() + 2.5 * liveness + 5
                got: Dict[Any, float] = {}
                while time.monotonic() < end:
                    got = {}
                    for c in conns:
                        got.update(_ask(c, "seen", v))
                    if len(got) >= expected:
                        break
                    time.sleep(0.1)
                delays = [t - killed for t in got.values()]
                if delays:
                    firsts.append(min(delays))  # its declarer's own view: the rest is the fan-out
                pairs += delays
                missed += max(0, expected - len(delays))
                named_all.append(max(delays) if delays and len(delays) >= expected else float("inf"))
            out[f"detect_{kind}_p50_s"] = _pct(pairs, 0.5)
            out[f"detect_{kind}_p99_s"] = _pct(pairs, 0.99)
            out[f"detect_{kind}_all_max_s"] = max(named_all) if named_all else float("nan")
            out[f"detect_{kind}_first_s"] = _pct(firsts, 0.5)
            out[f"detect_{kind}_missed"] = missed
        out["spared"] = sum(_ask(c, "spared") for c in conns)
        killed_names = names[:kills] + names[n - kills:]
        false_named: set = set()
        cut_off: List[str] = []
        for c in conns:
            named, cut = _ask(c, "false", killed_names)
            false_named |= set(named)
            cut_off += cut
        out["false_losses"] = sorted(false_named)
        out["cut_off"] = sorted(cut_off)
        if churn > 0:
            _say(f"N={n} {design}: churn, {churn:g} joins and deaths a second for {churn_seconds:g} s")
            out.update(_churn(conns, owner, names[kills:n - kills], killed_names, extras, churn, churn_seconds,
                              liveness, server.pid, port))
        return out
    finally:
        for c in conns:
            try:
                c.send(("stop", None))
                c.poll(10) and c.recv()
            except (OSError, EOFError):
                pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        stop.set()
        server.join(5)
        if server.is_alive():
            server.kill()


# ------------------------------------------------------------------------ driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--designs", default="all,ring")
    parser.add_argument("--liveness", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of steady state measured")
    parser.add_argument("--hosts", type=int, default=8, help="processes holding the simulated members")
    parser.add_argument("--switch-interval", type=float, default=0.005,
                        help="the hosts' sys.setswitchinterval, seconds (CPython's default; see _host)")
    parser.add_argument("--kills", type=int, default=4, help="deaths of each kind (remote, same host)")
    # 16: 128 joins in flight at 8 hosts. One thread per member (0, all at once, as a
    # launcher starts its processes) puts 256 threads on each host's GIL, a convoy no
    # deployment has (a member has its process to itself): it cost more CPU than the
    # parallel joins saved (1,024 joined in 9.5-9.9 s, against 8.5 s at 16), and at
    # liveness=2 it starved a whole host past the silence bound once in four runs.
    parser.add_argument("--joiners", type=int, default=16,
                        help="threads per host that join its members at once (0: one per member; 8 before "
                             "session 21)")
    parser.add_argument("--churn", type=float, default=0.0,
                        help="after the deaths: this many joins and as many silent deaths a second (0: none)")
    parser.add_argument("--churn-seconds", type=float, default=60.0, help="how long the churn lasts")
    parser.add_argument("--gone-kept", type=int, default=0,
                        help="departed members each member's view remembers (roster.GONE_KEPT; 0: the "
                             "default, 16,384), so that a churn of minutes reaches that bound too")
    parser.add_argument("--departures-kept", type=int, default=0,
                        help="MACHINLIKE_DEPARTURES_KEPT for the run (0: the default, 18,432), so that a "
                             "churn of minutes reaches the bound of the store's keys")
    parser.add_argument("--timeout", type=float, default=240.0, help="hard limit per (N, design), seconds")
    parser.add_argument("--one", nargs=2, metavar=("N", "DESIGN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see CONNECTORS
    if args.departures_kept:
        os.environ["MACHINLIKE_DEPARTURES_KEPT"] = str(args.departures_kept)  # (the hosts inherit it)
    if args.gone_kept:
        os.environ[GONE_KEPT_ENV] = str(args.gone_kept)  # (read by _host)
    if args.one:
        result = run_one(int(args.one[0]), args.one[1], args.liveness, args.window, args.hosts, args.kills,
                         args.switch_interval, args.joiners, args.churn, args.churn_seconds)
        print("RESULT " + json.dumps(result))
        return
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for design in args.designs.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), design,
                   "--liveness", str(args.liveness), "--window", str(args.window), "--hosts", str(args.hosts),
                   "--switch-interval", str(args.switch_interval), "--joiners", str(args.joiners),
                   "--kills", str(args.kills), "--churn", str(args.churn), "--churn-seconds", str(args.churn_seconds)]
            # Its own session: over the hard limit, its store and hosts go with it.
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            try:
                out, err = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                print(f"N={n} {design}: over the hard limit of {args.timeout:g} s; last said: "
                      f"{err.strip().splitlines()[-1:] if err.strip() else '-'}", flush=True)
                continue
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"N={n} {design}: failed (rc {proc.returncode}): {err[-800:]}", flush=True)
                continue
            row = json.loads(lines[-1][7:])
            rows.append(row)
            print(f"N={n:5d} {design:4s}  req/s {row['requests_per_s']:9.0f} ({row['requests_per_member_s']:.2f}"
                  f"/member)  key reads/s {row['key_reads_per_s']:10.0f} ({row['key_reads_per_member_s']:.1f}"
                  f"/member)  store CPU {row['store_cpu_pct']:5.1f}%  in {row['store_in_Bps'] / 1e6:6.2f} MB/s"
                  f"  out {row['store_out_Bps'] / 1e6:6.2f} MB/s  members' CPU {row['member_cpu_pct']:.3f}%"
                  f"/member  connect {row['connect_s']:.1f} s  join {row['join_s']:.2f} s (store CPU "
                  f"{row['join_store_cpu_pct']:.0f}%, {row['join_requests_per_member']:.1f} requests/member)  "
                  f"detection remote "
                  f"p50/p99/all "
                  f"{row['detect_remote_p50_s']:.2f}/{row['detect_remote_p99_s']:.2f}/"
                  f"{row['detect_remote_all_max_s']:.2f} s  same host {row['detect_here_p50_s']:.2f}/"
                  f"{row['detect_here_p99_s']:.2f}/{row['detect_here_all_max_s']:.2f} s  first named remote/here "
                  f"{row['detect_remote_first_s']:.2f}/{row['detect_here_first_s']:.2f} s  missed "
                  f"{row['detect_remote_missed'] + row['detect_here_missed']}  false losses "
                  f"{len(row['false_losses'])} (cut off {len(row['cut_off'])})", flush=True)
            if "churn_events" in row:
                first, last = row["churn_samples"][0], row["churn_samples"][-1]
                print(f"        churn {row['churn_rate']:.1f} joins and deaths/s for {row['churn_s']:.0f} s "
                      f"({row['churn_events']} each): joined {row['churn_joined']} ({row['churn_join_failed']} "
                      f"failed); deaths named to all p50/p99/max {row['churn_named_p50_s']:.2f}/"
                      f"{row['churn_named_p99_s']:.2f}/{row['churn_named_max_s']:.2f} s (first named "
                      f"{row['churn_first_p50_s']:.2f}/{row['churn_first_p99_s']:.2f} s), missed "
                      f"{row['churn_missed']} of {row['churn_owed']} (survivor, death) pairs, never named "
                      f"{row['churn_unnamed']}{_first(row.get('churn_unnamed_names'))}, false losses "
                      f"{len(row['churn_false'])} (cut off {len(row['churn_cut_off'])}); hosts' RSS "
                      f"{first[1] / 2**20:.0f} -> {last[1] / 2**20:.0f} MB, store RSS {first[2] / 2**20:.0f} -> "
                      f"{last[2] / 2**20:.0f} MB, store keys {first[3]} -> {last[3]}; store requests "
                      f"{row.get('churn_requests_per_s', float('nan')):.0f}/s, of which on notes of silence "
                      f"{row.get('churn_note_requests_per_s', float('nan')):.1f}/s", flush=True)
                print(f"        store records left of the churn's first {CENSUS} victims: {row['churn_census']}",
                      flush=True)
                print("        churn samples (s, hosts' RSS MB, store RSS MB, store keys, hosts' threads, hosts' "
                      "descriptors): " + ", ".join(f"({t:.0f}, {h / 2**20:.0f}, {st / 2**20:.0f}, {k}, {th}, {fd})"
                                                   for t, h, st, k, th, fd in row["churn_samples"]), flush=True)
    ring = [r for r in rows if r["design"] == "ring"]
    if ring:
        r = max(ring, key=lambda x: x["n"])
        p99 = max(r["detect_remote_p99_s"], r["detect_here_p99_s"])
        print(f"liveness scale: N={r['n']} requests/s per member {r['requests_per_member_s']:.2f}, key reads/s "
              f"per member {r['key_reads_per_member_s']:.2f}, store CPU {r['store_cpu_pct']:.1f}%, join "
              f"{r['join_s']:.2f} s, detection p99 {p99:.2f} s")


if __name__ == "__main__":
    main()
