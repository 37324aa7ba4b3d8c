"""Bad steps are skipped, not applied.

Invariant: a skipped step changes nothing but the data position. Its global batch is
consumed; the parameters, the optimizer state (AdamW's moments and its step count), the
routers' correction bias and the learning-rate schedule stay as they were, so the run goes
on exactly as a run whose data never held that batch (tested bitwise on every layout).

A step is skipped when its loss or its global gradient norm is not finite, or, with
`train.skip_spike_sigma=S > 0`, when either exceeds the mean plus S standard deviations of
the last `train.skip_spike_window` applied steps, judged once `MIN_SPIKE_HISTORY` of them
are in (the config refuses a smaller window). Both figures are already all-reduced before
the decision (the loss sum in `StepLoss.end`, the norm in `clip.grad_norm`), so every rank
takes the same decision from the same bits, with no collective and no host sync of its own.
`train.max_skipped_steps` consecutive skips stop the run (`SkipLimitReached`), and a run
whose every step was skipped ends as a failure too (`NoUpdateApplied`); both say what most
likely made the steps non-finite (`likely_cause`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# Applied steps the spike rule needs before it judges, and the config's least
# train.skip_spike_window. NOTE: a smaller window is refused at start-up rather than judged
# once full: the rule compares a step with mean + S sd of its window, and the deviation of
# n = 2-9 steps is itself too uncertain (relative error ~ 1/sqrt(2(n-1)): 25-70%), so
# ordinary early-training noise would be skipped; and judging on another window than the
# one asked for would change the rule silently.
from moetrain.config.schema import MIN_SPIKE_HISTORY


class SkipLimitReached(Exception):
    """Too many consecutive steps were skipped: the run stops (exit 3) after saving."""


class NoUpdateApplied(Exception):
    """Every step of this run was skipped: it trained nothing, so it does not end as a
    success (exit 3, as a run stopped by bad steps), whatever train.max_skipped_steps."""


# An auxiliary loss whose weighted value exceeds this many times the token loss is named as
# the likely cause of a non-finite step. NOTE: the usual weights (1e-3 to 1e-2 for the
# balance loss, 1e-3 for the z-loss) keep these terms at hundredths of the token loss; ten
# times it means the routers' losses drive the gradient, and a gradient that overflows while
# the token loss is finite then comes from them.
AUX_DOMINATES = 10.0


def loss_weights(aux_field: str | None, terms: Any, moe: Any) -> dict[str, tuple[str, float]]:
    """The auxiliary losses `likely_cause` weighs, by record figure: the config key of each
    one's weight and the weight (the aux loss first, its key the model's own field,
    `ModelSpec.aux_loss_field`; then the z-loss). `terms`: the model's `LossTerms`; `moe`:
    the config's [moe] section."""
    weights = {}
    if aux_field is not None:
        weights["aux_loss"] = (f"model.{aux_field}", terms.aux_loss_coef)
    weights["z_loss"] = ("moe.z_loss_coef", moe.z_loss_coef)
    return weights


def likely_cause(
    record: dict[str, Any], coefs: dict[str, tuple[str, float]], untouched: bool
) -> str:
    """What to change after skipped steps, from the last one's `record`: an auxiliary loss
    (`coefs`: by record figure, the config key of its weight and the weight; the aux
    weight's key is the model's own field, `ModelSpec.aux_loss_field`) that is not finite
    or outweighs the token loss, named with its key; else, when no update was applied since the weights
    the run started from (`untouched`), not the learning rate; else the learning rate."""
    loss = record["loss"]
    if math.isfinite(loss):  # a non-finite token loss is not the auxiliary losses' doing
        for figure, (key, coef) in coefs.items():
            value = record.get(figure)
            if value is None or not coef:
                continue
            weighted = coef * value
            if not math.isfinite(weighted) or abs(weighted) > AUX_DOMINATES * abs(loss):
                return (
                    f"{key}={coef:g} weighs {figure} {value:.4g} to {weighted:.4g}, against a "
                    f"token loss of {loss:.4g}: the routers' loss drives the gradient. Lower "
                    f"{key} (0.001 to 0.01 is usual)"
                )
    if untouched:
        return (
            "No update was applied since the weights this run started from, so train.lr "
            "played no part: check the model's keys ([model]), the weights it started from "
            "and the data"
        )
    return "Lower train.lr or inspect the data of those steps"


@dataclass(frozen=True)
class Verdict:
    skip: bool
    reason: str = ""  # why, for the console: "loss nan", "grad norm 41.2 > 12.3 (mean + 6 sd)"


