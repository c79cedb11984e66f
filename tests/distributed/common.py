"""Shared pieces of the multi-device scripts: a tiny transformer LM, its data and train step.

The scripts run in processes of their own, with simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set by the test that starts them,
before jax is imported). Each prints one JSON object on its last line of stdout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib
import re
import sys
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
for path in (REPO_ROOT, REPO_ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxmp  # noqa: E402
from examples.lm import model as model_lib  # noqa: E402

VOCAB, SEQ_LEN, BATCH = 32, 16, 16
LEARNING_RATE = 0.1


class MLP(nn.Module):
    """A per-position MLP language model (a bigram model): quick to compile."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.Embed(VOCAB, 32, embedding_init=nn.initializers.normal(0.5), **kw)(tokens)
        x = nn.gelu(nn.Dense(64, **kw)(x))
        return nn.Dense(VOCAB, **kw)(x).astype(self.output_dtype)


def make_model(policy: jaxmp.Policy, kind: str, param_dtype: Any = None) -> nn.Module:
    """``"transformer"``: the example LM (`examples/lm/model.py`), tiny; ``"mlp"``: `MLP`."""
    dtypes = dict(
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype if param_dtype is None else param_dtype,
        output_dtype=policy.output_dtype,
    )
    if kind == "mlp":
        return MLP(**dtypes)
    return model_lib.TransformerLM(
        vocab_size=VOCAB,
        max_len=SEQ_LEN,
        num_layers=1,
        num_heads=2,
        d_model=64,
        mlp_ratio=4,
        **dtypes,
    )


def make_optimizer(policy: jaxmp.Policy) -> optax.GradientTransformationExtraArgs:
    # SGD with momentum: a params-shaped moment, and updates proportional to the gradients, so
    # that runs which differ only in reduction order stay within the dtype's tolerance.
    return jaxmp.mixed_precision(optax.sgd(LEARNING_RATE, momentum=0.9), policy)


@functools.cache
def _float32_params(kind: str, seed: int) -> Any:
    """The float32 init of `kind`, as NumPy arrays: computed once per process (one compile)."""
    model = make_model(jaxmp.get_policy("float32"), kind)
    tokens = jnp.zeros((1, SEQ_LEN), jnp.int32)
    return jax.device_get(jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"])


def init(policy: jaxmp.Policy, tx: optax.GradientTransformation, kind: str, seed: int = 0):
    """Float32 init (the same values for every policy), optimizer state from it, params cast.

    Fresh arrays on every call (a train step may donate them); the optimizer state is built by
    one jitted `tx.init` rather than op by op.
    """
    params_f32 = jax.tree.map(jnp.asarray, _float32_params(kind, seed))
    return policy.cast_to_param(params_f32), jax.jit(tx.init)(params_f32)


def batch(step: int, rows: int = BATCH, seed: int = 0) -> dict[str, np.ndarray]:
    """A deterministic batch of random tokens; `weights` scales each example's loss."""
    rng = np.random.default_rng([seed, step])
    tokens = rng.integers(0, VOCAB, (rows, SEQ_LEN + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((rows,), np.float32),
    }


def make_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]
        )
        return jnp.mean(per_token.mean(-1) * batch["weights"])

    return loss_fn


def make_train_step(model: nn.Module, tx: optax.GradientTransformation):
    """The usual jaxmp step; under `jax.jit` with sharded inputs it needs nothing more."""
    grad_fn = jaxmp.value_and_grad(make_loss_fn(model))

    def train_step(params, opt_state, batch):
        loss_scale = jaxmp.get_loss_scale(opt_state)
        loss, grads = grad_fn(loss_scale, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, **jaxmp.loss_scale_metrics(opt_state)}

    return train_step


def all_reduce_operands(hlo_text: str) -> list[tuple[str, int]]:
    """``(dtype, elements)`` of every all-reduce operand in an HLO module's text."""
    found = []
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match:
            for dtype, dims in re.findall(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]", match.group(1)):
                found.append((dtype, math.prod(int(d) for d in dims.split(",") if d)))
    return found


def tree_digest(tree: Any) -> str:
    """A hash of every leaf's bytes, dtype and shape (fetched to the host)."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.asarray(jax.device_get(leaf))
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(value.dtype).encode() + str(value.shape).encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def per_device_bytes(tree: Any) -> int:
    """Bytes of `tree` stored on the first device (the shards it holds)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def save_tree(path: pathlib.Path, tree: Any) -> None:
    """Saves the leaves of `tree` as float64 arrays in an .npz keyed by leaf path."""
    flat = {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(x), np.float64)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    np.savez(path, **flat)


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result, sort_keys=True))
