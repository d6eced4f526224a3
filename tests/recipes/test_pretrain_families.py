"""recipes/pretrain.py trains every family: a preset of any family by name, or continued pretraining from an HF
checkpoint (ours or one transformers wrote). The first step's loss of a --from-pretrained run equals transformers'
loss of that checkpoint on the same batch, so the run really starts from the checkpoint's weights."""

import argparse
import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pretrain", ROOT / "recipes" / "pretrain.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)

VOCAB, SEQ, BATCH = 256, 16, 8
SHORT = ["--batch", str(BATCH), "--seq-len", str(SEQ), "--no-progress", "--warmup-steps", "1", "--peak-flops", "1e11"]
TINY = ["--model.num_hidden_layers", "1", "--model.vocab_size", str(VOCAB)]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_batch() -> dict[str, np.ndarray]:
    """The recipe's first synthetic batch (its defaults: seed 0, ids below 256)."""
    from nnx_zoo.train.data import DataConfig, make_iterator

    return next(make_iterator(DataConfig(seq_len=SEQ, global_batch=BATCH, seed=0, synthetic_vocab=VOCAB), VOCAB))


def transformers_loss(directory: Path, batch: dict[str, np.ndarray]) -> float:
    """transformers' mean next-token cross-entropy of the checkpoint on ``batch`` (PyTorch, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(batch["input_ids"], dtype=torch.long)).logits
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               torch.as_tensor(batch["targets"], dtype=torch.long).reshape(-1),
                                               reduction="none").numpy()
    mask = batch["loss_mask"].reshape(-1).astype(np.float64)
    return float((losses * mask).sum() / mask.sum())


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> tuple[Path, str]:
    """llama3-tiny, two steps on the recipe's default mesh (FSDP over all 8 devices): its run directory and what it
    printed to stderr. Trained once for the tests that read it (a recipe run is ~10 s of CPU)."""
    run_dir = tmp_path_factory.mktemp("llama3") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert recipe.main(["--model", "llama3-tiny", *TINY, *SHORT, "--steps", "2", "--run-dir", str(run_dir)]) == 0
    return run_dir, err.getvalue()


def test_a_llama3_preset_trains_and_resumes(llama_run, capsys):
    run_dir, err = llama_run
    assert [r["step"] for r in records(run_dir)] == [1, 2]
    assert not [k for k in records(run_dir)[0] if k.startswith(("mtp", "expert", "aux"))]  # a dense model
    assert "llama3-tiny (Llama3)" in err
    # Resuming restores the checkpoint and checks the run's definition (training on after a resume is the same
    # code path for every family: tests/recipes/test_pretrain_recipe.py).
    assert recipe.main(["--model", "llama3-tiny", *TINY, *SHORT, "--steps", "2", "--run-dir", str(run_dir)]) == 0
    assert "this run already finished: its checkpoint is at step 2" in capsys.readouterr().out
    assert [r["step"] for r in records(run_dir)] == [1, 2]
    # The stored run definition is the Llama config with its overrides: a resume with another preset is refused.
    code = recipe.main(["--model", "qwen3-tiny", *TINY, *SHORT, "--steps", "2", "--run-dir", str(run_dir)])
    assert code == 2 and "model_type" in capsys.readouterr().err


@pytest.mark.parametrize(("preset", "layers"), [
    ("qwen3-moe-tiny", ["--model.num_hidden_layers", "2", "--model.mlp_only_layers", "[0]"]),  # dense, then MoE
    ("mixtral-tiny", []),
    # Sigmoid routing with a selection bias: the Switch loss on the softmax of its logits, and bias balancing too.
    ("minimax-m2-tiny", ["--routing-bias-rate", "0.01"]),
    ("gpt-oss-tiny", ["--model.num_hidden_layers", "2", "--model.sliding_window", "4"]),  # sliding, full; sinks
])
def test_an_moe_preset_trains_with_the_switch_aux_loss(tmp_path, capsys, preset, layers):
    """Qwen3-MoE, Mixtral, MiniMax-M2 and GPT-OSS train with the recipe; ``--model.output_router_logits true`` adds the
    Switch load-balancing loss (times ``router_aux_loss_coef``), logged as ``aux_loss``."""
    run_dir = tmp_path / "run"
    args = ["--model", preset, *TINY, *layers, *SHORT, "--steps", "2", "--moe-impl", "dense",
            "--model.output_router_logits", "true", "--run-dir", str(run_dir)]
    assert recipe.main(args) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # About coef * k for a near-uniform router (a fresh model's): 0.001 * 2 for Qwen3-MoE and MiniMax-M2, 0.02 * 2
    # for Mixtral, 0.9 * 2 for GPT-OSS (its release's coefficient).
    coef = {"qwen3-moe-tiny": 0.001, "minimax-m2-tiny": 0.001, "mixtral-tiny": 0.02, "gpt-oss-tiny": 0.9}[preset]
    assert all(0.9 * 2 * coef < r["aux_loss"] < 1.5 * 2 * coef for r in rows), rows
    assert f"{preset} (" in capsys.readouterr().err


def test_glm_trains_with_aux_loss_free_balancing(tmp_path, capsys):
    """GLM-4.5 (a dense layer, then an MoE layer routed by sigmoid + selection bias, shared experts) trains with
    the recipe; ``--routing-bias-rate`` moves the bias after every step (``update_routing_bias``: the arithmetic is
    tests/models/test_moe_exact.py's) and the expert balance is logged. No aux loss: transformers has none."""
    run_dir = tmp_path / "run"
    args = ["--model", "glm4.5-tiny", *TINY, "--model.num_hidden_layers", "2", *SHORT, "--steps", "2",
            "--moe-impl", "dense", "--routing-bias-rate", "0.01", "--run-dir", str(run_dir)]
    assert recipe.main(args) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["expert_max_over_mean"] >= 1.0 for r in rows), rows
    assert "aux_loss" not in rows[0] and "glm4.5-tiny (Glm4MoE)" in capsys.readouterr().err


