"""``DecoderConfig``: the hyper-parameters of a dense pre-norm decoder (GQA attention + SwiGLU), shared by the
families built on ``nnx_zoo.models.causal_lm`` (Llama 3, Qwen3).

Fields carry Hugging Face ``config.json`` names. A family's config is only what differs: a subclass names, as
class keywords, its ``model_type``, its architecture name, whether its attention normalizes queries and keys per
head (``qk_norm``), its presets (``cpu_presets`` gives the two small CPU ones every family has), the field values
of its flagship size (which become the subclass's defaults) and constant HF keys; it may refuse HF settings it
does not implement (``_hf_problems``). Fields after ``initializer_range`` are nnx_zoo's own (compute/parameter
dtype, layer scanning, rematerialization, attention kernel) and are not written to HF.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Self

import jax.numpy as jnp

from nnx_zoo.hf.config_io import config_json_path, read_json_object
from nnx_zoo.hf.errors import CheckpointFormatError
from nnx_zoo.layers.kernel_choices import kernel_setting_problems
from nnx_zoo.layers.pipeline import pipeline_chunk
from nnx_zoo.layers.rope import LinearScaling, Llama3Scaling, RopeScaling, YarnScaling, rope_from_hf, rope_to_hf

# The stack-name prefix of the layers that run before the pipeline (``pipeline_layers``): ``prefix_layers``, ...
PREFIX = "prefix_"

# The dtype names a model computes and stores parameters in (``jnp.dtype`` aliases such as jnp.bfloat16 map here).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


class LayerKind(NamedTuple):
    """What sets a decoder layer apart within its model; the layers of one kind share a stack (``layer_stacks``).

    ``attention``: ``"full"``, ``"sliding"`` (a sliding window) or ``"chunked"`` (transformers' ``layer_types``
    words without ``_attention``); ``moe``: a sparse MoE MLP instead of the dense one. A family with more kinds
    (Llama 4's NoPE layers, Gemma 4's shared K/V) uses its own NamedTuple with these two fields and its own.

    >>> LayerKind("sliding", moe=True)
    LayerKind(attention='sliding', moe=True)
    """

    attention: str = "full"
    moe: bool = False


ATTENTION_KINDS = ("full", "sliding", "chunked")
FULL = LayerKind()  # a full-attention layer with the dense MLP


class ParameterCount(NamedTuple):
    """``total``: every parameter; ``active``: those one token uses (all of them in a dense model; k of the routed
    experts per MoE layer in an MoE one); ``embedding``: the input embedding table (a lookup, not a matmul)."""

    total: int
    active: int
    embedding: int


class FamilyConfig:
    """What every family's config dataclass shares: presets by name, validated copies, canonical dtype names.

    A family's config is a frozen dataclass subclassing it, with ``PRESETS`` (name -> fields) and its own
    ``num_parameters()`` / ``train_flops_per_token(seq_len)``:

    >>> Qwen3Config.preset("qwen3-tiny", num_hidden_layers=1).with_overrides(dtype="bfloat16").dtype
    'bfloat16'
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    # config.json keys with no sensible default: the architecture's shape. A file without one is refused, naming
    # it (a silent default such as hidden_size=4096 would only show up later as a list of wrong tensor shapes).
    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = ()
    # What transformers' config class takes for a key that config.json leaves out, where it differs from this
    # class's field default (a flagship's value): HF model_type -> {key: value}. A file's silence means what
    # transformers makes of it, not our flagship's setting (tests/models/test_config_defaults.py checks every
    # model_type against transformers' classes). A multimodal file's text_config takes its text model type's.
    HF_CLASS_DEFAULTS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    # Kernel settings whose choices a family narrows (field -> names), e.g. an attention with no cuDNN kernel; the
    # rest take every name of nnx_zoo.layers.kernel_choices.KERNEL_SETTINGS.
    KERNEL_OPTIONS: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        """The ``config.json`` ``model_type`` values this config reads (each family's config names them)."""
        return ()

    @classmethod
    def check_field_names(cls, names: Any) -> None:
        """Raise ``TypeError`` naming each of ``names`` that is not a field of this config, with close matches
        (a misspelt override must not become a raw dataclass error, or silently nothing)."""
        fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = [name for name in names if name not in fields]
        if not unknown:
            return
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, fields, n=3)
            hints.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
        raise TypeError(f"unknown {cls.__name__} fields: {', '.join(hints)}; fix the name (its fields are "
                        f"{', '.join(fields)})")

    @property
    def mtp_depth(self) -> int:
        """How many multi-token-prediction depths ``forward(..., with_mtp=True)`` returns (``mtp_logits``' leading
        dim); 0: the model has no MTP. Trainers and recipes ask this, not a family's own field."""
        return 0

    def with_overrides(self, **overrides: Any) -> Self:
        """A copy with some fields changed (validated again)."""
        self.check_field_names(overrides)
        return dataclasses.replace(self, **overrides)  # type: ignore[type-var]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """A named configuration of this family (``PRESETS``: published sizes and small CPU ones)."""
        try:
            fields = cls.PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r} of {cls.__name__}; choose one of {sorted(cls.PRESETS)}"
                             ) from None
        cls.check_field_names(overrides)
        return cls(**{**fields, **overrides})

    @classmethod
    def from_hf(cls, dir_or_dict: str | Path | Mapping[str, Any], **overrides: Any) -> Self:
        """Read this family's HF ``config.json`` (a checkpoint directory, the file, or its dict).

        Both rope forms are read (transformers-5 ``rope_parameters``; the hub's legacy ``rope_scaling`` with a
        top-level ``rope_theta``). ``overrides`` set any field, e.g. ``dtype="bfloat16"``. A file of another
        ``model_type``, or one that is missing, not a JSON object, or holds unusable values, raises
        ``nnx_zoo.hf.CheckpointFormatError`` naming the file; so does one without a shape field
        (``REQUIRED_HF_FIELDS``, e.g. ``hidden_size``), naming it. An unknown override is the caller's
        ``TypeError``, with the close field names.
        """
        cls.check_field_names(overrides)  # the caller's mistake, not the file's
        if isinstance(dir_or_dict, Mapping):
            d = cls._with_hf_defaults(dict(dir_or_dict))
            return cls._from_hf_dict(cls._with_required(d, overrides), overrides)
        path = config_json_path(dir_or_dict)
        source = str(path) + (f" (with overrides {overrides})" if overrides else "")
        try:
            d = cls._with_hf_defaults(read_json_object(path, "model config"))
            return cls._from_hf_dict(cls._with_required(d, overrides), overrides)
        except CheckpointFormatError:
            raise
        except ValueError as err:
            raise CheckpointFormatError(f"{source}: {err}") from err

    @classmethod
    def _with_hf_defaults(cls, d: dict[str, Any]) -> dict[str, Any]:
        """``d`` with transformers' value for each ``HF_CLASS_DEFAULTS`` key it leaves out (in its ``text_config``
        too, by that dict's ``model_type``, or the one text type named in ``HF_CLASS_DEFAULTS``). A ``rope_theta``
        inside the rope dict still wins over the top-level one filled in here, as in transformers."""
        defaults = cls.HF_CLASS_DEFAULTS.get(d.get("model_type"), {})
        filled = {**{k: v for k, v in defaults.items() if k not in d}, **d}
        text = d.get("text_config")
        if isinstance(text, Mapping):
            others = [t for t in cls.HF_CLASS_DEFAULTS if t != d.get("model_type")]
            text_type = text.get("model_type", others[0] if len(others) == 1 else None)
            text_defaults = cls.HF_CLASS_DEFAULTS.get(text_type, {})
            filled["text_config"] = {**{k: v for k, v in text_defaults.items() if k not in text}, **text}
        return filled

    @classmethod
    def _with_required(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """``d`` itself, after a ``ValueError`` naming the ``REQUIRED_HF_FIELDS`` neither it nor ``overrides``
        gives."""
        missing = [name for name in cls.REQUIRED_HF_FIELDS if name not in d and name not in overrides]
        if missing:
            raise ValueError(f"missing required field(s) {', '.join(missing)}: the model's shape cannot be guessed; "
                             "add them to config.json (as the checkpoint's publisher wrote them), or pass them as "
                             f"overrides, e.g. from_hf(path, {missing[0]}=...)")
        return d

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Self:
        """The config for an HF ``config.json`` dict plus overrides; ``ValueError`` for unusable values."""
        raise NotImplementedError(f"{cls.__name__} does not read HF configs")

    def _problems(self) -> list[str]:
        """What is wrong with this config's values (every family names its own), one line each."""
        return []

    def _raise_problems(self) -> None:
        """Raise one ``ValueError`` listing every problem: each kernel setting its kernel does not take (checked
        here, for every family and every way a config is built), then the family's ``_problems()``."""
        problems = kernel_setting_problems(self, self.KERNEL_OPTIONS) + self._problems()
        if problems:
            raise ValueError(f"invalid {type(self).__name__}:\n  - " + "\n  - ".join(problems))

    def _canonical_dtypes(self) -> None:
        """Store ``dtype`` / ``param_dtype`` as numpy dtype names (``jnp.float32`` -> ``'float32'``)."""
        for name in ("dtype", "param_dtype"):
            try:
                object.__setattr__(self, name, jnp.dtype(getattr(self, name)).name)
            except TypeError:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a dtype; use one of {', '.join(DTYPE_NAMES)}"
                                 ) from None
            if getattr(self, name) not in DTYPE_NAMES:  # numpy knows more (int8, float8_*) than a model runs in
                raise ValueError(f"{name}={getattr(self, name)!r} is not a supported compute/parameter dtype; use one "
                                 f"of {', '.join(DTYPE_NAMES)}")


