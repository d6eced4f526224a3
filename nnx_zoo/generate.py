"""Text generation with a KV cache: greedy, temperature, top-k and top-p sampling, stop tokens, left padding.

Works with any model that offers the cached-decoding trio (every family does; ``docs/causal_lm.md``):

- ``model.init_cache(batch, max_len) -> cache`` (a pytree of fixed-size arrays),
- ``model.prefill(input_ids, attention_mask, cache) -> (logits [batch, t, vocab], cache)``,
- ``model.decode_step(tokens [batch], cache) -> (logits [batch, vocab], cache)``.

The whole generation (prefill, then a ``jax.lax.while_loop`` of decode steps over the fixed-size cache) is one
jitted function, so the decode step is traced and compiled once for all tokens, and once per (model structure,
batch, prompt length, ``max_new_tokens``, greedy or sampling) across calls: prompts, weights, temperature,
``top_k``, ``top_p``, stop tokens and the seed are traced inputs. The loop stops early once every row has
produced a stop token.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_zoo.models.inputs import check_ids_fit
from nnx_zoo.sharding import restore_sharding


class GenerateOutput(NamedTuple):
    """``tokens [batch, prompt_len + max_new_tokens]`` int32: the prompt as given (left padding kept), then the
    new tokens; after a row's stop token the rest of the row is ``pad_token_id``. ``lengths [batch]`` int32: how
    many tokens each row generated, its stop token included."""

    tokens: jax.Array
    lengths: jax.Array


def generate(
    model: Any,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    pad_token_id: int = 0,
    rng: jax.Array | int | None = None,
) -> GenerateOutput:
    """Continue each row of ``input_ids [batch, prompt_len]`` by up to ``max_new_tokens`` tokens.

    ``attention_mask [batch, prompt_len]`` (1 = token, 0 = padding) marks left padding; every row's last prompt
    token must be real. ``temperature=0`` is greedy (argmax); otherwise tokens are sampled from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then to the smallest
    set whose probability reaches ``top_p`` (``top_k_filter``, ``top_p_filter``). A row ends after any of
    ``stop_tokens``. ``rng`` is a ``jax.random.key`` or an int seed (default seed 0): equal seeds give equal
    samples.

    >>> out = generate(model, ids, mask, max_new_tokens=16, temperature=0.7, top_p=0.9, stop_tokens=(eos,))
    >>> out.tokens[:, ids.shape[1]:], out.lengths
    """
    _check_model(model)
    input_ids = jnp.asarray(input_ids)
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    _check_inputs(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, stop_tokens, pad_token_id)
    # The prompt's ids in the vocabulary and prompt + new tokens within the positions (host side, before jit).
    if getattr(model, "config", None) is not None:
        check_ids_fit(model.config, input_ids, attention_mask, total_len=input_ids.shape[1] + int(max_new_tokens))
    if rng is None or isinstance(rng, (int, np.integer)):
        rng = jax.random.key(0 if rng is None else int(rng))
    # Stop ids are padded with -1 (never a token) to a multiple of 8, so their number rarely forces a recompile.
    stops = [int(t) for t in stop_tokens]
    stops += [-1] * (_STOP_BUCKET * max(1, math.ceil(len(stops) / _STOP_BUCKET)) - len(stops))
    sampling = Sampling(temperature=jnp.float32(temperature or 1.0),
                        top_k=jnp.int32(_NO_TOP_K if top_k is None else top_k),
                        top_p=jnp.float32(1.0 if top_p is None else top_p))
    graphdef, state = nnx.split(model)
    with _mesh_of(state):
        return _generate(graphdef, state, input_ids.astype(jnp.int32), attention_mask.astype(jnp.int32), rng, sampling,
                         jnp.asarray(stops, jnp.int32), jnp.int32(pad_token_id),
                         max_new_tokens=int(max_new_tokens), greedy=temperature == 0)


def _mesh_of(state: nnx.State) -> contextlib.AbstractContextManager[Any]:
    """With no ambient mesh (``jax.set_mesh``), the mesh the model's parameters live on, so the bookkeeping
    arrays of the loop are laid out on it too; otherwise nothing."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for leaf in jax.tree.leaves(state):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, Mesh) and mesh.size > 1:
            return jax.set_mesh(mesh)
    return contextlib.nullcontext()


_STOP_BUCKET = 8
_NO_TOP_K = np.iinfo(np.int32).max


