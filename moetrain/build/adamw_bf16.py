"""AdamW whose moments are stored in bf16 (`train.optimizer_state_dtype=bf16`).

torch's AdamW keeps `exp_avg` and `exp_avg_sq` in the parameter's dtype (the fp32 master
shards here), 8 bytes per trained parameter. DeepSeek-V3 keeps them in bf16 (report §3.3.2):
4 bytes. This subclass stores them so and steps each parameter in fp32: the moments are
widened, updated, used for the update, and rounded back to bf16 (round to nearest even),
so a step's arithmetic is fp32 and the only loss is the storage rounding, one relative
2^-9 per moment per step (tests/test_optimizer_step.py derives its bound from that).

The state keeps torch's keys (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints save and
load it through the same `get_state_dict` / DCP path, and torch's own AdamW `step` is not
touched. A resume converts: the checkpoint's moments, whatever dtype saved them, are cast
to this run's (bf16 ones exactly; fp32 ones rounded, as a step would round them). Parameters may be DTensors (FSDP, EP): the arithmetic runs on their local shards.

NOTE: one parameter at a time, with fp32 temporaries of that parameter's shard only (not
foreach over a group): the widened moments of a whole group at once would take back the
memory the bf16 state saves.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWLowPrecisionState(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay, bias-corrected moments, no amsgrad) with
    its moments stored in `state_dtype`."""

    def __init__(self, params, state_dtype: torch.dtype = torch.bfloat16, **kwargs) -> None:
        super().__init__(params, fused=None, foreach=False, **kwargs)
        self.state_dtype = state_dtype
        # NOTE: torch's `load_state_dict` casts floating state to the parameter's dtype
        # (fp32); narrowed back once loaded: exact for moments saved in bf16, their bf16
        # rounding for moments an fp32 run saved (a resume converts, it does not refuse).
        self.register_load_state_dict_post_hook(_narrow_loaded_state)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # as torch creates it: a float32 step tensor on the CPU, zero moments
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p)
                state["step"] += 1
                step = state["step"].item()
                param, grad = _local(p), _local(p.grad).float()
                exp_avg = _local(state["exp_avg"]).float().lerp_(grad, 1 - beta1)
                exp_avg_sq = _local(state["exp_avg_sq"]).float().mul_(beta2)
                exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
                param.mul_(1 - lr * decay)
                # torch's single-tensor AdamW: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
                bias2 = math.sqrt(1 - beta2**step)
                denom = exp_avg_sq.sqrt().div_(bias2).add_(eps)
                param.addcdiv_(
                    exp_avg.to(param.dtype), denom.to(param.dtype), value=-lr / (1 - beta1**step)
                )
                _local(state["exp_avg"]).copy_(exp_avg)  # rounded to the state's dtype
                _local(state["exp_avg_sq"]).copy_(exp_avg_sq)
        return loss


def _narrow_loaded_state(optimizer: AdamWLowPrecisionState) -> None:
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].to(optimizer.state_dtype)
