"""Export a training run's checkpoint as a Hugging Face directory (``config.json``, safetensors shards, index).

A run directory (``train``'s ``TrainConfig.run_dir``; the recipes' ``--run-dir``) holds
``checkpoints/<step>/{state,data,meta}``: ``state`` is the ``TrainState`` (model and optimizer), ``meta["run"]`` the
run's definition (``nnx_zoo.train.run_spec``), whose ``structure.model`` is the model config's HF dict and whose
``settings.model`` its other fields (dtype, ...). That is all an export needs: the config is rebuilt from the
definition through the family registry, the model is built with shapes only, and only the model's weights are read
from the checkpoint (the optimizer state, twice the model's size under AdamW, is never loaded).

LoRA runs: a model trained with adapters (``nnx_zoo.apply_lora``) exports merged weights. Its adapters' settings
must be in the run's model settings under ``"lora"`` (``nnx_zoo.layers.lora.lora_settings``), since the alpha
and the pattern are not in the weights.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from nnx_zoo.train.checkpoint import ITEMS, Checkpointer

# What an earlier export wrote (and only that may be replaced by a new one).
_EXPORT_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")
_RUN_DIR_LAYOUT = ("a run directory holds checkpoints/<step>/ (state, data, meta), as recipes/pretrain.py "
                   "--run-dir DIR or nnx_zoo.train.train(TrainConfig(run_dir=DIR)) write it")


class ExportError(ValueError):
    """The run or the output directory cannot be used for an export; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """What ``export_run`` wrote: the output directory, the family, the step, the files, the tokenizer."""

    out_dir: Path
    model_type: str
    model_class: str
    step: int
    files: tuple[str, ...]
    tokenizer: str  # "copied from <path>", or why there is none
    lora_merged: int  # adapted modules merged into their weights (0: no LoRA)


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
               log: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint ``step`` (default: the latest complete one) of the run in ``run_dir`` as a Hugging Face
    directory ``out_dir``, which ``nnx_zoo.AutoModelForCausalLM.from_pretrained`` and transformers load.

    Any family (``model_type`` of the stored config), DeepSeek-V3's MTP heads included (as the extra layers
    ``model.layers.<num_hidden_layers + i>`` of the hub format). The parameter dtype is the run's
    (``config.json``'s ``torch_dtype``). When the run read files with a tokenizer JSON file (``--tokenizer PATH``),
    it is copied as ``tokenizer.json`` with a ``tokenizer_config.json`` naming its end-of-sequence token, so
    ``transformers.AutoTokenizer`` loads it; the built-in byte tokenizer and synthetic data write no tokenizer.

    LoRA: a model trained with adapters exports merged weights (``W + alpha / rank * A @ B``). The run must record
    them in its model settings, ``train(..., model_settings={..., "lora": lora_settings(pattern, rank, alpha)})``
    (``nnx_zoo.layers.lora.lora_settings``), with the arguments given to ``apply_lora``.

    ``out_dir`` must not exist, be empty, or hold an earlier export (then its files are replaced); anything else
    is refused, as are a run directory without checkpoints and a ``step`` it does not have (``ExportError``,
    naming the available steps). ``log`` receives one line per thing written.

    >>> export_run("runs/deepseek3-tiny", "exports/deepseek3-tiny")             # the latest checkpoint
    >>> export_run("runs/deepseek3-tiny", "exports/step-10", step=10, log=print)
    >>> AutoModelForCausalLM.from_pretrained("exports/deepseek3-tiny")
    """
    return export_run_info(run_dir, out_dir, step=step, log=log).out_dir


def export_run_info(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                    log: Callable[[str], None] | None = None) -> ExportInfo:
    """``export_run``, returning what was written (``ExportInfo``) instead of only the directory.

    >>> info = export_run_info("runs/llama3-tiny", "exports/llama3-tiny")
    >>> info.model_type, info.step, info.files
    """
    say = log or (lambda line: None)
    checkpoints_dir, asked_step = _checkpoints_dir(Path(run_dir))
    step = asked_step if step is None else step
    out = Path(out_dir)
    _check_out_dir(out)
    ckpt = Checkpointer(checkpoints_dir, async_save=False)
    try:
        steps = sorted(ckpt.all_steps())
        if not steps:
            raise ExportError(f"{run_dir}: no complete checkpoint in {checkpoints_dir}; {_RUN_DIR_LAYOUT}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ExportError(f"{run_dir}: no checkpoint at step {step}; the available steps are "
                              f"{', '.join(map(str, steps))}")
        definition = ckpt.read_meta(step).get("run")
        if not isinstance(definition, Mapping):
            raise ExportError(f"checkpoint step {step} in {checkpoints_dir} stores no run definition (meta['run']); "
                              "it was not written by nnx_zoo.train.train")
        config, lora = _model_config(definition, checkpoints_dir, step)
        model, merged = _restored_model(ckpt, step, config, lora)
    finally:
        ckpt.close()

    _clear_earlier_export(out)
    model.save_pretrained(out)
    tokenizer = _copy_tokenizer(definition, out)
    files = tuple(sorted(p.name for p in out.iterdir()))
    model_type = definition["structure"]["model"]["model_type"]
    info = ExportInfo(out, model_type, type(model).__name__, step, files, tokenizer, merged)
    mtp = getattr(config, "num_nextn_predict_layers", 0)
    say(f"exported step {step} of {run_dir} ({type(model).__name__}, model_type {model_type}, "
        f"{config.param_dtype}) to {out}")
    if mtp:
        say(f"MTP heads: {mtp}, as layers {config.num_hidden_layers}..{config.num_hidden_layers + mtp - 1}")
    if merged:
        say(f"LoRA: {merged} adapted modules merged into their weights")
    say(f"files: {', '.join(files)}")
    say(f"tokenizer: {tokenizer}")
    return info


# ------------------------------------------------------------------------------------------------ inputs
def _checkpoints_dir(path: Path) -> tuple[Path, int | None]:
    """The checkpoints directory of ``path`` (a run directory, its ``checkpoints``, or one step's directory),
    and the step when ``path`` names one."""
    if not path.is_dir():
        raise ExportError(f"{path}: no such run directory; {_RUN_DIR_LAYOUT}")
    if (path / "checkpoints").is_dir():
        return (path / "checkpoints").absolute(), None
    if path.name.isdigit() and all((path / item).is_dir() for item in ITEMS):  # RUN_DIR/checkpoints/<step>
        return path.parent.absolute(), int(path.name)
    if any(p.name.isdigit() and (p / "state").is_dir() for p in path.iterdir()):  # RUN_DIR/checkpoints
        return path.absolute(), None
    raise ExportError(f"{path}: not a run directory (no checkpoints/ in it); {_RUN_DIR_LAYOUT}")


def _is_export(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()


def _check_out_dir(out: Path) -> None:
    """Refuse to write where an export would overwrite or mix with files it did not write."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; choose a new output directory")
    entries = list(out.iterdir())
    if not entries:
        return
    if not _is_export(out):
        raise ExportError(f"{out} is not empty and holds no earlier export (config.json and "
                          "model.safetensors.index.json); choose a new or empty output directory")
    strangers = [p.name for p in entries if not _export_file(p)]
    if strangers:
        raise ExportError(f"{out} holds an earlier export and other files ({', '.join(sorted(strangers)[:5])}); "
                          "choose a new or empty output directory")


def _export_file(p: Path) -> bool:
    return p.is_file() and (p.name in _EXPORT_FILES or (p.name.startswith("model") and p.suffix == ".safetensors"))


def _clear_earlier_export(out: Path) -> None:
    """Remove an earlier export's files, so no stale shard or tokenizer survives into the new one."""
    if out.is_dir():
        for p in out.iterdir():
            if _export_file(p):
                p.unlink()


def _model_config(definition: Mapping[str, Any], where: Path, step: int) -> tuple[Any, dict[str, Any] | None]:
    """The model config the run trained (HF dict plus the stored settings) and its LoRA settings, if any."""
    from nnx_zoo.models.registry import MODEL_TYPES, AutoConfig

    structure = dict(definition.get("structure", {}).get("model") or {})
    settings = dict(definition.get("settings", {}).get("model") or {})
    model_type = structure.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ExportError(f"checkpoint step {step} in {where}: its run definition names model_type {model_type!r}; "
                          f"exportable model types are {sorted(MODEL_TYPES)}")
    config_cls = MODEL_TYPES[model_type][0]
    names = {f.name for f in dataclasses.fields(config_cls)}
    lora = settings.pop("lora", None)
    # Non-config settings (e.g. "from_pretrained": where the starting weights came from) do not shape the model.
    overrides = {k: v for k, v in settings.items() if k in names}
    try:
        config = AutoConfig.from_hf(structure, **overrides)
    except (ValueError, TypeError) as err:
        raise ExportError(f"checkpoint step {step} in {where}: its stored model config cannot be rebuilt: {err}"
                          ) from err
    if lora is not None and not (isinstance(lora, Mapping) and {"rank", "alpha"} <= set(lora)):
        raise ExportError(f"checkpoint step {step} in {where}: model settings 'lora' must be a dict with rank, "
                          f"alpha and pattern (nnx_zoo.layers.lora.lora_settings), got {lora!r}")
    return config, None if lora is None else dict(lora)


def _abstract_model(config: Any, lora: dict[str, Any] | None) -> nnx.Module:
    from nnx_zoo.layers.lora import apply_lora
    from nnx_zoo.models.registry import AutoModelForCausalLM
    from nnx_zoo.sharding import abstract_module

    model_cls = AutoModelForCausalLM.model_class(config)

    def make() -> nnx.Module:
        model = model_cls(config, rngs=nnx.Rngs(0))
        if lora is not None:
            apply_lora(model, pattern=lora.get("pattern"), rank=int(lora["rank"]), alpha=float(lora["alpha"]))
        return model

    return abstract_module(make)


def _restored_model(ckpt: Checkpointer, step: int, config: Any, lora: dict[str, Any] | None) -> tuple[Any, int]:
    """The model of checkpoint ``step``, its weights on one host device; LoRA adapters merged. Only the model's
    part of the stored state is read (orbax's partial restore), not the optimizer's."""
    from nnx_zoo.layers.lora import LoRAParam, merge_lora

    abstract = _abstract_model(config, lora)
    graphdef, state = nnx.split(abstract)
    device = jax.local_devices(backend="cpu")[0]  # host memory: the export goes through the host anyway
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          nnx.to_pure_dict(state))
    stored = _stored_model_tree(ckpt, step)
    adapters_stored = _has_lora(stored)
    where = f"checkpoint step {step} in {ckpt.directory}"
    if adapters_stored and lora is None:
        raise ExportError(f"{where} holds LoRA adapters, but the run's model settings do not say how they were "
                          "made; record them when training: train(..., model_settings={..., 'lora': "
                          "lora_settings(pattern, rank, alpha)}) (nnx_zoo.layers.lora)")
    if lora is not None and not adapters_stored:
        raise ExportError(f"{where}: the run's model settings name LoRA adapters ({lora}) but the checkpoint holds "
                          "none")
    # A partial restore reads what the target names and skips the rest: check that the model's parts match the
    # stored ones exactly, or a head the rebuilt config lacks (e.g. MTP) would be dropped without a word.
    missing, unexpected = _tree_difference(target, stored)
    if missing or unexpected:
        raise ExportError(f"{where}: the model rebuilt from the run's definition does not match the stored weights"
                          + (f"; not stored: {', '.join(missing[:5])}" if missing else "")
                          + (f"; stored but not in the model: {', '.join(unexpected[:5])}" if unexpected else ""))
    ckpt.verify_files(step)  # a damaged checkpoint is named as such, never exported
    try:
        restored = ckpt.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item={"model": target},
                restore_args={"model": jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=sharding), target)},
                partial_restore=True)))
    except Exception as err:  # orbax raises many types; name the checkpoint and the likely cause
        raise ExportError(f"{where}: the model weights cannot be read for the stored config ({_short(err)}); the "
                          "checkpoint may be corrupt, or its model settings (e.g. 'lora') do not match its weights"
                          ) from err
    ckpt.verify_arrays(step, {"model": restored.state["model"]})
    nnx.replace_by_pure_dict(state, restored.state["model"])
    model = nnx.merge(graphdef, state)
    merged = 0
    if lora is not None:
        merged = merge_lora(model)
        if any(isinstance(v, LoRAParam) for v in jax.tree.leaves(nnx.state(model), is_leaf=_is_variable)):
            raise ExportError(f"{where}: LoRA adapters remain after merging")
    return model, merged