class Sampling(NamedTuple):
    """The sampling knobs as traced values (changing them does not recompile)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, input_ids: jax.Array, attention_mask: jax.Array,
              rng: jax.Array, sampling: Sampling, stop_tokens: jax.Array, pad_token_id: jax.Array, *,
              max_new_tokens: int, greedy: bool) -> GenerateOutput:
    model = nnx.merge(graphdef, state)
    batch, prompt_len = input_ids.shape
    # The loop's bookkeeping (prompt, tokens, flags) is tiny: keep it whole on every device of the ambient mesh,
    # whatever layout the inputs arrived with or the model hands its tokens back in.
    replicated = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
    input_ids, attention_mask = restore_sharding((input_ids, attention_mask), replicated)

    def pick(logits: jax.Array, step: jax.Array) -> jax.Array:
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = top_k_filter(logits.astype(jnp.float32) / sampling.temperature, sampling.top_k)
        logits = top_p_filter(logits, sampling.top_p)
        return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1).astype(jnp.int32)

    def record(tokens: jax.Array, new: jax.Array, done: jax.Array, lengths: jax.Array, step: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Write step ``step``'s tokens (padding for finished rows); returns what was written too."""
        new = jnp.where(done, pad_token_id, restore_sharding(new, replicated))
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, prompt_len + step))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.any(new[:, None] == stop_tokens[None, :], axis=-1)
        return tokens, new, done, lengths

    cache = model.init_cache(batch, prompt_len + max_new_tokens)
    logits, cache = model.prefill(input_ids, attention_mask, cache)
    tokens = jnp.full((batch, prompt_len + max_new_tokens), pad_token_id)
    tokens = jax.lax.dynamic_update_slice(tokens, input_ids, (0, 0))
    step = jnp.int32(0)
    tokens, last, done, lengths = record(tokens, pick(logits[:, -1], step), jnp.zeros((batch,), bool),
                                         jnp.zeros((batch,), jnp.int32), step)

    def keep_going(carry: tuple[Any, ...]) -> jax.Array:
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens - 1) & ~jnp.all(done)

    def decode(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        step, tokens, cache, last, done, lengths = carry
        step = step + 1
        logits, cache = model.decode_step(last, cache)
        tokens, last, done, lengths = record(tokens, pick(logits, step), done, lengths, step)
        return step, tokens, cache, last, done, lengths

    _, tokens, _, _, _, lengths = jax.lax.while_loop(keep_going, decode, (step, tokens, cache, last, done, lengths))
    return GenerateOutput(tokens=tokens, lengths=lengths)


def top_k_filter(logits: jax.Array, k: int | jax.Array) -> jax.Array:
    """``logits [..., vocab]`` with all but the ``k`` largest of each row set to ``-inf`` (ties with the k-th
    largest are kept too; ``k`` above the vocabulary keeps everything). ``k`` may be a traced int."""
    if isinstance(k, (int, np.integer)) and k < 1:
        raise ValueError(f"top_k must be a positive integer, got {k!r}")
    descending = -jnp.sort(-logits, axis=-1)
    index = jnp.clip(jnp.asarray(k, jnp.int32), 1, logits.shape[-1]) - 1
    kth_largest = jnp.take_along_axis(descending, jnp.broadcast_to(index, logits.shape[:-1] + (1,)), axis=-1)
    return jnp.where(logits >= kth_largest, logits, -jnp.inf)


def top_p_filter(logits: jax.Array, p: float | jax.Array) -> jax.Array:
    """Nucleus filter: keep, per row of ``logits [..., vocab]``, the smallest set of most likely tokens whose
    probability reaches ``p`` (always at least the most likely token); the rest become ``-inf``. Tokens tied
    with the least likely kept one are kept too.

    >>> top_p_filter(jnp.log(jnp.array([0.5, 0.3, 0.2])), 0.7)  # 0.5 < 0.7 <= 0.5 + 0.3: keeps two
    Array([-0.6931472, -1.2039728,       -inf], dtype=float32)
    """
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending.astype(jnp.float32), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep a token when the more likely ones have not reached p yet (the first token always qualifies).
    kept = jnp.sum(mass_before < p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(descending, jnp.maximum(kept, 1) - 1, axis=-1)
    keep = (logits >= threshold) | (jnp.asarray(p) >= 1)  # p = 1 keeps all, whatever the rounding of the sums
    return jnp.where(keep, logits, -jnp.inf)


def _check_model(model: Any) -> None:
    missing = [name for name in ("init_cache", "prefill", "decode_step") if not callable(getattr(model, name, None))]
    if missing:
        raise TypeError(
            f"generate needs a model with cached decoding (init_cache, prefill, decode_step); "
            f"{type(model).__name__} lacks {missing}"
        )


def _check_inputs(input_ids: jax.Array, attention_mask: jax.Array, max_new_tokens: int, temperature: float,
                  top_k: int | None, top_p: float | None, stop_tokens: Sequence[int], pad_token_id: int) -> None:
    """Raise, saying what is wrong, on bad arguments."""
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be integer token ids [batch, prompt_len], got {input_ids.dtype} "
                         f"{input_ids.shape}; add a batch dim with ids[None] for a single prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens; generation needs at least one prompt token per row")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {attention_mask.shape} must have input_ids' shape {input_ids.shape}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive integer, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if isinstance(stop_tokens, (int, np.integer)) or not all(isinstance(t, (int, np.integer)) for t in stop_tokens):
        raise ValueError(f"stop_tokens must be a sequence of token ids, e.g. (eos_id,), got {stop_tokens!r}")
    if not isinstance(pad_token_id, (int, np.integer)):
        raise ValueError(f"pad_token_id must be an int, got {pad_token_id!r}")
    if not isinstance(attention_mask, jax.core.Tracer):
        mask = np.asarray(attention_mask)
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        if not mask[:, -1].all():
            rows = np.flatnonzero(mask[:, -1] == 0).tolist()
            raise ValueError(f"rows {rows} end in padding: pad prompts on the left (the last prompt token of "
                             "every row must be real, it is the one generation continues from)")
