"""Mixed precision for Flax Linen: a policy-aware `TrainState` and `policy_scope`.

This module imports Flax; ``import jaxmp`` does not. The pieces:

* `policy_scope`: run a model written in float32 under a `jaxmp.Policy`, with
  per-module-class (or module-path) overrides, Haiku-style.
* `TrainState`: `flax.training.train_state.TrainState` that knows its policy,
  keeps the params in the policy's param dtype, skips non-finite steps whole
  (step counter included) and exposes the loss scale and its metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from jaxmp._src import attention as attention_lib
from jaxmp._src import flax_common
from jaxmp._src import loss_scale as loss_scale_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src import state as state_lib
from jaxmp._src import tree as tree_lib
from jaxmp._src.fp8_autocast import Float8Autocast, fp8_autocast
from jaxmp._src.loss_scaling import loss_scaling
from jaxmp._src.mixed_precision import default_loss_scale, mixed_precision

__all__ = ("FP8_STATE_KEY", "Float8Apply", "TrainState", "fp8_apply", "policy_scope")

# Per thread: the active scopes' policies (innermost last) and the module-call depth.
_local = threading.local()


def _scopes() -> list[flax_common.ModulePolicies]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


@dataclasses.dataclass
class _ScopeRecord:
    """What one `policy_scope` did: the modules that compute in their policy's dtype, and
    those that keep an explicit ``dtype`` other than it (path and dtype)."""

    followed: int = 0
    kept: dict[str, str] = dataclasses.field(default_factory=dict)

    def check(self, policy: policy_lib.Policy) -> None:
        """Raises when the scope changed no module (Flax's lm1b passes ``dtype=config.dtype``
        to every module: a "float16" scope would leave the whole model in float32)."""
        if self.followed or not self.kept:
            return
        shown = ", ".join(f"{path}: {dtype}" for path, dtype in list(self.kept.items())[:4])
        more = f", and {len(self.kept) - 4} more" if len(self.kept) > 4 else ""
        raise ValueError(
            f"`policy_scope({policy})` changed no module: the {len(self.kept)} modules "
            f"called in it with a `dtype` all keep their own ({shown}{more}), so the model "
            f"does not compute in {policy.compute_dtype.name}. A module's explicit `dtype=` "
            "wins over the scope's policy: leave it at its default (`dtype=None`), give it "
            "the policy's (`dtype=policy.compute_dtype`), or pass overrides, which win over "
            "a module's own dtype (`overrides={nn.LayerNorm: 'float32', nn.Module: "
            f"'{policy}'}}`, the first match wins). To run the model as it is, drop the scope."
        )


def _dtype_name(dtype: Any) -> str:
    try:
        return jnp.dtype(dtype).name
    except TypeError:  # None, or not a dtype
        return str(dtype)


def _interceptor(policies: flax_common.ModulePolicies, record: _ScopeRecord):
    def interceptor(next_fun, args, kwargs, context):
        if _scopes()[-1] is not policies:  # the innermost scope decides alone
            return next_fun(*args, **kwargs)
        module = context.module
        path = module.scope.path if module.scope is not None else ()
        override = policies.override_for(module, path)
        policy = policies.default if override is None else override
        # A bound Linen module is a frozen dataclass, private to this `apply`/`init`
        # call. Setting its dtype attributes for the duration of the method (and
        # restoring them after, so a module bound with `.bind` does not keep them)
        # changes exactly this call: Flax modules read `self.dtype` when they cast
        # their inputs and params (`promote_dtype`) and `self.param_dtype` when they
        # create params. `nn.intercept_methods` alone could cast inputs only.
        saved = {}
        for attr, value in (
            (flax_common.DTYPE_ATTR, policy.compute_dtype),
            (flax_common.PARAM_DTYPE_ATTR, policy.param_dtype),
        ):
            if not flax_common.has_field(module, attr):
                continue
            if override is None and flax_common.is_explicit(module, attr):
                # The module's own `dtype=` (Flax's examples pass `dtype=config.dtype`)
                # wins over the scope's default policy; only an override naming the
                # module replaces it.
                continue
            saved[attr] = getattr(module, attr)
            object.__setattr__(module, attr, value)
        if flax_common.has_field(module, flax_common.DTYPE_ATTR):
            name = _dtype_name(getattr(module, flax_common.DTYPE_ATTR))
            if name == policy.compute_dtype.name:
                record.followed += 1
            else:
                record.kept[flax_common.path_string(path)] = name
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            out = next_fun(*args, **kwargs)
        finally:
            _local.depth = depth
            for attr, value in saved.items():
                object.__setattr__(module, attr, value)
        if depth == 0 and context.method_name != "setup":
            # The outermost call returns the policy's output dtype (float32 logits
            # under "mixed_float16"), whatever its last layer computed in.
            out = policies.default.cast_to_output(out)
        return out

    return interceptor


@contextlib.contextmanager
def policy_scope(
    policy: policy_lib.Policy | str,
    overrides: Mapping[type | str, policy_lib.Policy | str] | None = None,
) -> Iterator[policy_lib.Policy]:
    """Runs every Linen module called inside under `policy` (or its override).

    Inside the scope, each Flax module that has a ``dtype`` attribute computes in
    its policy's compute dtype and each one with a ``param_dtype`` attribute
    creates its params (at ``init``) in its policy's param dtype; the outermost
    module call returns ``policy.output_dtype``. A module's policy is that of the
    first entry of `overrides` that matches it, else `policy`. Keys of
    `overrides` are module classes (matched with `isinstance`, e.g.
    ``nn.LayerNorm``) or regexes fully matching the module path written
    ``"/Block_0/LayerNorm_1"`` (e.g. ``r".*/LayerNorm_\\d+"``); values are
    `jaxmp.Policy` objects or policy strings. In nested scopes the innermost one
    alone applies.

    A module's own ``dtype=`` or ``param_dtype=`` wins over `policy`: the scope
    fills in what the model leaves at the field's default (``dtype=None`` on
    Flax's layers, "infer from the inputs"), and keeps a value the model sets
    (``nn.Dense(4, dtype=jnp.float32)``, or ``dtype=config.dtype`` as in Flax's
    examples). A value equal to the field's default (``param_dtype=jnp.float32``
    on Flax's layers) is not told apart from it. An entry of `overrides` that
    matches the module wins over its own dtypes too. So a model that already
    takes its dtypes from a config needs no scope at all: give it the policy's
    (``dtype=policy.compute_dtype, param_dtype=policy.param_dtype``). A module
    that passes its own defaulted ``dtype`` down (``Block(dtype=self.dtype)``)
    gets the policy's, and its layers receive it explicitly, so a path override
    on the block reaches them. A scope in which every module called keeps an
    explicit ``dtype`` other than its policy's changes nothing (a "float16" run
    of Flax's lm1b, which passes ``dtype=config.dtype`` to every module, would
    train in float32): that is an error when the scope exits.

    Normalisation layers compute their statistics in at least float32 in any
    case (Flax upcasts them), and BatchNorm's ``batch_stats`` stay float32;
    overriding them to ``"float32"`` also keeps their outputs in float32.

    The scope works through `flax.linen.intercept_methods`: it must be active
    while the model is traced (put it inside the jitted function, around
    ``apply``), and it affects modules, not ``jnp`` code written in a module's
    methods, which runs on whatever dtypes its submodules return.

    Args:
      policy: the default `jaxmp.Policy` or policy string.
      overrides: optional mapping from module classes or path regexes to
        policies; the first matching entry wins.

    Yields:
      The parsed default policy.

    Raises:
      TypeError / ValueError: for a bad `policy` or `overrides` entry (naming it).
      ValueError: when the scope exits (at trace time) if modules with a ``dtype``
        were called in it and none computes in its policy's compute dtype: the
        message names them and the way out (``dtype=None``, or `overrides`).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp.linen
      >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> params = model.init(jax.random.key(0), x)
      >>> with jaxmp.linen.policy_scope("mixed_float16", {nn.LayerNorm: "float32"}):
      ...     y, state = model.apply(params, x, capture_intermediates=True)
      >>> layers = state["intermediates"]
      >>> layers["layers_0"]["__call__"][0].dtype, layers["layers_1"]["__call__"][0].dtype
      (dtype('float16'), dtype('float32'))
      >>> y.dtype
      dtype('float32')
    """
    policies = flax_common.module_policies(policy, overrides, module_base=nn.Module)
    record = _ScopeRecord()
    scopes = _scopes()
    scopes.append(policies)
    try:
        with nn.intercept_methods(_interceptor(policies, record)):
            yield policies.default
    finally:
        scopes.pop()
    # Reached only when the body did not raise.
    record.check(policies.default)


def _split_overwrite(tree: Any) -> tuple[Any, Any]:
    """Splits off Flax's FP8 collection: ``(params, overwrite)``, ``overwrite`` None if absent."""
    if isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree:
        return tree["params"], tree[OVERWRITE_WITH_GRADIENT]
    return tree, None


