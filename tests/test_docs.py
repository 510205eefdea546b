"""The documentation: the Sphinx site builds with warnings as errors (once, in a
module fixture), the API reference covers every public name and lists every top-level
re-export, the Examples page lists every example program, the troubleshooting page quotes
only messages the code still says, and every tutorial program runs.

How the tutorials stay true: every Python code block of ``docs/tutorials`` is a
``literalinclude`` of part of a complete program in ``docs/tutorials/code/`` (checked
below: no inline Python blocks), the build fails when an include marker is missing, and
this module runs every program:

* programs that start processes with ``machinlike.launch`` (or none) are imported here and
  their ``main()`` is called (what ``python program.py`` calls): their ranks start from this
  session's warm forkserver, about a second each, where a fresh interpreter would spend
  several seconds importing torch twice;
* ``test_with_worlds.py`` is a pytest module and runs under pytest in a subprocess, as
  the tutorial tells users to run it;
* ``multihost_train.py`` also runs as two separate interpreters given the environment
  torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of
  an agent store this test hosts on a free port).

Shell blocks (torchrun and SLURM command lines for a cluster) are not executed.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import _background
import machinlike

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE = DOCS / "tutorials" / "code"

# Programs run in this process, in the order of the tutorials.
IN_PROCESS = ["quickstart", "rpc_services", "elastic_world", "collective_ddp", "param_servers", "inference",
              "pickling_tour", "pool_tour", "placement", "multihost_train", "clusters", "watching"]


# ----------------------------------------------------------------------------- the build
def _inventory(path: Path) -> set:
    """Object names of a Sphinx ``objects.inv`` (version 2: four text lines, then zlib)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    names = set()
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        match = re.match(r"(.+?)\s+py:\w+\s+-?\d+\s", line)
        if match:
            names.add(match.group(1))
    return names


def _public_modules() -> list:
    names = ["machinlike"]
    for info in pkgutil.walk_packages(machinlike.__path__, "machinlike."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts):
            continue
        names.append(info.name)
    return names


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module: (the finished sphinx-build, its output folder)."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed: pip install -e '.[docs]' to build the docs")
    # In a session the build runs beside the suite from the start (conftest, _background).
    result = _background.outcome("sphinx", 150)
    folder = _background.folder_of("sphinx")
    if result is None or folder is None:  # not started beside the suite: build it here
        out = tmp_path_factory.mktemp("docs") / "html"
        return subprocess.run(_background.sphinx_argv(out), cwd=ROOT, env=_background.checkout_env(),
                              capture_output=True, text=True, timeout=150), out
    return result, folder / "html"


def test_sphinx_build_has_no_warnings(site):
    result, _ = site
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stderr[-6000:]}"


def test_api_reference_documents_every_public_name(site):
    _, out = site
    documented = _inventory(out / "objects.inv")
    modules = _public_modules()
    missing = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            if f"{module_name}.{name}" in documented:
                continue
            # A re-export (machinlike.World, machinlike.server.grad.PushPullGradServer) is
            # documented once, where another public module exports the same object.
            obj = getattr(module, name)
            if not str(getattr(obj, "__module__", "")).startswith("machinlike"):
                continue  # another library's (machinlike.get_context is multiprocessing's)
            elsewhere = [m for m in modules if f"{m}.{name}" in documented
                         and getattr(importlib.import_module(m), name, None) is obj]
            if not elsewhere:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names missing from the API reference: {missing}"


def test_reference_index_lists_every_top_level_name():
    table = (DOCS / "api" / "index.rst").read_text()
    unlisted = [name for name in machinlike.__all__ if f"``{name}``" not in table]
    assert not unlisted, f"top-level re-exports missing from the table of docs/api/index.rst: {unlisted}"


def test_examples_page_lists_every_example():
    page = (DOCS / "examples.rst").read_text()
    programs = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
    unlisted = [name for name in programs if f"``examples/{name}``" not in page]
    assert not unlisted, f"examples missing from docs/examples.rst: {unlisted}"


