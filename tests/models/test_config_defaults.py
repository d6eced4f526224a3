"""A ``config.json`` that leaves out optional keys reads as transformers' config class reads the same dict.

For every registered ``model_type``: a tiny preset's exported dict (a multimodal type: that dict as its
``text_config``), with each optional key left out in turn and then all of them at once. What ``from_hf`` reads
must equal what it reads from the dict transformers' config class makes of it (its defaults filled in, its
derived fields spelt out), field by field over the fields of our config. Both sides go through transformers'
class, so a field we keep as "derive it" (``layer_types=None``) and transformers spells out compares equal; a
default of ours that differs from transformers' is written out by our export and so shows. A key whose absence
we refuse (a shape field, ``REQUIRED_HF_FIELDS``, or a value that no longer fits the others) is not compared.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import pytest
import transformers

from nnx_zoo.models.registry import MODEL_TYPES

transformers.logging.set_verbosity_error()  # its warnings on the tiny presets' token ids and rope factors
SKIP_KEYS = {"model_type", "architectures", "transformers_version", "torch_dtype", "dtype"}
MULTIMODAL = {"llama4": "llama4_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
              "gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# A layer schedule is spelt as a list (layer_types) or a rule (a pattern, an interval): compared as layer_kinds().
SCHEDULE_FIELDS = {"layer_types", "sliding_window_pattern", "mlp_layer_types", "moe_layers", "no_rope_layers"}
# Moonshot's Kimi K2 has no transformers class of its own: its checkpoints name DeepseekV3Config's code.
HF_CLASS_OF = {"kimi_k2": "deepseek_v3"}


def _preset_dict(model_type: str) -> dict[str, Any]:
    """The exported config.json dict of the smallest preset that exports ``model_type`` (or its text type)."""
    config_cls = MODEL_TYPES[model_type][0]
    exported = MULTIMODAL.get(model_type, HF_CLASS_OF.get(model_type, model_type))
    names = [p for p in config_cls.PRESETS if config_cls.preset(p).to_hf_dict().get("model_type") == exported]
    assert names, f"no preset of {config_cls.__name__} exports {exported}"
    name = min(names, key=lambda p: ("tiny" not in p, len(p)))
    return config_cls.preset(name).to_hf_dict()


def _wrap(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "text_config": d} if model_type in MULTIMODAL else {**d, "model_type":
                                                                                           model_type}


def _through_transformers(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """The dict transformers' config class makes of ``d`` (defaults filled in), in ``model_type``'s layout."""
    cls = transformers.CONFIG_MAPPING[HF_CLASS_OF.get(model_type, MULTIMODAL.get(model_type, model_type))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cls(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
    return _wrap(model_type, out)


def _read(model_type: str, d: dict[str, Any]) -> Any:
    return MODEL_TYPES[model_type][0].from_hf(_wrap(model_type, d))


def _differences(model_type: str, d: dict[str, Any]) -> list[str] | None:
    """Fields where our reading of ``d`` differs from our reading of transformers' reading of it; None where we
    (or transformers) refuse ``d``."""
    d = json.loads(json.dumps(d))  # as a config.json holds it (lists, not tuples)
    try:
        ours = _read(model_type, d)
        ours = json.loads(json.dumps(_unwrap(ours.to_hf_dict())))
        theirs = _through_transformers(model_type, d)
        ours = MODEL_TYPES[model_type][0].from_hf(_through_transformers(model_type, ours))
    except (ValueError, TypeError):
        return None
    except Exception as err:  # transformers refuses it (huggingface_hub's strict dataclass validation)
        if "transformers" in type(err).__module__ or "huggingface_hub" in type(err).__module__:
            return None
        raise
    theirs = MODEL_TYPES[model_type][0].from_hf(theirs)
    def value(config: Any, name: str) -> Any:
        v = getattr(config, name)
        return v() if callable(v) else v

    fields = [f.name for f in dataclasses.fields(ours)]
    if callable(getattr(ours, "layer_kinds", None)):  # a schedule's spellings compare as the schedule they give
        fields = [f for f in fields if f not in SCHEDULE_FIELDS] + ["layer_kinds"]
    return [f"{f}: ours {value(ours, f)!r}, transformers' {value(theirs, f)!r}" for f in fields
            if value(ours, f) != value(theirs, f)]


def _unwrap(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "model_type"}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_a_config_json_without_optional_keys_reads_as_transformers_reads_it(model_type):
    full = _unwrap(_preset_dict(model_type))
    assert _differences(model_type, full) == [], "the full dict itself"
    required = set(MODEL_TYPES[model_type][0].REQUIRED_HF_FIELDS)
    optional, problems = [], []
    for key in sorted(set(full) - SKIP_KEYS - required):
        found = _differences(model_type, {k: v for k, v in full.items() if k != key})
        if found is not None:
            optional.append(key)
            problems += [f"without {key!r}: {line}" for line in found]
    assert len(optional) >= 3, optional  # the comparison ran on something
    found = _differences(model_type, {k: v for k, v in full.items() if k not in optional})
    assert found is not None, f"without all of {optional}: refused"
    problems += [f"without all optional keys: {line}" for line in found]
    assert not problems, "\n".join(problems)
