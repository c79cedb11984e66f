"""Autocast: train an unmodified float32 Flax NNX CNN (BatchNorm, Dropout) in mixed float16.

The model below is written the ordinary float32 way, as in Flax's NNX MNIST tutorial: no
``dtype`` argument, no cast. `jaxmp.autocast` runs its loss function with op-level precision
rules: convolutions and matmuls in float16, BatchNorm statistics, softmax and cross-entropy
in float32. The BatchNorm running statistics and the Dropout ``nnx.Rngs`` counter update as
in the plain call. `jaxmp.mixed_precision` adds dynamic loss scaling (the params stay float32:
autocast casts them where they are used). The data is scikit-learn's 8x8 digits (1797 images,
shipped with scikit-learn: nothing is downloaded).

Run::

    python examples/autocast_digits.py                      # mixed_float16, 300 steps
    python examples/autocast_digits.py --policy float32     # the model as written
    python examples/autocast_digits.py --steps 100 --policy mixed_bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxmp
import jaxmp.nnx


@dataclasses.dataclass(frozen=True)
class Config:
    """What to train.

    Attributes:
      policy: a `jaxmp.get_policy` string; ``"float32"`` runs the model as written, any
        other policy runs its loss function under `jaxmp.autocast`.
      steps: training steps.
      batch_size: images per step.
      learning_rate: AdamW's learning rate.
      seed: the seed of the init, the dropout masks and the batch order.
      eval_every: steps between two evaluations on the test split.
    """

    policy: str = "mixed_float16"
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 5e-3
    seed: int = 0
    eval_every: int = 100

    def __post_init__(self):
        jaxmp.get_policy(self.policy)  # a clear error for a bad policy string
        for name in ("steps", "batch_size", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"`learning_rate` must be positive, got {self.learning_rate!r}.")


class CNN(nnx.Module):
    """A small CNN written for float32, with BatchNorm and Dropout (8x8x1 images)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.1, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.1, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model: CNN, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain float32 code: mean cross-entropy, and the logits."""
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits


def load_data() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and test splits of the digits: NHWC float32 images in [0, 1], int32 labels."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = (x[perm] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    y = y[perm].astype(np.int32)
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def create(config: Config) -> tuple[CNN, jaxmp.nnx.Optimizer]:
    """The float32 model and its optimizer (AdamW with the policy's loss scaling)."""
    model = CNN(rngs=nnx.Rngs(config.seed))
    tx = jaxmp.mixed_precision(optax.adamw(config.learning_rate, b1=0.9), config.policy)
    return model, jaxmp.nnx.Optimizer(model, tx, wrt=nnx.Param)


def make_train_step(config: Config):
    """The jitted train step; the loss function runs under autocast unless the policy is
    ``"float32"``."""
    policy = jaxmp.get_policy(config.policy)
    forward = loss_fn if config.policy == "float32" else jaxmp.autocast(loss_fn, policy)
    grad_fn = jaxmp.nnx.value_and_grad(forward, has_aux=True)

    @nnx.jit
    def train_step(model: CNN, optimizer: jaxmp.nnx.Optimizer, images, labels):
        (loss, logits), grads = grad_fn(optimizer.loss_scale, model, images, labels)
        optimizer.update(model, grads)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return loss, accuracy, optimizer.metrics()

    return train_step


def make_eval_step(config: Config):
    policy = jaxmp.get_policy(config.policy)
    forward = loss_fn if config.policy == "float32" else jaxmp.autocast(loss_fn, policy)

    @nnx.jit
    def eval_step(model: CNN, images, labels):
        loss, logits = forward(model, images, labels)
        return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

    return eval_step


def batch_indices(config: Config, num_train: int) -> np.ndarray:
    """The images of each step: a pure function of the seed, the same for every policy."""
    rng = np.random.default_rng(config.seed)
    return np.stack(
        [rng.choice(num_train, config.batch_size, replace=False) for _ in range(config.steps)]
    )


def train_and_evaluate(config: Config, log: bool = False) -> dict[str, Any]:
    """Trains the CNN and evaluates it on the test split.

    Returns:
      A dict: ``losses`` (per step), ``evals`` (``(step, test loss, test accuracy)`` every
      ``eval_every`` steps and at the end), ``test_accuracy``, ``skipped_steps``,
      ``loss_scale``, and the trained ``model`` and ``optimizer``.
    """
    (x_train, y_train), (x_test, y_test) = load_data()
    model, optimizer = create(config)
    train_step, eval_step = make_train_step(config), make_eval_step(config)
    losses, evals = [], []
    for step, idx in enumerate(batch_indices(config, len(x_train)), start=1):
        loss, _, metrics = train_step(model, optimizer, x_train[idx], y_train[idx])
        losses.append(float(loss))
        if step % config.eval_every == 0 or step == config.steps:
            model.eval()  # running BatchNorm statistics, no dropout
            test_loss, test_acc = eval_step(model, x_test, y_test)
            model.train()
            evals.append((step, float(test_loss), float(test_acc)))
            if log:
                print(
                    f"step {step:4d}  train loss {float(loss):.4f}  test loss "
                    f"{float(test_loss):.4f}  test accuracy {float(test_acc):.4f}  "
                    f"loss scale {float(metrics['loss_scale']):g}  "
                    f"skipped {int(metrics['skipped_steps'])}"
                )
    return {
        "losses": np.asarray(losses),
        "evals": evals,
        "test_accuracy": evals[-1][2],
        "skipped_steps": int(metrics["skipped_steps"]),
        "loss_scale": float(metrics["loss_scale"]),
        "model": model,
        "optimizer": optimizer,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default))
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    config = Config(**args)
    print(f"policy {config.policy}, {config.steps} steps of {config.batch_size} images")
    result = train_and_evaluate(config, log=True)
    print(f"final test accuracy {result['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
