"""CUDA attention kernels against plain attention written here in fp32 (run on a GPU:
`pytest -m gpu tests/test_gpu.py`; `benchmarks/gpu_suite.sh` runs them on the lent H100).

The bound, derived rather than measured: the inputs are bf16 values, read exactly by the
kernels and by the fp32 reference alike, so every difference comes from the kernels'
bf16 roundings (unit roundoff u = 2^-8, half of bf16's epsilon 2^-7; fp32 accumulation is
2^16 times finer).
- out: P rounded to bf16 before P @ V (|error| <= u * sum_j p_ij |v_j|) and the block's
  output rounded (u * |out|, which is at most the same sum): <= 2u * (P @ |V|). A ring adds
  nothing: its fp32 merge is a convex combination of block outputs.
- gradients: four roundings (P, dS = P * (dP - delta), the bf16 out that delta reads, the
  block's gradient output), each at most u times the same product taken over absolute
  values: <= 4u * M, M the magnitudes below (`_magnitudes`).
Each element is held to twice that (a margin for the exp and the fp32 sums), against its
own magnitude, so the bound holds on any GPU and any kernel choice; a planted bug (K/V heads
read from the wrong group) exceeds it by orders of magnitude (checked).
"""

from __future__ import annotations

import pytest
import torch

from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.visibility import Visibility
from moetrain.parallelisms.attention_kernels import KERNELS
from moetrain.parallelisms.cp_schedule import local_positions, split_for_cp
from moetrain.parallelisms.flash_attention import DocumentSpans, FlashAttentionCore
from moetrain.parallelisms.flash_attn_support import MAJORS, import_problem
from moetrain.parallelisms.ring_messages import RingStats, merge
from moetrain.parallelisms.ring_steps import Ring, mask_ids, sink_lse, step_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]
U = 2.0**-8  # bf16 unit roundoff: half the spacing of bf16 values at 1 (eps = 2^-7)
HQ, HKV = 8, 2


