"""The GPU benchmarks on a machine without one: each says "no GPU" and exits 0 (a lent GPU
comes for minutes: a script that fails to import there wastes them), and the timeline's
stamps cover every step of an echo (its ``--device cpu`` run: the same lane, CPU tensors),
with its experiments' changes applied too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("gpu.py", "gpu_breakdown.py", "gpu_floor.py", "gpu_timeline.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: benchmarks/gpu_all.sh runs these")


def _run(args, timeout):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT})
    return proc.returncode, proc.stdout + proc.stderr


def test_each_gpu_benchmark_says_no_gpu_and_exits_zero():
    # One interpreter for the four (each imports torch): as `python benchmarks/X.py` runs them.
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r})\n"
            f"for name in {SCRIPTS!r}:\n"
            f"    sys.argv = [name]\n"
            f"    try:\n"
            f"        runpy.run_path({os.path.join(ROOT, 'benchmarks')!r} + '/' + name, run_name='__main__')\n"
            f"    except SystemExit as stop:\n"
            f"        assert stop.code in (0, None), (name, stop.code)\n")
    rc, out = _run(["-c", code], 120)
    assert rc == 0, out[-3000:]
    assert out.count("no GPU") == len(SCRIPTS), out[-3000:]


@pytest.mark.parametrize("variants", [[], ["inline-release", "no-settle"]])
def test_the_timeline_stamps_every_step_of_an_echo(variants):
    rc, out = _run([os.path.join("benchmarks", "gpu_timeline.py"), "--device", "cpu", "--repeats", "30",
                    *(arg for v in variants for arg in ("--variant", v))], 150)
    assert rc == 0, out[-3000:]
    assert ("variants " + ", ".join(variants) in out) == bool(variants), out[-3000:]
    found = re.search(r"over 30 \((\d+) with every step stamped\)", out)
    assert found is not None and int(found.group(1)) >= 20, out[-3000:]
    assert "caller: order its stream, return" in out and "sum of the medians" in out


def test_the_churns_driver_figure_is_this_pids_line_of_nvidia_smi(tmp_path, monkeypatch):
    # gpu.py's churn reports the server's memory as the driver lists it per process.
    import runpy

    driver_mib = runpy.run_path(os.path.join(ROOT, "benchmarks", "gpu.py"))["driver_mib"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho '12, 900'\necho '{os.getpid()}, 1234'\necho '77, [N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert driver_mib() == 1234 and driver_mib(12) == 900
    assert driver_mib(1) is None and driver_mib(77) is None  # (not listed; listed without a figure)
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert driver_mib() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert driver_mib() is None  # no nvidia-smi at all


def test_the_one_command_for_a_lent_gpu_parses_and_says_no_gpu_here(tmp_path):
    proc = subprocess.run(["bash", os.path.join("benchmarks", "gpu_all.sh"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0 and "no GPU" in proc.stdout, proc.stdout + proc.stderr
