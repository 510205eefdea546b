"""The program README.md opens with runs as printed there."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from proc_util import free_port

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_the_first_program_runs_and_prints_what_its_comments_say(tmp_path):
    text = README.read_text()
    section = text[text.index("## A first program"):]
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "first_program.py"
    script.write_text(program)
    # The program takes the default port (29500) as a user's would; here the suite's other
    # tests run beside it, and one of theirs may hold that port: the world gets a free one.
    port = free_port()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={**os.environ, "MASTER_PORT": str(port)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tensor([2., 2.])" in done.stdout
    assert "[0, 1, 4, 9, 16]" in done.stdout
