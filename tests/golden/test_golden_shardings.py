"""The committed sharding dumps must match what the code resolves now; a change prints the diff.
Regenerate with ``python tests/golden/dumps.py`` when a change is intended."""

import difflib

import pytest

from tests.golden.dumps import MESHES, dump, path


@pytest.mark.parametrize("rules", list(MESHES))
def test_sharding_dump_matches_golden(rules):
    expected = path(rules).read_text()
    actual = dump(rules)
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "golden", "now"))
        pytest.fail(f"sharding of the model under {rules!r} changed (regenerate with "
                    f"`python tests/golden/dumps.py` if intended):\n{diff}")