def _join_overwrite(params: Any, overwrite: Any) -> Any:
    if overwrite is None:
        return params
    return {"params": params, OVERWRITE_WITH_GRADIENT: overwrite}


def _with_loss_scaling(
    tx: optax.GradientTransformation, policy: policy_lib.Policy, params: Any
) -> optax.GradientTransformation:
    """`tx` if its state holds a jaxmp loss-scaling state, else `tx` wrapped for `policy`."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"`tx` must be an optax.GradientTransformation, got {tx!r}.")
    abstract = jax.eval_shape(tx.init, params)
    if state_lib.find_loss_scaling_states(abstract):
        return tx
    # A master copy, or a rounding rule for params without one: the updates are ready for
    # half-precision params, and `mixed_precision` would add a master copy.
    updates_params = state_lib.PARAM_UPDATE_STATES
    leaves = jax.tree_util.tree_leaves(abstract, is_leaf=lambda x: isinstance(x, updates_params))
    has_master = any(isinstance(leaf, updates_params) for leaf in leaves)
    try:
        return _wrapped(tx, policy, has_master)
    except TypeError:  # an unhashable transformation: wrap it afresh
        return _wrapped.__wrapped__(tx, policy, has_master)


@functools.lru_cache(maxsize=256)
def _wrapped(
    tx: optax.GradientTransformation, policy: policy_lib.Policy, has_master: bool
) -> optax.GradientTransformation:
    """`tx` wrapped for `policy`, the same object for the same arguments.

    `TrainState.tx` is static pytree metadata: creating a state twice from the same
    arguments (under `jax.eval_shape`, then under `jax.jit` with ``out_shardings``, as
    Flax's lm1b example does) must give equal metadata, so a fresh wrapper per call
    would not do.
    """
    if has_master:
        return loss_scaling(tx, default_loss_scale(policy))
    return mixed_precision(tx, policy)


class TrainState(train_state.TrainState):
    """A Flax `TrainState` for mixed-precision training under a `jaxmp.Policy`.

    Create it with `TrainState.create`. It is a pytree (the policy, like
    ``apply_fn`` and ``tx``, is static), so it goes through `jax.jit` and orbax
    checkpoints whole, loss scale and skip counters included.

    ``apply_gradients(grads=...)`` takes the gradients of the *scaled* loss
    (from `jaxmp.value_and_grad`, with ``state.loss_scale``) and calls
    ``tx.update(grads, opt_state, params)``. When the gradients are not finite
    the step is skipped whole: params, optimizer state and ``step`` stay
    bit-identical and only the loss-scaling state moves (scale reduced, skip
    counted). So ``step`` counts applied updates; the skipped ones are in
    ``state.metrics()["skipped_steps"]``.

    Flax FP8 variables (the ``"_overwrite_with_gradient"`` collection of
    ``flax.linen.fp8_ops``, kept next to ``"params"`` as in Flax's own
    `TrainState`) bypass the optimizer: their "gradients" are their new values
    and are written as they are, never unscaled nor checked (unscaling them
    would divide an FP8 scale of 1.0 by the loss scale); they are kept too on a
    skipped step.

    Attributes:
      policy: the `jaxmp.Policy` (static).
      loss_scale: the current `jaxmp.LossScale` (a property).
    """

    policy: policy_lib.Policy = struct.field(pytree_node=False)

    @classmethod
    def create(  # type: ignore[override]  # `policy` is required
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        policy: policy_lib.Policy | str,
        **kwargs: Any,
    ) -> TrainState:
        """Creates the state with ``step=0``: params cast, optimizer initialised.

        The optimizer is initialised from `params` as given (pass the float32
        params from ``model.init`` so that a master copy starts exact); the state
        then stores them cast to ``policy.param_dtype`` (floating leaves only; FP8
        ``"_overwrite_with_gradient"`` variables are kept as they are).

        `tx` may be any jaxmp transformation (`jaxmp.mixed_precision`,
        `jaxmp.loss_scaling`, or an optax chain containing one). A `tx` whose
        state holds no jaxmp loss-scaling state is wrapped automatically:
        ``jaxmp.mixed_precision(tx, policy)`` (loss scale
        `jaxmp.default_loss_scale`), or just `jaxmp.loss_scaling` when it
        already holds a `jaxmp.master_weights`, `jaxmp.stochastic_rounding` or
        `jaxmp.kahan_summation` state.

        Args:
          apply_fn: usually ``model.apply``.
          params: the params (or ``{"params": ..., "_overwrite_with_gradient": ...}``).
          tx: an optax transformation (see above).
          policy: a `jaxmp.Policy` or policy string.
          **kwargs: further fields of a subclass.

        Returns:
          A `TrainState`; its ``step`` is an int32 array.

        Raises:
          TypeError / ValueError: for a bad `tx` or `policy`.

        Example:
          >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jaxmp.linen
          >>> model = nn.Dense(2)
          >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
          >>> state = jaxmp.linen.TrainState.create(
          ...     apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy="float16")
          >>> state.params["kernel"].dtype, state.loss_scale.loss_scale
          (dtype('float16'), Array(32768., dtype=float32))
        """
        policy = policy_lib.as_policy(policy, arg="policy")
        params_with_opt, overwrite = _split_overwrite(params)
        tx = _with_loss_scaling(tx, policy, params_with_opt)
        opt_state = tx.init(params_with_opt)
        return cls(
            step=jnp.zeros((), jnp.int32),
            apply_fn=apply_fn,
            params=_join_overwrite(policy.cast_to_param(params_with_opt), overwrite),
            tx=tx,
            opt_state=opt_state,
            policy=policy,
            **kwargs,
        )

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Applies the gradients of the scaled loss; skips the step if they are not finite.

        Args:
          grads: gradients with the structure of ``params`` (from
            `jaxmp.value_and_grad` called with ``self.loss_scale``).
          **kwargs: other fields to replace, as in Flax (new BatchNorm statistics,
            say); pytree fields among them are kept as they were on a skipped step.

        Returns:
          The new state: ``step`` advanced by one and params updated when the
          gradients were finite, else only the loss-scaling state changed.

        Example:
          >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jaxmp, jaxmp.linen
          >>> model = nn.Dense(1)
          >>> x = jnp.ones((4, 3))
          >>> state = jaxmp.linen.TrainState.create(
          ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
          ...     tx=optax.sgd(0.1), policy="mixed_float16")
          >>> loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2)
          >>> _, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
          >>> state = state.apply_gradients(grads=grads)
          >>> int(state.step), bool(state.metrics()["grads_finite"])
          (1, True)
        """
        grads_with_opt, grads_overwrite = _split_overwrite(grads)
        params_with_opt, params_overwrite = _split_overwrite(self.params)
        if (grads_overwrite is None) != (params_overwrite is None):
            raise ValueError(
                f"`grads` must have the structure of `params`: only one of them has the "
                f"{OVERWRITE_WITH_GRADIENT!r} collection."
            )
        updates, opt_state = self.tx.update(grads_with_opt, self.opt_state, params_with_opt)
        finite = state_lib.loss_scaling_state(opt_state).grads_finite
        # The select keeps params bit-identical on a skipped step (adding a zero
        # update would turn a -0.0 into +0.0).
        new_params = tree_lib.select(
            finite,
            optax.apply_updates(params_with_opt, updates),
            params_with_opt,
            names=("updated params", "params"),
        )
        if grads_overwrite is not None:
            grads_overwrite = tree_lib.select(
                finite,
                grads_overwrite,
                params_overwrite,
                names=(
                    f"grads[{OVERWRITE_WITH_GRADIENT!r}]",
                    f"params[{OVERWRITE_WITH_GRADIENT!r}]",
                ),
            )
        # Other pytree fields given here (such as new BatchNorm statistics) are
        # part of the step, so a skipped step keeps them too.
        pytree_fields = {
            f.name for f in dataclasses.fields(self) if f.metadata.get("pytree_node", True)
        }
        for name, value in kwargs.items():
            if name in pytree_fields:
                kwargs[name] = tree_lib.select(
                    finite, value, getattr(self, name), names=(f"new {name}", name)
                )
        step = jnp.asarray(self.step)
        return self.replace(
            step=step + finite.astype(step.dtype),
            params=_join_overwrite(new_params, grads_overwrite),
            opt_state=opt_state,
            **kwargs,
        )

    @property
    def loss_scale(self) -> loss_scale_lib.LossScale:
        """The `jaxmp.LossScale` to scale the next loss with."""
        return state_lib.get_loss_scale(self.opt_state)

    def metrics(self) -> dict[str, jax.Array]:
        """`jaxmp.loss_scale_metrics` of the optimizer state, for logging."""
        return state_lib.loss_scale_metrics(self.opt_state)


# --------------------------------------------------------------------------------------------
# FP8.

#: The key of `jaxmp.DelayedScaling`'s state in the ``"_overwrite_with_gradient"`` collection.
FP8_STATE_KEY = "jaxmp_fp8"


class Float8Apply:
    """A Linen ``apply`` under `jaxmp.autocast` with an FP8 recipe (from `fp8_apply`).

    Call it like ``model.apply``: ``apply(variables, *args, **kwargs)``. With
    `jaxmp.DelayedScaling`, the FP8 state lives in the variables, as
    ``variables["_overwrite_with_gradient"]["jaxmp_fp8"]`` (`init` puts it there): the
    collection Flax uses for its own FP8 scales, whose gradients are their next values.
    `jaxmp.linen.TrainState` keeps that collection next to ``"params"``, out of the
    optimizer, and writes the gradient into it at ``apply_gradients`` (keeping it on a
    skipped step), so a train step is the usual one: differentiate the loss with respect
    to ``state.params``, then ``state.apply_gradients(grads=grads)``.

    Attributes:
      autocast: the `jaxmp.Float8Autocast` of ``model.apply``.
    """

    def __init__(self, autocast: Float8Autocast):
        self.autocast = autocast

    def init(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`variables` with the FP8 state for calls shaped like ``(variables, *args)``.

        Stateless recipes need no state: `variables` comes back as a plain dict.

        Args:
          variables: the model's variables (``{"params": ...}``).
          *args: example arguments of ``model.apply`` after the variables.
          **kwargs: example keyword arguments.

        Returns:
          The variables, with ``"_overwrite_with_gradient": {"jaxmp_fp8": state}`` added
          for `jaxmp.DelayedScaling`.
        """
        variables = dict(variables)
        if not self.autocast.fp8.stateful:
            return variables
        plain, _ = _split_fp8_state(variables)
        state = self.autocast.fp8_init(plain, *args, **kwargs)
        overwrite = dict(variables.get(OVERWRITE_WITH_GRADIENT, {}))
        overwrite[FP8_STATE_KEY] = state
        variables[OVERWRITE_WITH_GRADIENT] = overwrite
        return variables

    def __call__(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        plain, state = _split_fp8_state(variables)
        if not self.autocast.fp8.stateful:
            return self.autocast(plain, *args, **kwargs)
        if state is None:
            raise ValueError(
                f"`variables` must hold the FP8 state of {type(self.autocast.fp8).__name__} "
                f"under [{OVERWRITE_WITH_GRADIENT!r}][{FP8_STATE_KEY!r}]: create the "
                "variables with `init(variables, *args)`."
            )
        return self.autocast.with_fp8_state(state)(plain, *args, **kwargs)


def _split_fp8_state(variables: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``(variables without the FP8 state, the state or None)``."""
    variables = dict(variables)
    overwrite = variables.pop(OVERWRITE_WITH_GRADIENT, None)
    if overwrite is None:
        return variables, None
    overwrite = dict(overwrite)
    state = overwrite.pop(FP8_STATE_KEY, None)
    if overwrite:  # Flax's own FP8 variables stay where the model reads them
        variables[OVERWRITE_WITH_GRADIENT] = overwrite
    return variables, state


def fp8_apply(
    apply_fn: Callable[..., Any] | nn.Module,
    policy: policy_lib.Policy | str,
    recipe: Any,
    *,
    exclude: str | Sequence[str] | None = None,
) -> Float8Apply:
    """Runs a Linen model's ``apply`` with its matmuls in FP8 (`jaxmp.autocast` with `recipe`).

    The model is unmodified: every ``dot_general`` (``nn.Dense``, ``nn.Einsum``, attention)
    runs in FP8 with `recipe`, except those whose module path matches `exclude` (a regex
    fully matching the name stack, the model's class first: ``"TransformerLM/head"``,
    ``".*/head"``); everything else follows `policy`. See `Float8Apply` for the state of
    `jaxmp.DelayedScaling`.

    Args:
      apply_fn: ``model.apply``, or the module ``model`` itself (``fp8_apply(Model(config),
        ...)`` in a loss that builds the model there).
      policy: a `jaxmp.Policy` or policy string (``"mixed_bfloat16"``).
      recipe: an FP8 recipe (`jaxmp.Float8CurrentScaling`, `jaxmp.DelayedScaling`,
        `jaxmp.Float8BlockScaling`, `jaxmp.MXFP8BlockScaling`).
      exclude: regex(es) of the name stacks kept out of FP8.

    Returns:
      A `Float8Apply`.

    Raises:
      TypeError / ValueError: for a bad `policy`, `recipe` or `exclude`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jaxmp, jaxmp.linen
      >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
      >>> x = jnp.ones((8, 16))
      >>> apply = jaxmp.linen.fp8_apply(model.apply, "mixed_bfloat16", jaxmp.DelayedScaling())
      >>> variables = apply.init(model.init(jax.random.key(0), x), x)
      >>> state = jaxmp.linen.TrainState.create(
      ...     apply_fn=apply, params=variables, tx=optax.adam(1e-3), policy="mixed_bfloat16")
      >>> @jax.jit
      ... def step(state):
      ...     loss_fn = lambda v: jnp.mean(state.apply_fn(v, x) ** 2)
      ...     _, grads = jaxmp.value_and_grad(loss_fn)(state.loss_scale, state.params)
      ...     return state.apply_gradients(grads=grads)
      >>> state = step(state)
      >>> fp8_state = state.params["_overwrite_with_gradient"]["jaxmp_fp8"]
      >>> fp8_state.names  # (key, module path) of each FP8 matmul
      (('s0', 'Sequential/layers_0'), ('s2', 'Sequential/layers_2'))
      >>> float(fp8_state.scale["s0"][0])  # the power of two below 448 / amax (amax 1)
      256.0
    """
    if isinstance(apply_fn, nn.Module):
        apply_fn = apply_fn.apply
    return Float8Apply(fp8_autocast(apply_fn, policy, recipe, exclude))


# --------------------------------------------------------------------------------------------
# Fused attention under `jaxmp.autocast` (`jaxmp._src.attention`).


def _fusable_linen_attention(arguments: Mapping[str, Any]) -> bool:
    """Whether a call of Flax Linen's ``dot_product_attention`` is plain softmax attention
    that `jaxmp.dot_product_attention` computes alike: no dropout, no sown weights, no
    einsum or precision of its own, floating operands of matching leading shapes."""
    a = arguments
    no_dropout = a.get("dropout_rate", 0.0) == 0.0 or a.get("deterministic", False) is True
    plain = all(
        a.get(name) is None
        for name in (
            "module",
            "precision",
            "einsum_dot_general",
            "qk_attn_weights_einsum",
            "attn_weights_value_einsum",
        )
    )
    q, k, v = a["query"], a["key"], a["value"]
    shapes = q.ndim == k.ndim == v.ndim >= 3 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]
    floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v))
    return bool(isinstance(no_dropout, bool) and no_dropout and plain and shapes and floating)


