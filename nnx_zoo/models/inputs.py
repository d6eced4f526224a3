"""Checks of a forward pass's or a generation's inputs, before anything is traced: what is wrong and how to fix it.

Below the models (``causal_lm``) and ``nnx_zoo.generate``, which both call them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_forward_inputs(input_ids: jax.Array, attention_mask: jax.Array | None, segment_ids: jax.Array | None,
                         position_ids: jax.Array | None, *, config: Any = None) -> None:
    """Raise, saying what is wrong, on inputs a forward pass cannot take (see ``_check_ids``); with the model's
    ``config``, also on sequences past its positions and on token ids outside its vocabulary
    (``check_ids_fit``)."""
    _check_ids(input_ids, attention_mask=attention_mask, segment_ids=segment_ids)
    if position_ids is not None and (position_ids.ndim != 2 or position_ids.shape[1] != input_ids.shape[1]):
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must be [batch or 1, seq={input_ids.shape[1]}]")
    if config is not None:
        check_ids_fit(config, input_ids, attention_mask, positions=position_ids)


def _concrete(x: jax.Array | None) -> np.ndarray | None:
    """``x`` on the host when its values are known here: not a tracer (never a host sync inside jit), and whole
    on this process. None otherwise."""
    if x is None or isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None
    return np.asarray(x)


def check_ids_fit(config: Any, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                  total_len: int | None = None, positions: jax.Array | None = None) -> None:
    """Raise when a sequence runs past ``config.max_position_embeddings`` (``total_len`` tokens, by default
    ``input_ids``' length; the largest of ``positions`` when given) or, where the ids are concrete, when a token id
    (one the mask marks real) is negative or ``>= config.vocab_size``: the embedding lookup would clamp it
    silently, and positions past the trained ones are an extrapolation no one asked for."""
    limit = config.max_position_embeddings
    concrete_positions = _concrete(positions)
    if concrete_positions is not None and concrete_positions.size and int(concrete_positions.max()) >= limit:
        raise ValueError(f"position_ids reach {int(concrete_positions.max())}, past the model's "
                         f"max_position_embeddings={limit} (positions 0..{limit - 1}); shorten the sequences, or "
                         "raise max_position_embeddings in the config (with rope scaling for lengths it never saw)")
    length = input_ids.shape[1] if total_len is None else total_len
    if positions is None and length > limit:
        what = f"{input_ids.shape[1]} tokens" if total_len is None else (
            f"a prompt of {input_ids.shape[1]} tokens + max_new_tokens={total_len - input_ids.shape[1]}")
        raise ValueError(f"{what} exceed the model's max_position_embeddings={limit}; use at most {limit} "
                         "positions (shorter inputs, fewer new tokens), or raise max_position_embeddings in the "
                         "config (with rope scaling for lengths it never saw)")
    ids = _concrete(input_ids)
    if ids is None or not ids.size:
        return
    mask = _concrete(attention_mask)
    real = ids if mask is None else ids[mask.astype(bool)]
    bad = real[(real < 0) | (real >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"input_ids hold {bad.size} token id(s) outside the vocabulary 0..{config.vocab_size - 1} "
                         f"(e.g. {int(bad.flat[0])}; min {int(real.min())}, max {int(real.max())}): the embedding "
                         "would clamp them silently. Tokenize with the model's own tokenizer, or use a config whose "
                         "vocab_size covers the ids")


def _check_ids(input_ids: jax.Array, **others: jax.Array | None) -> None:
    """Raise, saying what is wrong, when ``input_ids`` is not ``[batch, seq]`` integers or a companion array
    (padding mask, segment ids) has another shape."""
    if getattr(input_ids, "ndim", None) != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be integer token ids [batch, seq], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids))} {getattr(input_ids, 'shape', '')}; add a "
                         "batch dim with ids[None] for a single sequence")
    for name, value in others.items():
        if value is not None and tuple(value.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name} {tuple(value.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
