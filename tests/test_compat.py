"""The JAX internals jaxmp relies on exist and behave as `jaxmp._src.compat` expects.

This is the guard for a new JAX release: each test names the internal it checks, so a release
that renames or reshapes one breaks here, with the name in the message, rather than inside
autocast or loss scaling at a user's site. It runs on both ends of the supported range in CI.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmp._src import compat


def _eqn(fun, *args, name):
    """The last top-level equation of `fun`'s jaxpr whose primitive is `name` (or in it)."""
    names = (name,) if isinstance(name, str) else name
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    found = [e for e in jaxpr.eqns if e.primitive.name in names]
    assert found, f"tracing produced no `{name}` equation on jax {jax.__version__}: {jaxpr}"
    return found[-1]


def _eval(jaxpr, consts, *args):
    """Evaluates an open jaxpr by re-binding every equation through `compat.bind`."""
    env = {}

    def read(v):
        return v.val if isinstance(v, compat.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        with compat.source_context(eqn):
            outs = compat.bind(eqn, [read(v) for v in eqn.invars])
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, compat.DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


@pytest.mark.parametrize(("name", "places"), compat.INTERNAL_NAMES, ids=lambda v: str(v))
def test_internal_name_exists(name, places):
    assert compat.resolve(name) is not None, (
        f"jaxmp needs {' or '.join(places)}, missing on jax {jax.__version__}; "
        "update jaxmp/_src/compat.py"
    )


def test_missing_internal_names_reports_none_on_this_jax():
    assert compat.missing_internal_names() == []


def test_a_missing_internal_name_is_named(monkeypatch):
    extra = ("NoSuchThing", ("jax.extend.core.NoSuchThing", "jax.no_such_module.Thing"))
    monkeypatch.setattr(compat, "INTERNAL_NAMES", (*compat.INTERNAL_NAMES, extra))
    assert compat.missing_internal_names() == [
        "jax.extend.core.NoSuchThing or jax.no_such_module.Thing"
    ]
    with pytest.raises(ImportError, match=r"jax\.extend\.core\.NoSuchThing or .*supported range"):
        compat.resolve("NoSuchThing")


_BIG = np.arange(20.0, dtype=np.float32).reshape(5, 4)  # a closed-over constant


def _scan(c, xs):
    return lax.scan(lambda c, x: (c + x * _BIG[0], jnp.sum(c * x)), c, xs)


def test_scan_counts_and_body():
    c, xs = jnp.ones(4), jnp.arange(20.0).reshape(5, 4)
    eqn = _eqn(_scan, c, xs, name="scan")
    n_consts, n_carry = compat.scan_counts(eqn.params)
    assert n_carry == 1
    assert n_consts + n_carry + 1 == len(eqn.invars)
    for key in ("length", "reverse", "unroll", "jaxpr"):
        assert key in eqn.params, f"scan lost its `{key}` parameter on jax {jax.__version__}"
    body, consts = compat.jaxpr_and_consts(eqn.params["jaxpr"])
    assert len(body.invars) == len(eqn.invars)
    assert len(body.constvars) == len(consts)
    # One step of the body, re-bound through compat, matches the scan's first step.
    jaxpr = jax.make_jaxpr(_scan)(c, xs)
    outer_consts = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts, strict=True))
    ins = [outer_consts.get(v, None) for v in eqn.invars[:n_consts]]
    carry, y = _eval(body, consts, *ins, c, xs[0])
    np.testing.assert_allclose(carry, c + xs[0] * _BIG[0])
    np.testing.assert_allclose(y, jnp.sum(c * xs[0]))


@pytest.mark.parametrize(
    ("name", "fun", "keys"),
    [
        (
            "while",
            lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)),
            ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"),
        ),
        ("cond", lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), ("branches",)),
        # `pjit` up to jax 0.7, `jit` after.
        (("pjit", "jit"), jax.jit(jnp.sin), ("jaxpr", "name", "inline", "keep_unused")),
        (
            ("checkpoint", "remat2", "remat"),
            lambda x: jax.checkpoint(jnp.sin)(x),
            ("jaxpr", "prevent_cse", "policy"),
        ),
        ("custom_jvp_call", jax.nn.relu, ("call_jaxpr", "num_consts", "symbolic_zeros")),
        ("convert_element_type", lambda x: x.astype(jnp.float16), ("new_dtype",)),
        ("dot_general", lambda x: x @ x, ("preferred_element_type",)),
    ],
    ids=["while", "cond", "jit", "checkpoint", "custom_jvp_call", "convert", "dot_general"],
)
def test_primitive_parameters_jaxmp_reads(name, fun, keys):
    x = jnp.ones((2, 2)) if name == "dot_general" else jnp.arange(1.0, 5.0)
    eqn = _eqn(fun, x, name=name)
    for key in keys:
        assert key in eqn.params, f"`{eqn.primitive.name}` lost `{key}` on jax {jax.__version__}"
    for sub in compat.jaxprs_in_params(eqn.params):
        inner, consts = compat.jaxpr_and_consts(sub)
        assert len(inner.constvars) == len(consts)
    has_sub = name not in ("convert_element_type", "dot_general")
    assert compat.has_subjaxprs(eqn.params) == has_sub