# CI runs one family per distinct set of parts (each run ~10-20 s of CPU; NNX_ZOO_FULL_MATRIX=1 runs all): GLM-5 (MLA
# with the indexer, MoE, MTP) stands for Mistral 4 (MLA, every layer MoE), Qwen3-Next for Qwen3.5 dense and MoE (the
# same mixers, separate projections); Llama 4's chunked and NoPE layers are local attention, as the Gemma runs below.
# Each of those four also trains in CI elsewhere (tests/models/test_dense_sharding.py, deepseek/test_mesh_matrix.py),
# and the recipe is the same code for every family (its per-family part, training_extras, is tested below).
FULL = os.environ.get("NNX_ZOO_FULL_MATRIX") == "1"
FAMILY_RUNS = [
    # GLM-5: layer 0 dense with an indexer, layer 1 MoE reusing its top-k (4 of 16 keys: sparse), an MTP head; the
    # indexer's sparse stage (its KL) and aux-loss-free balancing of the sigmoid + bias router.
    ("glm5-tiny", ["--model.num_hidden_layers", "2", "--model.index_topk", "4", "--indexer-stage", "sparse",
                   "--routing-bias-rate", "0.01"]),
    # Mistral 4: every layer MoE, its softmax group-limited router (no bias to balance), YaRN, the query scale.
    ("mistral4-tiny", []),
    # Llama 4: a chunked dense layer (chunks of 4 in the 16-token sequences), a NoPE MoE one (temperature tuning).
    ("llama4-tiny", ["--model.num_hidden_layers", "2", "--model.no_rope_layers", "[1, 0]",
                     "--model.attention_chunk_size", "4"]),
    # Qwen3-Next: a linear (gated delta net) MoE layer, then a full (gated attention) one; shared experts gated; its
    # MTP depth (one full MoE layer) on, so the loss adds the MTP term.
    ("qwen3-next-tiny", ["--model.num_hidden_layers", "2", "--model.mtp_num_hidden_layers", "1"]),
    # Qwen3.5, dense and MoE: Qwen3-Next's layers with separate projections (a linear layer, then a full one).
    ("qwen3.5-tiny", ["--model.num_hidden_layers", "2"]),
    ("qwen3.5-moe-tiny", ["--model.num_hidden_layers", "2"]),
    # Kimi Linear: a KDA (per-channel decay) dense layer, then an MLA (no rope) one with the sigmoid + bias MoE.
    ("kimi-linear-tiny", ["--model.num_hidden_layers", "2"]),
]
if not FULL:
    FAMILY_RUNS = [run for run in FAMILY_RUNS if run[0] in ("glm5-tiny", "qwen3-next-tiny", "kimi-linear-tiny")]


