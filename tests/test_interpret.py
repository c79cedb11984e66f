"""Tests for the re-interpretation core: a small rule set's records through every control flow.

Autocast (tests/test_autocast*.py) and the inspector (tests/test_inspector.py) test the core
through their rules; here a rule set that only counts calls checks what the core itself
promises: records leave jit, checkpoint, scan, while and cond; loops combine them by the
rules' monoid; a branch not taken gives the identity; the clock orders them by execution.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import compat, interpret

NEVER = np.iinfo(np.int32).max
COUNTED = {"sin", "cos", "exp", "tan", "tanh", "log"}


class CountCalls(interpret.Rules):
    """Re-binds every equation as traced; records each counted op's calls and first clock."""

    emits = True
    keep_custom_rules = False

    def literal(self, value):
        return value

    def apply(self, frame, index, eqn, vals, interp):
        if compat.has_subjaxprs(eqn.params):
            outs = interp.higher_order(eqn, vals)
            if outs is not NotImplemented:
                return outs
        outs = compat.bind(eqn, vals)
        if eqn.primitive.name in COUNTED:
            stack = "/".join(name for kind, name in interp.location(eqn).name_stack)
            interp.emit((eqn.primitive.name, stack), {"calls": np.int32(1), "first": interp.tick()})
        return outs

    def empty(self, struct):
        return {"calls": np.int32(0), "first": np.int32(NEVER)}

    def combine(self, a, b):
        return {"calls": a["calls"] + b["calls"], "first": jnp.minimum(a["first"], b["first"])}

    def in_loop(self, meta, kind, detail):
        return (*meta[:2], f"{kind} ({detail})", *meta[2:])  # outermost loop first


def run(fun, *args):
    closed = jax.make_jaxpr(fun)(*args)
    interp = interpret.Interpreter(CountCalls())
    outs = interp.eval_jaxpr(closed.jaxpr, closed.consts, list(args))
    records = jax.device_get([(meta, arrays) for meta, arrays in interp.records])
    return outs, [(meta, int(a["calls"]), int(a["first"])) for meta, a in records]


def program(x):
    a = jnp.sin(x)  # clock 0
    b = jax.jit(jnp.cos)(a)  # 1
    b = jax.jit(jnp.cos)(b)  # 2: the same jaxpr again, re-bound from the cache
    b = jax.checkpoint(jnp.exp)(b)  # 3

    def body(carry, _):
        return jnp.log(jnp.exp(carry) + 1.0), None  # exp 4, 6, 8; log 5, 7, 9

    c, _ = lax.scan(body, b, None, length=3)
    d = lax.cond(x[0] > 0, jnp.tan, jnp.tanh, c)  # tan 10; tanh never

    def cond(state):
        return (state[0] < 3) & (jnp.sin(state[1]).sum() < 100.0)  # 11, 13, 15, 17 (four tests)

    _, e = lax.while_loop(cond, lambda s: (s[0] + 1, jnp.exp(s[1] * 0.0) + s[1]), (0, d))
    return e  # exp 12, 14, 16 (three iterations)


def test_records_through_every_control_flow_in_execution_order():
    x = jnp.array([0.5, 0.25])
    (out,), records = run(program, x)
    np.testing.assert_allclose(out, program(x), rtol=1e-6)
    assert [(meta[0], calls, first) for meta, calls, first in records] == [
        ("sin", 1, 0),
        ("cos", 1, 1),
        ("cos", 1, 2),
        ("exp", 1, 3),
        ("exp", 3, 4),
        ("log", 3, 5),
        ("tanh", 0, NEVER),
        ("tan", 1, 10),
        ("sin", 4, 11),
        ("exp", 3, 12),
    ]
    loops = [meta[2:] for meta, _, _ in records]
    assert loops[4] == ("scan (3 iterations)",)
    assert loops[6] == ("cond (branch 0 of 2)",) and loops[7] == ("cond (branch 1 of 2)",)
    assert loops[8] == ("while (condition)",) and loops[9] == ("while (body)",)


