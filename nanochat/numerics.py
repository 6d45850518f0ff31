"""Opt-in evaluation numerics: ``ours`` (the default) or ``reference`` (the authors' code, for comparing numbers).

``reference`` reproduces the two numerical differences listed in ``../shared/spec/reference_checkpoint_names.md``
that an evaluation of the same weights can see, plus their bits-per-byte bookkeeping and two CORE rules:

1. RoPE tables rounded to bf16 (theirs are cast to bf16 at construction); not for MobileLLM, whose reference
   keeps fp32 tables. The nanochat GPT casts its fp32 tables to q/k's dtype at use, so under bf16 autocast the
   two already agree there and this changes fp32 evaluation only. Qwen3 rotates in fp32 (``rope_half_split``),
   so this changes its bf16 evaluation too, and still does not match the reference's rotation in bf16;
2. MoME selection and weights in the router's output dtype: top-K on sigmoid(l) (softmax(l)), which is bf16
   under bf16 autocast, instead of top-K on l with fp32 weights (``MoMEMemory.reference_gating``);
3. ``token_bytes`` = UTF-8 length of each decoded token (partial UTF-8 counts 3 bytes, as in their file);
4. CORE prompts longer than the context T (``sequence_len``): their evaluator crops to ``model.max_seq_len``, which
   their GPT lacks, so it crops nothing and their rotary table (10 T) bounds the length. Ours crops at the rotary
   table's end instead of at T (``nanochat.core_eval.crop_length``), and the nanochat GPT's L layers get their
   window of T keys (a query at i sees keys i-T..i; S layers keep T//2). Up to T tokens (training, bpb) that window
   is the plain causal path, so only longer forwards change. MobileLLM and Qwen3 attend to the full causal context
   at any length in the reference too (families spec §2.3, §3.2), so only their crop changes. That their classes
   lack max_seq_len as well is an assumption: the spec says it of GPT only, and gives them the same 10 T tables.
5. a CORE multiple-choice option whose scored region is empty (its tokens a prefix of another option's): their
   mean of no losses is NaN and ``min`` keeps a NaN it starts with, so it wins when it is the first option;
   ours never picks it (``nanochat.core_eval.reference_scoring``, keyed on the ``core_crop_len`` mark of 4).

Not reproduced: their bf16 *storage* of wte, memory tables and routers, which makes their residual stream bf16
on CUDA; our weights are fp32 under autocast, so GPU numbers agree to bf16 rounding, not bit for bit.
"""

import torch

NUMERICS = ("ours", "reference")
# the families the authors' code has, and their RoPE tables (families spec §8): MobileLLM keeps fp32 tables,
# nanochat and Qwen3 cast them to bf16. Another family has no reference numerics to reproduce.
REFERENCE_ROPE = {"nanochat": "bf16-rounded", "mobilellm": "fp32", "qwen3": "bf16-rounded"}


def check_numerics(mode: str) -> None:
    if mode not in NUMERICS:
        raise ValueError(f"--numerics {mode!r} is unknown; allowed: {', '.join(NUMERICS)}")


@torch.no_grad()
def apply_numerics(model, mode: str) -> dict:
    """Switch a built (and loaded) model to ``mode``; returns what was changed, for the eval outputs."""
    check_numerics(mode)
    if mode == "ours":
        return {"numerics": "ours"}
    family = model.config.family
    if family not in REFERENCE_ROPE:
        raise ValueError(f"--numerics reference: the authors' code has no --model-type {family} (it has "
                         f"{', '.join(REFERENCE_ROPE)}), so there are no reference numerics to reproduce; use "
                         "--numerics ours")
    if REFERENCE_ROPE[family] == "bf16-rounded":
        for buf in (model.rope_cos, model.rope_sin):
            buf.copy_(buf.to(torch.bfloat16).to(buf.dtype))
    out = {"numerics": "reference", "rotary_tables": REFERENCE_ROPE[family], "token_bytes": "utf8-of-decoded-token"}
    memory = model.memory
    if hasattr(memory, "reference_gating"):
        if memory.opts.routing != "context" or hasattr(memory, "router_bias"):
            raise ValueError("--numerics reference: the authors' code evaluates learned routers without a "
                             f"router bias (this model: --mome-routing {memory.opts.routing}, "
                             f"--mome-balance {memory.opts.balance})")
        memory.reference_gating = True
        out["mome_gating"] = "topk-on-scores-in-router-dtype"
    out.update(_reference_long_prompts(model))
    return out


def _reference_long_prompts(model) -> dict:
    """Item 4 of the module docstring: CORE prompts cropped only at the rotary table's end, and each nanochat L
    layer limited to T keys; what was set, for the eval outputs (and so the resume fingerprint)."""
    T = model.config.sequence_len
    model.core_crop_len = model.rotary_len  # read by nanochat.core_eval.crop_length
    out = {"core_crop": f"left to the rotary table's {model.rotary_len} tokens (theirs crops nothing)"}
    if model.config.family != "nanochat":  # apply_numerics refused the families the authors' code lacks
        out["attention_windows"] = "full causal at any length, as theirs"
        return out
    for block, window in zip(model.blocks, model.config.attention_windows):
        block.attn.window = T if window is None else window  # their L layer: flash window_size=(T, 0)
    has_s = any(w is not None for w in model.config.attention_windows)
    out["attention_windows"] = f"L {T} keys before each query" + (f", S {T // 2}" if has_s else "")
    return out


def eval_token_bytes(tokenizer, mode: str) -> torch.Tensor:
    """The bits-per-byte denominators for ``mode`` (ours: raw token bytes)."""
    check_numerics(mode)
    if mode == "ours":
        return tokenizer.token_bytes()
    from nanochat.reference_tokenizer import reference_token_bytes

    return reference_token_bytes(tokenizer)