@pytest.mark.parametrize(("preset", "args"), FAMILY_RUNS)
def test_the_families_on_deepseeks_parts_train(tmp_path, capsys, preset, args):
    run_dir = tmp_path / "run"
    assert recipe.main(["--model", preset, *TINY, *args, *SHORT, "--steps", "2", "--moe-impl", "dense",
                        "--run-dir", str(run_dir)]) == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows), rows
    err = capsys.readouterr().err
    assert f"{preset} (" in err
    if preset.startswith("glm5"):
        assert all(r["indexer_loss"] > 0 and r["expert_max_over_mean"] >= 1.0 for r in rows), rows
        assert "indexer sparse stage: each query attends to its top 4 keys" in err
        # Another indexer stage in this run directory: the first message says to export and start a new run (no
        # flag resumes it: the optimizer state covers other parameters), before any settings difference.
        stage = args.index("--indexer-stage") + 1
        other = [*args[:stage], "dense_warmup", *args[stage + 1:]]
        assert recipe.main(["--model", preset, *TINY, *other, *SHORT, "--steps", "2", "--moe-impl", "dense",
                            "--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert f"`python recipes/export_hf.py {run_dir} exports/run`, then rerun this command with " \
               f"--from-pretrained exports/run in place of its --model" in err and "--override-settings" not in err
    if preset.startswith("qwen3-next"):
        assert all(r["mtp1"] > 0 for r in rows), rows  # the MTP depth's loss, in the trained loss


def test_continued_pretraining_from_our_qwen3_checkpoint_starts_from_its_weights(tmp_path):
    from nnx_zoo import Qwen3, Qwen3Config

    checkpoint = tmp_path / "qwen3"
    config = Qwen3Config.preset("qwen3-tiny", num_hidden_layers=1, vocab_size=VOCAB, initializer_range=0.2)
    Qwen3.create(config, seed=7).save_pretrained(checkpoint)
    run_dir = tmp_path / "run"
    assert recipe.main(["--from-pretrained", str(checkpoint), *SHORT, "--steps", "1", "--shard-mode", "explicit",
                        "--run-dir", str(run_dir)]) == 0
    expected = transformers_loss(checkpoint, first_batch())
    np.testing.assert_allclose(records(run_dir)[0]["loss"], expected, rtol=2e-5)
    assert expected > 1.2 * np.log(VOCAB)  # far from a fresh random model's ~ln(vocab): the weights were loaded


def test_continued_pretraining_from_a_transformers_llama_checkpoint(tmp_path, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    checkpoint = tmp_path / "hf-llama"
    LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
    )).save_pretrained(checkpoint)
    run_dir = tmp_path / "run"
    assert recipe.main(["--from-pretrained", str(checkpoint), *SHORT, "--steps", "1",
                        "--run-dir", str(run_dir)]) == 0
    assert "hf-llama (Llama3)" in capsys.readouterr().err
    np.testing.assert_allclose(records(run_dir)[0]["loss"], transformers_loss(checkpoint, first_batch()), rtol=2e-5)


def _gemma3_checkpoint(directory: Path) -> None:
    """transformers' Gemma 3: a sliding layer (4-token window) then a global one, tied embedding."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, sliding_window_pattern=2, max_position_embeddings=64,
        initializer_range=0.2)).save_pretrained(directory)


def _gemma4_checkpoint(directory: Path) -> None:
    """transformers' Gemma 4: a sliding layer (4-token window), a global one, then a global one reusing its K/V;
    per-layer inputs, the MoE block, tied embedding."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "full_attention"], num_kv_shared_layers=1,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=64,
        initializer_range=0.2)).save_pretrained(directory)


# Families with local attention layers: a transformers checkpoint (a maker per model_type) trained on by the recipe.
LOCAL_ATTENTION_CHECKPOINTS = {
    "gemma3_text": ("Gemma3", _gemma3_checkpoint),
    "gemma4_text": ("Gemma4", _gemma4_checkpoint),
}


