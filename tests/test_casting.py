import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxmp
from tests.conftest import F16, F32, FLOAT_DTYPES


def _mixed_tree():
    return {
        "w": jnp.ones((2, 3)),
        "h": jnp.ones(2, jnp.bfloat16),
        "i": jnp.arange(3),
        "b": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "none": None,
        "s": "tag",
        "py": 1.5,
        "np": np.ones(2, np.float32),
        "c": jnp.ones(2, jnp.complex64),
        "nested": [jnp.zeros(()), (jnp.int8(1),)],
    }


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_cast_tree_only_floating_leaves(dtype):
    tree = _mixed_tree()
    out = jaxmp.cast_tree(tree, dtype)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert out["w"].dtype == dtype and out["h"].dtype == dtype
    assert out["nested"][0].dtype == dtype
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == dtype
    assert out["i"] is tree["i"] and out["b"] is tree["b"] and out["key"] is tree["key"]
    assert out["raw_key"] is tree["raw_key"] and out["c"] is tree["c"]
    assert out["nested"][1][0] is tree["nested"][1][0]
    assert out["none"] is None and out["s"] == "tag" and out["py"] == 1.5


def test_cast_tree_no_copy_when_dtype_matches():
    x = jnp.ones(3)
    assert jaxmp.cast_tree({"x": x}, jnp.float32)["x"] is x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_cast_tree_under_jit(dtype):
    out = jax.jit(lambda t: jaxmp.cast_tree(t, dtype))({"w": jnp.ones(2), "i": jnp.arange(2)})
    assert out["w"].dtype == dtype and out["i"].dtype == jnp.int32


def test_cast_tree_shape_dtype_struct():
    spec = jax.eval_shape(lambda: {"w": jnp.ones((2, 2)), "i": jnp.arange(2)})
    out = jaxmp.cast_tree(spec, "bf16")
    assert out["w"] == jax.ShapeDtypeStruct((2, 2), jnp.bfloat16)
    assert out["i"].dtype == jnp.int32


def test_cast_tree_bad_dtype():
    with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype, got int32"):
        jaxmp.cast_tree({"w": jnp.ones(2)}, jnp.int32)
    with pytest.raises(ValueError, match="Unknown dtype 'f8' in `dtype`"):
        jaxmp.cast_tree({"w": jnp.ones(2)}, "f8")


def test_cast_to_full_and_half():
    tree = {"w": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(2)}
    assert jaxmp.cast_to_full(tree)["w"].dtype == F32
    assert jaxmp.cast_to_half(jaxmp.cast_to_full(tree))["w"].dtype == jaxmp.half_dtype() == F16
    assert jaxmp.cast_to_full(tree)["i"].dtype == jnp.int32


float_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float16]),
    shape=hnp.array_shapes(max_dims=2, max_side=4),
    elements=st.floats(-1e4, 1e4, width=16),
)
int_arrays = hnp.arrays(
    dtype=st.sampled_from([np.int32, np.int8, np.bool_]),
    shape=hnp.array_shapes(max_dims=2, max_side=4),
)


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=3), st.one_of(float_arrays, int_arrays), max_size=5
    ),
    st.sampled_from(FLOAT_DTYPES),
)
def test_cast_tree_property(tree, dtype):
    out = jaxmp.cast_tree(tree, dtype)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for key, leaf in tree.items():
        if np.issubdtype(leaf.dtype, np.floating):
            assert out[key].dtype == dtype
            # float16 values within +-1e4 are exact in float32 and round-trip exactly.
            if dtype == F32:
                np.testing.assert_array_equal(out[key], leaf)
        else:
            assert out[key] is leaf
