"""The README is part of the product: its commands must be the ones CI runs, and its code must run."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    # .ci/run extracts the command from the README with this same pattern; it must find exactly one.
    out = subprocess.run(
        ["sed", "-n", r"s/^    \(python3 -m venv .venv && .venv\/bin\/pip install .*pytest.*\)$/\1/p", "README.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert len(out) == 1, out
    assert out[0].endswith("python -m pytest -q")


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README should show code"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