@pytest.mark.parametrize("model_type", list(LOCAL_ATTENTION_CHECKPOINTS))
def test_the_local_attention_families_train_from_a_transformers_checkpoint(tmp_path, capsys, model_type):
    """Two steps from the checkpoint: the first step's loss is transformers' on the same batch (windows shorter than
    the sequence), and the run trains on."""
    import torch

    family, make = LOCAL_ATTENTION_CHECKPOINTS[model_type]
    torch.manual_seed(0)
    checkpoint = tmp_path / model_type
    make(checkpoint)
    run_dir = tmp_path / "run"
    assert recipe.main(["--from-pretrained", str(checkpoint), *SHORT, "--steps", "2", "--run-dir", str(run_dir)]) == 0
    assert f"{model_type} ({family})" in capsys.readouterr().err
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and np.isfinite(rows[1]["loss"])
    np.testing.assert_allclose(rows[0]["loss"], transformers_loss(checkpoint, first_batch()), rtol=2e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt9"], "unknown preset 'gpt9'; presets are DeepSeekV3: "),
        (["--model", "llama3-tiny", "--model.num_nextn_predict_layers", "1"],
         "--model.num_nextn_predict_layers: not a field of Llama3Config (the config of llama3-tiny)"),
        (["--model", "qwen3-tiny", "--from-pretrained", "x"], "give --model (a preset) or --from-pretrained"),
        (["--model", "qwen3-tiny", "--seq-len", "100000"], "--seq-len 100000 exceeds the model's"),
    ],
)
def test_bad_input_gets_one_clear_error(tmp_path, capsys, args, message):
    assert recipe.main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if "unknown preset" in message:
        for preset in ("deepseek3-tiny", "llama3.1-8b", "qwen3-0.6b"):
            assert preset in err


