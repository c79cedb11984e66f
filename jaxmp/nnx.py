"""Mixed precision for Flax NNX: `set_policy`, `value_and_grad` and `Optimizer`.

This module imports Flax; ``import jaxmp`` does not. `nnx.Optimizer` works with
any jaxmp transformation as it is (``nnx.Optimizer(model,
jaxmp.mixed_precision(tx, policy), wrt=nnx.Param)``), and `jaxmp.get_loss_scale`
/ `jaxmp.loss_scale_metrics` accept it; `jaxmp.nnx.Optimizer` only adds that a
skipped step does not advance ``step``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp._src import flax_common, interpret
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src import state as state_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8_autocast import fp8_autocast
from jaxmp._src.grad import as_loss_scale_object, scaled_loss_fn

__all__ = ("Float8", "Float8StateVariable", "Optimizer", "set_policy", "value_and_grad")

M = TypeVar("M", bound=nnx.Module)


def _cast(variable: nnx.Param, dtype: Any) -> None:
    value = variable.get_value()
    if jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != dtype:
        variable.set_value(value.astype(dtype))


def set_policy(
    model: M,
    policy: policy_lib.Policy | str,
    overrides: Mapping[type | str, policy_lib.Policy | str] | None = None,
) -> M:
    """Puts every module of an NNX model under `policy` (or its override), in place.

    Each module with a ``dtype`` attribute gets its policy's compute dtype and
    each one with a ``param_dtype`` attribute its param dtype (NNX modules read
    them when called and when creating params), and every `nnx.Param` is cast
    to the param dtype of the module that holds it (``policy.param_dtype`` for
    params outside any matched module). A module's policy is that of the first
    entry of `overrides` matching it, else `policy`. Keys of `overrides` are
    module classes (`isinstance`, e.g. ``nnx.LayerNorm``) or regexes fully
    matching the module path written ``"/layers/0/norm"``; values are
    `jaxmp.Policy` objects or policy strings. Batch statistics and other
    non-param variables keep their dtype.

    The optimizer may be created before or after `set_policy`. Its float32
    master copy (`jaxmp.master_weights`, when the params become float16 or
    bfloat16) starts from the params as they are when it is created: after
    `set_policy`, the usual order, from the params rounded to the half dtype,
    which for a random init is just another init and trains the same; before
    it, from the exact float32 values, which keeps the float32 digits of
    pretrained weights.

    `set_policy` changes the modules, not the model's own code: the model's
    output has the dtype its last layer computes in (float16 for a final
    ``nnx.Linear`` under ``"mixed_float16"``). Cast it with
    ``policy.cast_to_output(model(x))`` for the policy's output dtype, or
    override the last layer to ``"float32"``.

    Args:
      model: the NNX module.
      policy: the default `jaxmp.Policy` or policy string.
      overrides: optional mapping from module classes or path regexes to policies.

    Returns:
      `model` itself, changed in place.

    Raises:
      TypeError / ValueError: for a bad `model`, `policy` or `overrides` entry.

    Example:
      >>> import jax.numpy as jnp, jaxmp.nnx
      >>> from flax import nnx
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.LayerNorm(4, rngs=rngs))
      >>> model = jaxmp.nnx.set_policy(model, "float16", {nnx.LayerNorm: "float32"})
      >>> model.layers[0].kernel.dtype, model.layers[1].scale.dtype
      (dtype('float16'), dtype('float32'))
      >>> model(jnp.ones((1, 3))).dtype
      dtype('float32')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"`model` must be an nnx.Module, got {type(model).__name__}.")
    policies = flax_common.module_policies(policy, overrides, module_base=nnx.Module)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            _cast(node, policies.default.param_dtype)
    for path, module in nnx.iter_modules(model):
        module_policy = policies.policy_for(module, path)
        for attr, value in (
            (flax_common.DTYPE_ATTR, module_policy.compute_dtype),
            (flax_common.PARAM_DTYPE_ATTR, module_policy.param_dtype),
        ):
            if flax_common.has_field(module, attr):
                setattr(module, attr, value)
        if module_policy.param_dtype != policies.default.param_dtype:
            for value in vars(module).values():
                if isinstance(value, nnx.Param):
                    _cast(value, module_policy.param_dtype)
    return model


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """`nnx.value_and_grad` of the loss multiplied by a loss scale (NNX `jaxmp.value_and_grad`).

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)``: `value` is
    `fun`'s own output (the unscaled loss, or ``(loss, aux)`` with `has_aux`);
    `grads` (an `nnx.State` of the `nnx.Param` variables for a module argument) are
    the gradients of ``loss_scale.scale(loss)``, for ``optimizer.update``. A module
    holding `Float8` modules with `jaxmp.DelayedScaling` also gets the "gradients" of
    their `Float8StateVariable`: the next FP8 state, which `Optimizer.update` writes.

    Args:
      fun: the loss function; returns a scalar (or ``(scalar, aux)``).
      argnums: which positional argument(s) of `fun` to differentiate.
      has_aux: whether `fun` returns ``(loss, aux)``.

    Returns:
      The function ``g``; `loss_scale` is a `jaxmp.LossScale` (for example
      ``jaxmp.get_loss_scale(optimizer)``) or a scalar.

    Raises:
      TypeError: if `fun` is not callable; when ``g`` is called, if its first argument
        is not a loss scale (a module or a batch passed first: the message says to pass
        ``optimizer.loss_scale`` before them), or `fun` does not return a scalar loss
        (or a pair with `has_aux`).

    Example:
      >>> import jax.numpy as jnp, jaxmp, jaxmp.nnx
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
      >>> loss_fn = lambda m: jnp.sum(m(jnp.ones((1, 2))))
      >>> loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(jaxmp.StaticLossScale(8.0), model)
      >>> grads["kernel"].get_value().ravel()
      Array([8., 8.], dtype=float32)
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {fun!r}.")

    def g(loss_scale: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # The usual slip is `value_and_grad(loss_fn)(model, x)`: say which argument is
        # missing instead of printing the model (issue 29).
        if nnx.graph.is_graph_node(loss_scale) or isinstance(loss_scale, nnx.State):
            raise _not_a_loss_scale(loss_scale)
        try:
            scale = as_loss_scale_object(loss_scale)
        except TypeError:
            raise _not_a_loss_scale(loss_scale) from None

        scaled_fun = scaled_loss_fn(fun, scale, has_aux)
        grad_fn = nnx.value_and_grad(scaled_fun, argnums=_with_fp8(argnums, args), has_aux=True)
        (_, value), grads = grad_fn(*args, **kwargs)
        return value, grads

    return g


def _not_a_loss_scale(x: Any) -> TypeError:
    """The error for a first argument that is not a loss scale, described in a few words
    (a module's repr can run to pages)."""
    if isinstance(x, nnx.Module):
        described = f"an nnx.Module ({type(x).__name__})"
    elif isinstance(x, nnx.State):
        described = "an nnx.State"
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        described = f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    else:
        described = f"a {type(x).__name__}"
    return TypeError(
        "The first argument of the function that `jaxmp.nnx.value_and_grad` returns must be "
        f"the loss scale, got {described}. Pass the loss scale first: "
        "`jaxmp.nnx.value_and_grad(loss_fn)(optimizer.loss_scale, model, *batch)` (a "
        "`jaxmp.LossScale`, or a positive float)."
    )


class Optimizer(nnx.Optimizer):
    """`nnx.Optimizer` whose ``step`` does not advance on a skipped step.

    With a jaxmp transformation (`jaxmp.mixed_precision`, `jaxmp.loss_scaling`)
    a plain `nnx.Optimizer` already leaves the model and the optimizer's inner
    state untouched on a non-finite step, but counts it in ``step``. This
    subclass restores ``step`` too, so a skipped step changes nothing but the
    loss-scaling state (scale reduced, skip counted in
    ``jaxmp.loss_scale_metrics(optimizer)["skipped_steps"]``): ``step`` counts
    applied updates. Its transformation must contain a jaxmp loss-scaling state.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp, jaxmp.nnx
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> opt = jaxmp.nnx.Optimizer(
      ...     model, jaxmp.mixed_precision(optax.sgd(0.1), "mixed_float16"), wrt=nnx.Param)
      >>> grads = nnx.state(model, nnx.Param)
      >>> grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), grads)
      >>> _ = opt.update(model, grads)
      >>> int(opt.step[...]), int(jaxmp.loss_scale_metrics(opt)["skipped_steps"])
      (0, 1)
    """

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """Like `nnx.Optimizer.update`; ``step`` advances only when the step was applied.

        Entries of `grads` for `Float8StateVariable` variables (from `value_and_grad`)
        are the next FP8 states: they are written into `model` as they are, never given
        to the optimizer, and kept unchanged on a skipped step.
        """
        fp8_grads = None
        if isinstance(grads, nnx.State):
            fp8_grads, grads = nnx.split_state(grads, Float8StateVariable, ...)
        step = self.step[...]
        updates = super().update(model, grads, **kwargs)
        finite = state_lib.loss_scaling_state(self.opt_state).grads_finite
        self.step[...] = step + finite.astype(step.dtype)
        if fp8_grads is not None and jax.tree.leaves(fp8_grads):
            current = nnx.state(model, Float8StateVariable)
            names = ("FP8 state gradients", "model's FP8 state")
            nnx.update(model, tree_lib.select(finite, fp8_grads, current, names=names))
        return updates

    @property
    def loss_scale(self) -> loss_scale_lib.LossScale:
        """The `jaxmp.LossScale` to scale the next loss with."""
        return state_lib.get_loss_scale(self.opt_state)

    def metrics(self) -> dict[str, jax.Array]:
        """`jaxmp.loss_scale_metrics` of the optimizer state, for logging."""
        return state_lib.loss_scale_metrics(self.opt_state)


# --------------------------------------------------------------------------------------------
# FP8.


class Float8StateVariable(nnx.Variable):
    """The `jaxmp.Float8State` of a `Float8` module (`jaxmp.DelayedScaling`).

    Not an `nnx.Param`: the optimizer never sees it. `value_and_grad` differentiates it
    along with the params, and its gradient is its next value, which `Optimizer.update`
    writes into the model.
    """


class _ConstructorSignature:
    """A class's ``__signature__``: its ``__init__``'s without ``self``.

    NNX's metaclass defines ``__call__(*args, **kwargs)``, which `inspect.signature` (and
    Sphinx) would show for the class. On an instance the attribute is absent, so a module's
    own signature is that of its ``__call__``.
    """

    def __get__(self, instance: Any, owner: type) -> inspect.Signature:
        if instance is not None:
            raise AttributeError("__signature__")
        init = next(vars(cls)["__init__"] for cls in owner.__mro__ if "__init__" in vars(cls))
        signature = inspect.signature(init)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


def _call_model(model: Any, *args: Any, **kwargs: Any) -> Any:
    return model(*args, **kwargs)


class Float8(nnx.Module):
    """An NNX model whose matmuls run in FP8: `jaxmp.autocast` with an FP8 recipe.

    ``Float8(model, policy, recipe, *example_args)`` wraps an unmodified model: calling it
    calls the model with every ``dot_general`` (``nnx.Linear``, ``nnx.Einsum``, attention)
    in FP8 with `recipe` (and, with a per-tensor recipe, every convolution), everything
    else following `policy`. With `jaxmp.DelayedScaling`, the FP8 state is the
    `Float8StateVariable` ``fp8_state``, created from the example arguments; train with
    `value_and_grad` and `Optimizer`, which update it.

    Args:
      model: the NNX model (its params as the policy wants them: see `set_policy`).
      policy: a `jaxmp.Policy` or policy string (``"mixed_bfloat16"``).
      recipe: an FP8 recipe (`jaxmp.Float8CurrentScaling`, `jaxmp.DelayedScaling`, ...).
      *example_args: arguments of a call (arrays or `jax.ShapeDtypeStruct`), to create the
        delayed state; unused by the stateless recipes.
      exclude: regex(es) fully matching the name stacks kept out of FP8 (``jax.named_scope``
        names in the model's code).
      **example_kwargs: keyword arguments of a call.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp, jaxmp.nnx
      >>> from flax import nnx
      >>> x = jnp.ones((8, 16))
      >>> model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu,
      ...                        nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
      >>> model = jaxmp.nnx.Float8(model, "mixed_bfloat16", jaxmp.DelayedScaling(), x)
      >>> optimizer = jaxmp.nnx.Optimizer(
      ...     model, jaxmp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16"), wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer):
      ...     loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
      ...     loss, grads = jaxmp.nnx.value_and_grad(loss_fn)(optimizer.loss_scale, model)
      ...     optimizer.update(model, grads)
      >>> train_step(model, optimizer)
      >>> float(model.fp8_state.get_value().scale["s0"][0])  # power of two below 448 / amax 1
      256.0
    """

    __signature__ = _ConstructorSignature()

    def __init__(
        self,
        model: Any,
        policy: policy_lib.Policy | str,
        recipe: Any,
        *example_args: Any,
        exclude: str | Sequence[str] | None = None,
        **example_kwargs: Any,
    ):
        self.model = model
        self.autocast = fp8_autocast(_call_model, policy, recipe, exclude)
        state = None
        if self.autocast.fp8.stateful:
            init = self.autocast.fp8_init(model, *example_args, **example_kwargs)
            state = Float8StateVariable(init)
        self.fp8_state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fp8_state is None:
            return self.autocast(self.model, *args, **kwargs)
        call = self.autocast.with_fp8_state(self.fp8_state.get_value())
        return call(self.model, *args, **kwargs)


def _with_fp8(argnums: Any, args: tuple[Any, ...]) -> Any:
    """`argnums` for `nnx.value_and_grad`: a module holding FP8 state differentiates it too."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    wrt = nnx.Any(nnx.Param, Float8StateVariable)
    out = []
    for i in nums:
        node = args[i] if isinstance(i, int) and -len(args) <= i < len(args) else None
        has_fp8 = nnx.graph.is_graph_node(node) and jax.tree.leaves(
            nnx.state(node, Float8StateVariable)
        )
        out.append(nnx.DiffState(i, wrt) if has_fp8 else i)
    return out[0] if isinstance(argnums, int) else tuple(out)


# --------------------------------------------------------------------------------------------
# `jaxmp.autocast` of functions taking NNX modules.


@dataclasses.dataclass(frozen=True)
class _GraphNodes:
    """Where the NNX graph nodes of an autocast call's arguments go (static and hashable).

    Attributes:
      graphdef: the `nnx.GraphDef` of the list of graph nodes.
      treedef: the tree of ``(args, kwargs)`` with each graph node as a leaf.
      positions: the leaf positions of the graph nodes in `treedef`.
    """

    graphdef: Any
    treedef: Any
    positions: tuple[int, ...]

    def merge(self, others: list[Any], state: Any) -> tuple[Any, Any, Callable[[], Any]]:
        """The call's ``(args, kwargs)`` rebuilt inside the trace, and a reader of the state.

        The modules rebuilt are named (`_name_modules`), so that the ops of the call carry
        the modules' attribute paths in their name stacks.
        """
        nodes = nnx.merge(self.graphdef, state)
        _name_modules(nodes)
        leaves = list(others)
        for position, node in zip(self.positions, nodes, strict=True):
            leaves.insert(position, node)
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return args, kwargs, lambda: nnx.state(nodes)


def _name_modules(tree: Any) -> None:
    """Makes each NNX module in `tree` run its ``__call__`` under a `jax.named_scope`.

    So that the ops of a call name the module path, as Flax Linen's do (the names
    `jaxmp.inspect` prints and `fp8_exclude` patterns match): `tree` holds the modules merged
    inside a trace, fresh copies and never the caller's objects. Each copy's class becomes a
    subclass whose ``__call__`` opens a scope named by the module's attribute path in the
    enclosing module (the class name for a module passed as an argument): the layers of an
    ``nnx.Sequential`` are ``"Sequential/0"``, ``"Sequential/1"``... `nnx.split` records the
    subclass, so the copies `nnx.grad` and `nnx.value_and_grad` make inside the call are named
    too.
    """
    for root in jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node):
        if not nnx.graph.is_graph_node(root):
            continue
        modules = {
            tuple(path): node for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)
        }
        for path, node in modules.items():
            # The nearest enclosing module: the longest proper prefix of the path that is one.
            parent = next(
                (path[:i] for i in range(len(path) - 1, 0, -1) if path[:i] in modules), ()
            )
            name = "/".join(str(k) for k in path[len(parent) :]) if path else type(node).__name__
            if _defines_call(type(node)):
                node.__class__ = _scoped_class(
                    getattr(type(node), "_jaxmp_unscoped", type(node)), name
                )


def _defines_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


@functools.cache
def _scoped_class(cls: type, name: str) -> type:
    """`cls` with ``__call__`` under ``jax.named_scope(name)`` (one class per pair)."""
    unscoped_call = cls.__call__  # type: ignore[operator]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            return unscoped_call(self, *args, **kwargs)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_jaxmp_unscoped": cls,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _split_graph_nodes(tree: Any) -> tuple[_GraphNodes, list[Any], Any, Callable] | None:
    """Splits the NNX graph nodes out of `tree` for `jaxmp.autocast`, or None if it has none.

    Returns ``(nodes, others, state, write_back)``: the static `_GraphNodes`, the other
    leaves of `tree`, the nodes' `nnx.State`, and a function that writes the state leaves
    the call changed (a list with None for the unchanged ones) back into the nodes, as
    `nnx.jit` does: BatchNorm statistics and `nnx.Rngs` counters update as in the plain call.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=nnx.graph.is_graph_node)
    positions = tuple(i for i, leaf in enumerate(leaves) if nnx.graph.is_graph_node(leaf))
    if not positions:
        return None
    nodes = [leaves[i] for i in positions]
    others = [leaf for i, leaf in enumerate(leaves) if i not in positions]
    graphdef, state = nnx.split(nodes)

    def write_back(new_leaves: list[Any]) -> None:
        old_leaves, state_def = jax.tree.flatten(state)
        if all(new is None for new in new_leaves):
            return
        merged = [
            old if new is None else new for new, old in zip(new_leaves, old_leaves, strict=True)
        ]
        nnx.update(nodes, jax.tree.unflatten(state_def, merged))

    return _GraphNodes(graphdef, treedef, positions), others, state, write_back


# `jaxmp.autocast`, `jaxmp.inspect` and FP8 split NNX modules out of a call's arguments with
# this; it replaces the package root's stand-in, which imports this module on first need.
interpret.register_graph_splitter(_split_graph_nodes)
