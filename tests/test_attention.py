"""Attention under autocast (`jaxmp._src.attention`): the fused path and its boundary.

Under a half-precision policy, attention written with ``jax.nn.dot_product_attention``, Flax
Linen's ``nn.dot_product_attention`` / ``nn.MultiHeadDotProductAttention`` and Flax NNX's
``nnx.dot_product_attention`` / ``nnx.MultiHeadAttention`` is dispatched to
`jaxmp.dot_product_attention` on its operands cast to the compute dtype (its ops run under the
``dot_product_attention`` name scope): cuDNN's fused kernel on an NVIDIA GPU, XLA's attention in
the compute dtype here. Outputs and gradients match the float32 model within the policy's
tolerance; ``fused_attention=False`` gives the op-by-op re-interpretation; the boundary holds
inside jit, scan, remat and the inspector, and the traced libraries are left as they were.
Lowering for the GPU (cuDNN's custom call) needs JAX's CUDA plugin:
``benchmarks/attention_lowering.py``.
"""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
import jaxmp.linen
from jaxmp._src import attention, compat
from tests.conftest import TOLERANCE

B, T, N, H = 2, 16, 4, 32
BF16 = jnp.dtype(jnp.bfloat16)


def qkv(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (B, T, N, H)) for k in (k1, k2, k3))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _scoped_eqns(jaxpr, outer=()):
    """``(eqn, its whole name stack's scopes)`` of every equation, sub-jaxprs included."""
    if isinstance(jaxpr, compat.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        scopes = (*outer, *compat.name_stack_of(eqn).split("/"))
        yield eqn, scopes
        for sub in compat.jaxprs_in_params(eqn.params):
            yield from _scoped_eqns(sub, scopes)


def dispatched(jaxpr):
    """The attention products of `jaxpr` that autocast dispatched, and the others."""
    dots = [(e, s) for e, s in _scoped_eqns(jaxpr) if e.primitive.name == "dot_general"]
    inside = [e for e, s in dots if attention.SCOPE in s]
    return inside, [e for e, s in dots if attention.SCOPE not in s]


class LinenBlock(nn.Module):
    """A causal self-attention block through Linen's module (the default ``attention_fn``)."""

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=N, deterministic=True)(x, mask=mask)


def nnx_block():
    return nnx.MultiHeadAttention(
        num_heads=N, in_features=N * H, decode=False, deterministic=True, rngs=nnx.Rngs(0)
    )


def forms():
    """(name, function, args): each way of writing attention the issue names."""
    q, k, v = qkv()
    x = jax.random.normal(jax.random.key(3), (B, T, N * H))
    linen_params = LinenBlock().init(jax.random.key(4), x)
    causal = nn.make_causal_mask(jnp.ones((B, T)))
    return [
        (
            "jax.nn",
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            (q, k, v),
        ),
        (
            "linen function",
            lambda q, k, v: nn.dot_product_attention(q, k, v, mask=causal),
            (q, k, v),
        ),
        ("linen module", LinenBlock().apply, (linen_params, x)),
        ("nnx function", lambda q, k, v: nnx.dot_product_attention(q, k, v), (q, k, v)),
        ("nnx module", lambda m, x: m(x), (nnx_block(), x)),
    ]


FORMS = [f[0] for f in forms()]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_each_form_is_dispatched_and_matches_float32(form, policy):
    _, fn, args = next(f for f in forms() if f[0] == form)
    f = jaxmp.autocast(fn, policy)
    inside, _ = dispatched(f.jaxpr(*args))
    compute = jaxmp.get_policy(policy).compute_dtype
    # The logits and the weighted sum, in the compute dtype; float16 has a second branch
    # for XLA:CPU, which has no float16 product accumulated in float32: float32 there.
    branches = 2 if compute == jnp.float16 else 1
    assert len(inside) == 2 * branches
    dtypes = sorted(str(jnp.dtype(e.invars[0].aval.dtype)) for e in inside)
    assert dtypes == sorted([compute.name] * 2 + ["float32"] * 2 * (branches - 1))
    out, ref = jax.jit(f)(*args), fn(*args)
    assert out.dtype == ref.dtype == jnp.float32
    assert rel_err(out, ref) <= TOLERANCE[compute]


def test_gradients_match_float32_and_switching_off_gives_the_op_by_op_path():
    q, k, v = qkv()

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v)))

    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    fused = jaxmp.autocast(fn, "mixed_bfloat16")
    plain = jaxmp.autocast(fn, "mixed_bfloat16", fused_attention=False)
    assert dispatched(plain.jaxpr(q, k, v))[0] == []  # today's re-interpretation
    ref = jax.grad(loss(fn), (0, 1, 2))(q, k, v)
    for f in (fused, plain):
        grads = jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
        for g, r in zip(grads, ref, strict=True):
            assert rel_err(g, r) <= TOLERANCE[BF16]