def _tree_difference(target: Any, stored: Any) -> tuple[list[str], list[str]]:
    """('/'-joined leaf paths of ``target`` not in ``stored``, those of ``stored`` not in ``target``)."""
    def paths(tree: Any, prefix: str = "") -> set[str]:
        if isinstance(tree, Mapping):
            return {p for k, v in tree.items() for p in paths(v, f"{prefix}{k}/")}
        return {prefix.rstrip("/")}

    ours, theirs = paths(target), paths(stored)
    return sorted(ours - theirs), sorted(theirs - ours)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _stored_model_tree(ckpt: Checkpointer, step: int) -> Any:
    """The stored ``state['model']`` tree's metadata (names and shapes, no values)."""
    # The handler's own reader: the checkpointer's would warn about a file the manager does not write.
    metadata = ocp.PyTreeCheckpointHandler().metadata(ckpt.directory / str(step) / "state")
    tree = getattr(metadata, "tree", metadata)
    if not isinstance(tree, Mapping) or "model" not in tree:
        raise ExportError(f"checkpoint step {step} in {ckpt.directory}: its state holds no model (keys: "
                          f"{sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__})")
    return tree["model"]


# The attribute names of LoRALinear's and LoRAExperts' factors (nnx_zoo.layers.lora).
_LORA_KEYS = frozenset(f"{name}_{ab}" for name in ("lora", "wi_gate", "wi_up", "wo") for ab in "ab")


