"""The pretraining recipe end to end, sized small: runs, writes metrics, resumes, and rejects bad input."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("deepseek_pretrain", ROOT / "recipes" / "deepseek_pretrain.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)

SMALL = [
    "--model", "deepseek3-tiny", "--model.num_hidden_layers", "2", "--model.first_k_dense_replace", "1",
    "--model.vocab_size", "512", "--model.num_nextn_predict_layers", "1",
    "--batch", "8", "--seq-len", "16", "--no-progress", "--warmup-steps", "1",
]


def test_runs_writes_metrics_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert recipe.main([*SMALL, "--steps", "2", "--run-dir", str(run_dir), "--mesh", "fsdp=4,expert=2",
                        "--tensorboard", "--profile-steps", "2:2"]) == 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "profile").rglob("*.xplane.pb"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "mtp1"):
        assert key in records[0], key
    assert records[0]["mtp1"] > 0  # the multi-token-prediction head is trained
    assert records[0]["expert_max_over_mean"] >= 1.0  # expert loads are measured (and balance the router bias)
    capsys.readouterr()
    # Resumed onto another mesh, with a given peak: it is used and named, and compiling is announced.
    assert recipe.main([*SMALL, "--steps", "3", "--extend", "--run-dir", str(run_dir), "--mesh", "fsdp=8",
                        "--peak-flops", "2e9"]) == 0
    captured = capsys.readouterr()
    assert "steps 2 -> 3 (resumed)" in captured.out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "peak per device: 2.0 GFLOP/s (given by --peak-flops)" in captured.out
    assert records[2]["mfu"] == pytest.approx(records[2]["tflops_per_device"] * 1e12 / 2e9)
    assert "compiling the train step ..." in captured.err and "compiled and ran step 3 in" in captured.err
    # What 'auto' chose on this CPU at 16 positions, printed at start and in the summary.
    assert "nnx_zoo: kernels: attention xla (attention_impl=auto), moe dense (moe_impl=auto)" in captured.err
    assert "kernels: attention xla (attention_impl=auto), moe dense (moe_impl=auto)" in captured.out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "deepseek9"], "unknown preset 'deepseek9'"),
        (["--mesh", "fsdp=3"], "mesh {'fsdp': 3} has 3 positions but there are 8 devices"),
        (["--mesh", "fsdp=8", "--batch", "4"], "not divisible"),
        (["--model.num_attention_heads", "0"], "num_attention_heads must be a positive integer"),
        (["--lr", "-1"], "lr must be positive"),
        (["--rules", "nope"], "unknown rule set 'nope'"),
        (["--seq-len", "200000"], "--seq-len 200000 exceeds the model's max_position_embeddings (163840"),
        (["--synthetic-vocab", "600"], "--synthetic-vocab 600 exceeds the model's vocab_size (512); use "
                                       "--synthetic-vocab 512 or less, or raise --model.vocab_size to 600"),
        (["--model.vocab_sizee", "5"], "--model.vocab_sizee (did you mean --model.vocab_size?): not a field"),
        (["--model.dtype", "float8"], "dtype='float8' is not a dtype; use one of float32, bfloat16"),
    ],
)
def test_bad_input_gets_one_clear_error(tmp_path, capsys, args, message):
    assert recipe.main([*SMALL, "--steps", "1", "--run-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_trains_on_local_jsonl_with_packing_and_muon(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document number {i} says hello."}) for i in range(40)) + "\n")
    run_dir = tmp_path / "run"
    # Packed documents (segment_ids) through the blockwise attention kernel, asked for by name.
    args = ["--steps", "2", "--run-dir", str(run_dir), "--data", str(corpus), "--optimizer", "muon",
            "--attention-impl", "blockwise"]
    assert recipe.main([*SMALL, *args]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)
    captured = capsys.readouterr()
    assert "nnx_zoo: kernels: attention blockwise, moe dense (moe_impl=auto)" in captured.err
    assert "kernels: attention blockwise, moe dense (moe_impl=auto)" in captured.out  # and in the summary


def test_mesh_axis_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe.main([*SMALL, "--mesh", "fsdp=2,fsdp=8"])
    assert exit_info.value.code == 2
    assert "mesh axis 'fsdp' is given twice in 'fsdp=2,fsdp=8'" in capsys.readouterr().err


def test_help_lists_every_preset_and_rule_set(capsys):
    from nnx_zoo.models.deepseek import PRESETS
    from nnx_zoo.sharding import RULE_SETS

    with pytest.raises(SystemExit):
        recipe.main(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse may wrap a name at a hyphen
    for name in [*PRESETS, *RULE_SETS]:
        assert name in text, name


def test_help_opens_with_the_description_and_shows_every_option_and_default(capsys):
    import re

    from nnx_zoo import DeepSeekV3Config
    from nnx_zoo.models.deepseek import PRESETS

    with pytest.raises(SystemExit):
        recipe.main(["--model", "deepseek3-mini", "--help"])
    out = capsys.readouterr().out
    usage, description = out.split("\n\n")[:2]
    assert "\n" not in usage.strip() and description.startswith("Pretrain DeepSeek-V3"), out[:300]
    assert "Examples" in out and ">>>" not in out  # the module's docstring, not an internal class's
    parser = recipe.build_parser(DeepSeekV3Config, PRESETS)
    entries = re.split(r"\n  (?=-)", out)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry = next(e for e in entries if e.split()[0].rstrip(",") == action.option_strings[0])
        help_text = " ".join(entry.split()[1 if action.nargs == 0 else 2:])
        assert help_text, f"{action.option_strings[0]} has no help"
        if action.default is not None and action.default is not False and action.default != "":
            assert "default" in help_text, f"{action.option_strings[0]}: no default shown in {help_text!r}"
    # Per-family help: each field shows the chosen preset's value.
    text = " ".join(out.split())
    mini = DeepSeekV3Config.preset("deepseek3-mini")
    for field in ("hidden_size", "n_routed_experts", "kv_lora_rank"):
        assert f"override DeepSeekV3Config.{field} (int; preset: {getattr(mini, field)})" in text, field


def test_default_synthetic_vocab_fits_a_smaller_model_vocab():
    from nnx_zoo import DeepSeekV3Config
    from nnx_zoo.models.deepseek import PRESETS

    args = recipe.build_parser(DeepSeekV3Config, PRESETS).parse_args([])
    small = DeepSeekV3Config.preset("deepseek3-tiny", vocab_size=100)
    assert recipe.pretrain.synthetic_vocab(args, small) == 100  # the default bends to the model
    assert recipe.pretrain.synthetic_vocab(args, DeepSeekV3Config.preset("deepseek3-tiny")) == 256
