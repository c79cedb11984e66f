"""examples/lm/model.py: incremental decoding with a key/value cache computes the logits of
the full-sequence forward (the training path), in each cache format and under jaxmp.quantized;
greedy generation past the model's window."""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from tests.conftest import BF16, F32, TOLERANCE

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import model as model_lib  # noqa: E402

# The largest logit error of decoding with a quantised cache against the full forward,
# relative to the largest logit, about twice the largest of four draws of tokens for the
# untrained model below (int8 0.6% to 0.8%, FP8 5.2% to 9.9%; for the trained main-job model
# see docs/guides/quantized_inference.md).
CACHE_ERROR = {"int8": 0.02, "fp8": 0.2}


def _model(dtype=F32, max_len=16):
    return model_lib.TransformerLM(
        vocab_size=40,
        max_len=max_len,
        num_layers=2,
        num_heads=4,
        d_model=32,
        mlp_ratio=2,
        dtype=dtype,
        param_dtype=F32,
        output_dtype=F32,
    )


@functools.cache
def _params(max_len=16):
    tokens = jnp.zeros((1, max_len), jnp.int32)
    return _model(max_len=max_len).init(jax.random.key(0), tokens)["params"]


def _tokens(batch=2, length=16, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 40)


def _decoded(model, params, tokens, fmt, prompt=5, apply=None):
    """Logits of `tokens` through the cache: the first `prompt` at once, then one at a time."""
    apply = jax.jit(apply or functools.partial(model_lib.decode, model))
    caches = model_lib.init_cache(model, tokens.shape[0], fmt)
    logits, caches = apply(params, caches, tokens[:, :prompt], 0)
    out = [logits]
    for t in range(prompt, tokens.shape[1]):
        logits, caches = apply(params, caches, tokens[:, t : t + 1], t)
        out.append(logits)
    return jnp.concatenate(out, axis=1), caches


def _relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def test_decoding_with_a_cache_gives_the_full_forwards_logits():
    model, params, tokens = _model(), _params(), _tokens()
    full = model.apply({"params": params}, tokens)
    decoded, caches = _decoded(model, params, tokens, None)
    assert decoded.shape == full.shape and decoded.dtype == full.dtype
    assert _relative_error(decoded, full) <= 10 * TOLERANCE[F32]
    assert len(caches) == 2 and caches[0].shape == (2, 16, 4, 8) and caches[0].dtype == F32
    # Prefill of the whole sequence at once: the same.
    at_once, _ = _decoded(model, params, tokens, None, prompt=16)
    assert _relative_error(at_once, full) <= 10 * TOLERANCE[F32]


def test_decoding_in_bfloat16_is_as_close_to_float32_as_the_bfloat16_forward():
    # The cached path computes the attention's scores in float32 where Flax rounds them to
    # bfloat16 first: each is its own bfloat16 rounding of the float32 model (1% to 1.4% of the
    # largest logit over four draws of tokens, for either).
    model, params, tokens = _model(BF16), _params(), _tokens()
    reference = _model().apply({"params": params}, tokens)
    params = jax.tree.map(lambda p: p.astype(BF16), params)
    full = model.apply({"params": params}, tokens)
    decoded, caches = _decoded(model, params, tokens, None)
    assert caches[0].dtype == BF16 and caches[0].keys.dtype == BF16
    assert _relative_error(full, reference) <= 2 * TOLERANCE[BF16]
    assert _relative_error(decoded, reference) <= 2 * TOLERANCE[BF16]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_decoding_with_a_quantised_cache_is_close_to_the_full_forward(fmt):
    model, params, tokens = _model(), _params(), _tokens()
    full = model.apply({"params": params}, tokens)
    decoded, caches = _decoded(model, params, tokens, fmt)
    assert caches[0].format == fmt
    err = _relative_error(decoded, full)
    assert 0 < err <= CACHE_ERROR[fmt], err
    assert (np.argmax(decoded, -1) == np.argmax(full, -1)).mean() >= 0.9


def test_decoding_runs_quantised_weights_under_jaxmp_quantized():
    model, params, tokens = _model(BF16), _params(), _tokens()
    params = jax.tree.map(lambda p: p.astype(BF16), params)

    def apply(p, x):
        return model.apply({"params": p}, x)

    qparams = jaxmp.quantize(apply, params, tokens, recipe="int8")
    full = jaxmp.quantized(apply)(qparams, tokens)
    decode = jaxmp.quantized(functools.partial(model_lib.decode, model))
    decoded, _ = _decoded(model, qparams, tokens, "int8", apply=decode)
    assert _relative_error(decoded, full) <= CACHE_ERROR["int8"] + 2 * TOLERANCE[BF16]


def test_greedy_generation_past_the_window_and_forced_tokens():
    model, params = _model(max_len=8), _params(max_len=8)
    prompt = _tokens(2, 3)
    tokens, logits = model_lib.generate(model, params, prompt, 20, None)
    assert tokens.shape == (2, 20) and logits.shape == (2, 20, 40)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    # The first window: what the full forward of the prompt and the tokens so far predicts.
    window = jnp.concatenate([prompt, tokens[:, :5]], axis=1)  # 8 positions
    full = model.apply({"params": params}, window)
    np.testing.assert_array_equal(tokens[:, :6], np.argmax(full[:, 2:], -1))
    # Past it: the last half of the window, recomputed from position 0.
    seq = np.concatenate([prompt, tokens], axis=1)
    last = model.apply({"params": params}, seq[:, 5:9])  # the window after 8 + 1 tokens
    np.testing.assert_array_equal(tokens[:, 6], np.argmax(last[:, -1], -1))
    # Forced tokens: the logits at each position given the forced ones before it.
    forced, forced_logits = model_lib.generate(model, params, prompt, 20, "int8", forced=tokens)
    assert forced_logits.shape == logits.shape
    assert _relative_error(forced_logits, logits) <= CACHE_ERROR["int8"]
    with pytest.raises(ValueError, match=r"`prompt` must hold 1 to 8 tokens"):
        model_lib.generate(model, params, _tokens(1, 9), 4, None)
