"""examples/sharding.py on 8 simulated devices: meshes, batch placement and its errors.

Usage: ``python sharding_example.py``. Prints one JSON object.
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repository root on sys.path)
import jax
import numpy as np

from examples import sharding


def main() -> None:
    out: dict = {"device_count": jax.device_count()}
    mesh = sharding.make_mesh("data=4,model=2")
    out["mesh"] = {"shape": dict(mesh.shape), "axis_types": [t.name for t in mesh.axis_types]}
    out["dict_mesh"] = dict(sharding.make_mesh({"model": 8}).shape)
    batch = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3), "y": np.arange(16)}
    placed = sharding.shard_batch(batch, mesh)
    out["batch"] = {
        "spec": [list(a) if isinstance(a, tuple) else a for a in placed["x"].sharding.spec],
        "rows_per_device": sorted({s.data.shape[0] for s in placed["x"].addressable_shards}),
        "values_kept": bool(np.array_equal(np.asarray(placed["x"]), batch["x"])),
    }
    try:
        sharding.shard_batch({"x": np.zeros((12, 3))}, mesh)
    except ValueError as e:
        out["batch_error"] = str(e)
    try:
        sharding.make_mesh("data=4")
    except ValueError as e:
        out["mesh_error"] = str(e)
    common.emit(out)


if __name__ == "__main__":
    main()
