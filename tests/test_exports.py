"""The import surface: SPEC's module paths, every ``__all__``, the top-level re-exports,
machin's names, and no side effects at import time."""

from __future__ import annotations

import importlib
import multiprocessing

import pytest
from fresh_import import import_report

import machinlike

# SPEC: module paths mirror machin.parallel's, plus the new machinlike.testing.
MODULES = [
    "machinlike.distributed",
    "machinlike.server",
    "machinlike.assigner",
    "machinlike.pickle",
    "machinlike.pool",
    "machinlike.queue",
    "machinlike.process",
    "machinlike.thread",
    "machinlike.event",
    "machinlike.exception",
    "machinlike.testing",
    "machinlike.metrics",
    "machinlike.compat.machin",  # inert until install()
]

# The machin.parallel names (seed 002) that code being ported imports, by module.
MACHIN_NAMES = {
    "machinlike.distributed": ["World", "RpcGroup", "CollectiveGroup", "get_world", "get_cur_rank",
                               "get_cur_name", "is_world_initialized", "debug_with_process"],
    "machinlike.server": ["OrderedServerBase", "OrderedServerSimple", "OrderedServerSimpleImpl",
                          "PushPullModelServer", "PushPullModelServerImpl", "PushPullGradServer",
                          "PushPullGradServerImpl"],
    "machinlike.assigner": ["ModelAssigner", "ModelSizeEstimator"],
    "machinlike.pickle": ["Pickler", "dumps", "loads", "mark_static_module"],
    "machinlike.pool": ["Pool", "P2PPool", "CtxPool", "ThreadPool", "CtxThreadPool"],
    "machinlike.queue": ["SimpleQueue", "SimpleP2PQueue", "MultiP2PQueue", "TimeoutError"],
    "machinlike.process": ["Process", "ProcessException"],
    "machinlike.thread": ["Thread"],
    "machinlike.event": ["OrEvent", "AndEvent"],
    "machinlike.exception": ["ExceptionWithTraceback", "RemoteTraceback"],
}


@pytest.mark.parametrize("path", MODULES)
def test_every_name_in_all_exists_once(path):
    module = importlib.import_module(path)
    names = module.__all__
    assert len(names) == len(set(names)), f"{path}.__all__ repeats a name"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{path}.__all__ names what the module lacks: {missing}"
    private = [name for name in names if name.startswith("_")]
    assert not private, f"{path}.__all__ exports private names: {private}"


@pytest.mark.parametrize("path", sorted(MACHIN_NAMES))
def test_machin_names_keep_their_module(path):
    module = importlib.import_module(path)
    absent = [name for name in MACHIN_NAMES[path] if name not in module.__all__]
    assert not absent, f"machin code importing {absent} from {path} would break"


def test_top_level_reexports_are_the_canonical_objects():
    homes = {name: importlib.import_module(path) for path in MODULES for name in importlib.import_module(path).__all__}
    # machin.parallel re-exported these two of multiprocessing's at its top level.
    homes.update(get_context=multiprocessing, get_start_method=multiprocessing)
    assert len(machinlike.__all__) == len(set(machinlike.__all__))
    for name in machinlike.__all__:
        assert name in homes, f"machinlike.{name} has no home module among {MODULES}"
        assert getattr(machinlike, name) is getattr(homes[name], name), f"machinlike.{name} is a different object"
    for name in ("World", "launch", "launch_ray", "Pool", "PushPullGradServer", "ModelAssigner", "OrEvent", "ExceptionWithTraceback"):
        assert name in machinlike.__all__


def test_import_has_no_side_effects():
    # A fresh interpreter: importing every module must not start threads or processes,
    # pick a multiprocessing start method, initialise torch.distributed, or change the
    # process-wide pickling tables (torch is imported first: its own registrations are its),
    # or import Ray (optional and slow to import: only launch_ray imports it).
    report = import_report()  # one probe interpreter, shared with tests/test_pickle.py
    assert len(report["threads"]) == 1, report["threads"]
    assert report["children"] == []
    assert report["start_method"] is None
    assert not report["dist_initialized"]
    assert report["copyreg_changed"] == []
    assert not report["ray_imported"]
