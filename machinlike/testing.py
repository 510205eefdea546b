"""Testing distributed code with pytest: run a test body in N processes, a World in each.

Example::

    from machinlike.testing import world_test

    @world_test(world_size=3, timeout=30)
    @pytest.mark.parametrize("n", [1, 2])
    def test_sum(world, n, tmp_path):          # pytest fills n and tmp_path as usual
        group = world.create_rpc_group("g", world.get_members())
        ...

The decorated test runs in ``world_size`` processes started by :func:`machinlike.launch`
(free ports, the warm forkserver, no fixed sleeps); each receives its World first and the
test's fixtures and parameters after it. A failure on any rank fails the test with that
rank's traceback; a hang fails it after ``timeout`` with every rank's stack dumped.
Fixture values must be picklable. The test function must live at module level of an
importable test module (the ranks import it by name).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _checks
from .distributed import launch

__all__ = ["run_world", "world_test"]


def run_world(fn: Callable[..., Any], world_size: int = 3, args: Sequence[Any] = (),
              kwargs: Optional[Dict[str, Any]] = None, *, timeout: float = 60.0, **world_kwargs: Any) -> List[Any]:
    """Run ``fn(world, *args, **kwargs)`` on ``world_size`` ranks and return their results.

    A bounded :func:`machinlike.launch`: ``timeout`` (seconds, 60 unless given) cannot be
    None here, so a hanging test fails instead of blocking the suite.

    Args:
        fn: Run on every rank with its World first; lambdas and local functions work.
        world_size: Number of ranks.
        args, kwargs: Extra arguments of ``fn``.
        timeout: Seconds for the whole run once the ranks are started, their Worlds'
            start-up included (> 0). Each rank's
            ``World.stop`` waits at most ``min(30, timeout)`` for its peers.
        **world_kwargs: Passed to :func:`machinlike.launch` (``return_exceptions=``,
            ``names=``) and from there to each :class:`~machinlike.distributed.World`.

    Returns:
        ``fn``'s return value of each rank, in rank order.

    Raises:
        ValueError: ``timeout`` is None, not positive or not finite.
        TypeError: ``timeout`` is not a number.
        Exception: the first failure of any rank (see :func:`machinlike.launch`).
        TimeoutError: the run exceeded ``timeout``; every rank's stack went to stderr.
    """
    if timeout is None:  # mandatory here: a hanging test must fail, not block the suite
        raise ValueError("timeout=None must be a positive number of seconds: run_world needs a bound")
    wait = _checks.seconds("timeout", timeout)
    return launch(fn, world_size, args, kwargs, timeout=wait, stop_timeout=min(30.0, wait), **world_kwargs)


def _import_test_module(name: str) -> Any:
    """Import a test module in a rank with pytest's assertion rewriting, as pytest would.

    Without it, a failing ``assert`` in a rank reports a bare AssertionError; with it, the
    remote traceback shows the compared values. Falls back to a plain import when pytest
    is not installed or the module has no Python source.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return importlib.import_module(name)
    if spec is None or origin is None or not origin.endswith(".py"):
        return importlib.import_module(name)
    with open(origin, "rb") as stream:
        source = stream.read()
    tree = ast.parse(source, filename=origin)
    rewrite_asserts(tree, source, origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(tree, origin, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class _TestBody:
    """Picklable pointer to the undecorated test function, resolved by import in a rank."""

    def __init__(self, module: str, qualname: str) -> None:
        self.module = module
        self.qualname = qualname

    def __call__(self, world: Any, **kwargs: Any) -> Any:
        target: Any = _import_test_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target._machinlike_body(world, **kwargs)


def world_test(world_size: int = 3, *, timeout: float = 60.0, **world_kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a test ``fn(world, ...)`` to run on ``world_size`` ranks.

    Args:
        world_size: Number of ranks.
        timeout: Seconds for the whole run (start-up included).
        **world_kwargs: Passed to each rank's :class:`~machinlike.distributed.World`.

    Returns:
        A decorator. The decorated test returns None (pytest's rule for tests); use
        :func:`run_world` where the per-rank results are needed.

    Raises:
        TypeError: (when decorating) the function takes no parameter for the World, or
            is not defined at module level.
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise TypeError(f"{fn.__qualname__} must take the World as its first parameter")
        if "<locals>" in fn.__qualname__:
            raise TypeError(f"{fn.__qualname__} must be defined at module level (ranks import it by name)")
        body = _TestBody(fn.__module__, fn.__qualname__)

        def test(**kwargs: Any) -> None:
            run_world(body, world_size, kwargs=kwargs, timeout=timeout, **world_kwargs)

        # pytest reads this signature to pass fixtures and parameters (the World is ours).
        test.__signature__ = inspect.Signature(params[1:])  # type: ignore[attr-defined]
        test.__name__ = fn.__name__
        test.__qualname__ = fn.__qualname__
        test.__module__ = fn.__module__
        test.__doc__ = fn.__doc__
        test.pytestmark = list(getattr(fn, "pytestmark", []))  # type: ignore[attr-defined]
        test._machinlike_body = fn  # type: ignore[attr-defined]
        return test

    return decorate
