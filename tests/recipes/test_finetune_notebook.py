"""recipes/deepseek_finetune.ipynb runs top to bottom headless (its code cells, in order, in one namespace, in a
temporary directory) and does what it says: the loss falls, the fine-tuned model answers the training prompts,
and the merged, saved and reloaded model gives the same logits and the same answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_finetune.ipynb"


@pytest.fixture(scope="module")
def namespace(tmp_path_factory) -> dict:
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] for c in cells), "commit the notebook without outputs"
    namespace: dict = {"__name__": "__main__"}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("notebook"))
        for i, cell in enumerate(cells):
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name} code cell {i}", "exec"), namespace)
        namespace["cwd"] = Path.cwd()
    return namespace


def test_the_loss_falls_on_response_tokens(namespace):
    losses = namespace["losses"]
    assert len(losses) == namespace["STEPS"] and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.3 * losses[0], (losses[0], losses[-10:])
    assert (namespace["cwd"] / namespace["WORK_DIR"] / "loss.png").stat().st_size > 1000  # the plot was drawn
    mask = namespace["data"]["loss_mask"]
    assert 0 < mask.mean() < 0.5  # prompts and padding are masked out of the loss


def test_fine_tuning_changed_the_answers(namespace):
    expected = {e["prompt"]: e["response"] for e in namespace["examples"]}
    prompts, before, after = namespace["SAMPLE_PROMPTS"], namespace["before"], namespace["after"]
    right_after = sum(a == expected[p] for p, a in zip(prompts, after))
    assert sum(b == expected[p] for p, b in zip(prompts, before)) == 0
    assert right_after >= len(prompts) // 2, list(zip(prompts, after))


def test_the_merged_checkpoint_reloads_and_generates(namespace):
    merged_dir = namespace["cwd"] / namespace["MERGED_DIR"]
    assert (merged_dir / "config.json").exists() and list(merged_dir.glob("*.safetensors"))
    assert not [p for p in json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"]
                if "lora" in p]
    np.testing.assert_allclose(namespace["logits_reloaded"], namespace["logits_before_save"], rtol=1e-6, atol=1e-6)
    assert namespace["reloaded_answers"] == namespace["after"]
