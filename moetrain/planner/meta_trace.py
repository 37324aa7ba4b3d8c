"""The dry-run planner's instruments (`moetrain.planner.footprint` measures with them): a
dispatch mode that follows every storage a meta run creates from its birth to its death,
and what the meta device needs to run a training step with the footprint of the kernels
a real run takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moetrain.parallelisms.plan import match_modules


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = local_tensor(t).untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class StorageTimeline(TorchDispatchMode):
    """Every storage an op creates, with the op index of its creation and of its death
    (polled after each op: a storage dies when its last tensor does)."""

    def __init__(self, resting: set[int]) -> None:
        super().__init__()
        self.resting = resting  # storages that were there before: parameters, buffers, state
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # cdata -> (ref, serial)
        self.spans: list[list[int]] = []  # serial -> [nbytes, born, died (-1: alive)]
        self.op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = meta_op(func, args, kwargs or {})
        self.op += 1
        self.poll()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata in self.resting or s._cdata in self.live:
                    continue
                self.live[s._cdata] = (StorageWeakRef(s), len(self.spans))
                self.spans.append([s.nbytes(), self.op, -1])
        return out

    def poll(self) -> None:
        # NOTE: the storage class's own test, not StorageWeakRef.expired (two Python calls
        # around it): this runs for every live storage after every op, a third of a trace
        expired = torch.UntypedStorage._expired
        dead = [k for k, (ref, _) in self.live.items() if expired(ref.cdata)]
        for k in dead:
            self.spans[self.live.pop(k)[1]][2] = self.op

    def live_bytes(self) -> int:
        return sum(self.spans[serial][0] for _, serial in self.live.values())

    def serial(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(t.untyped_storage()._cdata)
        return None if entry is None else entry[1]


class MetaShortcuts(TorchDispatchMode):
    """Ops through `meta_op` (its shortcuts), nothing recorded: for a step whose own
    allocations are not measured (the optimizer's first, which creates its state)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return meta_op(func, args, kwargs or {})


def live_curve(spans, grad_serials, grad_scale) -> list[float]:
    """Live bytes after each op: activations + gradients scaled by `grad_scale`."""
    ops = 1 + max((max(b, d) for _, b, d in spans), default=0)
    delta = [0.0] * (ops + 1)
    for serial, (nbytes, born, died) in enumerate(spans):
        weight = grad_scale if serial in grad_serials else 1.0
        delta[born] += weight * nbytes
        delta[ops if died < 0 else died] -= weight * nbytes
    live, out = 0.0, []
    for d in delta:
        live += d
        out.append(live)
    return out


def meta_op(func, args, kwargs):
    """`func` run on meta tensors, where its meta kernel needs help or is slow.

    NOTE: the grouped GEMM's meta kernel takes bf16 only; the shapes do not depend on the
    dtype, so an fp32 product is shaped by its bf16 twin. Not `moetrain::grouped_mm` (the
    compile path): the trace runs the op a real run runs."""
    if func in ELEMENTWISE:
        out = elementwise(args, kwargs)
        if out is not None:
            return out
    if func in FOREACH_IN_PLACE and all(t.device.type == "meta" for t in args[0]):
        return None  # an in-place foreach op allocates nothing and returns nothing
    if func is _aten._foreach_sqrt.default:
        outs = [elementwise((t,), {}) for t in args[0]]
        if all(o is not None for o in outs):
            return outs
    if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
        low = [
            a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        ]
        return torch.empty_like(func(*low, **kwargs), dtype=args[0].dtype)
    return func(*args, **kwargs)


_aten = torch.ops.aten
# Element-wise ops whose meta kernels are Python references: a few hundred microseconds
# each, a quarter of a trace (`elementwise` gives their output in a few).
ELEMENTWISE = frozenset(
    {
        _aten.add.Tensor,
        _aten.sub.Tensor,
        _aten.mul.Tensor,
        _aten.div.Tensor,
        _aten.mul.Scalar,
        _aten.div.Scalar,
        _aten.pow.Tensor_Scalar,
        _aten.neg.default,
        _aten.rsqrt.default,
    }
)


# In-place foreach ops of the optimizer's step, whose meta kernels loop in Python too.
FOREACH_IN_PLACE = frozenset(
    {
        _aten._foreach_addcmul_.Scalar,
        _aten._foreach_addcdiv_.ScalarList,
        _aten._foreach_lerp_.Scalar,
        _aten._foreach_div_.ScalarList,
        _aten._foreach_add_.Tensor,
        _aten._foreach_add_.Scalar,
        _aten._foreach_add_.List,
        _aten._foreach_mul_.Scalar,
        _aten._foreach_mul_.Tensor,
        _aten._foreach_mul_.List,
    }
)


def elementwise(args, kwargs) -> torch.Tensor | None:
    """The output of an out-of-place `ELEMENTWISE` op on meta tensors, or None where the
    shortcut's rule may not hold: with floating-point tensors only, and every operand of
    the output's (broadcast) shape contiguous, the kernel allocates a contiguous tensor of
    that shape in the promoted dtype. `tests/test_dry_run_phases.py` and
    `tests/test_meta_shortcuts.py` check it against the ops' own meta kernels."""
    if any(k != "alpha" for k in kwargs):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "meta" or not t.is_floating_point() for t in tensors):
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    full = [t for t in tensors if t.shape == shape]
    if not full or not all(t.is_contiguous() for t in full):
        return None
    dtype = torch.result_type(args[0], args[1]) if len(args) > 1 else tensors[0].dtype
    return torch.empty(shape, dtype=dtype, device="meta")


