import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from tests.conftest import F16, F32


def _loss(w, x):
    return jnp.sum((w.astype(F16) * x.astype(F16)) ** 2).astype(F32)


def test_value_is_unscaled_and_grads_scaled():
    w, x = jnp.ones(3), jnp.full(3, 2.0)
    loss, grads = jax.jit(jaxmp.value_and_grad(_loss))(jaxmp.StaticLossScale(2.0**10), w, x)
    assert float(loss) == 12.0
    np.testing.assert_array_equal(grads, 8.0 * 2.0**10)
    assert grads.dtype == F32


def test_scaling_rescues_float16_underflow():
    # d/dw sum((w x)^4) = 4 w^3 x^4 = 2**-26 at w=1, x=2**-7: below float16's smallest
    # subnormal (2**-24), so it flushes to zero unless the loss is scaled.
    w, x = jnp.ones(3), jnp.full(3, 2.0**-7)
    tiny = lambda w, x: jnp.sum((w.astype(F16) * x.astype(F16)) ** 4).astype(F32)  # noqa: E731
    _, plain = jaxmp.value_and_grad(tiny)(jaxmp.NoOpLossScale(), w, x)
    _, scaled = jaxmp.value_and_grad(tiny)(jaxmp.StaticLossScale(2.0**15), w, x)
    assert not np.any(np.asarray(plain))
    np.testing.assert_array_equal(jaxmp.StaticLossScale(2.0**15).unscale(scaled), 2.0**-26)


def test_has_aux_and_argnums():
    def loss(w, b, x):
        value = jnp.sum(w * x + b)
        return value, {"value": value}

    g = jaxmp.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (value, aux), (gw, gb) = g(
        jaxmp.StaticLossScale(4.0), jnp.ones(2), jnp.float32(1.0), jnp.arange(2.0)
    )
    assert float(value) == 3.0 and float(aux["value"]) == 3.0
    np.testing.assert_array_equal(gw, [0.0, 4.0])
    assert float(gb) == 8.0


def test_accepts_scalar_and_jmp_loss_scales():
    import jmp

    w, x = jnp.ones(3), jnp.ones(3)
    _, g1 = jaxmp.value_and_grad(_loss)(8.0, w, x)
    _, g2 = jaxmp.value_and_grad(_loss)(jnp.float32(8.0), w, x)
    _, g3 = jaxmp.value_and_grad(_loss)(jmp.StaticLossScale(jnp.float32(8.0)), w, x)
    np.testing.assert_array_equal(g1, 16.0)
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(g1, g3)


def test_errors():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jaxmp.value_and_grad(3)
    with pytest.raises(TypeError, match="`fun` must return a scalar loss, got shape \\(3,\\)"):
        jaxmp.value_and_grad(lambda w: w)(1.0, jnp.ones(3))
    with pytest.raises(TypeError, match="must return a pair"):
        jaxmp.value_and_grad(lambda w: jnp.sum(w), has_aux=True)(1.0, jnp.ones(3))
    with pytest.raises(TypeError, match="`loss_scale` must be a jaxmp loss scale"):
        jaxmp.value_and_grad(lambda w: jnp.sum(w))("big", jnp.ones(3))


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"argnums": "a"}, TypeError, "`argnums` must be an int or a non-empty sequence"),
        ({"argnums": ()}, TypeError, "`argnums`"),
        ({"argnums": (0, 1.0)}, TypeError, "`argnums`"),
        ({"argnums": True}, TypeError, "`argnums`"),
        ({"argnums": (0, 0)}, ValueError, "`argnums` must not repeat"),
        ({"has_aux": "yes"}, TypeError, "`has_aux` must be a bool"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        jaxmp.value_and_grad(lambda w: jnp.sum(w), **kwargs)


# ---------------------------------------------------------------------------------------------
# Trees with leaves that are not differentiable (an Equinox module's activation functions).


def _tree_with_a_function():
    return {"layer": {"w": jnp.arange(3.0), "activation": jnp.tanh, "n": jnp.int32(2)}}


def _tree_loss(tree, x):
    layer = tree["layer"]
    return jnp.sum(layer["activation"](layer["w"] * x)) * layer["n"]


def test_value_and_grad_names_a_leaf_it_cannot_differentiate():
    g = jaxmp.value_and_grad(_tree_loss)
    with pytest.raises(
        TypeError,
        match=r"argument 0.*type .* at \['layer'\]\['activation'\].*filter_value_and_grad",
    ):
        g(1.0, _tree_with_a_function(), jnp.ones(3))
    with pytest.raises(
        TypeError, match=r"argument 1.*dtype int32 at \['n'\].*filter_value_and_grad"
    ):
        jaxmp.value_and_grad(lambda x, t: jnp.sum(t["w"] * x), argnums=1)(
            1.0, jnp.ones(3), {"w": jnp.ones(3), "n": jnp.int32(2)}
        )


@pytest.mark.parametrize("has_aux", [False, True])
def test_filter_value_and_grad_differentiates_the_floating_arrays(has_aux):
    tree, x = _tree_with_a_function(), jnp.full(3, 0.5)

    def loss(tree, x):
        value = _tree_loss(tree, x)
        return (value, {"double": 2 * value}) if has_aux else value

    value, grads = jaxmp.filter_value_and_grad(loss, has_aux=has_aux)(
        jaxmp.StaticLossScale(2.0**10), tree, x
    )
    expected = jax.grad(lambda w: _tree_loss({"layer": {**tree["layer"], "w": w}}, x))(
        tree["layer"]["w"]
    )
    loss_value = _tree_loss(tree, x)
    if has_aux:
        assert float(value[0]) == float(loss_value) and float(value[1]["double"]) == 2 * loss_value
    else:
        assert float(value) == float(loss_value)
    # Only the floating arrays have gradients; the other leaves are None.
    assert grads["layer"]["activation"] is None and grads["layer"]["n"] is None
    np.testing.assert_allclose(grads["layer"]["w"], expected * 2.0**10, rtol=1e-6)
    assert grads["layer"]["w"].dtype == F32


def test_filter_value_and_grad_matches_equinox():
    eqx = pytest.importorskip("equinox", reason="equinox is an optional test dependency")
    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 4)

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    value, grads = eqx.filter_jit(jaxmp.filter_value_and_grad(loss))(8.0, model, x)
    ref_value, ref_grads = eqx.filter_value_and_grad(loss)(model, x)
    assert float(value) == float(ref_value)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, 8.0 * r, rtol=1e-6)


def test_filter_value_and_grad_bad_arguments():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        jaxmp.filter_value_and_grad(3)
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        jaxmp.filter_value_and_grad(jnp.sum, has_aux=1)
    with pytest.raises(TypeError, match="first positional argument"):
        jaxmp.filter_value_and_grad(jnp.sum)(1.0)


def test_filter_value_and_grad_does_not_import_equinox():
    code = (
        "import sys, jax.numpy as jnp, jaxmp; "
        "g = jaxmp.filter_value_and_grad(lambda m: jnp.sum(m['w'])); "
        "g(2.0, {'w': jnp.ones(2), 'f': len}); "
        "assert 'equinox' not in sys.modules, 'equinox imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
