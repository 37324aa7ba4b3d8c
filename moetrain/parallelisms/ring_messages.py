"""The ring's messages and its merge, for `moetrain.parallelisms.context_parallel`: one K/V message
per hop (document ids riding in the same buffer), the point-to-point pass to the next rank,
and the online-softmax fold of a block into the running (out, lse)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingStats:
    """Point-to-point operations posted, block kernel calls and the query-key pairs they
    compute (for tests, logs and the benchmark)."""

    def __init__(self) -> None:
        self.p2p_ops = 0
        self.kernel_calls = 0  # forward
        self.backward_kernel_calls = 0
        self.pairs = 0  # forward: B * rows * cols of every kernel call


def pass_to_next(buf: torch.Tensor, group, tag: int, stats: RingStats):
    """Post: send `buf` to the next rank, receive the previous rank's into a new buffer."""
    cp, rank = group.size(), group.rank()
    recv = torch.empty_like(buf)
    ops = [
        dist.P2POp(dist.isend, buf, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % cp), group, tag),
    ]
    stats.p2p_ops += len(ops)
    return recv, dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for work in works:
        work.wait()


def pack(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """One message per hop: K, V (may be narrower), then the document ids [B, s] if any,
    int64 reinterpreted as K's dtype (the bits travel unchanged, so the ids stay exact)."""
    parts = [k.reshape(-1), v.reshape(-1)]
    if ids is not None:
        parts.append(ids.to(torch.int64).reshape(-1).view(k.dtype))
    return torch.cat(parts)


def unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n : n + v_shape.numel()].view(v_shape)


def unpack_ids(buf: torch.Tensor, k_shape, v_shape, ids: torch.Tensor | None):
    """The document ids [B, s] a packed block carries (None without document masks)."""
    if ids is None:
        return None
    # clone: a view to a wider dtype needs the slice to start at an aligned offset
    return buf[k_shape.numel() + v_shape.numel() :].clone().view(torch.int64).view(ids.shape)


def merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Online softmax: fold a block's (out, lse) into the running ones, rows `rows`, fp32."""
    old_lse = lse[:, :, rows]  # [B, H, s]
    new_lse = torch.logaddexp(old_lse, block_lse)  # -inf where a row has seen no key yet
    # Such rows (document masks) would give exp(-inf - -inf) = NaN; against 0 both weights
    # are exp(-inf) = 0 and the row stays (out 0, lse -inf) until a block shows it a key.
    ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    keep = torch.exp(old_lse - ref).transpose(1, 2)[..., None]  # [B, s, H, 1]
    take = torch.exp(block_lse - ref).transpose(1, 2)[..., None]
    out[:, rows] = out[:, rows] * keep + block_out * take
    lse[:, :, rows] = new_lse
