"""The servers' accessor calls take a ``timeout=`` each, and the steps of one call share it.

* A frozen host (SIGSTOP: it holds its connections and never answers): with the World's
  ``rpc_timeout`` at 30 s, a model push, a model pull, a gradient push and an ordered
  pull each end within their own ``timeout=`` of 1.5 s, with a ``TimeoutError`` that
  names the call and the budget; once the host runs again, the same accessors work.
* A slow one: a model server over an ordered server of the user's own whose every call
  takes 0.6 s. A push through a fresh accessor is three calls (the spec read, claimed,
  the push); with ``timeout=1.0`` it fails after the second (each on a timeout of its own,
  it would succeed after 1.8 s).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

from machinlike.server import (OrderedServerBase, OrderedServerSimpleImpl, PushPullGradServerImpl,
                               PushPullModelServer, PushPullModelServerImpl)
from machinlike.testing import run_world

from proc_util import wait_stopped

BUDGET = 1.5
SLACK = 1.5  # a loaded 2-core box: the call's own bound plus scheduling


def _timed(call, match, budget=BUDGET):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=match) as caught:
        call()
    took = time.monotonic() - start
    assert took < budget + SLACK, f"{match!r}: {took:.2f} s for a {budget} s budget"
    return caught.value


class SlowOrdered(OrderedServerBase):
    """A user's ordered server: a real one behind a link that takes 0.6 s a call."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def push(self, key, value, version, prev_version):
        self.calls += 1
        time.sleep(0.6)
        return self.inner.push(key, value, version, prev_version)

    def pull(self, key, version=None):
        self.calls += 1
        time.sleep(0.6)
        return self.inner.pull(key, version)


def _body(world):
    group = world.create_rpc_group("g", world.get_members())
    if world.rank == 0:
        models = PushPullModelServerImpl("models", group)
        grads = PushPullGradServerImpl("grads", group, reduce_batch_size=1)
        managed = nn.Linear(2, 1)
        grads.manage_model(managed, torch.optim.SGD(managed.parameters(), lr=0.1))
        grads.start()
        ordered = OrderedServerSimpleImpl("kv", group)
        group.pair("pid", os.getpid())
    group.barrier(timeout=60)
    if world.rank == 1:
        host = group.get_paired("pid").to_here()
        model_server = group.get_paired("models").to_here()
        grad_server = group.get_paired("grads").to_here()
        kv = group.get_paired("kv").to_here()
        net = nn.Linear(2, 1)
        # Bad timeouts are refused before anything is sent.
        with pytest.raises(ValueError, match="timeout"):
            model_server.push(net, timeout=0)
        with pytest.raises(TypeError, match="timeout"):
            grad_server.pull(net, timeout="1")
        with pytest.raises(ValueError, match="timeout"):
            kv.pull("k", timeout=-1)

        slow = SlowOrdered(kv)
        err = _timed(lambda: PushPullModelServer("slow", slow).push(net, timeout=1.0),
                     r"push of model 'slow': not done within 1 s", budget=1.0 + 0.6)
        assert slow.calls <= 2, slow.calls  # the third call was never made (the second, if the first ran long)

        os.kill(host, signal.SIGSTOP)
        try:
            wait_stopped(host)
            err = _timed(lambda: model_server.push(net, timeout=BUDGET),
                         rf"push of model 'model': not done within {BUDGET:g} s")
            assert isinstance(err.__cause__, TimeoutError)  # the step that ran out, as cause
            _timed(lambda: model_server.pull(net, timeout=BUDGET), rf"pull of model 'model': .*{BUDGET:g} s")
            net(torch.ones(1, 2)).sum().backward()
            _timed(lambda: grad_server.push(net, timeout=BUDGET),
                   rf"push to gradient server 'grads': not done within {BUDGET:g} s")
            _timed(lambda: kv.pull("k", timeout=BUDGET), rf"within {BUDGET:g}")
        finally:
            os.kill(host, signal.SIGCONT)
        # The host runs again: the same accessors work.
        assert model_server.push(net, timeout=30) and net.pp_version == 1
        net.zero_grad()
        net(torch.ones(1, 2)).sum().backward()
        grad_server.push(net, timeout=30)
        assert kv.push("k", 1, 1, None, timeout=30) and kv.pull("k", timeout=30) == (1, 1)
    group.barrier(timeout=60)
    if world.rank == 0:
        for server in (models, grads, ordered):
            server.close()
    group.barrier(timeout=60)
    group.destroy()


def test_each_accessor_call_ends_within_its_timeout_all_steps_together():
    run_world(_body, 2, timeout=120, rpc_timeout=30)


def test_a_step_after_one_that_took_effect_says_so_when_it_runs_out():
    from machinlike.server._budget import CallBudget

    with pytest.raises(TimeoutError, match=r"push to gradient server 'g' \(the gradients were queued\): not done "
                                           r"within 0.05 s") as caught:
        with CallBudget(0.05, "push to gradient server 'g'") as budget:
            budget.then("the gradients were queued")
            raise TimeoutError("the pull's call did not answer")  # as a step that ran out raises
    assert str(caught.value.__cause__) == "the pull's call did not answer"


def test_a_spent_budget_raises_a_plain_timeout_error_told_once():
    # The user's traceback names builtins.TimeoutError, not a private subclass (trial 7).
    from machinlike.server._budget import CallBudget

    with pytest.raises(TimeoutError) as caught:
        with CallBudget(0.05, "pull of model 'm'"):
            with CallBudget(0.05, "pull of model 'm'") as inner:
                inner._deadline -= 1  # as when the time ran out before the next step
                inner.left()
    assert type(caught.value) is TimeoutError and caught.value.__cause__ is None
    assert str(caught.value).startswith("pull of model 'm': not done within 0.05 s")
    with pytest.raises(TimeoutError) as wrapped:
        with CallBudget(0.05, "push of model 'm'"):
            raise TimeoutError("the step did not answer")
    assert type(wrapped.value) is TimeoutError and str(wrapped.value.__cause__) == "the step did not answer"