def _package_text() -> str:
    """Every source file of the package, its string literals that Python joins
    (``"a " f"b"`` across lines) joined here too, so a message reads as it is raised."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "machinlike").rglob("*.py")))
    return re.sub(r"\"\s*\n\s*[frbFRB]*\"", "", text).replace('\\"', '"')


def test_troubleshooting_quotes_what_the_code_says():
    # Each line of the page's message blocks is "Type: message", "..." standing for the
    # parts made at run time: every literal piece between them (and between the ": " that
    # join a message's parts) must still be in the package's source
    # and the type must exist, so that the page cannot drift from the errors it explains.
    import builtins

    import machinlike.exception

    page = (DOCS / "tutorials" / "troubleshooting.rst").read_text()
    blocks = re.findall(r"\.\. code-block:: text\n\n((?:   .*\n)+)", page)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    assert len(lines) >= 10, "the page's message blocks were not found"
    source = _package_text()
    missing = []
    for line in lines:
        typed = re.match(r"(\w+): (?:\[Errno \d+\] )?(.*)", line)
        if typed and typed.group(1).endswith("Error"):
            assert hasattr(builtins, typed.group(1)) or hasattr(machinlike.exception, typed.group(1)), line
            line = typed.group(2)
        # (": " too: a message is often a caller's prefix and a detail made elsewhere)
        pieces = [piece.strip(" :;,.()") for piece in re.split(r"\.\.\.|: ", line)]
        missing += [f"{piece!r} (of {line!r})" for piece in pieces if piece and piece not in source]
    assert not missing, "quoted in troubleshooting.rst but not said by the code: " + "; ".join(missing)


def test_tutorial_python_comes_from_executed_programs():
    inline = re.compile(r"^\s*\.\. (code-block|code|sourcecode)::\s*(python|py|pycon|ipython)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (DOCS / "tutorials").glob("*.rst") if inline.search(p.read_text())]
    assert not offenders, f"inline Python blocks (use literalinclude of docs/tutorials/code/*.py): {offenders}"
    included = set()
    for page in DOCS.rglob("*.rst"):
        included.update(re.findall(r"literalinclude::\s*\S*code/(\w+)\.py", page.read_text()))
    programs = {p.stem for p in CODE.glob("*.py")}
    assert programs == included, f"programs not shown: {programs - included}; shown but missing: {included - programs}"
    assert programs == set(IN_PROCESS) | {"test_with_worlds"}, "a program this module does not run"


# -------------------------------------------------------------------------- the programs
@pytest.mark.parametrize("name", IN_PROCESS)
def test_tutorial_program_runs(name, monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # run the plain, local way
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(CODE))  # the ranks inherit sys.path and import it too
    # Ray's workers are not this process's children: they find the program through the
    # environment of the local Ray that the program starts (a cluster's image would hold it).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(CODE), str(ROOT), os.environ.get("PYTHONPATH")])))
    sys.modules.pop(name, None)
    try:
        program = importlib.import_module(name)
        if hasattr(program, "LOGDIR"):  # a user keeps it for TensorBoard; the suite leaves nothing in /tmp
            monkeypatch.setattr(program, "LOGDIR", str(tmp_path / "logs"))
        program.main()
    finally:
        sys.modules.pop(name, None)


def test_testing_tutorial_passes_under_pytest():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CODE / "test_with_worlds.py")],
        cwd=ROOT, env=_background.checkout_env(), capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b5 passed\b", result.stdout), result.stdout[-2000:]


def test_multihost_program_runs_as_torchrun_workers():
    import torch.distributed as dist

    # torchrun's agent hosts the store and every worker is its client; so does this test,
    # on a port the kernel picks (no race for a free port).
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    env = {**_background.checkout_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    ranks = [subprocess.Popen([sys.executable, str(CODE / "multihost_train.py")], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait(10)
        del store
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-4000:]
        assert "'size': 2.0" in out and "'interface': 'lo'" in out, out