def _spike(name: str, value: float, history: deque[float], sigma: float) -> str:
    n = len(history)
    mean = sum(history) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in history) / n)
    limit = mean + sigma * sd
    if value > limit:
        return f"{name} {value:.4g} > {limit:.4g} (mean + {sigma:g} sd of the last {n} steps)"
    return ""


class StepGuard:
    """Judges each step from its (already global) loss and gradient norm."""

    def __init__(self, max_consecutive: int, spike_sigma: float, spike_window: int) -> None:
        if spike_sigma > 0 and spike_window < MIN_SPIKE_HISTORY:
            # A window that never holds MIN_SPIKE_HISTORY steps would never judge a spike.
            raise ValueError(
                f"spike_window={spike_window} < {MIN_SPIKE_HISTORY}: the spike rule would never "
                "judge (the config refuses train.skip_spike_window below it)"
            )
        self.max_consecutive = max_consecutive
        self.spike_sigma = spike_sigma
        self.losses: deque[float] = deque(maxlen=spike_window)
        self.norms: deque[float] = deque(maxlen=spike_window)
        self.skipped_total = 0  # every skipped step of the run (the LR schedule lags by it)
        self.consecutive = 0  # skipped steps since the last applied one

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        """Whether to skip this step; updates the counts (call once per step)."""
        figures = (("loss", loss), ("grad norm", grad_norm))
        reasons = [f"{name} {value}" for name, value in figures if not math.isfinite(value)]
        if not reasons and self.spike_sigma > 0 and len(self.losses) >= MIN_SPIKE_HISTORY:
            reasons = [
                r
                for r in (
                    _spike("loss", loss, self.losses, self.spike_sigma),
                    _spike("grad norm", grad_norm, self.norms, self.spike_sigma),
                )
                if r
            ]
        if reasons:
            self.skipped_total += 1
            self.consecutive += 1
            return Verdict(True, "; ".join(reasons))
        self.consecutive = 0
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return Verdict(False)

    def observe(self, loss: float, grad_norm: float, skipped: bool) -> Verdict:
        """Record a step the device guard (`DeviceGuard`) judged: the same counts as
        `judge`, by its verdict, and the reason it skipped, for the console."""
        if not skipped:
            self.consecutive = 0
            self.losses.append(loss)
            self.norms.append(grad_norm)
            return Verdict(False)
        figures = (("loss", loss), ("grad norm", grad_norm))
        reasons = [f"{name} {value}" for name, value in figures if not math.isfinite(value)]
        if not reasons and self.spike_sigma > 0 and len(self.losses) >= MIN_SPIKE_HISTORY:
            spikes = (
                _spike("loss", loss, self.losses, self.spike_sigma),
                _spike("grad norm", grad_norm, self.norms, self.spike_sigma),
            )
            reasons = [r for r in spikes if r]
        if not reasons and self.limit_reached:
            reasons = [f"past train.max_skipped_steps={self.max_consecutive}"]
        self.skipped_total += 1
        self.consecutive += 1
        return Verdict(True, "; ".join(reasons) or "judged a spike on the device")

    @property
    def limit_reached(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

    def note(self, step: int, reason: str) -> str:
        """The console line of skipped step `step`."""
        return (
            f"step {step} skipped ({reason}): its batch is consumed, nothing else moved "
            f"({self.consecutive} in a row, {self.skipped_total} in this run)"
        )

    def limit_error(self, step: int, reason: str, cause: str) -> SkipLimitReached:
        """What stops the run once `limit_reached` (after the trainer saved step `step`);
        `cause`: `likely_cause`'s advice."""
        first = step - self.consecutive + 1
        return SkipLimitReached(
            f"steps {first}-{step} were all skipped (train.max_skipped_steps="
            f"{self.max_consecutive}; the last: {reason}); saved checkpoint step-{step} holding "
            f"the last good state, the weights of step {first - 1}, with the data past the "
            f"skipped batches. {cause}, then resume (checkpoint.resume=auto)"
        )

    @staticmethod
    def nothing_applied_error(first: int, last: int, reason: str, cause: str) -> NoUpdateApplied:
        """What ends a run whose steps `first`-`last` were all skipped."""
        steps = f"step {last} was" if first == last else f"steps {first}-{last} were all"
        return NoUpdateApplied(
            f"this run applied no update: {steps} skipped (the last: {reason}), so its weights "
            f"are those it started from (step {first - 1}). {cause}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_total": self.skipped_total,
            "consecutive": self.consecutive,
            "losses": list(self.losses),
            "norms": list(self.norms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_total = int(state["skipped_total"])
        self.consecutive = int(state["consecutive"])
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
        self.norms.clear()
        self.norms.extend(float(v) for v in state["norms"])


def to_device_unblocked(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without the host waiting for the copy.

    NOTE: a copy from pageable memory makes CUDA finish the stream first (torch waits for
    it, a sync); from pinned memory it is queued like a kernel, and torch keeps the pinned
    block alive until the copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class DeviceGuard:
    """`StepGuard.judge` on the device: the verdict is a bool tensor, so the update can be
    skipped (fused AdamW's `found_inf`, the bias update's `skip`) without the host reading
    the loss or the norm inside the step. The host's `StepGuard` then `observe`s each
    verdict once the step's figures are read, after the next step is queued.

    Its state (the window of applied steps' figures, the skipped and consecutive counts) is
    the host guard's, as float64 and int64 tensors: built from it (`load`, also after a
    resume), they judge alike. Past `train.max_skipped_steps` consecutive skips it skips
    every step: the host stops the run at the step that reached the limit, and what the
    device queued after it must not move the weights.
    """

    def __init__(self, guard: StepGuard, device: torch.device) -> None:
        self.sigma, self.max_consecutive = guard.spike_sigma, guard.max_consecutive
        window = guard.losses.maxlen or 1
        f64 = {"dtype": torch.float64, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        self.losses, self.norms = torch.zeros(window, **f64), torch.zeros(window, **f64)
        self.slots = torch.arange(window, **i64)
        self.filled, self.next = torch.zeros((), **i64), torch.zeros((), **i64)
        self.skipped, self.consecutive = torch.zeros((), **i64), torch.zeros((), **i64)
        # Set by the step that reaches the limit: the host stops the run at that step, so
        # what was queued after it is skipped. (Not by a resume at the limit: resumed, the
        # run goes on, and its first step is judged as any other.)
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)
        self.load(guard)

    def load(self, guard: StepGuard) -> None:
        """Take the host guard's state (its window in order, then its counts)."""
        n = len(guard.losses)
        self.losses.zero_()
        self.norms.zero_()
        if n:
            window = torch.tensor([list(guard.losses), list(guard.norms)], dtype=torch.float64)
            window = to_device_unblocked(window, self.losses.device)
            self.losses[:n], self.norms[:n] = window[0], window[1]
        self.filled.fill_(n)
        self.next.fill_(n % len(self.slots))
        self.skipped.fill_(guard.skipped_total)
        self.consecutive.fill_(guard.consecutive)
        self.stopped.fill_(False)

    def _spike(self, value: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        valid = self.slots < self.filled
        n = self.filled.clamp(min=1).double()
        mean = torch.where(valid, window, 0.0).sum() / n
        sd = (torch.where(valid, window - mean, 0.0).square().sum() / n).sqrt()
        return value > mean + self.sigma * sd

    @torch.no_grad()
    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether to skip this step (a bool tensor); updates the state (once per step).

        NOTE: written in few ops, since each is a launch of the step: x - x is 0 exactly
        when x is finite (inf - inf and NaN are NaN), and the float64 sum of the loss and
        the norm (both fp32-born, so no overflow) is finite exactly when both are."""
        loss = loss.double()
        total = loss + grad_norm
        skip = (total - total) != 0
        if self.sigma > 0:
            grad_norm = grad_norm.double()
            spike = self._spike(loss, self.losses) | self._spike(grad_norm, self.norms)
            skip = skip | ((self.filled >= MIN_SPIKE_HISTORY) & spike)
        skip = skip | self.stopped
        if self.sigma > 0:  # the window of applied steps: only the spike rule reads it
            keep = ~skip
            at = self.next.view(1)
            self.losses.index_copy_(0, at, torch.where(keep, loss, self.losses[at]))
            self.norms.index_copy_(0, at, torch.where(keep, grad_norm, self.norms[at]))
            self.next.copy_(torch.where(keep, (self.next + 1) % len(self.slots), self.next))
            self.filled.copy_(
                torch.where(keep, (self.filled + 1).clamp(max=len(self.slots)), self.filled)
            )
        self.skipped.add_(skip)
        self.consecutive.mul_(skip).add_(skip)  # + 1 when skipped, else back to 0
        if self.max_consecutive > 0:
            self.stopped |= self.consecutive >= self.max_consecutive
        return skip


def poison_one_gradient(params: list[torch.Tensor]) -> None:
    """`debug.inject_nonfinite_step`: a NaN in this rank's first non-empty gradient shard,
    on every rank, as a real overflow would leave one."""
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if g is not None and g.numel():
            g.view(-1)[:1].fill_(float("nan"))  # (not `= nan`: a copy from the host)
            return
