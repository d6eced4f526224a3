"""The scripts a session runs on a lent GPU start and write their results on the CPU: device time is scarce (a
few minutes a session), so a script broken by a refactor must fail here, not there. Each runs its cheapest
smoke shape; what they measure is checked on the GPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"device_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dsa_layer_benchmark_compiles_both_layers(tmp_path):
    dsa_layer = _script("dsa_layer")
    assert dsa_layer.main(["--platform", "cpu", "--quick", "--memory-only", "--contexts", "256", "--out-dir",
                           str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "dsa_layer_quick.json").read_text())["rows"]
    assert [r["seq"] for r in rows] == [256] and rows[0]["dsa_sparse"], rows
    assert rows[0]["dsa"]["temp_bytes"] > 0 and rows[0]["dense"]["temp_bytes"] > 0, rows


def test_the_gpu_train_step_benchmark_runs_its_grouped_matmul_case(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_train_step.py"), "--smoke", "--cases", "gmm",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_train_step_smoke.json").read_text())["gmm"]
    assert {r["ran"] for r in rows} >= {"tiled", "xla"} and all(r["seconds"] > 0 for r in rows), rows


def test_the_gpu_profile_maps_each_op_to_the_line_that_asked_for_it(tmp_path, monkeypatch):
    """`_harness.hlo_op_sources` walks the HLO's stack-frame tables (whose printed parent ids are one above the
    parent's): past a helper file to its caller, or the innermost frame when the helper is not skipped."""
    harness = _script("_harness")
    (tmp_path / "plumb_helper.py").write_text("import jax.numpy as jnp\n\n\ndef sine(x):\n    return jnp.sin(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import plumb_helper

    def caller(x):
        return plumb_helper.sine(x) * 2.0

    caller_line = caller.__code__.co_firstlineno + 1
    text = jax.jit(caller).lower(jnp.ones(4)).compile().as_text()
    for plumbing, want in ((("plumb_helper.py",), f"test_device_scripts.py:{caller_line}"),
                           ((), "plumb_helper.py:5")):
        lines = {line for op_name, line in harness.hlo_op_sources(text, prefer="", plumbing=plumbing).values()
                 if op_name.endswith("/sin")}
        assert lines == {want}, (plumbing, lines)


def test_the_gpu_profile_worker_attributes_the_train_step_to_model_code():
    result = _script("gpu_train_step").profile_worker("llama3-tiny", 1, 32, '{"num_hidden_layers": 1}', 1)
    assert result["kernel_ms_per_step"] > 0, result
    assert {"attention", "dense MLP", "step: gradient sums, clip, AdamW"} <= set(result["parts_ms"]), result
    known = sum(ms for line, ms in result["lines_ms"].items() if line != "?")
    assert known > 0.9 * sum(result["lines_ms"].values()), result  # nearly every op is traced to a source line



def _recipe():
    spec = importlib.util.spec_from_file_location("pretrain_gpu", BENCHMARKS.parent / "recipes" / "pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


def _planned_gib(out: str) -> float:
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    return float(total.split("remat full:")[1].split("GiB")[0])


def test_the_gpu_v4_case_plans_under_an_h100_and_its_smoke_shape_parses(capsys):
    """The `v4` case's recipe commands (the train step itself runs through `run_recipe` and `profile_worker`, which
    the other cases check): at full size it plans (abstract, nothing compiled, ~1 s) under an H100's 78 GiB with
    V4's attention, and its smoke command is a V4 preset the recipe takes."""
    gpu, recipe = _script("gpu_train_step"), _recipe()
    argv = gpu.family_recipe_args(gpu.Shapes(smoke=False).families["v4"])
    assert argv[:2] == ["--model", "deepseek4-flash"] and "--model.num_hidden_layers" in argv
    assert recipe.main([*argv, "--plan", "--mesh", "fsdp=1"]) == 0
    out = capsys.readouterr().out
    assert "V4 attention (sliding blockwise, CSA blockwise, HCA blockwise" in out, out
    assert _planned_gib(out) < 78, out
    smoke = gpu.family_recipe_args(gpu.Shapes(smoke=True).families["v4"])
    assert recipe.main([*smoke, "--plan", "--mesh", "fsdp=1"]) == 0
    assert "2 hyper-connection streams" in capsys.readouterr().out  # deepseek4-tiny's


@pytest.mark.parametrize("case", ["qwen3moe", "gpt_oss", "gemma3", "qwen3_5", "kimi_linear"])
def test_the_gpu_family_cases_plan_under_an_h100_and_transformers_has_their_model(case, capsys):
    """Each family case's cut of its published preset plans under remat full below an H100's 78 GiB (abstract,
    ~1 s), its smoke command is one the recipe takes, and the torch side's config (the cut config through
    transformers' AutoConfig) has a causal-LM class in the installed transformers with the cut's sizes."""
    import transformers

    from nnx_zoo import AutoConfig

    gpu, recipe = _script("gpu_train_step"), _recipe()
    for smoke in (False, True):
        run = gpu.Shapes(smoke=smoke).families[case]
        assert recipe.main([*gpu.family_recipe_args(run), "--plan", "--mesh", "fsdp=1"]) == 0
        out = capsys.readouterr().out
        assert f"global batch {run.batch} x sequence {run.seq}" in out, out
        if not smoke:
            assert 10 < _planned_gib(out) < 78, out  # a cut that still weighs something, and fits
        hf = transformers.AutoConfig.for_model(**AutoConfig.preset(run.preset, **run.cut).to_hf_dict())
        assert transformers.AutoModelForCausalLM._model_mapping[type(hf)].__name__.endswith("ForCausalLM")
        assert all(getattr(hf, k) == v for k, v in run.cut.items()), (hf, run.cut)


def test_the_qwen3_5_smoke_traces_transformers_under_torch_compile(capsys):
    """The `qwen3_5` case's torch.compile row at its smoke shape, through the worker's own entry (as its subprocess
    runs it, two steps): dynamo captures transformers' Qwen3.5-MoE (the gated delta rule's torch fallback, the expert
    loop) and it trains. The smoke compiles with the ``eager`` backend: inductor's C++ code generation on the CPU
    took over 5 minutes for this model and stalled the whole smoke run; the GPU run keeps inductor."""
    import torch

    gpu = _script("gpu_train_step")
    assert gpu.Shapes(smoke=False).compile_backend == "inductor"
    run = gpu.Shapes(smoke=True).families["qwen3_5"]
    try:
        gpu.run_worker(["torch", run.preset, str(run.batch), str(run.seq), "2", "1", "1", json.dumps(run.cut)],
                       smoke=True)
    finally:
        torch._dynamo.reset()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and result["kernels"] == "sdpa attention, torch.compile (backend eager)", result
