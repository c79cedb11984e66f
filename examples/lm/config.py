"""Training configuration: a small YAML file validated into a frozen dataclass.

Every field has a default, so a config file only lists what it changes. Unknown keys and bad
values raise `ValueError` naming the key and the valid choices; a bad ``precision`` string
surfaces `jaxmp.get_policy`'s own message, prefixed with the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import optax
import yaml

import jaxmp

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"

LOSS_SCALE_KINDS = ("auto", "dynamic", "static", "none")
ROUNDINGS = ("nearest", "stochastic", "kahan")
MOMENT_FORMATS = ("float32", "bfloat16", "int8", "fp8")
# The `fp8` key: the recipe of the model's FP8 matmuls (docs/guides/fp8.md), or none.
FP8_RECIPES = {
    "none": None,
    "current": jaxmp.Float8CurrentScaling(),
    "delayed": jaxmp.DelayedScaling(history_len=16),
    "block": jaxmp.Float8BlockScaling(),
    "mxfp8": jaxmp.MXFP8BlockScaling(),
}
# The `qat` key: the `jaxmp.quantize` recipe the model is trained to be served with
# (docs/guides/quantized_inference.md), or none. int4 with serve.py's groups of 128.
QAT_RECIPES = {
    "none": None,
    "int8": jaxmp.Int8WeightOnly(),
    "int8_dynamic": jaxmp.Int8DynamicActivations(),
    "fp8": jaxmp.Float8Rowwise(),
    "int4": jaxmp.Int4WeightOnly(group_size=128),
}
# The keys that say what precision a run trains in; a config's name (``mixed_float16``,
# ``bf16_stochastic_rounding``) describes them. The loss scale's numbers tune, like the
# learning rate.
PRECISION_KEYS = (
    "precision",
    "loss_scale",
    "master_weights",
    "rounding",
    "first_moment",
    "second_moment",
    "fp8",
    "qat",
    "qat_start",
)
_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run: precision, loss scaling, model, data and schedule.

    `loss_scale` ``"auto"`` lets `jaxmp.mixed_precision` choose (dynamic scaling starting at
    ``2**15`` for float16 compute, none otherwise); the other kinds build the loss scale from
    the ``loss_scale_*`` fields. ``mesh`` shards the run over devices
    (``"data=4,model=2"``, see ``examples/sharding.py``); ``""`` means one device.

    With float16 or bfloat16 params, ``master_weights: false`` drops the float32 master copy
    and ``rounding`` says how each update is rounded to the params' dtype (``nearest``,
    ``stochastic`` or ``kahan``); ``first_moment`` and ``second_moment`` store Adam's moments
    in ``bfloat16``, ``int8`` or ``fp8`` between steps (`jaxmp.mixed_precision`'s options).

    ``fp8`` runs the model's linear layers (attention projections and MLP) in FP8 under
    `jaxmp.autocast` with a recipe: ``current``, ``delayed`` (history of 16 steps), ``block``
    (DeepSeek-V3's 1x128 / 128x128) or ``mxfp8``; ``none`` (the default) keeps them in the
    policy's compute dtype. The output head and the attention's two products of activations
    stay in the compute dtype, as in Transformer Engine's and DeepSeek-V3's recipes.

    ``qat`` trains the model with the numerics ``examples/serve.py`` serves it with
    (`jaxmp.quantization_aware`: the matmul weights quantised in the forward pass with
    ``int8``, ``int8_dynamic``, ``fp8`` or ``int4``, straight-through gradients into the float
    params), after ``qat_start`` steps of training as the policy alone (0: from the start;
    a fine-tune: the same run, schedule and step count). The run's validation loss is then
    the quantised model's, from the first step.
    """

    name: str = "run"
    precision: str = "mixed_float16"
    loss_scale: str = "auto"
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 2000
    loss_scale_factor: int = 2
    loss_scale_min: float = 1.0
    loss_scale_max: float = 2.0**32
    # Low memory: the master copy, the rounding without one, the moments' storage.
    master_weights: bool = True
    rounding: str = "nearest"
    first_moment: str = "float32"
    second_moment: str = "float32"
    fp8: str = "none"
    qat: str = "none"
    qat_start: int = 0
    # Model.
    num_layers: int = 2
    num_heads: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    # Data and schedule.
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 1500
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_batches: int = 8
    checkpoint_interval: int = 500
    val_fraction: float = 0.1
    seed: int = 0
    mesh: str = ""

    @property
    def policy(self) -> jaxmp.Policy:
        """The precision policy parsed from `precision`."""
        return jaxmp.get_policy(self.precision)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = _FIELD_TYPES[field.name]
            if expected is float and isinstance(value, str):
                # PyYAML reads `3e-3` (no dot) as a string: accept it when it parses.
                try:
                    value = float(value)
                except ValueError:
                    pass
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if expected is float and isinstance(value, float):
                object.__setattr__(self, field.name, value)
            elif expected is bool:
                if not isinstance(value, bool):
                    raise ValueError(
                        f"config key `{field.name}` must be true or false, got {value!r}."
                    )
            elif not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(
                    f"config key `{field.name}` must be {expected.__name__}, got {value!r}."
                )
        try:
            jaxmp.get_policy(self.precision)
        except (ValueError, TypeError) as e:
            # jaxmp's message names get_policy's argument, with the choices and a guess: here
            # it is the config key the user wrote (in the file or with --set).
            raise ValueError(str(e).replace("`policy_name`", "config key `precision`")) from None
        if self.loss_scale not in LOSS_SCALE_KINDS:
            raise ValueError(
                f"config key `loss_scale` must be one of {', '.join(LOSS_SCALE_KINDS)}, "
                f"got {self.loss_scale!r}."
            )
        positive = (
            "loss_scale_init",
            "loss_scale_period",
            "loss_scale_min",
            "loss_scale_max",
            "num_layers",
            "num_heads",
            "d_model",
            "mlp_ratio",
            "seq_len",
            "batch_size",
            "steps",
            "learning_rate",
            "eval_interval",
            "eval_batches",
            "checkpoint_interval",
        )
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"config key `{key}` must be > 0, got {getattr(self, key)!r}.")
        for key in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ValueError(f"config key `{key}` must be >= 0, got {getattr(self, key)!r}.")
        if self.loss_scale_factor < 2:
            raise ValueError(
                f"config key `loss_scale_factor` must be an integer >= 2, "
                f"got {self.loss_scale_factor!r}."
            )
        if self.loss_scale_min > self.loss_scale_max:
            raise ValueError(
                f"config keys `loss_scale_min` ({self.loss_scale_min}) and `loss_scale_max` "
                f"({self.loss_scale_max}) must satisfy min <= max."
            )
        if self.loss_scale_init > self.loss_scale_max:
            raise ValueError(
                f"config key `loss_scale_init` ({self.loss_scale_init}) must be <= "
                f"`loss_scale_max` ({self.loss_scale_max})."
            )
        try:
            self.make_loss_scale()
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"config keys `loss_scale_init`, `loss_scale_period`, `loss_scale_factor`, "
                f"`loss_scale_min`, `loss_scale_max` (loss_scale={self.loss_scale!r}): {e}"
            ) from None
        if self.d_model % self.num_heads:
            raise ValueError(
                f"config key `d_model` ({self.d_model}) must be divisible by `num_heads` "
                f"({self.num_heads})."
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"config key `val_fraction` must be in (0, 1), got {self.val_fraction!r}."
            )
        self._check_low_memory()
        if self.fp8 not in FP8_RECIPES:
            hint = _did_you_mean(self.fp8, FP8_RECIPES)
            raise ValueError(
                f"config key `fp8` must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}.{hint}"
            )
        self._check_qat()

    def _check_qat(self) -> None:
        if self.qat not in QAT_RECIPES:
            hint = _did_you_mean(self.qat, QAT_RECIPES)
            raise ValueError(
                f"config key `qat` must be one of {', '.join(QAT_RECIPES)}, got {self.qat!r}.{hint}"
            )
        if self.qat_start < 0:
            raise ValueError(f"config key `qat_start` must be >= 0, got {self.qat_start!r}.")
        if self.qat == "none":
            if self.qat_start:
                raise ValueError(
                    f"config key `qat_start` ({self.qat_start}) is the step quantization-aware "
                    "training starts after; set `qat` to a recipe too."
                )
            return
        if self.qat_start >= self.steps:
            raise ValueError(
                f"config key `qat_start` ({self.qat_start}) must be < `steps` ({self.steps}): "
                "quantization-aware training starts after it."
            )
        if self.fp8 != "none":
            raise ValueError(
                f"config keys `fp8` and `qat` (fp8={self.fp8!r}, qat={self.qat!r}): "
                "quantization-aware training runs the recipe's kernels in the forward pass; "
                "train the model without `fp8`."
            )

    def _check_low_memory(self) -> None:
        """The low-memory keys, checked by jaxmp itself: one line naming the keys."""
        if self.rounding not in ROUNDINGS:
            hint = _did_you_mean(self.rounding, ROUNDINGS)
            raise ValueError(
                f"config key `rounding` must be one of {', '.join(ROUNDINGS)}, "
                f"got {self.rounding!r}.{hint}"
            )
        for key in ("first_moment", "second_moment"):
            value = getattr(self, key)
            if value not in MOMENT_FORMATS:
                hint = _did_you_mean(value, MOMENT_FORMATS)
                raise ValueError(
                    f"config key `{key}` must be one of {', '.join(MOMENT_FORMATS)}, "
                    f"got {value!r}.{hint}"
                )
        try:
            jaxmp.mixed_precision(optax.identity(), self.policy, **self._low_memory_options())
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"config keys `precision`, `master_weights`, `rounding` "
                f"(precision={self.precision!r}, master_weights={self.master_weights}, "
                f"rounding={self.rounding!r}): {e}"
            ) from None

    def make_optimizer_wrapper(
        self, inner: optax.GradientTransformation
    ) -> optax.GradientTransformationExtraArgs:
        """`jaxmp.mixed_precision` of `inner` with this config's policy, loss scale and options."""
        return jaxmp.mixed_precision(
            inner, self.policy, self.make_loss_scale(), **self._low_memory_options()
        )

    def _low_memory_options(self) -> dict[str, Any]:
        return dict(
            master_weights=None if self.master_weights else False,
            rounding=self.rounding,
            moments=(self.first_moment, self.second_moment),
            seed=self.seed,
        )

    def describe(self) -> str:
        """The policy, loss scale and low-memory options, for `--help` and logs."""
        text = f"{self.policy}, loss scale {self.loss_scale}"
        if self.policy.param_dtype.itemsize < 4:  # float16 or bfloat16 params
            rounding = {"nearest": "round-to-nearest", "stochastic": "stochastic rounding",
                        "kahan": "Kahan summation"}[self.rounding]  # fmt: skip
            text += ", f32 master copy" if self.master_weights else f", no master copy, {rounding}"
        if (self.first_moment, self.second_moment) != ("float32", "float32"):
            text += f", moments {self.first_moment}/{self.second_moment}"
        if self.fp8 != "none":
            text += f", FP8 {self.fp8} scaling"
        if self.qat != "none":
            text += f", {self.qat} quantization-aware training"
            text += f" after step {self.qat_start}" if self.qat_start else " from the start"
        return text

    @property
    def qat_recipe(self) -> Any:
        """The jaxmp quantisation recipe of the `qat` key, or None."""
        return QAT_RECIPES[self.qat]

    @property
    def fp8_recipe(self) -> Any:
        """The jaxmp FP8 recipe of the `fp8` key, or None."""
        return FP8_RECIPES[self.fp8]

    def make_loss_scale(self) -> jaxmp.LossScale | None:
        """The configured loss scale; None for "auto" (`jaxmp.mixed_precision` chooses)."""
        if self.loss_scale == "none":
            return jaxmp.NoOpLossScale()
        if self.loss_scale == "static":
            return jaxmp.StaticLossScale(self.loss_scale_init)
        if self.loss_scale == "dynamic":
            return jaxmp.DynamicLossScale(
                self.loss_scale_init,
                period=self.loss_scale_period,
                factor=self.loss_scale_factor,
                min_loss_scale=self.loss_scale_min,
                max_loss_scale=self.loss_scale_max,
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _did_you_mean(token: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(token, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _resolve(tp: Any) -> type:
    if isinstance(tp, str):  # `from __future__ import annotations` leaves names as strings.
        tp = {"str": str, "int": int, "float": float, "bool": bool}[tp]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        raise TypeError("config fields must have a single type")
    return tp


_FIELD_TYPES = {f.name: _resolve(f.type) for f in dataclasses.fields(Config)}


def valid_keys() -> str:
    return ", ".join(_FIELD_TYPES)


def from_dict(values: Mapping[str, Any]) -> Config:
    """Validates a mapping into a `Config`; unknown keys are errors listing the valid ones."""
    if not isinstance(values, Mapping):
        raise ValueError(f"a config must be a mapping of keys to values, got {values!r}.")
    for key in values:
        if key not in _FIELD_TYPES:
            raise _unknown_key(key)
    return Config(**values)


def _unknown_key(key: Any) -> ValueError:
    hint = _did_you_mean(key, _FIELD_TYPES) if isinstance(key, str) else ""
    return ValueError(f"unknown config key `{key}`; valid keys are: {valid_keys()}.{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """Parses ``key=value`` into the key and a value typed by the dataclass field's type."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ValueError(f"--set expects KEY=VALUE, got {text!r}; valid keys are: {valid_keys()}.")
    if key not in _FIELD_TYPES:
        raise _unknown_key(key)
    tp = _FIELD_TYPES[key]
    raw = raw.strip()
    if tp is str:
        return key, raw
    if tp is bool:
        if raw.lower() not in _BOOLS:
            raise ValueError(f"config key `{key}` must be true or false, got {raw!r}.")
        return key, _BOOLS[raw.lower()]
    try:
        if tp is int:
            return key, int(raw)
        return key, float(raw)
    except ValueError:
        raise ValueError(f"config key `{key}` must be {tp.__name__}, got {raw!r}.") from None


def _valid_names(name: str) -> str:
    hint = _did_you_mean(pathlib.Path(name).stem, available())
    return f"valid names are: {', '.join(available())} (or the path of a YAML file).{hint}"


def config_path(name_or_path: str) -> pathlib.Path:
    """Resolves a config name (``mixed_float16``), a file name in ``configs/`` or a path.

    ``fp32``, ``fp32.yaml`` and ``configs/fp32.yaml`` name the same file; a path that does not
    exist is an error listing the valid names.
    """
    path = pathlib.Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix in (".yaml", ".yml"):
        shipped = CONFIG_DIR / path.name
        if path.parent == pathlib.Path(".") and shipped.is_file():
            return shipped
        if path.exists():
            raise ValueError(
                f"config file {name_or_path} is not a file; {_valid_names(name_or_path)}"
            )
        raise ValueError(f"config file {name_or_path} not found; {_valid_names(name_or_path)}")
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise ValueError(f"unknown config {name_or_path!r}; {_valid_names(name_or_path)}")
    return candidate


def available() -> list[str]:
    """Names of the configs shipped in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def read_file(path: pathlib.Path) -> dict[str, Any]:
    """The mapping in a YAML config file; unreadable files and bad YAML are one-line errors."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"cannot read config file {path}: {reason}.") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(
            f"config file {path} is not valid YAML{where}: {' '.join(problem.split())}; "
            "a config is a mapping of `key: value` lines."
        ) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"config file {path} must hold a mapping of `key: value` lines, got {values!r}."
        )
    return values


def load(name_or_path: str, overrides: Iterable[str] = ()) -> Config:
    """Loads a YAML config by name or path and applies ``key=value`` overrides.

    The run keeps the config's name (its directory is ``runs/<name>``) unless an override
    changes what precision it trains (a key of `PRECISION_KEYS`; for ``precision``, the
    policy): ``--set precision=bfloat16`` on ``mixed_float16`` trains bfloat16, so the run
    is named ``mixed_float16+precision=bfloat16``, not ``mixed_float16``. An explicit
    ``name=`` override wins.

    Raises:
      ValueError: one line naming the file or the ``--set`` key and what is valid.
    """
    path = config_path(name_or_path)
    values = read_file(path)
    values.setdefault("name", path.stem)
    try:
        base = from_dict(values)
    except ValueError as e:
        raise ValueError(f"config file {path}: {e}") from None
    changed: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        values[key] = value
        changed[key] = value
    config = from_dict(values)
    if "name" in changed:
        return config
    renamed = [
        f"+{key}={_show(getattr(config, key))}"
        for key in PRECISION_KEYS
        if key in changed and _trains_differently(base, config, key)
    ]
    return dataclasses.replace(config, name=base.name + "".join(renamed)) if renamed else config


def _trains_differently(a: Config, b: Config, key: str) -> bool:
    if key == "precision":
        return a.policy != b.policy
    return getattr(a, key) != getattr(b, key)


def _show(value: Any) -> str:
    """A value as written in ``--set`` (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe_changes(old: Config, new: Config) -> str:
    """What `new` changes of `old`, for the line a resumed run prints when its config changes
    (``"extending the run from 1500 to 1600 steps, eval_interval 100 -> 50"``); "" if nothing."""
    before, after = old.to_dict(), new.to_dict()
    parts = [
        f"{key} {_show(before[key])} -> {_show(after[key])}"
        for key in before
        if key != "steps" and before[key] != after[key]
    ]
    if old.steps != new.steps:
        verb = "extending" if new.steps > old.steps else "shortening"
        parts.insert(0, f"{verb} the run from {old.steps} to {new.steps} steps")
    return ", ".join(parts)


def describe_keys() -> str:
    """Every config key with its default (``steps=1500``), for ``--help``."""
    defaults = Config()

    def show(value: Any) -> str:
        return repr(value) if value == "" else str(value)

    return ", ".join(f"{name}={show(getattr(defaults, name))}" for name in _FIELD_TYPES)


def describe_configs() -> list[tuple[str, str]]:
    """``(name, what it sets)`` for each shipped config, for ``--help``."""
    described = []
    for name in available():
        try:
            config = load(name)
            text = config.describe()
        except ValueError as e:
            text = f"(invalid: {e})"
        described.append((name, text))
    return described


def dump(config: Config) -> str:
    """The config as YAML, loadable again with `load`."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
