"""Per-step schedules of the paper's runs (reference training spec §1.5), as pure functions of the step.

Pure functions of ``it`` (the 0-based index of the optimizer step about to run) and the horizon ``N`` keep a
resumed run bit-identical to an uninterrupted one: nothing here carries state between steps.
"""

from dataclasses import dataclass

from nanochat.cli_types import flag_name

MUON_MOMENTUM_START = 0.85
MUON_MOMENTUM_END = 0.95
MUON_MOMENTUM_RAMP_STEPS = 300


@dataclass(frozen=True)
class ScheduleConfig:
    num_iterations: int
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.4
    final_lr_frac: float = 0.0
    momentum_start: float = MUON_MOMENTUM_START
    momentum_end: float = MUON_MOMENTUM_END
    momentum_ramp_steps: int = MUON_MOMENTUM_RAMP_STEPS

    def __post_init__(self):
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1 (got {self.num_iterations})")
        for name in ("warmup_ratio", "warmdown_ratio"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{flag_name(name)} must be in [0, 1] (got {v})")
        if self.warmup_ratio + self.warmdown_ratio > 1.0:
            raise ValueError(
                f"--warmup-ratio + --warmdown-ratio must be <= 1 (got {self.warmup_ratio} + {self.warmdown_ratio})"
            )
        if not 0.0 <= self.final_lr_frac <= 1.0:
            raise ValueError(f"--final-lr-frac must be in [0, 1] (got {self.final_lr_frac})")
        if self.momentum_ramp_steps < 0:  # muon_momentum would read it as 0, silently
            raise ValueError(f"--muon-momentum-ramp must be >= 0 steps (got {self.momentum_ramp_steps})")

    @property
    def warmup_iters(self) -> int:
        return round(self.warmup_ratio * self.num_iterations)

    @property
    def warmdown_iters(self) -> int:
        return round(self.warmdown_ratio * self.num_iterations)


def lr_multiplier(it: int, sc: ScheduleConfig) -> float:
    """Linear warmup, flat, then linear warmdown toward final_lr_frac.

    Matches the reference exactly: the last step run is it = N-1, so with final_lr_frac = 0 the last
    multiplier is 1/warmdown_iters, not 0.
    """
    n, wu, wd = sc.num_iterations, sc.warmup_iters, sc.warmdown_iters
    if it < wu:
        return (it + 1) / wu
    if it <= n - wd:
        return 1.0
    progress = (n - it) / wd
    return progress + (1.0 - progress) * sc.final_lr_frac


def muon_momentum(it: int, sc: ScheduleConfig) -> float:
    """Linear ramp momentum_start -> momentum_end over the first momentum_ramp_steps steps, then constant."""
    frac = min(it / sc.momentum_ramp_steps, 1.0) if sc.momentum_ramp_steps > 0 else 1.0
    return (1.0 - frac) * sc.momentum_start + frac * sc.momentum_end


def weight_decay_multiplier(it: int, sc: ScheduleConfig) -> float:
    """Muon weight decay decays linearly to 0 over the run: wd_scaled * (1 - it/N)."""
    return 1.0 - it / sc.num_iterations


def apply_schedules(optimizer, it: int, sc: ScheduleConfig) -> dict[str, float]:
    """Set lr (every group), momentum and weight decay (Muon groups) for step ``it``; return the values used.

    Groups carry their unscheduled values in ``initial_lr`` / ``initial_weight_decay`` (set by
    ``init_schedule_state``) so repeated application never compounds.
    """
    lrm, mom, wdm = lr_multiplier(it, sc), muon_momentum(it, sc), weight_decay_multiplier(it, sc)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = mom
            group["weight_decay"] = group["initial_weight_decay"] * wdm
    return {"lrm": lrm, "muon_momentum": mom, "wd_mult": wdm}


def init_schedule_state(optimizer) -> None:
    """Remember each Muon group's unscheduled (depth-scaled) weight decay; idempotent."""
    for group in optimizer.param_groups:
        if group["kind"] == "muon":
            group.setdefault("initial_weight_decay", group["weight_decay"])
