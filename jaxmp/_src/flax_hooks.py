"""The Flax integrations' stand-ins, registered with the core when jaxmp is imported.

The core never imports upward, and `import jaxmp` imports no Flax. Two hooks stand in for the
integrations until the program has imported the part of Flax they serve, and then load them:

* NNX modules among the arguments of `jaxmp.autocast`, `jaxmp.inspect` or an FP8 call are split
  by `jaxmp.nnx` (`interpret.register_graph_splitter`), once ``flax.nnx`` is imported (as a
  program that builds NNX modules has); `jaxmp.nnx` then registers its own split instead.
* Flax Linen's attention is marked for `jaxmp.autocast` by `jaxmp.linen`
  (`attention.register_interceptor`), once ``flax.linen`` is imported; `jaxmp.linen` then
  registers its own marks instead.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from jaxmp._src import attention, interpret


def _split_nnx_graph_nodes(tree: Any) -> Any:
    if "flax.nnx" not in sys.modules:
        return None
    import jaxmp.nnx

    return jaxmp.nnx._split_graph_nodes(tree)


def _mark_linen_attention() -> contextlib.AbstractContextManager[Any]:
    if "flax.linen" not in sys.modules:
        return contextlib.nullcontext()
    import jaxmp.linen

    return jaxmp.linen._mark_linen_attention()


interpret.register_graph_splitter(_split_nnx_graph_nodes)
attention.register_interceptor("flax.linen", _mark_linen_attention)
