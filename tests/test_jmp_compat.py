"""`import jaxmp as jmp` runs jmp code: same names, signatures and semantics."""

import inspect

import jax
import jax.numpy as jnp
import jmp as real_jmp
import numpy as np
import pytest

import jaxmp

JMP_NAMES = [
    "Policy",
    "get_policy",
    "half_dtype",
    "cast_to_full",
    "cast_to_half",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
]


@pytest.mark.parametrize("name", JMP_NAMES)
def test_every_jmp_name_exists(name):
    assert hasattr(jaxmp, name) and name in jaxmp.__all__


@pytest.mark.parametrize(
    "name", ["DynamicLossScale", "StaticLossScale", "get_policy", "select_tree", "all_finite"]
)
def test_jmp_positional_parameters_accepted(name):
    theirs = [
        p.name
        for p in inspect.signature(getattr(real_jmp, name)).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    ours = [
        p.name
        for p in inspect.signature(getattr(jaxmp, name)).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    assert ours[: len(theirs)] == theirs


def _jmp_readme_train(jmp, steps=150):
    """The training loop of jmp's README, written against the module `jmp`."""
    policy = jmp.get_policy("params=float32,compute=float16,output=float32")
    loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32), period=5)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
    y = x.sum(1)
    params = {"w": jnp.zeros(4)}

    def loss_fn(params, x, y):
        params, x = policy.cast_to_compute((params, x))
        out = policy.cast_to_output(x @ params["w"])
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, loss_scale):
        grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
        grads = policy.cast_to_param(grads)
        grads = loss_scale.unscale(grads)
        grads_finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(grads_finite)
        new_params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        params = jmp.select_tree(grads_finite, new_params, params)
        return params, loss_scale

    scales = []
    for _ in range(steps):
        params, loss_scale = step(params, loss_scale)
        scales.append(float(loss_scale.loss_scale))
    return params, scales


def test_jmp_readme_loop_runs_the_same_with_jaxmp():
    ours, our_scales = _jmp_readme_train(jaxmp)
    theirs, their_scales = _jmp_readme_train(real_jmp)
    assert our_scales == their_scales
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-6)
    np.testing.assert_allclose(ours["w"], np.ones(4), atol=0.05)  # it learned y = sum(x)


def test_half_dtype_matches():
    assert jaxmp.half_dtype() == real_jmp.half_dtype()
    # jmp's README scales by `jmp.half_dtype()(2**15)`: the dtype is a callable scalar type.
    assert jaxmp.half_dtype()(2**15).dtype == real_jmp.half_dtype()(2**15).dtype


def test_get_policy_keyword_is_jmps():
    assert jaxmp.get_policy(policy_name="c=f16") == jaxmp.Policy(jnp.float32, jnp.float16)


def test_jmp_select_tree_error_is_an_assertion_error():
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        jaxmp.select_tree(jnp.ones([1]), None, None)
    with pytest.raises(ValueError, match="`pred` must be a scalar boolean"):
        jaxmp.select_tree("yes", {"a": jnp.ones(1)}, {"a": jnp.ones(1)})