def test_nested_loops_and_locations():
    def f(xs):
        def outer(carry, x):
            with jax.named_scope("inner_scope"):
                y = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
            return carry + y, None

        return lax.scan(outer, jnp.zeros(2), xs)[0]

    _, records = run(f, jnp.ones((3, 2)))
    ((meta, calls, first),) = records
    assert (meta[0], calls, first) == ("sin", 6, 0)
    assert "inner_scope" in meta[1]  # the name stack of the enclosing equations too
    assert meta[2:] == ("scan (3 iterations)", "scan (2 iterations)")


def test_rules_that_do_not_emit_leave_jit_signatures_alone():
    class Plain(CountCalls):
        emits = False

        def apply(self, frame, index, eqn, vals, interp):
            if compat.has_subjaxprs(eqn.params):
                outs = interp.higher_order(eqn, vals)
                if outs is not NotImplemented:
                    return outs
            return compat.bind(eqn, vals)

    def f(x):
        return jax.jit(jnp.sin)(x)

    def rebound(x):
        closed = jax.make_jaxpr(f)(x)
        return interpret.Interpreter(Plain()).eval_jaxpr(closed.jaxpr, closed.consts, [x])

    (eqn,) = jax.make_jaxpr(rebound)(jnp.ones(2)).jaxpr.eqns
    assert len(eqn.invars) == 1 and len(eqn.outvars) == 1  # no clock, no records


# --- Graph nodes: the split is registered from above, never imported by the core --------------


def test_registered_graph_splitter_splits_the_arguments(monkeypatch):
    seen = []

    def splitter(tree):
        seen.append(tree)
        return "split" if tree[0] else None

    monkeypatch.setattr(interpret, "_graph_splitter", None)
    assert interpret.split_graph_nodes(((1,), {})) is None  # none registered
    interpret.register_graph_splitter(splitter)
    assert interpret.split_graph_nodes(((1,), {})) == "split"
    assert interpret.split_graph_nodes(((), {})) is None
    assert seen == [((1,), {}), ((), {})]
    interpret.register_graph_splitter(None)
    assert interpret.split_graph_nodes(((1,), {})) is None and len(seen) == 2


def test_nnx_modules_are_split_without_importing_jaxmp_nnx_first():
    """A program that never imports `jaxmp.nnx` passes NNX modules to `jaxmp.autocast`: the
    package root's stand-in loads `jaxmp.nnx`, which registers its own split."""
    code = """if True:
        import sys
        import jax.numpy as jnp
        import jaxmp
        from jaxmp._src import interpret
        assert interpret.split_graph_nodes(((1,), {})) is None
        assert "flax" not in sys.modules, "flax imported"
        from flax import nnx
        assert "jaxmp.nnx" not in sys.modules
        model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
        out = jaxmp.autocast(lambda m, x: m(x), "mixed_bfloat16")(model, jnp.ones((2, 3)))
        assert out.shape == (2, 3), out
        # The statistics the call updated are written back to the model: the split did it.
        assert (model.mean.get_value() != 0).all(), model.mean
        assert interpret._graph_splitter is sys.modules["jaxmp.nnx"]._split_graph_nodes
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _gpu_only_primitive():
    """A primitive lowered for CUDA only, as cuDNN's fused attention is."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("jaxmp_test_gpu_only")
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False), "cuda")
    return prim


def test_a_platform_dependent_cond_stays_platform_dependent():
    # `lax.platform_dependent` (jaxmp.dot_product_attention, the FP8 product of
    # jaxmp.quantized): the program re-interpreted for the CPU lowers the CPU branch only. As
    # a plain `switch`, it lowered every branch, and one holding a primitive with no CPU
    # lowering (cuDNN's attention, with JAX's CUDA plugin installed) failed to compile.
    prim = _gpu_only_primitive()

    def fun(x):
        return lax.platform_dependent(x, cpu=jnp.sin, default=prim.bind)

    x = jnp.array([0.5, 0.25])
    (out,), records = run(jax.jit(fun), x)
    np.testing.assert_allclose(out, np.sin(np.asarray(x)), rtol=1e-6)
    assert [(meta[0], calls) for meta, calls, _ in records] == [("sin", 1)]

    def interpreted(x):
        closed = jax.make_jaxpr(fun)(x)
        return interpret.Interpreter(CountCalls()).eval_jaxpr(closed.jaxpr, closed.consts, [x])

    assert "jaxmp_test_gpu_only" not in jax.jit(interpreted).lower(x).as_text()