def _dispatch_linen_attention(arrays: dict[str, Any], options: dict[str, Any], dtype: Any) -> Any:
    """Flax Linen's attention (``[..., T, N, H]`` operands, a mask whose nonzero entries
    attend) as `jaxmp.dot_product_attention` on ``[B, T, N, H]``."""
    del options, dtype
    q, k, v = arrays["query"], arrays["key"], arrays["value"]
    lead = q.shape[:-3]

    def batch(x: Any, dims: int) -> Any:
        x = jnp.broadcast_to(x, (*lead, *x.shape[-dims:])) if x.ndim < len(lead) + dims else x
        return x.reshape((-1, *x.shape[-dims:]))

    # A mask or bias may broadcast over any leading dimension: to (*lead, N, T, S) first.
    logits = (*lead, q.shape[-2], q.shape[-3], k.shape[-3])
    bias, mask = arrays.get("bias"), arrays.get("mask")
    if bias is not None:
        bias = jnp.broadcast_to(bias, logits).reshape((-1, *logits[-3:]))
    if mask is not None:
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
        mask = jnp.broadcast_to(mask, logits).reshape((-1, *logits[-3:]))
    out = attention_lib.dot_product_attention(batch(q, 3), batch(k, 3), batch(v, 3), bias, mask)
    return out.reshape(q.shape)


