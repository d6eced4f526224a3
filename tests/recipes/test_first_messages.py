"""Mistakes a new user makes, each answered by a first message that, followed literally, works (issue 35: "the first
message points the right way", "nothing silent"). Nothing here trains: each case fails before the first compile,
or calls the function that says it."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from flax import nnx

from nnx_zoo import AutoConfig, Llama3, Llama3Config, Qwen3Config, Qwen3MoEConfig
from nnx_zoo.hf import CheckpointFormatError
from nnx_zoo.layers.kernel_choices import KERNEL_SETTINGS
from nnx_zoo.models.registry import MODEL_TYPES, preset_names
from nnx_zoo.train import DataConfig, OptimizerConfig
from nnx_zoo.train.data import read_documents
from nnx_zoo.train.loop import _StopSignal
from nnx_zoo.train.optim import warmup_note
from nnx_zoo.train.run_spec import RunMismatchError, reconcile
from nnx_zoo.train.tokenize import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"first_messages_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe, report = _load("pretrain"), _load("sharding_report")
TINY = ["--model.num_hidden_layers", "1", "--batch", "8", "--seq-len", "16", "--no-progress"]


def _fake_run_dir(tmp_path: Path) -> Path:
    """A training run's layout (checkpoints/<step>/), which is not a Hugging Face checkpoint."""
    (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
    return tmp_path / "run"


# ----------------------------------------------------------------------------- the recipe's command line
@pytest.mark.parametrize(("args", "message", "fixed"), [
    # An option another family's --help shows; the fix names a preset that takes it.
    (["--model", "llama3-tiny", "--indexer-stage", "sparse"],
     "--indexer-stage sets indexer_training, which Llama3Config (the config of llama3-tiny) does not have; leave "
     "--indexer-stage out, or train a model that has it (e.g. --model deepseek3.2-tiny)",
     ["--model", "deepseek3.2-tiny", "--indexer-stage", "sparse"]),
    (["--model", "qwen3-tiny", "--moe-impl=gmm"], "--moe-impl sets moe_impl, which Qwen3Config", None),
    (["--num-processes", "2"], "--num-processes 2 needs --coordinator HOST:PORT", None),
    # Pipeline parallelism: micro-batches need stages; the layers must split into the stages; counts must divide.
    (["--microbatches", "2"], "--microbatches 2 needs a pipeline: add a 'stage' axis to --mesh", None),
    # A layer count that does not split into the stages: the pipeline_layers that fit.
    (["--model.num_hidden_layers", "3", "--mesh", "stage=2,fsdp=4"],
     "--model.pipeline_layers 2 (the first 1 layers run before the pipeline)",
     ["--model.num_hidden_layers", "3", "--mesh", "stage=2,fsdp=4", "--model.pipeline_layers", "2"]),
    # DeepSeek-V3 runs every schedule (its 4 MoE layers after 3 dense: 2 chunks per stage), interleaved too.
    (["--model", "deepseek3-tiny", "--model.num_hidden_layers", "7", "--mesh", "stage=2,fsdp=4",
      "--pipeline-schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "1"],
     "--pipeline-schedule interleaved runs micro-batches in groups of the 2 stages: --microbatches 1 must be a "
     "multiple of 2",
     ["--model", "deepseek3-tiny", "--model.num_hidden_layers", "7", "--mesh", "stage=2,fsdp=4",
      "--pipeline-schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"]),
    (["--mesh", "stage=2,fsdp=4", "--microbatches", "3"],
     "--microbatches 3 must be >= 1 and divide the 8 rows of each accumulation step", None),
    (["--mesh", "stage=2,fsdp=4", "--pipeline-schedule", "1f1b", "--virtual-stages", "2"],
     "2 virtual stages need the 'interleaved' schedule (--pipeline-schedule interleaved)",
     ["--model.num_hidden_layers", "4", "--mesh", "stage=2,fsdp=4", "--pipeline-schedule", "interleaved",
      "--virtual-stages", "2"]),
    (["--steps", "2", "--profile-steps", "3:5"],
     "profile_steps 3:5 ends past the run's last step 2, so the trace would never be written whole; profile steps "
     "within 1:2 (recipes: --profile-steps 2:2)", ["--steps", "2", "--profile-steps", "2:2"]),
    # A kernel setting is refused on the recipe's path as on every other (test_kernel_settings_* below).
    (["--model", "qwen3-moe-tiny", "--model.grouped_matmul_impl", "triton"],
     "grouped_matmul_impl must be one of ('auto', 'tiled', 'xla', 'tokamax', 'pallas_triton'), got 'triton'",
     ["--model", "qwen3-moe-tiny", "--model.grouped_matmul_impl", "tiled"]),
])
def test_recipe_mistakes_get_a_message_whose_fix_works(tmp_path, capsys, args, message, fixed):
    assert recipe.main([*TINY, "--run-dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "unrecognized arguments" not in err, err
    if fixed is not None:  # the fix gets past the check: --plan stops right after the command line and config
        assert recipe.main([*TINY, "--plan", "--mesh", "fsdp=8", *fixed]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("where", ["run", "step"])
def test_a_run_directory_is_not_a_pretrained_checkpoint(tmp_path, capsys, where):
    run = _fake_run_dir(tmp_path)
    given = run if where == "run" else run / "checkpoints" / "3"
    out, step = ("exports/run", "") if where == "run" else ("exports/run-step3", " --step 3")
    command = f"`python recipes/export_hf.py {run} {out}{step}`, then load {out}"
    assert recipe.main(["--from-pretrained", str(given), *TINY]) == 2
    assert command in capsys.readouterr().err
    with pytest.raises(CheckpointFormatError) as caught:  # the library's own from_pretrained says the same
        Llama3.from_pretrained(given)
    assert command in str(caught.value)


def test_plan_of_a_dense_model_names_no_moe_path(capsys):
    for preset, moe in (("llama3-tiny", False), ("qwen3-moe-tiny", True)):
        assert recipe.main(["--model", preset, *TINY, "--plan", "--mesh", "fsdp=8"]) == 0
        header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("memory plan"))
        assert ("MoE path gmm" in header) is moe, header


# ---------------------------------------------------------------------------------------- the kernel settings
def test_kernel_settings_are_refused_when_any_familys_config_is_built():
    """Every family, every kernel field it has: the preset path; the first family's other paths below."""
    checked = 0
    for config_cls, model_cls in dict.fromkeys(MODEL_TYPES.values()):
        preset = preset_names()[model_cls.__name__][0]
        for field in sorted({f.name for f in dataclasses.fields(config_cls)} & set(KERNEL_SETTINGS)):
            with pytest.raises(ValueError, match=f"{field} must be one of .*, got 'bogus'"):
                config_cls.preset(preset, **{field: "bogus"})
            checked += 1
    assert checked >= 50  # 17 families x (attention, remat, and moe + grouped matmul where MoE)


def test_kernel_settings_are_refused_on_every_path():
    fields = dataclasses.asdict(Qwen3MoEConfig.preset("qwen3-moe-tiny"))
    hf = Qwen3MoEConfig.preset("qwen3-moe-tiny").to_hf_dict()
    match = "grouped_matmul_impl must be one of"
    for build in (lambda: Qwen3MoEConfig(**{**fields, "grouped_matmul_impl": "triton"}),
                  lambda: Qwen3MoEConfig.preset("qwen3-moe-tiny", grouped_matmul_impl="triton"),
                  lambda: Qwen3MoEConfig.preset("qwen3-moe-tiny").with_overrides(grouped_matmul_impl="triton"),
                  lambda: Qwen3MoEConfig.from_hf(hf, grouped_matmul_impl="triton"),
                  lambda: AutoConfig.from_hf(hf, grouped_matmul_impl="triton")):
        with pytest.raises(ValueError, match=match):
            build()


# -------------------------------------------------------------------------------------- the library's messages
def test_resuming_with_fewer_steps_than_done_says_how_to_train_further():
    stored = {"structure": {}, "settings": {}, "steps": 2, "schedule_steps": 2}
    with pytest.raises(RunMismatchError) as caught:
        reconcile(stored, stored, resume_step=2, steps=1, extend=False, override_settings=False)
    message = str(caught.value)
    assert "--steps 1 is not more than the 2 steps this run has done already" in message
    assert "--steps 4 --extend" in message
    definition, notes = reconcile(stored, stored, resume_step=2, steps=4, extend=True, override_settings=False)
    assert definition["schedule_steps"] == 2 and "extending the run from 2 to 4 steps" in notes[0]
    # Short of a planned run's end: finish it as planned (the --extend the old message offered is refused).
    planned = {**stored, "steps": 10, "schedule_steps": 10}
    with pytest.raises(RunMismatchError, match="To finish it as planned, rerun with --steps 10"):
        reconcile(planned, planned, resume_step=4, steps=6, extend=False, override_settings=False)


def test_a_malformed_jsonl_line_is_named_by_its_own_number(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{bad\n')
    with pytest.raises(ValueError, match=r"data.jsonl: line 4 is not valid JSON .* fix or remove line 4"):
        read_documents(path)


def test_a_tokenizer_without_a_known_eos_names_the_flag_and_the_flag_works(tmp_path):
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<|im_end|>"])
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    with pytest.raises(ValueError, match=r"name the token that ends each document with --eos-token .* e\.g\. "
                                         r"--eos-token '<\|im_end\|>'"):
        load_tokenizer(path)
    args = recipe.build_parser(Llama3Config).parse_args(["--tokenizer", path, "--eos-token", "<|im_end|>"])
    settings = recipe.train_config(args, recipe.ModelSource(Llama3Config, preset="llama3-tiny"),
                                   Llama3Config.preset("llama3-tiny"), recipe.Extras(0.0, 0.0))
    assert settings.data.eos_token == "<|im_end|>"
    assert load_tokenizer(path, eos_token=args.eos_token).eos_id == 2


def test_a_second_signal_says_what_is_kept(tmp_path):
    stop = _StopSignal(tmp_path)
    assert "before any checkpoint of this run was complete, so no step of it is kept; rerun the same command to " \
           "start it again" in stop.second_signal_message("SIGINT")
    (tmp_path / "4.orbax-checkpoint-tmp-1").mkdir()  # a save in flight is not a checkpoint
    assert "no step of it is kept" in stop.second_signal_message("SIGINT")
    (tmp_path / "3").mkdir()
    assert f"the last complete checkpoint (step 3 in {tmp_path}) is kept and rerunning the same command resumes " \
           "from it" in stop.second_signal_message("SIGINT")


def test_a_warmup_not_shorter_than_the_run_is_said():
    assert warmup_note(OptimizerConfig(warmup_steps=4), 5) is None
    note = warmup_note(OptimizerConfig(warmup_steps=10, lr=0.003), 5)
    assert "--warmup-steps 10 (warmup_steps) is not shorter than the 5 steps" in note
    assert "the peak learning rate 0.003 is reached only at the last step" in note
    assert warmup_note(OptimizerConfig(warmup_steps=5), 5) is not None


def test_another_familys_checkpoint_names_the_right_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(Qwen3Config.preset("qwen3-tiny").to_hf_dict()))
    with pytest.raises(CheckpointFormatError, match=r"It is a Qwen3 checkpoint: load it with Qwen3.from_pretrained"):
        Llama3.from_pretrained(tmp_path)


def test_save_pretrained_onto_a_file_says_to_give_a_directory(tmp_path):
    # Abstract: the refusal comes before any array is read.
    model = nnx.eval_shape(lambda: Llama3(Llama3Config.preset("llama3-tiny", num_hidden_layers=1), rngs=nnx.Rngs(0)))
    target = tmp_path / "weights.bin"
    target.write_text("mine")
    with pytest.raises(FileExistsError, match=f"{target} is a file, and save_pretrained writes a directory"):
        model.save_pretrained(target)
    assert target.read_text() == "mine"


@pytest.mark.parametrize("preset", ["llama3-tiny", "qwen3-moe-tiny", "deepseek4-tiny"])
def test_sharding_report_takes_any_familys_preset(capsys, preset):
    assert report.main(["--model", preset, "--mesh", "fsdp=8", "--summary"]) == 0
    assert "per device: parameters" in capsys.readouterr().out


def test_data_config_default_eos_is_no_run_difference():
    """Runs written before DataConfig.eos_token existed resume: a key one side lacks reads as its None."""
    stored = {"structure": {}, "settings": {"data": {"tokenizer": "bytes"}}, "steps": 2, "schedule_steps": 2}
    current = {**stored, "settings": {"data": {"tokenizer": "bytes", "eos_token": DataConfig().eos_token}}}
    reconcile(stored, current, resume_step=1, steps=2, extend=False, override_settings=False)