def test_the_boundary_holds_inside_jit_scan_remat_and_vmap():
    q, k, v = qkv()

    def layers(q, k, v):
        def body(h, _):
            return jax.nn.dot_product_attention(h, k, v, is_causal=True), None

        return jax.lax.scan(jax.checkpoint(body), q, None, length=3)[0]

    f = jaxmp.autocast(jax.jit(layers), "mixed_bfloat16")
    assert len(dispatched(f.jaxpr(q, k, v))[0]) == 2  # the scanned body, once
    assert rel_err(jax.jit(f)(q, k, v), layers(q, k, v)) <= TOLERANCE[BF16]
    per_example = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None])
    assert rel_err(per_example[:, 0], layers(q, k, v)) <= TOLERANCE[BF16]


def test_the_inspector_sees_the_attention_it_measures():
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out, report = jaxmp.inspect(fn, "mixed_bfloat16")(*qkv())
    assert out.shape == (B, T, N, H)
    assert len(report.find("dot_general")) == 2


def test_attention_with_dropout_or_sown_weights_is_not_dispatched():
    q, k, v = qkv()
    rng = jax.random.key(5)

    def dropped(q, k, v):
        return nn.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.1)

    f = jaxmp.autocast(dropped, "mixed_bfloat16")
    inside, others = dispatched(f.jaxpr(q, k, v))
    assert inside == [] and len(others) == 2
    assert jaxmp.autocast(dropped, "mixed_bfloat16")(q, k, v).shape == q.shape


def test_tracing_leaves_jax_and_flax_as_they_were():
    original_jax = jax.nn.dot_product_attention
    original_code = nn.attention.dot_product_attention.__code__

    def broken(q, k, v):
        jax.nn.dot_product_attention(q, k, v)
        nn.dot_product_attention(q, k, v)
        raise RuntimeError("the traced function failed")

    with pytest.raises(RuntimeError, match="the traced function failed"):
        jaxmp.autocast(broken, "mixed_bfloat16")(*qkv())
    assert jax.nn.dot_product_attention is original_jax
    assert nn.attention.dot_product_attention.__code__ is original_code
    assert "_jaxmp_attention_hook" not in nn.attention.dot_product_attention.__globals__


def test_dot_product_attention_chooses_xla_where_cudnn_does_not_apply():
    q, k, v = qkv()
    reference = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        cast = [x.astype(dtype) for x in (q, k, v)]
        out = jax.jit(lambda *a: jaxmp.dot_product_attention(*a, is_causal=True))(*cast)
        assert out.dtype == dtype
        assert rel_err(out, reference) <= TOLERANCE[jnp.dtype(dtype)] * 2
    with pytest.raises(ValueError, match=r"`implementation` must be one of None, 'xla', 'cudnn'"):
        jaxmp.dot_product_attention(q, k, v, implementation="flash")


def test_jaxmp_attention_in_a_float32_model_is_dispatched_too():
    fn = lambda q, k, v: jaxmp.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    f = jaxmp.autocast(fn, "mixed_bfloat16")
    inside, _ = dispatched(f.jaxpr(*qkv()))
    assert [str(e.invars[0].aval.dtype) for e in inside] == ["bfloat16"] * 2
    assert rel_err(jax.jit(f)(*qkv()), fn(*qkv())) <= TOLERANCE[BF16]


def test_linen_attention_is_dispatched_without_importing_jaxmp_linen():
    # A program that imports only jaxmp (and Flax) gets Linen's attention dispatched too:
    # `import jaxmp` registers a stand-in that loads `jaxmp.linen` once `flax.linen` is in.
    code = """
import sys
import flax.linen as nn, jax, jax.numpy as jnp, jaxmp
from jaxmp._src import attention, compat

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2, deterministic=True)(x)

x = jnp.ones((2, 8, 32))
variables = Block().init(jax.random.key(0), x)
assert "jaxmp.linen" not in sys.modules
jaxpr = jaxmp.autocast(Block().apply, "mixed_bfloat16").jaxpr(variables, x)

def walk(jaxpr, outer=()):
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        scopes = (*outer, *compat.name_stack_of(eqn).split("/"))
        yield eqn, scopes
        for sub in compat.jaxprs_in_params(eqn.params):
            yield from walk(sub, scopes)

print(sum(e.primitive.name == "dot_general" and attention.SCOPE in s for e, s in walk(jaxpr)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["2"]