attention_lib.register_dispatcher("linen", _dispatch_linen_attention)


@contextlib.contextmanager
def _mark_linen_attention() -> Iterator[None]:
    """While a function is traced by `jaxmp.autocast`, Flax Linen's ``dot_product_attention``
    marks its plain calls (`_fusable_linen_attention`). Its code is swapped for the span of
    the trace, so that every caller is seen, ``MultiHeadDotProductAttention`` among them (its
    ``attention_fn`` is this function object, bound when the class was defined)."""
    target = nn.attention.dot_product_attention
    original = types.FunctionType(
        target.__code__, target.__globals__, target.__name__, target.__defaults__,
        target.__closure__,
    )  # fmt: skip
    original.__kwdefaults__ = target.__kwdefaults__
    signature = inspect.signature(target)

    def hook(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if not _fusable_linen_attention(arguments):
            return original(*args, **kwargs)
        arrays = {n: arguments[n] for n in ("query", "key", "value", "bias", "mask")}
        return attention_lib.mark(
            "linen", lambda given: original(**{**arguments, **given}), arrays, {}
        )

    saved_code = target.__code__
    namespace: dict[str, Any] = {}
    exec(  # noqa: S102 - a trampoline of the same free variables (none) as the target
        "def trampoline(*args, **kwargs):\n    return _jaxmp_attention_hook(*args, **kwargs)\n",
        namespace,
    )
    target.__signature__ = signature  # type: ignore[attr-defined]  # what callers inspect
    target.__globals__["_jaxmp_attention_hook"] = hook
    target.__code__ = namespace["trampoline"].__code__
    try:
        yield
    finally:
        target.__code__ = saved_code
        target.__globals__.pop("_jaxmp_attention_hook", None)
        del target.__signature__  # type: ignore[attr-defined]


attention_lib.register_interceptor("flax.linen", _mark_linen_attention)
