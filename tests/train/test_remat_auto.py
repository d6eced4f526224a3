"""``--remat auto``: the recipe asks the memory plan for the least recomputation that fits the device's memory less
a margin, says what it chose and why, and XLA's compiled step stays under that memory (AOT, on 8 CPU devices)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from flax import nnx

from nnx_zoo import AutoModelForCausalLM
from nnx_zoo.layers.kernel_choices import kernel_choices
from nnx_zoo.sharding import make_mesh
from nnx_zoo.train.loop import step_peak_bytes
from nnx_zoo.train.remat_choice import MARGIN, ORDER, choose_remat, step_bytes

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pretrain_remat", ROOT / "recipes" / "pretrain.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
GIB = 2**30


def _parse(argv: list[str]):
    source = recipe.model_source(argv)
    return recipe.build_parser(source.config_cls).parse_args(argv), source


# (preset and flags, the policy the budget leaves room for): a budget just above what that policy needs, so the
# plan's estimate, not slack, keeps XLA's step under it.
CASES = [
    (["--model", "llama3-tiny", "--model.num_hidden_layers", "2", "--mesh", "fsdp=8", "--shard-mode", "explicit",
      "--batch", "8", "--seq-len", "128"], "none"),
    (["--model", "qwen3-moe-tiny", "--model.num_hidden_layers", "2", "--mesh", "fsdp=4,expert=2", "--rules",
      "ep-as-cp", "--batch", "8", "--seq-len", "64", "--moe-impl", "ep"], "full"),
    (["--model", "gemma3-tiny", "--mesh", "fsdp=4,tensor=2", "--batch", "8", "--seq-len", "128"], "full"),
]


@pytest.mark.parametrize(("argv", "policy"), CASES, ids=[c[0][1] for c in CASES])
def test_auto_picks_the_least_recomputation_that_fits_and_xla_stays_under_it(argv, policy, tmp_path, capsys):
    args, source = _parse(argv)
    config = recipe.model_config(args, source)
    mesh = make_mesh(dict(args.mesh), shard_mode=args.shard_mode)
    plan = recipe.memory_plan_of(args, config, mesh, args.seq_len, kernel_choices(config, seq_len=args.seq_len))
    needed = {remat: step_bytes(plan, remat) for remat in ORDER}
    assert needed["full"] < needed["none"]
    budget = int(needed[policy] / (1 - MARGIN) * 1.01)
    assert budget < needed["none"] / (1 - MARGIN) or policy == "none"  # 'none' does not fit where 'full' is asked

    args, _ = _parse([*argv, "--device-memory", str(budget / GIB), "--run-dir", str(tmp_path)])
    chosen, line = recipe.auto_remat(args, source, config)
    assert chosen.remat_policy == policy
    assert line.startswith(f"remat auto: '{policy}'") and "--device-memory less 10%" in line

    model_cls = AutoModelForCausalLM.model_class(chosen)
    extras = recipe.training_extras(chosen, model_cls, args)
    settings = recipe.train_config(args, source, chosen, extras)
    peak = step_peak_bytes(lambda: model_cls(chosen, rngs=nnx.Rngs(0), rules=args.rules), settings,
                           chosen.vocab_size)
    # Under the device's memory: the margin covers the plan's error (its activations are within 0.85-1.15 of XLA's).
    assert peak <= budget, (peak, needed, budget)


def test_nothing_fits_says_what_to_change_and_a_forced_policy_is_kept():
    argv = ["--model", "llama3-tiny", "--model.num_hidden_layers", "2", "--batch", "8", "--seq-len", "128"]
    args, source = _parse([*argv, "--device-memory", "0.001"])
    config = recipe.model_config(args, source)
    with pytest.raises(ValueError, match=r"even 'full' .* Lower --batch or --seq-len, shard over more devices"):
        recipe.auto_remat(args, source, config)
    assert recipe.remat_is_auto(args)
    for forced in (["--remat", "full"], ["--model.remat_policy", "dots_saveable"]):
        args, _ = _parse([*argv, *forced])
        assert not recipe.remat_is_auto(args)
        assert recipe.model_config(args, source).remat_policy == forced[1]
    with pytest.raises(ValueError, match="margin"):
        choose_remat(recipe.memory_plan_of(args, config, make_mesh({"fsdp": 8}), 128,
                                           kernel_choices(config, seq_len=128)), 2**30, margin=1.5)
