"""Attention in a policy's compute dtype, on cuDNN's fused kernel where it applies.

`dot_product_attention` is ``jax.nn.dot_product_attention`` that chooses its implementation:
cuDNN's fused flash attention (``implementation="cudnn"``) where JAX's own checks accept the
call (float16 or bfloat16 operands, a head size and mask kind cuDNN supports, cuDNN present),
on NVIDIA GPUs (``lax.platform_dependent``: the program lowered for another platform takes the
other branch), and XLA's attention elsewhere. JAX's own default, ``implementation=None``, is
XLA's attention everywhere; a half-precision XLA attention on a GPU reads and writes the whole
attention matrix, the fused kernel does not.

Under `jaxmp.autocast` the attention a function calls is *marked* while the function is traced
(`intercept`): a call of ``jax.nn.dot_product_attention`` (Flax NNX's ``dot_product_attention``
and ``MultiHeadAttention`` call it when they use no dropout) becomes a ``jit`` equation whose
name carries the call's options (`MARK`). Other rule sets (the inspector) see an ordinary
``jit`` of the float32 computation; autocast's rules see the mark and call
`dot_product_attention` on the operands cast to the compute dtype (`dispatch`). Rule sets
that add integrations register them with `register_interceptor` (`jaxmp.linen` marks Flax
Linen's attention).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "MARK",
    "SCOPE",
    "dispatch",
    "dot_product_attention",
    "intercept",
    "is_marked",
    "mark",
    "register_interceptor",
]

#: The prefix of the name of a marked attention's ``jit`` (its options follow, as a literal).
MARK = "jaxmp_attention"
#: The name scope of the ops of an attention autocast dispatched.
SCOPE = "dot_product_attention"

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_IMPLEMENTATIONS = (None, "xla", "cudnn")


def _jax_attention(*args: Any, **kwargs: Any) -> Any:
    """``jax.nn.dot_product_attention`` as it is now (`intercept` replaces it while tracing)."""
    return jax.nn.dot_product_attention(*args, **kwargs)  # type: ignore[call-overload, misc]


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention``, on cuDNN's fused kernel where it applies.

    With ``implementation=None`` (the default): cuDNN's flash attention on NVIDIA GPUs where
    JAX's checks accept the call (float16 or bfloat16 operands, a head size and a mask kind
    cuDNN supports, cuDNN installed), chosen per platform by ``lax.platform_dependent``, and
    XLA's attention otherwise (other platforms, float32 operands, an unsupported shape). The
    softmax runs in float32 on both paths. ``"xla"`` and ``"cudnn"`` force one, as in
    ``jax.nn.dot_product_attention``. Operands are ``(batch, length, heads, head_size)``.

    Args:
      query: the queries, ``[B, T, N, H]``.
      key: the keys, ``[B, S, K, H]``.
      value: the values, ``[B, S, K, H]``.
      bias: added to the logits (``[B, N, T, S]`` or broadcastable).
      mask: boolean, True where a query attends to a key (``[B, N, T, S]`` or broadcastable).
      scale: the logits' scale (``1 / sqrt(H)`` by default).
      is_causal: causal masking.
      query_seq_lengths: int32 ``[B]``, the queries' lengths before padding.
      key_value_seq_lengths: int32 ``[B]``, the keys' and values' lengths before padding.
      local_window_size: a sliding window, as in ``jax.nn.dot_product_attention``.
      implementation: None (choose), ``"xla"`` or ``"cudnn"``.

    Returns:
      The attention output, of `query`'s shape and dtype.

    Raises:
      ValueError: for an unknown `implementation`.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> q = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
      >>> jaxmp.dot_product_attention(q, q, q, is_causal=True).dtype  # XLA's here (a CPU)
      dtype(bfloat16)
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"`implementation` must be one of None, 'xla', 'cudnn', got {implementation!r}."
        )
    options = dict(
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
    )
    if implementation is not None or _intercepting():
        # A forced implementation; or traced by autocast (float32 operands of a float32
        # model, say): marked, so that autocast calls this function again on the operands in
        # the compute dtype.
        return _jax_attention(
            query, key, value, bias, mask, **options, implementation=implementation
        )

    def run(implementation: str) -> Callable[..., jax.Array]:
        def call(query: Any, key: Any, value: Any, bias: Any, mask: Any) -> jax.Array:
            if implementation == "cudnn" and bias is not None:
                # cuDNN adds the bias in the operands' dtype; XLA's attention adds it to
                # float32 logits, in the bias's own dtype.
                bias = _to_compute(bias, query.dtype, clip=True)
            return _jax_attention(
                query, key, value, bias, mask, **options, implementation=implementation
            )

        return call

    operands = (query, key, value, bias, mask)
    dtype = jnp.result_type(query)
    if dtype not in _HALF:
        return run("xla")(*operands)
    branches = {"default": run("xla")}
    if dtype == jnp.float16:
        # XLA:CPU has no float16 product accumulated in float32, which XLA's attention asks
        # for: there, float32 operands, the result rounded to float16.
        def widened(*operands: Any) -> jax.Array:
            wide = [None if x is None else _widen(x) for x in operands]
            return run("xla")(*wide).astype(dtype)

        branches["cpu"] = widened
    try:
        return lax.platform_dependent(*operands, cuda=run("cudnn"), **branches)
    except (NotImplementedError, ValueError, RuntimeError, TypeError):
        # cuDNN refused the call (a shape, a dtype, a mask kind) or is not installed.
        if len(branches) == 1:
            return branches["default"](*operands)
        return lax.platform_dependent(*operands, **branches)


def _widen(x: Any) -> Any:
    """A float16 operand as float32 (a boolean mask as it is)."""
    return x.astype(jnp.float32) if jnp.result_type(x) == jnp.float16 else x


# --------------------------------------------------------------------------------------------
# Marking attention while a function is traced (`jaxmp.autocast`).


class _NotLiteral(Exception):
    """An option that a ``jit``'s name cannot carry."""


