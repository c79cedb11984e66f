"""The README's code blocks run and do what the text says."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(heading: str) -> list[str]:
    text = README.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    section = text[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert "examples/train.py" in blocks[0]
    assert "pytest" in blocks[1]
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = blocks[1].strip().split("&& ", 2)[-1]
    assert test_command in ci


def test_jit_train_step_block():
    (code,) = _python_blocks("## A jit train step")
    assert len(code.strip().splitlines()) <= 22
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    train_step, params, opt_state = (namespace[k] for k in ("train_step", "params", "opt_state"))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(x.sum(1, keepdims=True))
    losses = []
    for _ in range(100):
        params, opt_state, loss, metrics = train_step(params, opt_state, x, y)
        losses.append(float(loss))
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(params))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    assert int(metrics["skipped_steps"]) >= 0
    assert float(metrics["loss_scale"]) == 2.0 ** (15 - int(metrics["skipped_steps"]))
