"""Memory traffic of one optimizer update with loss scaling, jaxmp against its peers.

For each approach, one jitted function takes the scaled gradients (as the backward pass
returns them), the optimizer state and the params, and returns the new params and state
(the optimizer update and `optax.apply_updates` together). The figure is XLA's cost model,
``compiled.cost_analysis()["bytes accessed"]``, in units of one float32 copy of the params
(deterministic for a given jax/jaxlib and backend), and its ratio to plain `optax.adam`.

Then, for a few of them, where the bytes go: the compiled program's instructions grouped by
what they read and what they write.

Run from the repository root::

    PYTHONPATH=. python benchmarks/update_cost.py
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hlo  # noqa: E402
import _model  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxmp  # noqa: E402

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
SCALE = 2.0**15


def _apply(tx):
    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _adjust(scale, counter, finite, period=2000):
    grow = counter + 1 >= period
    new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
    return jnp.clip(new_scale, 1.0, 2.0**32), jnp.where(finite & ~grow, counter + 1, 0)


def _naive(inner):
    """A loss-scaling wrapper as one writes it first: unscale, check, update, select after."""

    def init(params):
        return inner.init(params), jnp.asarray(SCALE, F32), jnp.zeros((), jnp.int32)

    def step(grads, state, params):
        inner_state, scale, counter = state
        grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / scale), grads)
        finite = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()
        updates, new_inner = inner.update(grads, inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
        inner_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_inner, inner_state)
        scale, counter = _adjust(scale, counter, finite)
        return optax.apply_updates(params, updates), (inner_state, scale, counter)

    return init, step


def _naive_master(inner):
    """Hand-written float32 master weights and loss scaling for half-precision params."""

    def init(params):
        master = jaxmp.cast_tree(params, F32)
        return master, inner.init(master), jnp.asarray(SCALE, F32), jnp.zeros((), jnp.int32)

    def step(grads, state, params):
        master, inner_state, scale, counter = state
        grads = jax.tree.map(lambda g: g.astype(F32) * (1.0 / scale), grads)
        finite = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()
        updates, new_inner = inner.update(grads, inner_state, master)
        new_master = optax.apply_updates(master, updates)
        keep = functools.partial(jnp.where, finite)
        master = jax.tree.map(keep, new_master, master)
        inner_state = jax.tree.map(keep, new_inner, inner_state)
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        scale, counter = _adjust(scale, counter, finite)
        return params, (master, inner_state, scale, counter)

    return init, step


def _jmp(inner):
    """jmp's glue: ``unscale``, ``all_finite``, ``select_tree`` over params and state."""
    import jmp  # noqa: PLC0415

    def init(params):
        # jmp 0.0.4's DynamicLossScale drops min_loss_scale when it is flattened, so its
        # arrays are carried and the object is rebuilt inside the step.
        return inner.init(params), jnp.asarray(SCALE, F32), jnp.zeros((), jnp.int32)

    def step(grads, state, params):
        inner_state, scale, counter = state
        ls = jmp.DynamicLossScale(scale, counter)
        grads = ls.unscale(jax.tree.map(lambda g: g.astype(F32), grads))
        finite = jmp.all_finite(grads)
        ls = ls.adjust(finite)
        updates, new_inner = inner.update(grads, inner_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jmp.select_tree(finite, new_params, params)
        inner_state = jmp.select_tree(finite, new_inner, inner_state)
        return params, (inner_state, ls.loss_scale, ls.counter)

    return init, step


def _apply_if_finite(inner):
    """`optax.apply_if_finite` around the optimizer; the unscale is written inline."""
    tx = optax.apply_if_finite(inner, max_consecutive_errors=10**9)

    def init(params):
        return tx.init(params), jnp.asarray(SCALE, F32)

    def step(grads, state, params):
        tx_state, scale = state
        grads = jax.tree.map(lambda g: g.astype(F32) / scale, grads)
        updates, tx_state = tx.update(grads, tx_state, params)
        scale = jnp.where(tx_state.last_finite, scale, jnp.maximum(scale * 0.5, 1.0))
        return optax.apply_updates(params, updates), (tx_state, scale)

    return init, step


@jax.custom_vjp
def _given_grads(params, grads):
    """A loss of 0 whose gradient with respect to `params` is `grads` (see `_flax`)."""
    del params, grads
    return jnp.zeros((), F32)


def _given_fwd(params, grads):
    return jnp.zeros((), F32), grads


def _given_bwd(grads, ct):
    del ct
    return grads, jax.tree.map(jnp.zeros_like, grads)


_given_grads.defvjp(_given_fwd, _given_bwd)


def _flax(inner):
    """Flax's `DynamicScale.value_and_grad` and the ImageNet example's ``jnp.where``s.

    `DynamicScale` computes the gradients itself; here the "loss" is a function whose
    gradient is the given (scaled) gradients, so the measured program is Flax's unscale,
    finiteness check and scale update, the optimizer, and the selects.
    """
    from flax.training import dynamic_scale as dynamic_scale_lib  # noqa: PLC0415

    def init(params):
        return inner.init(params), dynamic_scale_lib.DynamicScale(scale=jnp.asarray(SCALE, F32))

    def step(grads, state, params):
        inner_state, ds = state
        grad_fn = ds.value_and_grad(lambda p: _given_grads(p, grads))
        ds, is_fin, _, grads = grad_fn(params)
        updates, new_inner = inner.update(grads, inner_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(keep, new_params, params)
        inner_state = jax.tree.map(keep, new_inner, inner_state)
        return params, (inner_state, ds)

    return init, step


LOW_MEMORY = [
    ("round-to-nearest", {}),
    ("stochastic", dict(rounding="stochastic")),
    ("kahan", dict(rounding="kahan")),
    ("stochastic, bf16 moments", dict(rounding="stochastic", moments="bf16")),
    ("kahan, bf16 moments", dict(rounding="kahan", moments="bf16")),
    ("stochastic, int8 moments", dict(rounding="stochastic", moments="int8")),
    ("stochastic, fp8 moments", dict(rounding="stochastic", moments="fp8")),
]


def variants(learning_rate: float = 1e-3) -> list[tuple[str, str, Any, Any]]:
    """(name, param dtype, init, step) for every measured approach."""
    adam = optax.adam(learning_rate)

    def tx(t):
        return t.init, _apply(t)

    ls = jaxmp.DynamicLossScale(SCALE)
    try:
        jmp_row = [("jmp glue (unscale, all_finite, select_tree)", "float32", *_jmp(adam))]
    except ImportError:  # jmp is optional (not installed on every benchmark machine)
        jmp_row = []
    return [
        ("optax.adam (float32)", "float32", *tx(adam)),
        ("jaxmp.loss_scaling(adam)", "float32", *tx(jaxmp.loss_scaling(adam, ls))),
        ("jaxmp.mixed_precision(adam, 'mixed_float16')", "float32",
         *tx(jaxmp.mixed_precision(adam, "mixed_float16"))),
        ("naive loss-scaling wrapper (select after update)", "float32", *_naive(adam)),
        *jmp_row,
        ("optax.apply_if_finite(adam)", "float32", *_apply_if_finite(adam)),
        ("flax DynamicScale + jnp.where", "float32", *_flax(adam)),
        ("jaxmp.mixed_precision(adam, 'p=f16,c=f16'), f32 master", "float16",
         *tx(jaxmp.mixed_precision(adam, "p=f16,c=f16"))),
        ("hand-written f32 master + loss scaling, f16 params", "float16", *_naive_master(adam)),
        ("jaxmp.mixed_precision(adam, 'p=bf16,c=bf16'), f32 master", "bfloat16",
         *tx(jaxmp.mixed_precision(adam, "p=bf16,c=bf16"))),
        # The opt-in guards.
        ("jaxmp.loss_scaling(adam, check_outputs=True)", "float32",
         *tx(jaxmp.loss_scaling(adam, ls, check_outputs=True))),
        ("jaxmp.loss_scaling(master_weights(adam, count_saturated=True))", "float16",
         *tx(jaxmp.loss_scaling(jaxmp.master_weights(adam, count_saturated=True), ls))),
        ("jaxmp.loss_scaling(master_weights(adam), check_outputs=True)", "float16",
         *tx(jaxmp.loss_scaling(jaxmp.master_weights(adam), ls, check_outputs=True))),
        # Low memory: bfloat16 params without a master copy (docs/guides/low_memory.md).
        *[(f"jaxmp.mixed_precision(adam, 'p=bf16,c=bf16', {text})", "bfloat16",
           *tx(jaxmp.mixed_precision(adam, "p=bf16,c=bf16", master_weights=False, **kw)))
          for text, kw in LOW_MEMORY],
    ]  # fmt: skip


def compile_update(init, step, params: Any):
    """Compiles ``step(grads, opt_state, params)`` for grads and params like `params`."""
    opt_state = jax.eval_shape(init, jax.tree.map(lambda p: p.astype(F32), params))
    lowered = jax.jit(step).lower(params, opt_state, params)
    return lowered.compile(), jax.eval_shape(step, params, opt_state, params)


def _label(path: str) -> str:
    for key in ("master", "mu", "nu"):
        if re.search(rf"\b{key}\b", path):
            return key
    for key in ("grads", "params"):
        if path.startswith(key):
            return key
    return "state"


def _output_labels(out_shape: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    labels = []
    for path, _ in leaves:
        name = ("params" if path[0].idx == 0 else "opt_state") + jax.tree_util.keystr(path[1:])
        labels.append(_label(name))
    return labels


def params_of(config: _model.Config, dtype: Any) -> Any:
    shapes = _model.param_shapes(config)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, dtype), shapes)


def measure(config: _model.Config, breakdown: tuple[str, ...] = ()) -> dict[str, Any]:
    """Compiles every variant; returns bytes (in units), ratios and breakdowns."""
    dtypes = {"float32": F32, "float16": F16, "bfloat16": BF16}
    params = {k: params_of(config, v) for k, v in dtypes.items()}
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params["float32"]))
    unit = 4.0 * n
    results = {}
    for name, dtype, init, step in variants():
        compiled, out_shape = compile_update(init, step, params[dtype])
        entry = {"bytes": _hlo.bytes_accessed(compiled) / unit, "dtype": dtype}
        if any(name.startswith(b) for b in breakdown):
            entry["breakdown"] = _hlo.fusion_breakdown(
                compiled, _label, _output_labels(out_shape), unit
            )
        results[name] = entry
    base = results["optax.adam (float32)"]["bytes"]
    for entry in results.values():
        entry["ratio"] = entry["bytes"] / base
    return {"params": n, "results": results}