def _literal(value: Any) -> Any:
    """`value` as a Python literal that a ``jit``'s name carries and `read_mark` reads back:
    numpy scalars (``1 / np.sqrt(d)``) as Python ones, tuples item by item; raises
    `_NotLiteral` for anything else (an array, a non-finite float)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float and math.isfinite(value):
        return value
    if type(value) is tuple:
        return tuple(_literal(v) for v in value)
    raise _NotLiteral(value)


def mark(
    kind: str,
    call: Callable[[dict[str, Any]], Any],
    arrays: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """``call(arrays)`` as a ``jit`` named by `MARK`, `kind` and `options`.

    `arrays` are the attention's array arguments by name (None where absent), `options` the
    static ones its dispatcher needs (literals). Every evaluator but autocast runs the ``jit``
    as it is (the function's own computation); autocast reads the name back (`read_mark`)
    and calls `dispatch`.
    """
    names = [n for n, v in arrays.items() if v is not None]
    spec = {"kind": kind, "arrays": names, "options": options}

    def body(*values: Any) -> Any:
        return call(dict(zip(names, values, strict=True)))

    body.__name__ = body.__qualname__ = f"{MARK}{spec!r}"
    return jax.jit(body)(*[arrays[n] for n in names])


def is_marked(name: str) -> bool:
    return name.startswith(MARK + "{")


def read_mark(name: str) -> dict[str, Any]:
    """The ``{"kind", "arrays", "options"}`` a marked ``jit``'s name carries."""
    return ast.literal_eval(name[len(MARK) :])


def _marked_jax_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.nn.dot_product_attention`` that marks the calls autocast can dispatch."""

    @functools.wraps(original)
    def attention(query, key, value, bias=None, mask=None, **kwargs):  # type: ignore[no-untyped-def]
        arrays = {
            "query": query,
            "key": key,
            "value": value,
            "bias": bias,
            "mask": mask,
            "query_seq_lengths": kwargs.pop("query_seq_lengths", None),
            "key_value_seq_lengths": kwargs.pop("key_value_seq_lengths", None),
        }
        given = {n: v for n, v in arrays.items() if n not in ("query", "key", "value")}
        floating = all(
            jnp.issubdtype(jnp.result_type(arrays[n]), jnp.floating)
            for n in ("query", "key", "value")
        )
        try:
            options = {k: _literal(v) for k, v in kwargs.items()}
        except _NotLiteral:
            return original(query, key, value, **given, **kwargs)
        # Dispatched: a floating call that asks for no implementation and no softmax
        # residuals (an explicit ``return_residual=False`` is the default).
        residual = options.pop("return_residual", False)
        if residual or options.get("implementation") is not None or not floating:
            return original(query, key, value, **given, **kwargs)
        return mark("jax", lambda given: original(**given, **options), arrays, options)

    return attention


_INTERCEPTORS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {}


def register_interceptor(
    name: str, factory: Callable[[], contextlib.AbstractContextManager[Any]]
) -> None:
    """Sets the context manager factory `intercept` enters for library `name`: an integration
    that marks its library's attention (``"flax.linen"``: `jaxmp.linen`). A later
    registration under the same name replaces the earlier one."""
    _INTERCEPTORS[name] = factory


# The marks are installed once for every `intercept` open in any thread (a count under a
# lock: nested autocast, the inspector over an autocast function, threads tracing at once),
# and removed when the last one closes. A call marked outside autocast is harmless: the
# marked ``jit`` runs the call as it is.
_LOCK = threading.Lock()
_INSTALLED: list[contextlib.ExitStack] = []  # the installed marks, while any `intercept` is open
_OPEN = [0]  # how many `intercept`s are open, in every thread
_DEPTH = threading.local()  # this thread's open `intercept`s (`dot_product_attention` marks)


def _intercepting() -> bool:
    return getattr(_DEPTH, "value", 0) > 0


def _install() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    original = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = _marked_jax_attention(original)

    def restore() -> None:
        jax.nn.dot_product_attention = original

    stack.callback(restore)
    try:
        for factory in list(_INTERCEPTORS.values()):
            stack.enter_context(factory())
    except BaseException:
        stack.close()
        raise
    return stack


@contextlib.contextmanager
def intercept() -> Iterator[None]:
    """Marks the attention a function calls while it is traced inside this context."""
    with _LOCK:
        if not _OPEN[0]:
            _INSTALLED.append(_install())
        _OPEN[0] += 1
    _DEPTH.value = getattr(_DEPTH, "value", 0) + 1
    try:
        yield
    finally:
        _DEPTH.value -= 1
        with _LOCK:
            _OPEN[0] -= 1
            if not _OPEN[0]:
                _INSTALLED.pop().close()


# --------------------------------------------------------------------------------------------
# Dispatch (autocast's rule for a marked attention).

_DISPATCHERS: dict[str, Callable[..., Any]] = {}


def register_dispatcher(kind: str, fn: Callable[..., Any]) -> None:
    """`fn(arrays, options, compute_dtype)` computes a marked attention of `kind`."""
    _DISPATCHERS[kind] = fn


def _dispatch_jax(arrays: dict[str, Any], options: dict[str, Any], dtype: Any) -> Any:
    del dtype
    options = {k: v for k, v in options.items() if k != "implementation"}
    return dot_product_attention(**arrays, **options)


register_dispatcher("jax", _dispatch_jax)


# The operands cast to the compute dtype. A bias stays as it is (XLA's attention adds it to
# float32 logits; `dot_product_attention` casts it for cuDNN), so does a mask.
_CAST = ("query", "key", "value")


def _to_compute(x: Any, dtype: Any, *, clip: bool) -> Any:
    """A floating operand in `dtype`; with `clip` (a bias for cuDNN) clipped to its finite
    range first: a mask bias of -1e9 becomes the most negative value there instead of -inf,
    which would make a fully masked row NaN."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if clip and jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
        finfo = jnp.finfo(dtype)
        x = jnp.clip(x, float(finfo.min), float(finfo.max))
    return x.astype(dtype)


def dispatch(name: str, values: list[Any], compute_dtype: Any) -> list[Any]:
    """The outputs of the marked attention ``jit`` named `name` on `values`, its query, key
    and value cast to `compute_dtype` (a bias, masks and lengths as they are)."""
    spec = read_mark(name)
    arrays = {}
    for n, v in zip(spec["arrays"], values, strict=True):
        if n in _CAST:
            v = _to_compute(v, compute_dtype, clip=False)
        arrays[n] = v
    with jax.named_scope(SCOPE):
        out = _DISPATCHERS[spec["kind"]](arrays, spec["options"], compute_dtype)
    return jax.tree.leaves(out)