def test_from_pretrained_on_a_non_checkpoint_says_what_a_checkpoint_is(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert recipe.main(["--from-pretrained", str(empty)]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert recipe.main(["--from-pretrained", str(tmp_path / "weights.bin")]) == 2
    assert "not a directory" in capsys.readouterr().err
    # config.json of a family we do not have; then one of ours without weights: nothing is trained either way.
    (empty / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert recipe.main(["--from-pretrained", str(empty)]) == 2
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err
    from nnx_zoo import Llama3Config

    (empty / "config.json").write_text(json.dumps(Llama3Config.preset("llama3-tiny").to_hf_dict()))
    assert recipe.main(["--from-pretrained", str(empty), *SHORT, "--steps", "1",
                        "--run-dir", str(tmp_path / "run")]) == 2
    assert "safetensors" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_training_extras_follow_what_the_config_has():
    from nnx_zoo import AutoConfig, AutoModelForCausalLM

    def extras(preset: str, mtp_weight=None, routing_bias_rate=None, **overrides) -> tuple:
        config = AutoConfig.preset(preset, **overrides)
        args = argparse.Namespace(mtp_weight=mtp_weight, routing_bias_rate=routing_bias_rate)  # None: not given
        e = recipe.training_extras(config, AutoModelForCausalLM.model_class(config), args)
        return e.mtp_weight, e.routing_bias_rate, e.model_kwargs

    assert extras("llama3-tiny") == extras("qwen3-tiny") == (0.0, 0.0, ())
    assert extras("deepseek3-tiny", num_nextn_predict_layers=1) == (
        0.3, 1e-3, (("with_mtp", True), ("with_expert_load", True)))
    assert extras("deepseek3-tiny", num_nextn_predict_layers=0) == (0.0, 1e-3, (("with_expert_load", True),))
    # GLM-4.5's and MiniMax-M2's routers have a selection bias to balance; softmax top-k (Qwen3-MoE, Mixtral) has none.
    assert extras("glm4.5-tiny") == extras("glm4.5-air") == (0.0, 1e-3, (("with_expert_load", True),))  # no MTP run
    assert extras("minimax-m2-tiny") == extras("minimax-m2") == (0.0, 1e-3, (("with_expert_load", True),))
    assert extras("qwen3-moe-tiny")[:2] == extras("mixtral-tiny")[:2] == (0.0, 0.0)
    # All layers dense: no experts to balance.
    assert extras("deepseek3-tiny", num_hidden_layers=2, first_k_dense_replace=2, num_nextn_predict_layers=0)[:2] \
        == (0.0, 0.0)
    # Given, a weight or rate is used where the model has the thing, refused (not dropped) where it has not.
    assert extras("glm4.5-tiny", routing_bias_rate=0.01)[1] == 0.01
    assert extras("deepseek3-tiny", mtp_weight=0.1, num_nextn_predict_layers=1)[0] == 0.1
    assert extras("qwen3-moe-tiny", mtp_weight=0, routing_bias_rate=0)[:2] == (0.0, 0.0)  # off is always fine
    # Qwen3-Next / Qwen3.5: MTP where the config builds it (the releases' presets do), by mtp_num_hidden_layers.
    assert extras("qwen3-next-tiny")[:2] == (0.0, 0.0)
    assert extras("qwen3-next-tiny", mtp_num_hidden_layers=1) == extras("qwen3.5-9b") == (
        0.3, 0.0, (("with_mtp", True),))
    for preset, flag, why in [("qwen3-moe-tiny", "routing_bias_rate", "routes without a selection bias"),
                              ("llama3-tiny", "routing_bias_rate", "has no MoE layers"),
                              ("mixtral-tiny", "mtp_weight", "has no multi-token-prediction heads")]:
        with pytest.raises(ValueError, match=why):
            extras(preset, **{flag: 0.01})


def test_help_lists_every_family_preset_and_plan_works_for_a_dense_family(capsys):
    from nnx_zoo.models.registry import preset_names

    with pytest.raises(SystemExit):
        recipe.main(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse may wrap a name at a hyphen
    for name in [n for names in preset_names().values() for n in names]:
        assert name in text, name
    assert "--model.rope_scaling" in text and "--moe-impl" not in text  # llama3-tiny's fields by default
    assert recipe.main(["--model", "llama3.1-405b", "--mesh", "fsdp=64,tensor=8", "--plan"]) == 0
    assert "405" in capsys.readouterr().out


def test_a_mesh_that_does_not_divide_needs_allow_partial_and_then_trains_the_same(tmp_path, capsys, llama_run):
    """llama3-tiny's 2 key/value heads do not divide over tensor=4: strict placement refuses the mesh and names
    --allow-partial (so does --plan); with it, the k/v projections are replicated over 'tensor', that fallback is
    printed at start, and the losses equal those of FSDP 8, where everything divides (and which equals one device:
    tests/models/test_dense_sharding.py)."""
    args = ["--model", "llama3-tiny", *TINY, *SHORT, "--steps", "2", "--mesh", "fsdp=2,tensor=4"]
    assert recipe.main([*args, "--run-dir", str(tmp_path / "strict")]) == 2
    assert "--allow-partial" in capsys.readouterr().err
    assert recipe.main([*args, "--plan"]) == 0
    assert "needs --allow-partial" in capsys.readouterr().out

    assert recipe.main([*args, "--allow-partial", "--run-dir", str(tmp_path / "partial")]) == 0
    err = capsys.readouterr().err
    assert "allow_partial:" in err and "layers.attn.k_proj.kernel: dimension 2 (logical 'kv_heads', size 2)" in err, err
    want = [r["loss"] for r in records(llama_run[0])]  # the same run on the default mesh, FSDP 8
    got = [r["loss"] for r in records(tmp_path / "partial")]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("model", [["llama3-tiny"], ["deepseek3-tiny", "--model.first_k_dense_replace", "1"]])
def test_the_recipe_builds_its_model_with_the_rule_set_it_places_the_weights_by(monkeypatch, model):
    """The model enters its own rule set while tracing, so a model built without ``--rules`` would lay out its
    activations by ``default`` while its weights sit by the chosen set."""
    import nnx_zoo.train
    from nnx_zoo.sharding import get_rules

    class Built(Exception):
        pass

    def capture(make_model, settings, **_):
        raise Built(make_model(), settings.rules)

    monkeypatch.setattr(nnx_zoo.train, "train", capture)
    with pytest.raises(Built) as built:
        recipe.main(["--model", *model, *TINY, *SHORT, "--rules", "ep-as-cp"])
    made, rules = built.value.args
    assert rules == "ep-as-cp" and made.rules == get_rules("ep-as-cp")