def test_sub_jaxprs_evaluate_through_compat():
    def f(x):
        y = lax.cond(x[0] > 0, lambda v: v * _BIG[0], jnp.cos, x)
        return jax.jit(lambda v: jnp.sin(v) + _BIG[1])(y)

    x = jnp.arange(1.0, 5.0)
    closed = jax.make_jaxpr(f)(x)
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    (out,) = _eval(jaxpr, consts, x)
    np.testing.assert_allclose(out, f(x), rtol=1e-6)


def test_custom_jvp_rule_jaxpr_matches_jax_jvp():
    eqn = _eqn(jax.nn.relu, jnp.array([-1.0, 2.0]), name="custom_jvp_call")
    zeros = [False] * (len(eqn.invars) - eqn.params["num_consts"])
    jaxpr, consts, out_zeros = compat.custom_jvp_rule_jaxpr(eqn.params, zeros)
    assert out_zeros == [False]
    x, t = jnp.array([-1.0, 2.0]), jnp.array([10.0, 10.0])
    primal, tangent = _eval(jaxpr, consts, x, t)
    want_primal, want_tangent = jax.jvp(jax.nn.relu, (x,), (t,))
    np.testing.assert_array_equal(primal, want_primal)
    np.testing.assert_array_equal(tangent, want_tangent)


def test_symbolic_zero_and_tracer_checks():
    assert not compat.is_symbolic_zero(jnp.zeros(2))
    assert not compat.is_tracer(jnp.zeros(2))
    seen = []
    jax.jit(lambda x: seen.append(compat.is_tracer(x)) or x)(1.0)
    assert seen == [True]


def test_name_stack_and_context_of_an_equation():
    def f(x):
        with jax.named_scope("outer_scope"):
            return jnp.sin(x)

    eqn = _eqn(f, 1.0, name="sin")
    assert "outer_scope" in compat.name_stack_of(eqn)
    with compat.eqn_context(eqn):
        pass
    # Re-binding under the equation's source context keeps its name stack.
    (out,) = jax.make_jaxpr(lambda x: _eval(jax.make_jaxpr(f)(x).jaxpr, [], x)[0])(1.0).jaxpr.eqns[
        -1:
    ]
    assert "outer_scope" in compat.name_stack_of(out)


def test_known_primitive_names_include_lowered_ones():
    names = compat.known_primitive_names()
    assert {"dot_general", "scan", "while", "cond", "exp", "custom_jvp_call"} <= names
    assert {"dot_general", "exp"} <= compat.lowered_primitive_names()


def test_name_stack_parts_and_user_frames_of_a_derivative():
    def f(x):
        with jax.named_scope("outer_scope"):
            return jnp.sin(x) * 3.0

    line = f.__code__.co_firstlineno + 2
    eqn = _eqn(jax.grad(f), 1.0, name="mul")  # the last one: the backward pass's
    parts = compat.name_stack_parts(eqn)
    assert ("transform", "transpose") in parts, parts
    assert ("scope", "outer_scope") in parts, parts
    file, first_line, function = compat.user_frames(eqn)[0]
    # JAX gives the backward equation the traceback of the line it differentiates.
    assert (file, first_line, function.rsplit(".", 1)[-1]) == (__file__, line, "f")


def test_varying_axes_inside_shard_map():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = compat.varying_axes(x), compat.varying_axes(w)
        seen["max"] = compat.varying_axes(lax.pmax(jnp.max(x), "data"))
        return x

    P = jax.sharding.PartitionSpec
    jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(
        jnp.ones((2, 3)), jnp.ones(3)
    )
    assert seen == {"x": frozenset({"data"}), "w": frozenset(), "max": frozenset()}
    assert compat.varying_axes(jnp.ones(3)) == frozenset()