def _has_lora(tree: Any) -> bool:
    if isinstance(tree, Mapping):
        return any(str(k) in _LORA_KEYS or _has_lora(v) for k, v in tree.items())
    return False


def _short(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[:limit] + " ..."


# ------------------------------------------------------------------------------------------------ tokenizer
def _copy_tokenizer(definition: Mapping[str, Any], out: Path) -> str:
    """Copy the run's tokenizer JSON file into ``out``; returns a line saying what was done and why."""
    data = definition.get("settings", {}).get("data") or {}
    source, tokenizer = data.get("source", "synthetic"), data.get("tokenizer", "bytes")
    if source == "synthetic":
        return "none (the run trained on synthetic token ids; no tokenizer was used)"
    if tokenizer in (None, "bytes"):
        return ("none (the run used the built-in byte tokenizer: bytes are ids 0-255, <eos> 256, <pad> 257; "
                "nnx_zoo.train.tokenize.ByteTokenizer)")
    path = Path(tokenizer)
    if not path.is_file():
        return (f"none: the run's tokenizer file {tokenizer} is not there any more (a relative path is read from "
                "the current directory); copy it into the export as tokenizer.json yourself")
    from nnx_zoo.hf.config_io import write_json
    from nnx_zoo.train.tokenize import JsonTokenizer

    shutil.copyfile(path, out / "tokenizer.json")
    # transformers' AutoTokenizer needs a class to build from tokenizer.json; the generic fast one fits any file.
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    try:
        json_tokenizer = JsonTokenizer(path, eos_token=data.get("eos_token"))
        tokenizer_config["eos_token"] = json_tokenizer._tok.id_to_token(json_tokenizer.eos_id)
    except ValueError:  # no end-of-sequence token the trainer knows: the file itself is still the tokenizer
        pass
    write_json(out / "tokenizer_config.json", tokenizer_config)
    eos = f"; eos {tokenizer_config['eos_token']!r}" if "eos_token" in tokenizer_config else ""
    return f"copied from {path} (tokenizer.json, tokenizer_config.json{eos})"
