"""What a call sends by name: the RPC entry points and the rebuild functions of pickled
handles and groups (issue 34).

torch pickles a call's function by its qualified name, so these names are part of the
wire format between members. machinlike's rule (docs/architecture.rst): every member of
a world runs the same install. This test pins the names this release sends, so that a move
that changes them is a decision, and shows that a name of the release before the layered
tree (``machinlike.distributed._calls._call_service``) no longer resolves: a member of an
older install fails its first call with an unpickling error instead of running the wrong
function.
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest

ENTRY_POINTS = {
    "machinlike.distributed._calls.serve": ["_call_service", "_call_async_service", "_run", "_run_async"],
    "machinlike.distributed._calls.ref_owner": ["_ref_value", "_ref_call", "_keep_run", "_keep_call",
                                                "_keep_service", "_is_paired", "_run_service", "_hold", "_move",
                                                "_release", "_release_all"],
    "machinlike.distributed._calls.refs": ["_arrived"],
    "machinlike.distributed._groups.rpc_group": ["_rebuild_group"],
}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_entry_points_travel_by_the_names_this_release_pins(module):
    loaded = importlib.import_module(module)
    for name in ENTRY_POINTS[module]:
        func = getattr(loaded, name)
        assert f"{func.__module__}.{func.__qualname__}" == f"{module}.{name}"
        assert pickle.loads(pickle.dumps(func)) is func  # by reference, as torch's RPC pickler sends it


def test_a_name_of_the_flat_tree_does_not_resolve_in_a_fresh_interpreter():
    # What a member of the release before the layered tree would send for a service call.
    old = pickle.dumps(("machinlike.distributed._calls", "_call_service"))
    code = (
        "import importlib, pickle, sys\n"
        f"module, name = pickle.loads({old!r})\n"
        "try:\n"
        "    getattr(importlib.import_module(module), name)\n"
        "except AttributeError as err:\n"
        "    print('refused:', err)\n"
        "    sys.exit(0)\n"
        "sys.exit('the old name still resolves')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused" in done.stdout