@dataclasses.dataclass(frozen=True)
class DecoderConfig(FamilyConfig):
    """A dense decoder's hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    Use a family's subclass (``Llama3Config``, ``Qwen3Config``):

    >>> cfg = Llama3Config.preset("llama3-tiny")
    >>> cfg = Qwen3Config.from_hf("/path/to/checkpoint")          # a directory with config.json, or a dict
    >>> cfg.with_overrides(num_hidden_layers=2).num_parameters().total

    ``head_dim=None`` means ``hidden_size // num_attention_heads``; ``rope_scaling`` is None (the default
    schedule), a ``LinearScaling`` / ``Llama3Scaling`` / ``YarnScaling``, or an HF rope dict (converted).
    ``partial_rotary_factor < 1`` ropes only each head's first ``rotary_dim`` dims (HF's partial rotary: the
    rotated part first, rotate-half inside it; the rest unrotated); ``attention_bias`` adds q/k/v biases (and an
    ``o_proj`` one unless the family's ``O_BIAS`` is False).
    """

    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_attention_heads")
    MODEL_TYPE: ClassVar[str] = ""  # HF model_type this config reads and writes
    ARCHITECTURE: ClassVar[str] = ""  # HF architectures[0]
    QK_NORM: ClassVar[bool] = False  # per-head RMSNorm of queries and keys before rope
    # Whether that q/k norm runs over the whole projection (one statistic and scale over all heads: num_heads *
    # head_dim for queries, num_key_value_heads * head_dim for keys) rather than over each head.
    QK_NORM_FULL_WIDTH: ClassVar[bool] = False
    # Whether o_proj has a bias when attention_bias is set (None: it does, as Llama's; False: only q/k/v do).
    O_BIAS: ClassVar[bool | None] = None
    HF_EXTRAS: ClassVar[dict[str, Any]] = {}  # constant keys written to config.json
    # What transformers' config class makes of a config.json without num_key_value_heads: its class default (an
    # int), or None for LlamaConfig's rule, num_attention_heads (multi-head attention).
    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = None
    # What transformers makes of a config.json without head_dim: its config class's default (an int), or None for
    # hidden_size // num_attention_heads (LlamaConfig's and MixtralConfig's rule; the MoE families' attention
    # computes it so when their config class has no head_dim).
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = None
    # Whether transformers builds the model from "head_dim": null, as hidden_size // num_attention_heads (Llama,
    # Mixtral); False where its config class refuses null (Qwen3) or its model fails on it (Qwen3-MoE, GLM-4.5),
    # so such a file is refused here too.
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = True
    # Whether the family's transformers model implements partial_rotary_factor (GLM-4.5 does; Llama, Qwen3,
    # Qwen3-MoE and Mixtral rope whole heads and ignore or fail on another value, so here it is refused).
    PARTIAL_ROTARY: ClassVar[bool] = False

    def __init_subclass__(cls, *, model_type: str | None = None, architecture: str | None = None,
                          qk_norm: bool | None = None, o_bias: bool | None = None,
                          presets: Mapping[str, dict[str, Any]] | None = None,
                          defaults: Mapping[str, Any] | None = None, hf_extras: Mapping[str, Any] | None = None,
                          **kwargs: Any) -> None:
        """A family's class keywords (those not given are inherited):

        >>> @dataclasses.dataclass(frozen=True)
        ... class MyConfig(DecoderConfig, model_type="my", architecture="MyForCausalLM", qk_norm=True,
        ...                presets=cpu_presets("my", head_dim=32), defaults=dict(vocab_size=50000)):
        ...     pass
        """
        super().__init_subclass__(**kwargs)
        for attr, value in (("MODEL_TYPE", model_type), ("ARCHITECTURE", architecture), ("QK_NORM", qk_norm),
                            ("O_BIAS", o_bias), ("PRESETS", presets), ("HF_EXTRAS", hf_extras)):
            if value is not None:
                setattr(cls, attr, dict(value) if isinstance(value, Mapping) else value)
        # The flagship's values become field defaults: the dataclass decorator, which runs after this hook,
        # reads a field's default from an annotated class attribute.
        # The nearest dataclass base (DecoderConfig, or e.g. MoEDecoderConfig) names the fields defaults may set.
        base = next(b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b))
        types = typing.get_type_hints(base)  # the evaluated types, not the modules' annotation strings
        fields = {f.name for f in dataclasses.fields(base)}
        for name, value in (defaults or {}).items():
            if name not in fields:
                raise TypeError(f"{cls.__name__}: default for unknown field {name!r}; fields are {sorted(fields)}")
            cls.__annotations__[name] = types[name]
            setattr(cls, name, value)

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = None  # an HF rope dict is accepted and converted
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0  # rope on each head's first int(head_dim * factor) dims (rotate-half)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    # ---- nnx_zoo only ----
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters
    scan_layers: bool = True  # scan the layer stack (one compiled body); False unrolls it (debugging, same numbers)
    remat_policy: str = "none"  # 'none' | 'full' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
    attention_impl: str = "auto"  # 'auto' | 'xla' (einsum, the reference) | 'blockwise' (portable flash) | 'cudnn'
    # | 'tokamax' (nnx_zoo.layers.attention.choose_attention_impl)
    # How many of the last decoder layers a 'stage' mesh axis pipelines (None: all). The layers before them live in
    # their own stacks (``prefix_`` + the stack name, placed like ``unpipelined_layers``: whole on every stage) and
    # run before the pipeline; without 'stage' every layer runs in order, the same model. It changes the parameter
    # tree (not the HF checkpoint: the key table maps both stacks to their HF layers).
    pipeline_layers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            _, scaling = rope_from_hf({"rope_scaling": dict(self.rope_scaling),
                                       "max_position_embeddings": self.max_position_embeddings})
            object.__setattr__(self, "rope_scaling", scaling)
        if self.head_dim is None and _positive_int(self.hidden_size) and _positive_int(self.num_attention_heads):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._canonical_dtypes()
        self._raise_problems()

    def _problems(self) -> list[str]:
        p: list[str] = []
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            if not _positive_int(getattr(self, name)):
                p.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if _positive_int(self.num_attention_heads) and _positive_int(self.num_key_value_heads) and (
                self.num_attention_heads % self.num_key_value_heads):
            p.append(f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                     f"{self.num_attention_heads} (each key/value head serves a whole group of query heads)")
        if _positive_int(self.head_dim) and self.head_dim % 2:
            p.append(f"head_dim must be even (rope rotates pairs), got {self.head_dim}")
        factor = self.partial_rotary_factor
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1):
            p.append(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
        elif factor != 1 and not self.PARTIAL_ROTARY:
            p.append(f"partial_rotary_factor={factor}: {type(self).__name__} ropes whole heads, as its transformers "
                     "model does (it does not implement partial rotary); use 1.0")
        elif _positive_int(self.head_dim) and (self.rotary_dim < 2 or self.rotary_dim % 2):
            p.append(f"partial_rotary_factor={factor} leaves int(head_dim * factor) = {self.rotary_dim} rotary dims; "
                     "rope rotates pairs, so it must be a positive even number")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                p.append(f"{name} must be a positive number, got {value!r}")
        p += self._pipeline_layers_problems()
        if not isinstance(self.rope_scaling, (LinearScaling, Llama3Scaling, YarnScaling, type(None))):
            p.append(f"rope_scaling must be None, LinearScaling, Llama3Scaling, YarnScaling or an HF rope dict, got "
                     f"{self.rope_scaling!r}")
        return p

    @property
    def rotary_dim(self) -> int:
        """How many of each query/key head's dims rope rotates (the first ones): ``int(head_dim *
        partial_rotary_factor)``, as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm(self) -> bool:
        """Whether attention RMS-normalizes each query and key head (the family's ``QK_NORM``; a family whose
        config.json switches it overrides this)."""
        return self.QK_NORM

    @property
    def qk_norm_full_width(self) -> bool:
        """Whether the q/k norm (``qk_norm``) spans the whole projection instead of each head (the family's
        ``QK_NORM_FULL_WIDTH``)."""
        return self.QK_NORM_FULL_WIDTH

    @property
    def attention_output_bias(self) -> bool:
        """Whether ``o_proj`` has a bias: ``attention_bias`` unless the family's ``O_BIAS`` says otherwise."""
        return self.attention_bias if self.O_BIAS is None else self.O_BIAS and self.attention_bias

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """``(query/key width, value width)`` of one attention head (both ``head_dim``)."""
        return self.head_dim, self.head_dim

    # ---- the layer schedule ----
    def layer_kinds(self) -> tuple[Any, ...]:
        """One ``LayerKind`` per decoder layer (here every layer full attention with the dense MLP; a family with
        local or MoE layers says which)."""
        return (LayerKind(),) * self.num_hidden_layers

    def attention_options(self, kind: Any) -> dict[str, Any]:
        """``Attention``'s local-attention keywords for a layer of ``kind`` (``window``, ``chunk``, ``sinks``,
        ``softcap``); none for full attention. A family with local layers answers for them."""
        if kind.attention != "full":
            raise NotImplementedError(f"{type(self).__name__} has no {kind.attention!r} attention layers")
        return {}

    def mlp_width(self, kind: Any) -> int:
        """The dense MLP's width in a layer of ``kind`` (0: none, an MoE layer's sparse block takes its place); the
        sharding plan counts each kind's activations with it."""
        return 0 if kind.moe else self.intermediate_size

    def stack_name(self, kind: Any) -> str:
        """The model attribute holding the stack of ``kind``'s layers: ``layers``, prefixed by the attention kind
        unless full (``sliding_layers``), and ``dense_`` for the dense layers of a model mixing dense and MoE
        ones (``dense_layers``, ``sliding_dense_layers``)."""
        mixed = len({k.moe for k in self.layer_kinds()}) > 1
        return ("" if kind.attention == "full" else f"{kind.attention}_") + (
            "dense_" if mixed and not kind.moe else "") + "layers"

    def layer_stacks(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        """``(stack name, kind, layer indices)`` per kind, in order of the kinds' first layers; with
        ``pipeline_layers`` the layers before the last ``pipeline_layers`` in stacks of their own first
        (``prefix_`` + the name: ``unpipelined_layers`` stacks, run before the pipeline).

        >>> Llama3Config.preset("llama3-tiny").layer_stacks()
        [('layers', LayerKind(attention='full', moe=False), (0, 1, 2, 3))]
        >>> split = Llama3Config.preset("llama3-tiny", pipeline_layers=2)
        >>> [(name, indices) for name, _, indices in split.layer_stacks()]
        [('prefix_layers', (0, 1)), ('layers', (2, 3))]
        """
        kinds, split = self.layer_kinds(), self.unpipelined_layers
        out = []
        for prefix, layers in ((PREFIX, range(split)), ("", range(split, len(kinds)))):
            for kind in dict.fromkeys(kinds[i] for i in layers):
                out.append((prefix + self.stack_name(kind), kind, tuple(i for i in layers if kinds[i] == kind)))
        return out

    def layer_stack_names(self) -> tuple[str, ...]:
        """The stack name of each decoder layer, in model order (``layer_stacks``' names)."""
        names = [""] * self.num_hidden_layers
        for name, _, indices in self.layer_stacks():
            for i in indices:
                names[i] = name
        return tuple(names)

    @property
    def unpipelined_layers(self) -> int:
        """How many leading decoder layers run before the pipeline, outside it (``num_hidden_layers -
        pipeline_layers``; 0 when ``pipeline_layers`` is None)."""
        return 0 if self.pipeline_layers is None else self.num_hidden_layers - self.pipeline_layers

    def check_pipeline(self, stages: int, virtual_stages: int = 1) -> tuple[str, ...]:
        """The stack names of one pipeline chunk's layers when the pipelined layers (the last ``pipeline_layers``)
        split into ``stages * virtual_stages`` identical chunks; else a ``ValueError`` naming the
        ``pipeline_layers`` values that fit (``nnx_zoo.layers.pipeline.pipeline_chunk``)."""
        names, split = self.layer_stack_names(), self.unpipelined_layers
        # The advice compares layer kinds, not stack names (a prefix stack holds the same kind as its pipelined one).
        kinds = [self.stack_name(kind) for kind in self.layer_kinds()]
        pipeline_chunk(kinds[split:], stages, virtual_stages, unpipelined=kinds[:split])
        return names[split:split + len(names[split:]) // (stages * virtual_stages)]

    def _pipeline_layers_problems(self) -> list[str]:
        value, layers = self.pipeline_layers, self.num_hidden_layers
        if value is None or not _positive_int(layers):
            return []
        if not _positive_int(value) or value > layers:
            return [f"pipeline_layers={value!r} must be None (every layer pipelined) or a layer count in [1, "
                    f"num_hidden_layers={layers}]: the last pipeline_layers layers form the pipeline's stacks"]
        return []

    # ---- Hugging Face config.json (``FamilyConfig.from_hf`` reads the file) ----
    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return (cls.MODEL_TYPE,)

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> DecoderConfig:
        model_type = d.get("model_type", cls.MODEL_TYPE)
        if model_type != cls.MODEL_TYPE:
            raise ValueError(f"model_type {model_type!r} is not {cls.MODEL_TYPE!r}: {cls.__name__} cannot read it; "
                             "nnx_zoo.AutoModelForCausalLM.from_pretrained (or AutoConfig.from_hf) picks the family "
                             "from model_type")
        problems = cls._hf_problems(d)
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if problems:
            raise ValueError("unsupported config:\n  - " + "\n  - ".join(problems))
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:  # not our class default: theirs
            d = {**d, "num_key_value_heads": cls.HF_KV_HEADS_IF_ABSENT or d["num_attention_heads"]}
        # partial_rotary_factor: in the rope dict (transformers 5) or top level (hub files); else the class's.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", cls.partial_rotary_factor))
        d = {**d, **{key: {k: v for k, v in d[key].items() if k != "partial_rotary_factor"}
                     for key in ("rope_scaling", "rope_parameters") if isinstance(d.get(key), Mapping)}}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and k not in ("rope_theta", "rope_scaling", "dtype")}
        kwargs["partial_rotary_factor"] = factor
        # A file's silence or null means what transformers makes of it, not our class default (None below:
        # hidden_size // num_attention_heads, filled in by __post_init__).
        if "head_dim" not in d:
            kwargs["head_dim"] = cls.HF_HEAD_DIM_IF_ABSENT
        elif d["head_dim"] is None and not cls.HF_HEAD_DIM_NULL_OK and "head_dim" not in overrides:
            absent = cls.HF_HEAD_DIM_IF_ABSENT or "hidden_size // num_attention_heads"
            raise ValueError(f"head_dim is null: transformers' {cls.MODEL_TYPE} cannot build that model (its config "
                             "class refuses null or its attention fails on it); give the number, or leave the key "
                             f"out (transformers then takes {absent})")
        try:
            kwargs["rope_theta"], kwargs["rope_scaling"] = rope_from_hf(d, default_theta=cls.rope_theta)
            return cls(**{**kwargs, **overrides})
        except TypeError as err:  # a value of the wrong JSON type (float(None), ...)
            raise ValueError(f"a config value has the wrong type: {err}") from err

    @classmethod
    def _hf_problems(cls, d: dict[str, Any]) -> list[str]:
        """HF settings of this family that the model does not implement (each one line)."""
        return []

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (legacy ``rope_scaling`` with a top-level ``rope_theta``, which
        transformers 4 and 5 both read)."""
        d: dict[str, Any] = {"architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name in ("rope_theta", "rope_scaling") or (f.name == "partial_rotary_factor"
                                                              and self.partial_rotary_factor == 1.0):
                continue  # full rotary: the key is left out, as the dense families' files do
            d[f.name] = getattr(self, f.name)
            if f.name == "initializer_range":
                break
        d.update(rope_to_hf(self.rope_theta, self.rope_scaling))
        d.update(hidden_act="silu", torch_dtype=self.param_dtype, use_cache=True, **self.HF_EXTRAS)
        return d

    # ---- sizes and cost ----
    def _layer_params(self) -> int:
        h, heads, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attention = 2 * h * heads * hd + 2 * h * kv * hd
        if self.attention_bias:
            attention += heads * hd + 2 * kv * hd + (h if self.attention_output_bias else 0)
        if self.qk_norm:
            attention += (heads + kv) * hd if self.qk_norm_full_width else 2 * hd
        return attention + 3 * h * self.intermediate_size + 2 * h  # + input and post-attention norms

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts. ``include_mtp`` is accepted so every family answers the same call (these models
        have no multi-token-prediction heads)."""
        del include_mtp
        h, v = self.hidden_size, self.vocab_size
        total = v * h + (0 if self.tie_word_embeddings else v * h) + h + self.num_hidden_layers * self._layer_params()
        return ParameterCount(total=total, active=total, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """Training FLOPs per token: ``6 * (matmul parameters) + attention``.

        Matmul parameters are the active ones (all of a dense model; an MoE token uses k routed experts) but the
        input embedding (a lookup; a tied table still counts once, as the
        output head). Attention adds ``3 * seq_len * heads * 2 * head_dim`` per layer: forward
        ``2 * seq_len * heads * (head_dim + head_dim)`` for scores and mixing, halved for causality, times 3 for
        forward + backward.
        """
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)  # active = total if dense
        attention = 3 * seq_len * self.num_attention_heads * 2 * self.head_dim * self.num_hidden_layers
        return float(6 * matmul + attention)


def cpu_presets(family: str, *, head_dim: int, **fields: Any) -> dict[str, dict[str, Any]]:
    """The two CPU presets of a dense family, for tests and quick recipe runs: ``<family>-tiny`` (4 layers of
    width 128, 4 heads over 2 kv heads, tied embedding; ~5M parameters, 4.1M of them the embedding) and
    ``<family>-small`` (6 layers of width 256, 8 heads over 2 kv heads, its own output head; ~21M parameters,
    16M of them embedding and head), both on a 32,000-token vocabulary. ``fields`` add the family's own
    settings (rope) to both.

    >>> cpu_presets("llama3", head_dim=32, rope_theta=500000.0)["llama3-tiny"]["hidden_size"]
    128
    """
    common = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                  num_key_value_heads=2, head_dim=head_dim, **fields)
    return {
        f"{family}-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                               tie_word_embeddings=True, **common),
        f"{family}-small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                                **common),
    }


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
