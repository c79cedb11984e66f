"""The Flax section's code blocks run and train."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADING = "## Flax"


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    if HEADING not in text:
        raise AssertionError(f"no {HEADING!r} section in README.md")
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    section = text[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _data():
    x = jax.random.normal(jax.random.key(1), (64, 8))
    return x, jnp.sin(x.sum(1, keepdims=True))


def _run(block: int) -> dict:
    code = _python_blocks()[block]
    assert len(code.strip().splitlines()) < 25
    namespace: dict = {}
    exec(compile(code, f"{HEADING} block {block}", "exec"), namespace)
    return namespace


def _check(losses, metrics):
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    skipped = int(metrics["skipped_steps"])
    assert float(metrics["loss_scale"]) == 2.0 ** (15 - skipped)


def test_two_blocks():
    assert len(_python_blocks()) == 2


def test_linen_block():
    ns = _run(0)
    state, train_step = ns["state"], ns["train_step"]
    x, y = _data()
    losses = []
    for _ in range(100):
        state, loss, metrics = train_step(state, x, y)
        losses.append(float(loss))
    _check(losses, metrics)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert int(state.step) == 100 - int(metrics["skipped_steps"])


def test_nnx_block():
    ns = _run(1)
    model, optimizer, train_step = ns["model"], ns["optimizer"], ns["train_step"]
    x, y = _data()
    losses = []
    for _ in range(100):
        loss, metrics = train_step(model, optimizer, x, y)
        losses.append(float(loss))
    _check(losses, metrics)
    assert model.layers[0].kernel.get_value().dtype == jnp.float32
    assert model.layers[0].dtype == jnp.float16 and model.layers[1].dtype == jnp.float32