def _flash_attn_missing() -> str | None:
    """Why flash-attn-4 cannot run here (None: it can; no CUDA is the module's own skip)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if major not in MAJORS:
        return f"needs a Hopper or datacenter Blackwell GPU (9.x-11.x), this one is {major}.{minor}"
    problem = import_problem()
    return None if problem is None else f"needs flash-attn-4 importable: {problem}"


_FLASH_MISSING = _flash_attn_missing()
FLASH = pytest.mark.skipif(_FLASH_MISSING is not None, reason=str(_FLASH_MISSING))


def _visible(s: int, ids, window, device) -> torch.Tensor:
    i, j = torch.arange(s, device=device)[:, None], torch.arange(s, device=device)[None, :]
    seen = (j <= i)[None]
    if ids is not None:
        seen = seen & (ids[:, :, None] == ids[:, None, :])
    if window is not None:
        seen = seen & (i - j < window)
    return seen  # [B or 1, S, S]


def _plain(q, k, v, ids, window, sinks, scale):
    """fp32 attention from the definitions: q [B, S, Hq, D] ... -> (out, probabilities,
    sink probabilities [B, Hq, S] or None), the sink as one more logit of value 0."""
    qh = q.float().transpose(1, 2)
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(HQ // HKV, 1) for t in (k, v))
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(
        ~_visible(q.shape[1], ids, window, q.device)[:, None], float("-inf")
    )
    if sinks is not None:
        scores = torch.cat(
            [scores, sinks.float().view(1, HQ, 1, 1).expand(*scores.shape[:3], 1)], -1
        )
    probs = scores.softmax(-1)
    p_sink = probs[..., -1] if sinks is not None else None
    probs = probs[..., : q.shape[1]]
    return (probs @ vh).transpose(1, 2), probs, p_sink


def _magnitudes(q, k, v, probs, out, d_out, scale):
    """The same products over absolute values: what each element's rounding error scales
    with (see the module doc). Returns [out, dq, dk, dv] magnitudes in their layouts."""
    group = HQ // HKV
    qh = q.float().transpose(1, 2).abs()
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(group, 1).abs() for t in (k, v))
    do = d_out.float().transpose(1, 2).abs()
    delta = (do * out.float().transpose(1, 2).abs()).sum(-1, keepdim=True)
    ds = probs * (do @ vh.transpose(-1, -2) + delta)  # |dP| + |delta|, per pair
    fold = lambda t: t.view(t.shape[0], HKV, group, *t.shape[2:]).sum(2).transpose(1, 2)  # noqa: E731
    return [
        (probs @ vh).transpose(1, 2),
        (ds @ kh * scale).transpose(1, 2),
        fold(ds.transpose(-1, -2) @ qh * scale),
        fold(probs.transpose(-1, -2) @ do),
    ]


def _assert_within(name, ours, ref, magnitude, roundings: int) -> None:
    bound = 2 * roundings * U * magnitude + 1e-6 * magnitude.max()
    excess = ((ours.float() - ref.float()).abs() - bound).max().item()
    assert excess <= 0, (
        f"{name}: beyond {roundings} bf16 roundings of its magnitude by {excess:.3g}"
    )


def _inputs(b, s, d, dv, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s, HQ, d, generator=g, device=device).bfloat16()
    k = torch.randn(b, s, HKV, d, generator=g, device=device).bfloat16()
    v = torch.randn(b, s, HKV, dv, generator=g, device=device).bfloat16()
    d_out = torch.randn(b, s, HQ, dv, generator=g, device=device).bfloat16()
    return q, k, v, d_out


def _documents(b, s, device="cuda") -> torch.Tensor:
    ids = torch.zeros(b, s, dtype=torch.int64, device=device)
    for row in range(b):  # uneven documents, one starting inside every zigzag chunk
        for start in range(s // 7 + row * 13, s, s // 5):
            ids[row, start:] += 1
    return ids


CASES = [  # kernel, head dims (MLA's 192/128 where the kernel takes them), masked
    ("sdpa_flash", 128, 128, False),
    ("sdpa_cudnn", 128, 128, False),
    ("sdpa_efficient", 128, 128, False),
    ("sdpa_efficient", 192, 128, True),
    ("flex", 128, 128, False),
    ("flex", 64, 64, True),
    pytest.param("flash_attn", 128, 128, False, marks=FLASH),
]


@pytest.mark.parametrize("name,d,dv,masked", CASES)
def test_block_kernel_matches_plain_attention_in_bf16(name, d, dv, masked):
    """One whole causal block (its own out and lse are the ring's): forward, lse and the
    gradients against fp32 plain attention."""
    kernel, s, scale = KERNELS[name], 1024, d**-0.5
    q, k, v, d_out = _inputs(2, s, d, dv, seed=d + masked)
    ids = _documents(2, s) if masked else None
    pos = torch.arange(s, device="cuda")
    mask = Visibility(ids, ids, pos, pos, True) if masked else None
    out, lse = kernel.forward(q, k, v, scale, not masked, mask)
    grads = kernel.backward(d_out, q, k, v, out, lse, scale, not masked, mask)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref, probs, _ = _plain(*leaves, ids, None, None, scale)
    ref_grads = torch.autograd.grad(ref, leaves, d_out.float())
    mags = _magnitudes(q, k, v, probs.detach(), ref.detach(), d_out, scale)
    _assert_within(f"{name} out", out, ref, mags[0], 1)
    torch.testing.assert_close(lse, _lse(q, k, ids, scale), rtol=0, atol=1e-3)
    for label, ours, theirs, mag in zip(("dq", "dk", "dv"), grads, ref_grads, mags[1:]):
        _assert_within(f"{name} {label}", ours, theirs, mag, 4)
    # The bound catches a real mistake: K/V heads read from the neighbouring group.
    wrong, _, _ = _plain(q, k.roll(1, dims=2), v.roll(1, dims=2), ids, None, None, scale)
    with pytest.raises(AssertionError, match="beyond"):
        _assert_within("planted", out, wrong, mags[0], 1)


def _lse(q, k, ids, scale):
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(
        ~_visible(q.shape[1], ids, None, q.device)[:, None], float("-inf")
    )
    return scores.logsumexp(-1)


class _OneProcess:
    """A ring rank without a process group: the schedule asks only rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def simulate_ring(q, k, v, ids, sinks, d_out, kernel, cp, scale, window=None):
    """The ring of `context_parallel` over `cp` ranks in one process: its block schedule,
    kernels and merge, K/V read from the owner instead of received. Returns the global
    out and (dq, dk, dv, dsinks), dK/dV summed at their owner as the ring sends them."""
    part = lambda t, r: None if t is None else split_for_cp(t, r, cp, True)  # noqa: E731
    seq = q.shape[1] // cp
    rings = [Ring(_OneProcess(r, cp), scale, True, True, kernel, RingStats(), window) for r in range(cp)]  # fmt: skip
    qs, ks, vs, dos = ([part(t, r) for r in range(cp)] for t in (q, k, v, d_out))
    states = []
    for r, ring in enumerate(rings):  # forward: every rank's (out, lse)
        out = torch.zeros(*qs[r].shape[:3], v.shape[3], device=q.device)
        lse = torch.full((q.shape[0], HQ, seq), float("-inf"), device=q.device)
        for step in range(cp):
            src = (r - step) % cp
            q_ids, k_ids = mask_ids(part(ids, r), part(ids, src), ring, qs[r])
            for rows, cols, causal, mask in step_blocks(ring, step, src, seq, q_ids, k_ids):
                blk = kernel.forward(qs[r][:, rows], ks[src][:, cols], vs[src][:, cols], scale, causal, mask)  # fmt: skip
                merge(out, lse, *blk, rows)
        if sinks is not None:
            merge(out, lse, torch.zeros_like(out), sink_lse(sinks, qs[r]), slice(None))
        states.append((out, lse))
    dq = [torch.zeros(t.shape, device=q.device) for t in qs]
    dk = [torch.zeros(t.shape, device=q.device) for t in ks]
    dv = [torch.zeros(t.shape, device=q.device) for t in vs]
    dsinks = torch.zeros(HQ, device=q.device)
    for r, ring in enumerate(rings):  # backward: the pieces forward recorded
        out, lse = states[r]
        for step in range(cp):
            src = (r - step) % cp
            q_ids, k_ids = mask_ids(part(ids, r), part(ids, src), ring, qs[r])
            for rows, cols, causal, mask in step_blocks(ring, step, src, seq, q_ids, k_ids):
                g = kernel.backward(
                    dos[r][:, rows], qs[r][:, rows], ks[src][:, cols], vs[src][:, cols],
                    out[:, rows], lse[:, :, rows], scale, causal, mask,
                )  # fmt: skip
                dq[r][:, rows] += g[0]
                dk[src][:, cols] += g[1]
                dv[src][:, cols] += g[2]
        if sinks is not None:
            delta = (dos[r].float() * out).sum(-1).transpose(1, 2)
            dsinks -= (torch.exp(sink_lse(sinks, qs[r]) - lse) * delta).sum((0, 2))

    def whole(parts):  # each rank's rows back to their global positions
        full = torch.zeros(parts[0].shape[0], q.shape[1], *parts[0].shape[2:], device=q.device)
        for r, t in enumerate(parts):
            full[:, local_positions(r, cp, seq, True).to(q.device)] = t
        return full

    return whole([o for o, _ in states]), (whole(dq), whole(dk), whole(dv), dsinks)


RING_CASES = [  # kernel, documents, window, sinks
    ("sdpa_flash", False, None, False),
    ("sdpa_cudnn", False, None, True),
    ("sdpa_efficient", True, None, False),
    ("flex", False, None, False),
    ("flex", True, None, True),
    ("flex", True, 300, True),
    pytest.param("flash_attn", False, None, False, marks=FLASH),
    pytest.param("flash_attn", False, None, True, marks=FLASH),  # sinks: the ring's merge
]


@pytest.mark.parametrize("name,documents,window,with_sinks", RING_CASES)
def test_ring_of_cuda_kernels_matches_plain_attention(name, documents, window, with_sinks):
    """cp = 4 zigzag over a 4096-token sequence: the whole ring against fp32 attention."""
    cp, s, d, scale = 4, 4096, 128, 128**-0.5
    q, k, v, d_out = _inputs(1, s, d, d, seed=7)
    ids = _documents(1, s) if documents else None
    sinks = torch.linspace(-1.0, 2.0, HQ, device="cuda") if with_sinks else None
    out, grads = simulate_ring(q, k, v, ids, sinks, d_out, KERNELS[name], cp, scale, window)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if with_sinks else None
    ref, probs, p_sink = _plain(*leaves, ids, window, sink_leaf, scale)
    wrt = leaves + ([sink_leaf] if with_sinks else [])
    ref_grads = torch.autograd.grad(ref, wrt, d_out.float())
    mags = _magnitudes(q, k, v, probs.detach(), ref.detach(), d_out, scale)
    _assert_within(f"{name} ring out", out, ref, mags[0], 1)
    for label, ours, theirs, mag in zip(("dq", "dk", "dv"), grads, ref_grads, mags[1:]):
        _assert_within(f"{name} ring {label}", ours, theirs, mag, 4)
    if with_sinks:  # d sink_h = -sum_i p_sink,i * rowsum(dO_i * O_i)
        delta = (d_out.float() * ref.detach()).sum(-1).abs().transpose(1, 2)
        _assert_within(f"{name} dsinks", grads[3], ref_grads[3], (p_sink.detach() * delta).sum((0, 2)), 4)  # fmt: skip


@pytest.mark.parametrize("window,with_sinks", [(None, False), (256, True)])
def test_attention_core_on_cuda_masks_without_a_dense_mask(window, with_sinks):
    """`AttentionCore` with documents (and a window, sinks) on CUDA runs flex: the same
    attention as fp32, and at 16k tokens its forward and backward allocate memory linear in
    S (measured on the H100: 81 MiB, 146 MiB with sinks), no [S, S] mask."""
    s, d = 16384, 64
    q, k, v, d_out = _inputs(1, s, d, d, seed=3)
    ids = _documents(1, s)
    sinks = torch.linspace(-1.0, 2.0, HQ, device="cuda").requires_grad_() if with_sinks else None
    core = AttentionCore(d**-0.5, causal=True, window=window)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    core(*leaves, ids, sinks).backward(d_out)  # compiles flex first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = core(*leaves, ids, sinks)
    grads = torch.autograd.grad(out, leaves + ([sinks] if with_sinks else []), d_out)
    peak = torch.cuda.max_memory_allocated() - before
    # Linear in S: the op holds out, lse, a recomputed out, dq/dk/dv and their copies in the
    # inputs' layouts, and with sinks fp32 copies of out: at most 12 out-sized tensors. The
    # dense path needs the [S, S] bool mask and its bf16 bias alone: 768 MiB here.
    budget = 12 * out.numel() * out.element_size()
    assert peak < budget, f"{peak / 2**20:.0f} MiB, over {budget / 2**20:.0f} MiB"
    print(f"core peak {peak / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB)")
    cut = 2048  # the fp32 reference on the first documents only (its scores are S x S)
    ref_in = [t[:, :cut].float().requires_grad_() for t in (q, k, v)]
    ref, probs, _ = _plain(*ref_in, ids[:, :cut], window, sinks, d**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_in, d_out[:, :cut].float())
    mags = _magnitudes(*(t[:, :cut] for t in (q, k, v)), probs.detach(), ref.detach(), d_out[:, :cut], d**-0.5)  # fmt: skip
    _assert_within("core out", out[:, :cut], ref, mags[0], 1)
    # The first `cut` queries see only keys before `cut`: their dq is complete here.
    _assert_within("core dq", grads[0][:, :cut], ref_grads[0], mags[1], 4)


@FLASH
@pytest.mark.parametrize(
    "documents,window,with_sinks", [(False, None, False), (True, None, False), (True, 256, True)]
)
def test_flash_attention_core_matches_plain_attention(documents, window, with_sinks):
    """`parallel.cp_kernel=flash_attn` without CP: the core flash-attn-4 runs (documents
    through its variable-length call, windows, sinks trained by the kernel) against fp32
    attention, gradients of q, k, v and the sinks included."""
    s, d = 2048, 128
    q, k, v, d_out = _inputs(2, s, d, d, seed=11)
    ids = _documents(2, s) if documents else None
    sinks = torch.linspace(-1.0, 2.0, HQ, device="cuda") if with_sinks else None
    core = FlashAttentionCore(d**-0.5, True, window, DocumentSpans())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = [sinks.clone().requires_grad_()] if with_sinks else []
    out = core(*leaves, ids, *sink_leaf)
    grads = torch.autograd.grad(out, leaves + sink_leaf, d_out)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref_sink = [sinks.clone().requires_grad_()] if with_sinks else []
    ref, probs, p_sink = _plain(*ref_in, ids, window, *(ref_sink or [None]), d**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_in + ref_sink, d_out.float())
    mags = _magnitudes(q, k, v, probs.detach(), ref.detach(), d_out, d**-0.5)
    _assert_within("flash core out", out, ref, mags[0], 1)
    for label, ours, theirs, mag in zip(("dq", "dk", "dv"), grads, ref_grads, mags[1:]):
        _assert_within(f"flash core {label}", ours, theirs, mag, 4)
    if with_sinks:  # d sink_h = -sum_i p_sink,i * rowsum(dO_i * O_i)
        delta = (d_out.float() * ref.detach()).sum(-1).abs().transpose(1, 2)
        bound = (p_sink.detach() * delta).sum((0, 2))
        _assert_within("flash core dsinks", grads[3], ref_grads[3], bound, 4)
