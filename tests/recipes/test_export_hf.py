"""recipes/export_hf.py (nnx_zoo.train.export_run): a run's checkpoint becomes a Hugging Face directory that ours
and transformers reload with the run's logits. One short run per case, shared by the tests: a DeepSeek-V3 run with
an MTP head on a byte-tokenized text file, a Qwen3 run on a text file through a tokenizer JSON file, a LoRA Llama
run (bfloat16, synthetic data) through nnx_zoo.train.train. The reference logits come from the checkpoint itself,
restored in full by orbax."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, apply_lora, merge_lora
from nnx_zoo.train import export_run
from nnx_zoo.train.checkpoint import FILES_MANIFEST

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain, export_hf = _load("pretrain"), _load("export_hf")

SHORT = ["--batch", "8", "--seq-len", "16", "--no-progress", "--warmup-steps", "1", "--peak-flops", "1e11",
         "--steps", "2", "--checkpoint-every", "1", "--lr", "1e-2"]
DEEPSEEK = ["--model", "deepseek3-tiny", "--model.num_hidden_layers", "2", "--model.first_k_dense_replace", "1",
            "--model.vocab_size", "512", "--model.num_nextn_predict_layers", "1"]
QWEN3 = ["--model", "qwen3-tiny", "--model.num_hidden_layers", "1", "--model.vocab_size", "64"]
IDS = np.random.default_rng(0).integers(0, 40, (2, 12)).astype(np.int32)
WORDS = "the cat sat on a mat and dog ran to big red house near small green tree".split()


def make_tokenizer(path: Path) -> Path:
    """A word-level tokenizers JSON file over ``WORDS`` with ``<eos>`` and ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("deepseek")
    corpus = base / "corpus.txt"  # read with the built-in byte tokenizer (ids < 258 <= the vocabulary)
    corpus.write_text("".join(f"line {i}: the export keeps every weight.\n" for i in range(40)))
    run_dir = base / "run"
    assert pretrain.main([*DEEPSEEK, *SHORT, "--data", str(corpus), "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("qwen3")
    rng = np.random.default_rng(0)
    corpus = base / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(WORDS, 12))}) for _ in range(40)) + "\n")
    tokenizer = make_tokenizer(base / "words.json")
    run_dir = base / "run"
    assert pretrain.main([*QWEN3, *SHORT, "--data", str(corpus), "--tokenizer", str(tokenizer),
                          "--run-dir", str(run_dir)]) == 0
    return run_dir


RUNS = {"deepseek": "deepseek_run", "qwen3": "qwen3_run"}


