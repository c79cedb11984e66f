import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxmp
from tests.conftest import BF16, F16, F32

NAMES = {
    "f16": F16,
    "float16": F16,
    "bf16": BF16,
    "bfloat16": BF16,
    "f32": F32,
    "float32": F32,
    "full": F32,
    "half": F16,
}


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("f32", (F32, F32, F32)),
        ("float16", (F16, F16, F16)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("half", (F16, F16, F16)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("c=f16", (F32, F16, F16)),
        ("p=f16", (F16, F16, F16)),
        ("p=f32,c=bf16", (F32, BF16, BF16)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("p=f16,c=f16,o=f32", (F16, F16, F32)),
        ("o=f16", (F32, F32, F16)),
        ("  P = F32 , C=BF16 ", (F32, BF16, BF16)),
        ("Mixed_Float16", (F32, F16, F32)),
        ("FULL", (F32, F32, F32)),
    ],
)
def test_get_policy_grammar(spec, expected):
    policy = jaxmp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


@pytest.mark.parametrize("spec", ["f32", "c=f16", "p=f16,c=bf16,o=f32", "mixed_bfloat16", "half"])
def test_str_round_trips(spec):
    policy = jaxmp.get_policy(spec)
    assert jaxmp.get_policy(str(policy)) == policy
    assert eval(repr(policy), {"Policy": lambda s: jaxmp.get_policy(s)}) == policy


@given(
    st.sampled_from(sorted(NAMES)), st.sampled_from(sorted(NAMES)), st.sampled_from(sorted(NAMES))
)
def test_grammar_property(p, c, o):
    policy = jaxmp.get_policy(f"p={p},c={c},o={o}")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        NAMES[p],
        NAMES[c],
        NAMES[o],
    )
    assert jaxmp.get_policy(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("f8", "'f8'"),
        ("p=f16,x=f32", "'x=f32'"),
        ("p=int32", "'int32'"),
        ("p=f16,p=f32", "twice"),
        ("", "empty"),
        ("c", "'c'"),
    ],
)
def test_get_policy_errors_name_the_token(spec, fragment):
    with pytest.raises(ValueError) as info:
        jaxmp.get_policy(spec)
    message = str(info.value)
    assert fragment in message
    assert "`policy_name`" in message


def test_get_policy_error_lists_choices():
    with pytest.raises(ValueError, match="mixed_float16.*|.*'bf16'.*"):
        jaxmp.get_policy("float8")


def test_get_policy_type_error():
    with pytest.raises(TypeError, match="`policy_name` must be a policy string"):
        jaxmp.get_policy(16)


def test_policy_passes_through():
    policy = jaxmp.get_policy("mixed_float16")
    assert jaxmp.get_policy(policy) is policy


def test_policy_is_hashable_static_jit_argument():
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    jitted = jax.jit(f, static_argnums=1)
    x = jnp.ones(3)
    assert jitted(x, jaxmp.get_policy("mixed_float16")).dtype == F16
    assert jitted(x, jaxmp.Policy(jnp.float32, "f16", jnp.dtype("float32"))).dtype == F16
    assert len(traces) == 1  # equal policies hit the same cache entry
    assert jitted(x, jaxmp.get_policy("mixed_bfloat16")).dtype == BF16
    assert len(traces) == 2


def test_policy_equality_by_dtype_and_defaults():
    assert jaxmp.Policy("f32", "f16", "f32") == jaxmp.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert jaxmp.Policy(jnp.float16) == jaxmp.get_policy("p=f16")
    assert jaxmp.Policy(jnp.float32, jnp.bfloat16) == jaxmp.get_policy("c=bf16")
    assert hash(jaxmp.Policy("f32", "f16", "f32")) == hash(jaxmp.get_policy("mixed_float16"))


def test_with_methods():
    policy = jaxmp.get_policy("f32")
    assert policy.with_param_dtype(jnp.float16).param_dtype == F16
    assert policy.with_compute_dtype("bf16").compute_dtype == BF16
    assert policy.with_output_dtype(jnp.float16).output_dtype == F16
    assert policy.with_output_dtype(jnp.float16).compute_dtype == F32


def test_policy_is_frozen():
    policy = jaxmp.get_policy("f32")
    with pytest.raises(AttributeError):
        policy.param_dtype = F16  # type: ignore[misc]


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, "int8", jnp.complex64])
def test_policy_rejects_non_float_dtypes(field, bad):
    kwargs = {"param_dtype": jnp.float32, field: bad}
    with pytest.raises((TypeError, ValueError), match=f"`{field}`"):
        jaxmp.Policy(**kwargs)