class FusedAttention(TorchFunctionMode):
    """SDPA as a fused kernel on the meta device. NOTE: on meta, SDPA decomposes into its
    math path, which saves the [S, S] scores; the CPU and CUDA kernels a run uses save only
    q, k, v, the output and the log-sum-exp. The fused CPU kernel's meta form has that
    footprint (and takes GQA and masks).

    A V head narrower than Q/K's (MLA: 128 against 192), unmasked and without GQA, takes
    CUDA's memory-efficient kernel (flash wants one head dim; the trainer does not pad),
    which saves q, k, v and the output at V's width, the output laid out [B, S, H, Dv] so
    that the output projection's input is a view of it. `_NarrowV` has that footprint on
    meta and on CPU (so the allocator checks it). Padding V to one width instead would save
    a padded V and a padded output, and the projection's input as a copy: 96 KiB a token
    more in each DeepSeek-V3 block."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        kwargs.pop("enable_gqa", None)
        dv = v.shape[-1]
        plain = kwargs.get("attn_mask") is None and k.shape[-3] == q.shape[-3]
        if dv != q.shape[-1] and plain and not kwargs.get("dropout_p"):
            return _NarrowV.apply(q, k, v, kwargs.get("is_causal", False), kwargs.get("scale"))
        if dv != q.shape[-1]:  # the CPU flash kernel wants one head dim: pad V
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            kwargs.pop("dropout_p", 0.0),
            kwargs.pop("is_causal", False),
            attn_mask=kwargs.pop("attn_mask", None),
            scale=kwargs.pop("scale", None),
        )
        return out[0][..., :dv]


class _NarrowV(torch.autograd.Function):
    """Attention with V narrower than Q/K (`FusedAttention`), run by the fused CPU kernel
    on V padded to Q's width, keeping what CUDA's memory-efficient kernel keeps: q, k, v,
    the output at V's width (a [B, H, S, Dv] view of a [B, S, H, Dv] tensor) and the
    log-sum-exp. Backward pads V and the output again for the kernel's backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float | None):
        d, dv = q.shape[-1], v.shape[-1]
        padded, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, F.pad(v, (0, d - dv)), 0.0, causal, scale=scale
        )[:2]
        out = padded[..., :dv].transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        pad = (0, q.shape[-1] - v.shape[-1])
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            F.pad(grad, pad),
            q,
            k,
            F.pad(v, pad),
            F.pad(out, pad),
            lse,
            0.0,
            ctx.causal,
            scale=ctx.scale,
        )
        return dq, dk, dv[..., : v.shape[-1]], None, None


class _FusedCore(nn.Module):
    """An attention core run under `FusedAttention` from inside its own forward, so that
    an activation-checkpointing replay (which does not see the tracer's torch-function
    mode) takes the fused path too."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(self, *args, **kwargs):
        with FusedAttention():
            return self.core(*args, **kwargs)


def use_fused_attention(model: nn.Module, plan) -> None:
    """Swap the plan's attention cores of a meta model for `_FusedCore`s (in place)."""
    if plan.attention_core is not None:
        for fqn, core in match_modules(model, plan.attention_core, "attention_core"):
            model.set_submodule(fqn, _FusedCore(core))
