"""Run-length and batch arithmetic: horizon (steps), gradient accumulation, batch LR scale, the dry-run plan.

Everything here is pure arithmetic on the parsed flags and the model's parameter/FLOP accounting, so the
plan (``--dry-run``) and the real run can never disagree.
"""

import math

B_REF = 2**19  # reference total batch (tokens) at which LRs are tuned; LRs scale by sqrt(B / B_REF)


def grad_accum_steps(total_batch_size: int, device_batch_size: int, seq_len: int, world_size: int) -> int:
    """Micro-steps per optimizer step; raises naming the flags when the batch does not divide."""
    for name, v in (("--total-batch-size", total_batch_size), ("--device-batch-size", device_batch_size),
                    ("--max-seq-len", seq_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1 (got {v})")
    per_micro = device_batch_size * seq_len * world_size
    if total_batch_size % per_micro:
        raise ValueError(
            f"--total-batch-size {total_batch_size} is not divisible by --device-batch-size x --max-seq-len x "
            f"world_size = {device_batch_size} x {seq_len} x {world_size} = {per_micro}; pick a total batch that "
            f"is a multiple of {per_micro} (e.g. {max(1, round(total_batch_size / per_micro)) * per_micro})"
        )
    return total_batch_size // per_micro


def choose_layout(total_batch_size: int, seq_len: int, gpus: int, max_device_batch: int) -> tuple[int, int, int]:
    """(processes, device batch, grad accum) that split ``total_batch_size`` exactly over at most ``gpus`` GPUs.

    The most processes first, then the largest device batch <= ``max_device_batch``: e.g. 524,288 tokens of 2048
    on 6 GPUs -> 4 processes x 32 rows x 2 micro-steps, because no device batch makes 6 processes divide it.
    """
    if gpus < 1 or max_device_batch < 1:
        raise ValueError(f"need >= 1 GPU and a device batch >= 1 (got {gpus} GPUs, device batch {max_device_batch})")
    for nproc in range(gpus, 0, -1):
        for device_batch in range(max_device_batch, 0, -1):
            if total_batch_size % (device_batch * seq_len * nproc) == 0:
                return nproc, device_batch, grad_accum_steps(total_batch_size, device_batch, seq_len, nproc)
    raise ValueError(f"--total-batch-size {total_batch_size} is not a multiple of --max-seq-len {seq_len}: "
                     "no device batch and process count can split it")


def resolve_num_iterations(num_iterations: int | None, target_flops: float | None,
                           target_param_data_ratio: float | None,
                           flops_per_token: int, total_batch_size: int, ratio_params: int) -> tuple[int, str]:
    """Optimizer steps and which flag decided them: --num-iterations > --target-flops > --target-param-data-ratio.

    None (or <= 0) means "not set"; train_args rejects explicit negatives before we get here. The FLOP target
    is converted to steps first; batch size and weight decay then follow the real token count (nanochat derives
    them from the ratio even under a FLOP target; we do not).
    """
    if num_iterations and num_iterations > 0:
        return num_iterations, "num_iterations"
    if target_flops and target_flops > 0:
        n = round(target_flops / (flops_per_token * total_batch_size))
        if n < 1:
            raise ValueError(
                f"--target-flops {target_flops:.3g} buys less than one step "
                f"({flops_per_token:,} FLOPs/token x {total_batch_size:,} tokens/step); raise it or shrink the batch"
            )
        return n, "target_flops"
    if target_param_data_ratio and target_param_data_ratio > 0:
        n = int(target_param_data_ratio * ratio_params) // total_batch_size
        if n < 1:
            raise ValueError(f"--target-param-data-ratio {target_param_data_ratio} gives zero steps")
        return n, "target_param_data_ratio"
    raise ValueError("no horizon: set one of --num-iterations, --target-flops, --target-param-data-ratio (> 0)")


def batch_lr_scale(total_batch_size: int) -> float:
    return math.sqrt(total_batch_size / B_REF)


def build_plan(args, summary: dict, world_size: int) -> dict:
    """The plan dict printed by --dry-run and stored in plan.json / config.json for every run.

    ``summary`` is ``nanochat.gpt.model_summary`` (params_total/memory/backbone/active, flops_per_token). The
    param:data ratio counts backbone params: memory tables are excluded so that adding memory does not buy
    extra data (spec: report scaling, table and total params separately).
    """
    accum = grad_accum_steps(args.total_batch_size, args.device_batch_size, args.max_seq_len, world_size)
    n, source = resolve_num_iterations(args.num_iterations, args.target_flops, args.target_param_data_ratio,
                                       summary["flops_per_token"], args.total_batch_size, summary["params_backbone"])
    total_tokens = n * args.total_batch_size
    return {
        "params_total": summary["params_total"],
        "params_memory": summary["params_memory"],
        "params_backbone": summary["params_backbone"],
        "params_active": summary["params_active"],  # per token (MoE: K of E routed experts; memory: rows read)
        "flops_per_token": summary["flops_per_token"],
        "num_iterations": n,
        "horizon_source": source,
        "total_tokens": total_tokens,
        "total_flops": summary["flops_per_token"] * total_tokens,
        "tokens_per_param_backbone": total_tokens / summary["params_backbone"],
        "total_batch_size": args.total_batch_size,
        "device_batch_size": args.device_batch_size,
        "max_seq_len": args.max_seq_len,
        "grad_accum_steps": accum,
        "world_size": world_size,
        "batch_lr_scale": batch_lr_scale(args.total_batch_size),
        "muon_weight_decay": args.weight_decay * (12 / args.depth) ** 2,
    }