def stored_model(run_dir: Path, step: int, *, lora: dict | None = None) -> nnx.Module:
    """The model of checkpoint ``step`` as the trainer saved it: the whole state restored by orbax with no
    target (numpy arrays), its model part put into a model built from the run's stored definition."""
    checkpoint = run_dir / "checkpoints" / str(step)
    with warnings.catch_warnings():  # no target given: orbax warns that it reads the saved shardings
        warnings.simplefilter("ignore", UserWarning)
        state = ocp.PyTreeCheckpointer().restore(checkpoint / "state")
    definition = json.loads((checkpoint / "meta" / "metadata").read_text())["run"]
    settings = {k: v for k, v in definition["settings"]["model"].items() if k in ("dtype", "param_dtype")}
    config = AutoConfig.from_hf(definition["structure"]["model"], **settings)
    model = AutoModelForCausalLM.create(config, seed=123)
    if lora is not None:
        apply_lora(model, **lora)
    graphdef, variables = nnx.split(model)
    # Gathered to one device: orbax restores each array on the sharding it was saved with (8 fake devices).
    nnx.replace_by_pure_dict(variables, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state["model"]))
    return nnx.merge(graphdef, variables)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def transformers_logits(directory: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", sorted(RUNS))
def test_export_reloads_with_the_checkpoints_logits(family, request, tmp_path, capsys):
    run_dir = request.getfixturevalue(RUNS[family])
    out = tmp_path / "export"
    assert export_hf.main([str(run_dir), str(out), "--step", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"exported step 1 of {run_dir}" in printed and "model.safetensors.index.json" in printed
    reference = stored_model(run_dir, 1)
    expected = np.asarray(reference(IDS))
    assert rel_err(expected, np.asarray(stored_model(run_dir, 2)(IDS))) > 1e-4  # steps differ: --step counts

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is type(reference) and reloaded.config == reference.config
    np.testing.assert_allclose(np.asarray(reloaded(IDS)), expected, rtol=1e-6, atol=1e-6)
    assert rel_err(transformers_logits(out, IDS), expected) < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32"

    if family == "deepseek":  # the MTP head: its weights are the hub format's extra layer 2, and reload as trained
        keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.2.mlp.experts.0.down_proj.weight"} <= set(keys)
        assert config["num_nextn_predict_layers"] == 1
        assert reloaded.config.num_nextn_predict_layers == 1
        mtp = nnx.jit(lambda m, ids: m.forward(ids, with_mtp=True).mtp_logits[0])
        np.testing.assert_allclose(np.asarray(mtp(reloaded, IDS)), np.asarray(mtp(reference, IDS)), rtol=1e-6,
                                   atol=1e-6)
        assert "MTP heads: 1, as layers 2..2" in printed
        assert "tokenizer: none (the run used the built-in byte tokenizer" in printed
        assert not list(out.glob("tokenizer*"))


def test_the_latest_checkpoint_is_the_default_and_the_tokenizer_file_comes_along(qwen3_run, tmp_path):
    from transformers import AutoTokenizer

    out = export_run(qwen3_run, tmp_path / "export")
    np.testing.assert_allclose(np.asarray(AutoModelForCausalLM.from_pretrained(out)(IDS)),
                               np.asarray(stored_model(qwen3_run, 2)(IDS)), rtol=1e-6, atol=1e-6)
    tokenizer_file = qwen3_run.parent / "words.json"
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    text = "the big red dog sat near a small tree"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == Tokenizer.from_file(str(tokenizer_file)
                                                                                       ).encode(text).ids
    assert tokenizer.eos_token == "<eos>" and tokenizer.eos_token_id == 1


def test_a_lora_run_exports_merged_weights_in_its_dtype(tmp_path):
    import torch
    from safetensors import safe_open

    from nnx_zoo import Llama3
    from nnx_zoo.layers.lora import lora_settings
    from nnx_zoo.train import DataConfig, ExportError, OptimizerConfig, TrainConfig, train

    config = AutoConfig.preset("llama3-tiny", num_hidden_layers=1, vocab_size=256, hidden_size=32,
                               intermediate_size=64, head_dim=8, dtype="bfloat16", param_dtype="bfloat16")
    adapt = dict(pattern=None, rank=4, alpha=8.0)

    def make_model() -> Llama3:
        model = Llama3(config, rngs=nnx.Rngs(0))
        apply_lora(model, **adapt)
        return model

    structure, settings = pretrain.model_definition(config)
    run_dir = tmp_path / "run"
    train(make_model, TrainConfig(steps=2, run_dir=str(run_dir), progress=False, peak_flops_per_device=1e11,
                                  optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1),
                                  data=DataConfig(seq_len=16, global_batch=8)),
          vocab_size=256, flops_per_token=config.train_flops_per_token(16), model_structure=structure,
          model_settings={**settings, "lora": lora_settings(**adapt)})

    lines = []
    out = export_run(run_dir, tmp_path / "export", log=lines.append)
    assert "LoRA: 7 adapted modules merged into their weights" in lines
    assert "tokenizer: none (the run trained on synthetic token ids; no tokenizer was used)" in lines
    assert not list(out.glob("tokenizer*"))
    trained = stored_model(run_dir, 2, lora=adapt)
    b = trained.layers.attn.q_proj.lora_b[...]
    assert float(jnp.abs(b).max()) > 0  # trained adapters: merging them changes the weights
    base_q = np.asarray(trained.layers.attn.q_proj.base.kernel[...], np.float32)
    assert merge_lora(trained) == 7
    # The run's dtype: config.json's torch_dtype and the stored tensors (from_pretrained reads float32 unless
    # told otherwise, so it is told).
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    merged = AutoModelForCausalLM.from_pretrained(out, dtype="bfloat16")
    ours = jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state(merged, nnx.Param)))
    ref = jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state(trained, nnx.Param)))
    assert [path for path, _ in ours] == [path for path, _ in ref]
    for (path, a), (_, b) in zip(ours, ref):
        assert a.dtype == b.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
    assert not np.array_equal(np.asarray(merged.layers.attn.q_proj.kernel[...], np.float32), base_q)

    # A run that did not record its adapters (model_settings without "lora") cannot be merged: refused.
    meta_file = run_dir / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["run"]["settings"]["model"]["lora"]
    meta_file.write_text(json.dumps(meta))
    # Stands for a run written that way: without this the edit is (rightly) reported as a damaged checkpoint.
    (run_dir / "checkpoints" / "2" / FILES_MANIFEST).unlink()
    with pytest.raises(ExportError, match="holds LoRA adapters, but the run's model settings do not say"):
        export_run(run_dir, tmp_path / "export-2")
    assert not (tmp_path / "export-2").exists()


