"""`jaxmp.plot_loss_scale`: the loss-scale history and the skipped steps of a run, from the
metrics `jaxmp.loss_scale_metrics` returned at each step (a list of them, or stacked)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import pytest

import jaxmp

# A gradient of each step: step 3 and step 6 overflow.
_NAN_STEPS = (3, 6)


def _run(steps=10):
    """Per-step `{"loss", **loss_scale_metrics}` of a loss-scaled run, period 2: the scale
    grows every 2 finite steps and halves on each overflow."""
    tx = jaxmp.mixed_precision(
        optax.sgd(0.1), "mixed_float16", jaxmp.DynamicLossScale(2.0**10, period=2)
    )
    params = {"w": jnp.ones(3)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, bad):
        grads = {"w": jnp.where(bad, jnp.inf, 1.0) * jnp.ones(3)}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jaxmp.loss_scale_metrics(state)

    history = []
    for i in range(steps):
        params, state, metrics = step(params, state, i in _NAN_STEPS)
        history.append({"loss": 1.0 / (i + 1), **metrics})
    return history


@pytest.fixture(scope="module")
def history():
    return _run()


def _scale_lines(ax):
    (scale, skipped) = ax.get_lines()
    return scale, skipped


def test_plots_the_scale_and_marks_the_skipped_steps(history):
    fig = jaxmp.plot_loss_scale(history)
    ax_loss, ax_scale = fig.axes
    scales = [float(m["loss_scale"]) for m in history]
    scale, skipped = _scale_lines(ax_scale)
    np.testing.assert_array_equal(scale.get_xdata(), np.arange(10))
    np.testing.assert_array_equal(scale.get_ydata(), scales)
    np.testing.assert_array_equal(skipped.get_xdata(), _NAN_STEPS)
    np.testing.assert_array_equal(skipped.get_ydata(), [scales[i] for i in _NAN_STEPS])
    assert ax_scale.get_yscale() == "log"
    assert "2 skipped steps" in ax_scale.get_title()
    # The loss, read from the entries' "loss" key: raw and smoothed.
    raw = ax_loss.get_lines()[0]
    np.testing.assert_allclose(raw.get_ydata(), [1.0 / (i + 1) for i in range(10)])
    plt.close(fig)


def test_stacked_metrics_and_explicit_loss_and_steps(history, tmp_path):
    stacked = {k: np.stack([np.asarray(m[k]) for m in history]) for k in history[0] if k != "loss"}
    path = tmp_path / "scale.png"
    fig = jaxmp.plot_loss_scale(stacked, path, steps=np.arange(100, 110), title="a run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax_scale,) = fig.axes  # no loss: one panel
    scale, skipped = _scale_lines(ax_scale)
    np.testing.assert_array_equal(scale.get_xdata(), np.arange(100, 110))
    np.testing.assert_array_equal(skipped.get_xdata(), [100 + i for i in _NAN_STEPS])
    assert "a run" in fig._suptitle.get_text()
    plt.close(fig)
    fig = jaxmp.plot_loss_scale(stacked, loss=np.linspace(2, 1, 10))
    assert len(fig.axes) == 2
    plt.close(fig)


def test_metrics_logged_every_few_steps_mark_where_the_count_grew(history):
    # Logged every third step: steps 3 and 6 are logged, and the count grew there.
    every_third = history[::3]  # steps 0, 3, 6, 9
    fig = jaxmp.plot_loss_scale(every_third, steps=[0, 3, 6, 9])
    _, skipped = _scale_lines(fig.axes[1])
    np.testing.assert_array_equal(skipped.get_xdata(), [3, 6])
    plt.close(fig)
    # Steps 1, 4, 7: the skips of 3 and 6 show at the next logged step, 4 and 7.
    fig = jaxmp.plot_loss_scale(history[1::3], steps=[1, 4, 7])
    _, skipped = _scale_lines(fig.axes[1])
    np.testing.assert_array_equal(skipped.get_xdata(), [4, 7])
    plt.close(fig)


def test_a_run_without_loss_scaling():
    tx = jaxmp.mixed_precision(optax.sgd(0.1), "f32")
    metrics = jaxmp.loss_scale_metrics(tx.init({"w": jnp.ones(2)}))
    fig = jaxmp.plot_loss_scale([metrics] * 3)
    (ax,) = fig.axes
    assert "no step skipped" in ax.get_title()
    plt.close(fig)


def test_errors_name_the_entry_and_the_fix(history):
    with pytest.raises(ValueError, match=r"`metrics` must hold at least one step"):
        jaxmp.plot_loss_scale([])
    with pytest.raises(ValueError, match=r"entry 1 of `metrics` has no 'skipped_steps'"):
        jaxmp.plot_loss_scale([history[0], {"loss_scale": 1.0}])
    replicated = [jax.tree.map(lambda x: jnp.stack([x, x]), m) for m in history]
    with pytest.raises(ValueError, match=r"one value per step.*shape \(10, 2\).*\[0\]"):
        jaxmp.plot_loss_scale(replicated)
    with pytest.raises(ValueError, match=r"`steps` must have one value per entry \(10\), got 3"):
        jaxmp.plot_loss_scale(history, steps=[1, 2, 3])
    with pytest.raises(TypeError, match=r"`metrics` must be a sequence of"):
        jaxmp.plot_loss_scale(3.0)


def test_import_jaxmp_imports_no_matplotlib_and_no_ipython():
    code = (
        "import sys, jaxmp; print(sorted(m for m in ('matplotlib', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "draw",
    [
        "jaxmp.plot_loss_scale([{'loss_scale': 1.0, 'skipped_steps': 0}])",
        "jaxmp.inspect(jax.numpy.sin)(jax.numpy.ones(3))[1].plot()",
    ],
    ids=["plot_loss_scale", "Report.plot"],
)
def test_the_backend_of_a_notebook_kernel_is_kept(draw):
    # A Jupyter kernel names its inline backend in MPLBACKEND: drawing must not replace it
    # with Agg (its figures would no longer show); a script without one gets Agg.
    code = f"import jax, jaxmp, matplotlib\n{draw}\nprint(matplotlib.get_backend())"
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    inline = "module://matplotlib_inline.backend_inline"
    for backend, expected in ((None, "agg"), (inline, inline)):
        environ = env if backend is None else {**env, "MPLBACKEND": backend}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ
        )
        assert out.stdout.strip().lower() == expected.lower()
