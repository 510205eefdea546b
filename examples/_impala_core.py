"""The IMPALA pieces shared by ``impala.py`` (CartPole) and ``impala_atari.py``: the learner's
bounded inbox of trajectories and the V-trace targets.

Not part of the library: the examples import it from their own folder.

    actors ── registered_async(put, trajectory) ──► Inbox (bounded deque; a full one parks the
                                                     reply: back-pressure, no RPC thread held)
    learner ◄── take(B) ─────────────────────────────┘   then vtrace(values, rewards, ...)
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, Dict, List, Tuple

import torch
from torch.distributed import rpc

__all__ = ["Inbox", "vtrace"]


class Inbox:
    """A learner's bounded queue of trajectories, filled through an asynchronous RPC service.

    ``put`` is the service: while there is room the reply (True: keep going) is immediate;
    on a full queue it is parked until ``take`` makes room, which throttles the actors
    without holding one of the learner's RPC threads per waiting actor. After ``close``
    every reply, parked or new, is False: training is over.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: Deque[Dict[str, Any]] = collections.deque()
        self._parked: Deque[Tuple[torch.futures.Future, Dict[str, Any]]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    @rpc.functions.async_execution
    def put(self, trajectory: Dict[str, Any]) -> torch.futures.Future:
        reply: torch.futures.Future = torch.futures.Future()
        with self._cond:
            if not self._closed and len(self._items) >= self._capacity:
                self._parked.append((reply, trajectory))
                return reply
            accepted = not self._closed
            if accepted:
                self._items.append(trajectory)
                self._cond.notify()
        reply.set_result(accepted)  # outside the lock: it runs torch's reply callbacks
        return reply

    def take(self, count: int, timeout: float) -> List[Dict[str, Any]]:
        """The next ``count`` trajectories, in arrival order.

        Raises:
            TimeoutError: fewer than ``count`` arrived within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._items) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the learner received {len(self._items)} of {count} trajectories "
                                       f"within {timeout:g} s: are the actors alive?")
                self._cond.wait(left)
            batch = [self._items.popleft() for _ in range(count)]
            released = []
            while self._parked and len(self._items) < self._capacity:
                reply, trajectory = self._parked.popleft()
                self._items.append(trajectory)
                released.append(reply)
        for reply in released:
            reply.set_result(True)
        return batch

    def close(self) -> None:
        """Answer every parked and later ``put`` with False (stop)."""
        with self._cond:
            self._closed = True
            released = [reply for reply, _ in self._parked]
            self._parked.clear()
            self._items.clear()
        for reply in released:
            reply.set_result(False)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


def vtrace(values: torch.Tensor, bootstrap: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor,
           log_rhos: torch.Tensor, rho_bar: float = 1.0, c_bar: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets and policy-gradient advantages (Espeholt et al., 2018, section 4.1).

    Args:
        values: V(x_t) of the learner, [T, N].
        bootstrap: V(x_T), [N].
        rewards: r_t, [T, N].
        discounts: gamma_t, [T, N]: gamma, or 0 where the episode ended at step t.
        log_rhos: log(pi(a_t | x_t) / mu(a_t | x_t)), learner over behaviour policy, [T, N].
        rho_bar, c_bar: Truncation levels of the importance weights (rho-bar, c-bar).

    Returns:
        (v_s, advantages), each [T, N]: v_s = V(x_s) + sum_t gamma^(t-s) (prod c_i) delta_t V
        computed backwards, and rho_s (r_s + gamma_s v_{s+1} - V(x_s)).
    """
    rhos = log_rhos.exp()
    clipped_rhos = rhos.clamp(max=rho_bar)
    cs = rhos.clamp(max=c_bar)
    next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    vs_minus_v = torch.empty_like(deltas)
    acc = torch.zeros_like(bootstrap)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v
    vs_next = torch.cat([vs[1:], bootstrap.unsqueeze(0)], dim=0)
    return vs, clipped_rhos * (rewards + discounts * vs_next - values)