def test_bad_inputs_get_one_line_and_exit_2(deepseek_run, tmp_path, capsys):
    def run(*args: str) -> str:
        assert export_hf.main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("export_hf.py: ") and err.count("\n") == 1 and "Traceback" not in err
        return err

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    assert "no such run directory; a run directory holds checkpoints/<step>/" in run(tmp_path / "nope", out)
    assert "not a run directory (no checkpoints/ in it); a run directory holds checkpoints/<step>/" in run(empty, out)
    (empty / "checkpoints").mkdir()
    assert "no complete checkpoint in" in run(empty, out)
    assert "no checkpoint at step 7; the available steps are 1, 2" in run(deepseek_run, out, "--step", "7")
    assert not out.exists()

    user_files = tmp_path / "mine"
    user_files.mkdir()
    (user_files / "notes.txt").write_text("keep me")
    assert "is not empty and holds no earlier export" in run(deepseek_run, user_files)
    assert (user_files / "notes.txt").read_text() == "keep me" and len(list(user_files.iterdir())) == 1

    # A damaged checkpoint is named as such, never exported.
    damaged = tmp_path / "damaged"
    shutil.copytree(deepseek_run, damaged)
    victim = max((p for p in (damaged / "checkpoints" / "2" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 1]))
    err = run(damaged, out)
    assert f"checkpoint step 2 in {damaged / 'checkpoints'} is damaged: the file {victim} changed" in err
    assert "previous checkpoint (step 1)" in err and not out.exists()


def test_an_earlier_export_is_replaced_and_a_step_directory_is_accepted(deepseek_run, tmp_path):
    out = export_run(deepseek_run, tmp_path / "export", step=1)
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")  # a shard only an earlier export would have
    # The path the user tried (RUN_DIR/checkpoints/<step>) names the run and the step.
    export_run(deepseek_run / "checkpoints" / "2", out)
    assert not (out / "model-00009-of-00009.safetensors").exists()
    np.testing.assert_allclose(np.asarray(AutoModelForCausalLM.from_pretrained(out)(IDS)),
                               np.asarray(stored_model(deepseek_run, 2)(IDS)), rtol=1e-6, atol=1e-6)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds an earlier export and other files"):
        export_run(deepseek_run, out)


def test_the_script_runs_from_anywhere_with_help_and_exit_codes(tmp_path):
    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "recipes" / "export_hf.py"), *args], capture_output=True,
                              text=True, cwd=tmp_path, timeout=300)

    helped = script("--help")
    assert helped.returncode == 0, helped.stderr
    assert "RUN_DIR OUT_DIR" in helped.stdout and "Examples:" in helped.stdout and "--step" in helped.stdout
    refused = script("no-run", "out")
    assert refused.returncode == 2 and refused.stderr.startswith("export_hf.py: no-run: no such run directory")
    assert refused.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
