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
