"""What importing machinlike does to a fresh interpreter, for the tests that forbid side effects.

    fresh interpreter: torch ─► snapshot A ─► dill, torch.multiprocessing ─► snapshot B
        ─► machinlike's pickling modules ─► snapshot C ─► every public module ─► snapshot D
        ─► machin's shim: install, imports through it, uninstall (where machin is installed)

Those tests each need an interpreter that has not imported machinlike yet (this one has),
and every start imports torch, which takes seconds; so one probe, run at most once per
test session, answers all of them. The windows nest, each as wide as the test that reads
it had on its own: ``tests/test_exports.py`` compares A with D, ``tests/test_pickle.py``
B with C; ``tests/test_machin_compat.py`` reads the shim's part, which runs last (it
imports machin, and machin imports gym).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

__all__ = ["import_report"]

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import copyreg, importlib, importlib.util, json, multiprocessing, pickle, sys, threading
import torch, torch.distributed as dist

exports_before = dict(copyreg.dispatch_table)  # torch's own registrations are its
import dill, torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler

def snapshot():
    return {
        "strategy": tmp.get_sharing_strategy(),
        "copyreg": sorted(map(repr, copyreg.dispatch_table.items())),
        "forking": sorted(map(repr, ForkingPickler._extra_reducers.items())),
        "dill": repr(sorted(dill.settings.items())),
        "py_dispatch": sorted(map(repr, pickle._Pickler.dispatch.items())),
        "start_method": multiprocessing.get_start_method(allow_none=True),
    }

before = snapshot()
import machinlike.pickle, machinlike.queue, machinlike.process, machinlike.thread, machinlike.event
after = snapshot()
report = {"pickle_settings_changed": [k for k in before if before[k] != after[k]]}
for path in json.loads(sys.argv[1]):
    importlib.import_module(path)
now = dict(copyreg.dispatch_table)
report.update(
    threads=[repr(t) for t in threading.enumerate()],
    children=[repr(p) for p in multiprocessing.active_children()],
    start_method=multiprocessing.get_start_method(allow_none=True),
    dist_initialized=dist.is_initialized(),
    copyreg_changed=sorted(repr(k) for k in set(now) | set(exports_before) if now.get(k) != exports_before.get(k)),
    ray_imported="ray" in sys.modules,
)

def machin_shim():
    import machinlike, machinlike.compat.machin as shim
    assert "machin" not in sys.modules and not shim.is_installed()  # importing does nothing
    shim.install(); shim.install()
    import machin.parallel.server as server, machin.parallel as parallel
    import machinlike.server
    assert server is machinlike.server and parallel is machinlike
    assert machinlike.server.__spec__.name == "machinlike.server"  # its own spec kept
    from machin.parallel.queue import TimeoutError
    from machin.parallel import get_context
    try:
        import machin.parallel.server.param_server
    except ModuleNotFoundError as exc:
        assert "no machinlike counterpart" in str(exc), exc
    else:
        raise AssertionError("an unmapped machin module imported")
    shim.uninstall()
    assert not any(n.startswith("machin.parallel") for n in sys.modules)
    return "clean"

if importlib.util.find_spec("machin") is None:
    report["machin_shim"] = None
else:
    import traceback
    try:
        report["machin_shim"] = machin_shim()
    except BaseException:
        report["machin_shim"] = traceback.format_exc()
print("REPORT " + json.dumps(report), flush=True)
"""


@functools.lru_cache(maxsize=None)
def import_report() -> Dict[str, Any]:
    """The probe's findings (see the module docstring); fails if the probe itself failed."""
    from test_exports import MODULES  # the public modules: that test's list is the one kept up to date

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), json.dumps(MODULES)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    return json.loads(lines[-1][len("REPORT "):])