def test_policy_rejects_garbage_type():
    with pytest.raises(TypeError, match="`compute_dtype` must be a floating-point dtype"):
        jaxmp.Policy(jnp.float32, object())


def test_casting_methods_touch_only_floats():
    policy = jaxmp.get_policy("p=f16,c=bf16,o=f32")
    tree = {"x": jnp.ones(2), "i": jnp.arange(2), "s": "name", "n": None}
    for method, dtype in [
        (policy.cast_to_param, F16),
        (policy.cast_to_compute, BF16),
        (policy.cast_to_output, F32),
    ]:
        out = jax.jit(method, static_argnums=())({k: v for k, v in tree.items() if k in ("x", "i")})
        assert out["x"].dtype == dtype and out["i"].dtype == jnp.int32
        eager = method(tree)
        assert eager["s"] == "name" and eager["n"] is None


@pytest.mark.parametrize("spec", ["f32", "f16", "bf16", "c=f16", "p=f32,c=bf16,o=f32"])
def test_matches_jmp(spec):
    ours = jaxmp.get_policy(spec)
    theirs = jmp.get_policy(spec)
    assert ours.param_dtype == theirs.param_dtype
    assert ours.compute_dtype == theirs.compute_dtype
    assert ours.output_dtype == theirs.output_dtype


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ("mixed_flaot16", "mixed_float16"),
        ("mixed_bfloat61", "mixed_bfloat16"),
        ("bflaot16", "bfloat16"),
        ("flaot32", "float32"),
        ("p=f32,c=flaot16", "float16"),
        ("p=f32,comptue=f16", "compute"),
    ],
)
def test_misspelt_policy_suggests_the_closest_name(typo, suggestion):
    with pytest.raises(ValueError, match=f"Did you mean '{suggestion}'"):
        jaxmp.get_policy(typo)


def test_errors_name_the_argument_the_user_wrote():
    with pytest.raises(ValueError, match="`policy`.*Did you mean 'mixed_float16'"):
        jaxmp.mixed_precision(optax.sgd(0.1), policy="mixed_flaot16")
    with pytest.raises(ValueError, match="`policy`"):
        jaxmp.autocast(lambda x: x, "mixed_flaot16")
    with pytest.raises(TypeError, match="`policy` must be a policy string"):
        jaxmp.mixed_precision(optax.sgd(0.1), policy=None)
    with pytest.raises(ValueError, match="Unknown dtype"):  # jmp's words, kept
        jaxmp.get_policy("compute_float16")


@pytest.mark.parametrize("dtype", [jnp.float16, np.float16, jnp.dtype("bfloat16"), jnp.float32])
def test_a_dtype_means_the_same_as_its_name(dtype):
    name = jnp.dtype(dtype).name
    assert jaxmp.get_policy(dtype) == jaxmp.get_policy(name) == jaxmp.Policy(dtype)
    tx = jaxmp.mixed_precision(optax.sgd(0.1), dtype)
    assert jaxmp.get_loss_scale(tx.init({"w": jnp.ones(2)})) == jaxmp.default_loss_scale(name)


@pytest.mark.parametrize("bad", [None, float, int, bool, complex])
def test_none_and_python_types_are_not_float64(bad):
    # jnp.dtype(None) and jnp.dtype(float) are float64: never what these arguments mean.
    with pytest.raises(TypeError, match="`param_dtype` must be a floating-point dtype"):
        jaxmp.Policy(bad)
    with pytest.raises(TypeError, match="`dtype` must be a floating-point dtype"):
        jaxmp.cast_tree({"w": jnp.ones(2)}, bad)
    with pytest.raises(TypeError, match="`dtype` must be a floating-point dtype"):
        jaxmp.master_weights(optax.sgd(0.1), dtype=bad)
    if bad is not None:  # None is the documented default of compute_dtype and output_dtype
        with pytest.raises(TypeError, match="`compute_dtype` must be a floating-point dtype"):
            jaxmp.Policy(jnp.float32, bad)


def test_python_float_type_error_says_what_to_pass():
    with pytest.raises(TypeError, match=r"Python's `float`.*jnp\.float32"):
        jaxmp.Policy(float)


def test_dtype_to_names_takes_any_dtype_like():
    for dtype in (np.float16, jnp.float16, jnp.dtype("float16"), "float16"):
        assert jaxmp.dtype_to_names[dtype][0] == "f16"
    assert jaxmp.dtype_to_names[jnp.float32][0] == "f32"
    assert (
        str(jaxmp.Policy(jnp.bfloat16)).split(",")[0]
        == "p=" + jaxmp.dtype_to_names[jnp.bfloat16][0]
    )
    with pytest.raises(KeyError):
        jaxmp.dtype_to_names[jnp.int32]
