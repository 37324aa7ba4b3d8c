"""Regional `torch.compile` of the plan's blocks (`train.compile`).

Each block's own `forward` is compiled in place (an instance attribute, like activation
checkpointing; no wrapper module), so parameter names, checkpoint keys and HF names do
not change, and module hooks stay outside the compiled code: the block's FSDP all-gather
and reshard run around it eagerly. Blocks of one kind share one compiled graph (dynamo
treats their parameters as inputs), so compile time does not grow with depth.

Inside a block, the graph breaks only where eager-only code runs (each piece between
breaks is compiled):

- expert parallelism: at the experts' call. Their FSDP hooks (dynamo skips FSDP hooks) and
  the EP dispatch and combine hooks run eagerly (`torch.compiler.disable` in
  moetrain/parallelisms/expert_parallel.py: host reads of the split sizes, per-layer handles);
  the experts' own forward is a graph of its own.
- context parallelism: the ring (`ContextParallelAttention.forward`) runs eagerly
  (moetrain/parallelisms/context_parallel.py: a fresh ring handle per call).
- bf16 (`train.mixed_precision`): at the router's call. The plan's `fp32_modules` are FSDP
  units of their own (kept in fp32), and dynamo skips FSDP hooks.
- the grouped GEMM traces as one op on every dtype (moetrain/models/common/grouped_gemm.py), so
  without EP and CP (and in fp32) a block is one graph.

NOTE: compile goes *inside* activation checkpointing (torchtitan puts it outside): our
checkpointing runs the replay in eager `torch.utils.checkpoint` with its own contexts
(`moetrain.models.common.replay`), which dynamo cannot trace (it
accepts only torch's selective-checkpoint modes as `context_fn`). So the replay calls the
compiled forward again, and everything `moetrain/parallelisms/activation_checkpoint.py` promises
(counts once, pending dispatches paired, bytes) holds as in eager. `selective` swaps
autograd's saved tensors through saved-tensor hooks, which dynamo does not trace: that
combination is refused (moetrain/config/checks.py).
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(blocks: list[tuple[str, nn.Module]], backend: str = "inductor") -> None:
    """Compile each of `blocks` ((fqn, module) of the plan's `blocks`) in place: call it
    before activation checkpointing and FSDP. `backend`: inductor on CPU and CUDA."""
    for _, block in blocks:
        # NOTE: fullgraph=False: the graph breaks listed above are expected.
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=False)
