"""recipes/deepseek_finetune.ipynb runs top to bottom headless (its code cells, in order, in one namespace, in a
temporary directory) and does what it says: the loss falls, the fine-tuned model answers the training prompts,
and the merged, saved and reloaded model gives the same logits and the same answers. A checkpoint that
transformers wrote goes through the same cells (CHECKPOINT_DIR), and its merged output loads in transformers: in CI
one family per distinct path (``CI_FAMILIES``), every family with ``NNX_ZOO_FULL_MATRIX=1``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_finetune.ipynb"


def run_notebook(directory: Path, checkpoint_dir: Path | None = None, **settings) -> dict:
    """Execute the notebook's code cells in ``directory``; ``settings`` replace the first cell's values."""
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] for c in cells), "commit the notebook without outputs"
    namespace: dict = {"__name__": "__main__"}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        if checkpoint_dir is None:
            patch.delenv("CHECKPOINT_DIR", raising=False)
        else:
            patch.setenv("CHECKPOINT_DIR", str(checkpoint_dir))
        for i, cell in enumerate(cells):
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name} code cell {i}", "exec"), namespace)
            if i == 0:
                namespace.update(settings)
        namespace["cwd"] = Path.cwd()
    return namespace


@pytest.fixture(scope="module")
def namespace(tmp_path_factory) -> dict:
    return run_notebook(tmp_path_factory.mktemp("notebook"))


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


def _transformers_checkpoint(family: str, directory: Path):
    """A tiny random transformers model of ``family`` with the notebook's byte vocabulary, saved to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nnx_zoo.train.tokenize import ByteTokenizer
    from tests.models.deepseek.hf_reference import make_hf_model
    from tests.models.dense_reference import make_hf

    vocab = ByteTokenizer.vocab_size
    if family == "llama":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False))
    elif family in MLA_ARCHS:  # MLA; a dense layer, then routed + shared experts
        model = make_hf_model(arch=MLA_ARCHS[family], vocab_size=vocab, max_position_embeddings=256)
    elif family == "deepseek_v4":  # a sliding hash-routed layer, a CSA layer, an HCA layer
        from tests.models.deepseek4.reference import hf_config
        from tests.models.deepseek4.reference import make_hf_model as make_v4

        model = make_v4(hf_config("parts", vocab_size=vocab, max_position_embeddings=256), seed=0)
    elif family == "llama4_text":  # a chunked dense layer, then a NoPE MoE one (top-2, a shared expert)
        from tests.models.llama4.reference import make_hf as make_llama4

        model = make_llama4("maverick", vocab_size=vocab, max_position_embeddings=256, num_hidden_layers=2,
                            no_rope_layers=[1, 0])
    elif family == "gemma3_text":  # a sliding layer (4-token window), then a global one
        from tests.models.gemma.reference import make_gemma3

        model = make_gemma3(vocab_size=vocab, max_position_embeddings=256, num_hidden_layers=2,
                            sliding_window_pattern=2)
    elif family == "gemma4_text":  # sliding, global, then a global one reusing its K/V; per-layer inputs; MoE
        from tests.models.gemma.reference import make_gemma4

        model = make_gemma4(vocab_size=vocab, vocab_size_per_layer_input=vocab, max_position_embeddings=256,
                            num_hidden_layers=3, layer_types=["sliding_attention"] + ["full_attention"] * 2,
                            num_kv_shared_layers=1, hidden_size_per_layer_input=8, enable_moe_block=True,
                            num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    elif family in QWEN_HYBRIDS:  # a linear layer, then a full one (Qwen3-Next's first dense, then MoE)
        from tests.models.qwen3_next.reference import make_hf as make_qwen

        model = make_qwen(QWEN_HYBRIDS[family], vocab_size=vocab, max_position_embeddings=256, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"])
    elif family == "kimi_linear":  # a KDA layer with the dense MLP, then an MLA one (no rope) with the MoE
        from tests.models.kimi_linear.reference import make_hf as make_kimi

        model = make_kimi(vocab_size=vocab, max_position_embeddings=256, num_hidden_layers=2,
                          linear_attn_config={"full_attn_layers": [2], "kda_layers": [1], "num_heads": 2,
                                              "head_dim": 8, "short_conv_kernel_size": 4})
    else:
        model = make_hf(family, vocab_size=vocab, max_position_embeddings=256)
    model.save_pretrained(directory)
    return type(model)


# The Qwen hybrids (tests/models/qwen3_next/reference.py's tiny configs): model_type -> case.
QWEN_HYBRIDS = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


# The families on DeepSeek's parts (tests/models/deepseek/hf_reference.py's tiny configs): model_type -> arch.
MLA_ARCHS = {"deepseek_v2": "v2", "deepseek_v32": "v32", "glm_moe_dsa": "glm5", "mistral4": "mistral4"}


# model_type -> adapted expert stacks. LoRA on the routed experts too for the MoE families (LORA_ON_EXPERTS): one
# adapter per expert (one module path: the stacked layers; GLM-5's MoE layers are two stacks, the one with an indexer
# and the one reusing its top-k; Qwen3.5-MoE's too, its linear and its full layers), merged.
FAMILIES = {"llama": 0, "qwen3_moe": 1, "mixtral": 1, "glm4_moe": 1, "deepseek_v2": 1, "deepseek_v32": 1,
            "glm_moe_dsa": 2, "mistral4": 1, "deepseek_v4": 3, "llama4_text": 1, "minimax_m2": 1,
            "gpt_oss": 2,  # GPT-OSS: both stacks
            "gemma3_text": 0, "gemma4_text": 3, "qwen3_next": 1, "qwen3_5_text": 0, "qwen3_5_moe_text": 2,
            "kimi_linear": 1}
# CI runs one family per distinct path through the notebook (each ~10-40 s of CPU); NNX_ZOO_FULL_MATRIX=1 runs all.
# The representative covers the families after it, which share its layers, attention and MoE kind:
CI_FAMILIES = {
    "llama": (),  # dense GQA + SwiGLU
    # GQA + routed experts (a dense first layer, shared experts): Qwen3-MoE, Mixtral, MiniMax-M2 (every layer MoE),
    # Llama 4 (a shared expert; its chunked attention is local attention, as Gemma 4's sliding window)
    "glm4_moe": ("qwen3_moe", "mixtral", "minimax_m2", "llama4_text"),
    # MLA with the lightning indexer (sparse path) and a layer reusing its top-k, two MoE stacks (the notebook's own
    # run is DeepSeek-V3's MLA): V2 (MLA, softmax router), V3.2 (the indexer), Mistral 4 (MLA, every layer MoE)
    "glm_moe_dsa": ("deepseek_v2", "deepseek_v32", "mistral4"),
    "deepseek_v4": (),  # V4: sliding hash-routed, CSA and HCA layers
    # Local attention: a sliding and a global stack with MoE, K/V sharing: Gemma 3 (sliding and global, dense),
    # GPT-OSS (sliding and full stacks, every layer MoE)
    "gemma4_text": ("gemma3_text", "gpt_oss"),
    # Gated DeltaNet linear layers and full ones, two MoE stacks: Qwen3-Next (the same mixers), Qwen3.5 (dense)
    "qwen3_5_moe_text": ("qwen3_next", "qwen3_5_text"),
    "kimi_linear": (),  # KDA linear layers, MLA without rope
}
FULL = os.environ.get("NNX_ZOO_FULL_MATRIX") == "1"


def test_ci_families_cover_every_family():
    covered = [f for rep, rest in CI_FAMILIES.items() for f in (rep, *rest)]
    assert sorted(covered) == sorted(FAMILIES), "each family is run or covered by exactly one representative"


@pytest.mark.parametrize("family, adapted_experts",
                         [(f, n) for f, n in FAMILIES.items() if FULL or f in CI_FAMILIES])
def test_a_transformers_checkpoint_goes_through_load_lora_train_merge_save(tmp_path, family, adapted_experts):
    import torch

    from nnx_zoo import AutoModelForCausalLM
    from tests.models.dense_reference import rel_err

    base = tmp_path / family
    hf_cls = _transformers_checkpoint(family, base)
    ns = run_notebook(tmp_path, base, STEPS=3, BATCH=4, LORA_RANK=4, LORA_ALPHA=8, LORA_ON_EXPERTS=adapted_experts > 0)
    assert type(ns["model"]) is AutoModelForCausalLM.model_class(family)
    if family == "llama":
        assert len(ns["adapted"]) == 7  # the family's default: q/k/v/o and gate/up/down of the one layer
    assert sum(path.endswith("mlp/experts") for path in ns["adapted"]) == adapted_experts, ns["adapted"]
    assert len(ns["losses"]) == 3 and all(np.isfinite(ns["losses"]))
    if family in ("deepseek_v32", "glm_moe_dsa"):  # the probe is longer than the indexer's top-k: sparse path ran
        assert 0 < ns["model"].config.index_topk < np.array(ns["probe"]).shape[1]
    # The merged checkpoint is a plain one of the family: transformers loads it and computes the notebook's logits,
    # which training changed (the adapters were trained and merged, not dropped).
    merged = hf_cls.from_pretrained(tmp_path / ns["MERGED_DIR"], dtype=torch.float32).eval()
    original = hf_cls.from_pretrained(base, dtype=torch.float32).eval()
    probe = torch.as_tensor(np.array(ns["probe"]), dtype=torch.long)
    with torch.no_grad():
        merged_logits, original_logits = merged(probe).logits.numpy(), original(probe).logits.numpy()
    # Relative to the largest logit, as the parity tests measure: per element, the near-zero logits of these
    # 0.3-std random weights differ by float32 rounding alone (Mixtral: 3e-5 absolute at 3.5 max, 8e-6 relative).
    assert rel_err(ns["logits_before_save"], merged_logits) < 1e-5
    assert np.abs(merged_logits - original_logits).max() > 1e-3