BREAKDOWN = (
    "optax.adam",
    "jaxmp.loss_scaling",
    "naive loss-scaling",
    "jaxmp.mixed_precision(adam, 'p=f16",
)


def report(measured: dict[str, Any]) -> str:
    lines = [
        f"Update traffic, {measured['params'] / 1e6:.2f}M parameters: bytes accessed "
        "(XLA cost model) in float32 copies of the params, and the ratio to optax.adam.",
        "",
    ]
    rows = [
        [name, e["dtype"], f"{e['bytes']:.3f}", f"{e['ratio']:.4f}"]
        for name, e in measured["results"].items()
    ]
    lines.append(_hlo.table(["update + apply_updates", "params", "bytes / P", "ratio"], rows))
    for name, e in measured["results"].items():
        if "breakdown" not in e:
            continue
        lines += ["", f"Where the bytes go: {name} (total {e['bytes']:.3f})", ""]
        rows = [
            [reads, writes, f"{r:.3f}", f"{w:.3f}", str(c)]
            for reads, writes, r, w, c in e["breakdown"]
            if r + w >= 0.001
        ]
        listed = sum(r + w for _, _, r, w, _ in e["breakdown"] if r + w >= 0.001)
        rows.append(["(scalars, small)", "", f"{e['bytes'] - listed:.3f}", "", ""])
        lines.append(_hlo.table(["reads", "writes", "read", "written", "ops"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="update", choices=sorted(_model.CONFIGS))
    args = parser.parse_args(argv)
    print(_hlo.machine())
    measured = measure(_model.CONFIGS[args.config], BREAKDOWN)
    print(report(measured))


if __name__ == "__main__":
    _hlo.real_compiles()
    main()
