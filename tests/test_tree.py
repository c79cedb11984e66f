import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_detects(bad, dtype):
    tree = {"a": jnp.ones(3, dtype), "b": [jnp.zeros(2, dtype).at[1].set(bad)], "i": jnp.arange(3)}
    assert not bool(jax.jit(jaxmp.all_finite)(tree))
    tree["b"] = [jnp.zeros(2, dtype)]
    assert bool(jax.jit(jaxmp.all_finite)(tree))


def test_all_finite_edge_cases():
    assert bool(jaxmp.all_finite({}))
    assert bool(jaxmp.all_finite({"i": jnp.arange(3), "n": None}))
    assert jaxmp.all_finite({"a": jnp.ones(2)}).dtype == jnp.bool_


def test_all_finite_matches_jmp():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tree = [jnp.asarray(rng.normal(size=4)) for _ in range(3)]
        if rng.random() < 0.5:
            tree[rng.integers(3)] = tree[0].at[rng.integers(4)].set(jnp.nan)
        assert bool(jaxmp.all_finite(tree)) == bool(jmp.all_finite(tree))


def test_select_tree():
    a = {"x": jnp.ones(2), "i": jnp.int32(1)}
    b = {"x": jnp.zeros(2), "i": jnp.int32(2)}
    out = jax.jit(jaxmp.select_tree)(jnp.array(True), a, b)
    assert out["x"].tolist() == [1.0, 1.0] and int(out["i"]) == 1
    out = jaxmp.select_tree(jnp.array(False), a, b)
    assert int(out["i"]) == 2


def test_select_tree_errors_name_the_leaf():
    a = {"x": jnp.ones(2), "y": {"z": jnp.ones(3)}}
    with pytest.raises(ValueError, match=r"differ at leaf \['y'\]\['z'\]: float32\[3\] vs float16"):
        jaxmp.select_tree(
            jnp.array(True), a, {"x": jnp.ones(2), "y": {"z": jnp.ones(3, jnp.float16)}}
        )
    with pytest.raises(ValueError, match=r"leaves only in `b`: \['w'\]"):
        jaxmp.select_tree(jnp.array(True), a, {**a, "w": jnp.ones(1)})
    with pytest.raises(ValueError, match="`pred` must be a scalar boolean, got shape \\(2,\\)"):
        jaxmp.select_tree(jnp.array([True, False]), a, a)
    with pytest.raises(ValueError, match="`pred` must be a scalar boolean.*float32"):
        jaxmp.select_tree(jnp.float32(1), a, a)


@pytest.mark.parametrize("bad", [complex(np.nan, 0), complex(0, np.inf), complex(-np.inf, 1)])
@pytest.mark.parametrize("size", [2, 100])
def test_all_finite_checks_complex_leaves(bad, size):
    z = jnp.ones(size, jnp.complex64)
    assert bool(jax.jit(jaxmp.all_finite)({"z": z}))
    assert not bool(jax.jit(jaxmp.all_finite)({"z": z.at[size // 2].set(bad)}))


def test_all_finite_checks_python_floats():
    assert not bool(jaxmp.all_finite({"lr": float("nan"), "w": jnp.ones(2)}))
    assert not bool(jaxmp.all_finite([complex(float("inf"), 0)]))
    assert bool(jaxmp.all_finite([1.0, 3, True, "name", None, 2j]))


def test_all_true_reads_rows():
    from jaxmp._src.tree import all_true

    mask = jnp.ones((40, 40), bool)
    assert bool(jax.jit(all_true)([mask, jnp.array(True)]))
    assert not bool(jax.jit(all_true)([mask.at[39, 0].set(False)]))
    assert bool(all_true([]))
