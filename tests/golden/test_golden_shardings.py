"""The committed sharding dumps (``tests/golden/sharding_<preset>_<rules>.txt``: one small preset per family,
every named rule set, 8 devices) must match what the code resolves now; a change prints the diff.

Regenerate when a change is intended, then review the diff like code; all presets, or only some:

    python tests/golden/dumps.py
    python tests/golden/dumps.py llama3-small qwen3-tiny
"""

import difflib

import pytest

from tests.golden.dumps import MESHES, PRESETS, dump, path


@pytest.mark.parametrize("rules", list(MESHES))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_sharding_dump_matches_golden(preset, rules):
    if not path(preset, rules).exists():
        pytest.fail(f"no golden dump {path(preset, rules)}; write it with `python tests/golden/dumps.py {preset}`")
    expected = path(preset, rules).read_text()
    actual = dump(preset, rules)
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "golden", "now"))
        pytest.fail(f"sharding of {preset} under {rules!r} changed (regenerate with "
                    f"`python tests/golden/dumps.py {preset}` if intended):\n{diff}")
