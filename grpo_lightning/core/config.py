"""Every GRPO option in one documented place, checked before any model loads.

Each option is declared once, by its annotation: its type, its choices (`Literal`, made of the registry that
implements them) and its range (`Range`), which jsonargparse reads and `--help` prints, and which
`check_fields` checks when the config is built. Only rules between options are written out, in
`__post_init__`.
"""

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Annotated, Literal

from grpo_lightning.core.algorithm.advantages import Baseline, ScaleRewards
from grpo_lightning.core.algorithm.kl import K1_IN_LOSS, KLEstimator
from grpo_lightning.core.algorithm.loss import ImportanceSamplingLevel, LossType
from grpo_lightning.core.algorithm.sampler_correction import ImportanceSamplingMode
from grpo_lightning.core.algorithm.schedules import ScheduleType
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.options import Range, check_fields, option_error

# The ranges several options share.
PositiveInt = Annotated[int, Range("> 0")]
NonNegativeInt = Annotated[int, Range(">= 0")]
AtLeastOne = Annotated[int, Range(">= 1")]
PositiveFloat = Annotated[float, Range("> 0")]
NonNegativeFloat = Annotated[float, Range(">= 0")]


@dataclass
class GRPOConfig:
    """Options of the GRPO algorithm (defaults follow TRL's `GRPOConfig` where both have the option).

    Each option is documented under its declaration (`--help` and `--print_config` show it) and checked
    when the config is built, against its annotation (type, `Literal` choices, `Range`).
    """

    # -------------------------------------------------------------------------------------------- sampling
    num_generations: Annotated[int, Range(">= 2", why="advantages compare a group")] = 8
    """Completions sampled per prompt, the group size G (DeepSeekMath, arXiv:2402.03300, sec. 4.1.2). Must be
    >= 2: advantages are relative to the group.
    """
    max_completion_length: PositiveInt = 256
    """New tokens per completion."""
    min_completion_length: NonNegativeInt = 0
    """EOS is suppressed until this many new tokens (`generate`'s `min_new_tokens`); equal to
    `max_completion_length` it fixes the length, as benchmarks need. Above 0 the first tokens are drawn
    without EOS while the loss scores them under the raw policy, so the importance ratio there is
    off-policy by the EOS probability: keep 0 for training runs.
    """
    max_prompt_length: PositiveInt | None = 512
    """Prompt tokens kept; longer prompts are cut from the left. None keeps all."""
    truncate_prompts: Literal["left", "error"] = "left"
    """What to do with a prompt over `max_prompt_length`: "left" (cut its start, with a warning) or "error".
    """
    temperature: PositiveFloat = 1.0
    """Sampling temperature, > 0. The same temperature scales the logits of the log-probs, as the sampler saw
    them.
    """
    top_p: Annotated[float, Range("> 0, <= 1")] = 1.0
    """Nucleus sampling: draw from the most likely tokens whose probabilities sum to top_p, in (0, 1]; 1.0
    disables it.
    """
    top_k: Annotated[int, Range(">= 0", why="0 disables it")] = 0
    """Draw from the k most likely tokens only; 0 disables it."""
    dynamic_sampling: bool = False
    """Drop the groups whose completions all got the same reward (they carry no gradient) and sample the next
    batches' prompts until an update has one informative group per prompt of a batch (DAPO,
    arXiv:2503.14476, sec. 3.2). Rounds without an update make no optimizer step, so `max_steps` still
    counts updates. Logs `train/dynamic_sampling/frac_dropped` and `train/dynamic_sampling/extra_rounds`.
    """
    dynamic_sampling_max_rounds: NonNegativeInt = 9
    """Extra generation rounds an update may wait for; after them it is topped up with uninformative groups
    (verl's DAPO recipe stops with an error after 10 rounds, `max_num_gen_batches=10`).
    """
    dynamic_sampling_metric: str | None = "accuracy_reward"
    """The reward function (by name, as logged under `train/rewards/<name>`) whose values decide whether a
    group carries signal, as the DAPO paper filters on accuracy (verl:
    `algorithm.filter_groups.metric=acc`); None filters on the weighted total of the reward functions,
    before any KL in the reward. With a shaped total such as accuracy + format, an all-wrong group that
    differs only in format passes a total-reward filter, and updates made of such groups can teach the
    format while accuracy falls (BENCHMARKS.md measured it).
    """
    # ------------------------------------------------------------------------------------------ advantages
    scale_rewards: ScaleRewards = "group"
    """"group" divides the centred reward by the group's std (GRPO), "batch" by the batch's (Hu et al.,
    REINFORCE++, arXiv:2501.03262), "none" only centres (Dr. GRPO, arXiv:2503.20783).
    """
    baseline: Baseline = "mean"
    """"mean" (group mean, GRPO) or "loo" (leave-one-out, RLOO, arXiv:2402.14740)."""
    advantage_clip: PositiveFloat | None = None
    """Clamp advantages to [-c, c]. None: no clipping."""
    step_credit: Annotated[float, Range(">= 0", why="it is subtracted from the advantage")] = 0.0
    """Token-level credit for wrong steps: each generated token that writes part of an arithmetic claim that
    does not verify (`grpo_lightning.core.rewards.steps`, e.g. "3 + 4 = 8") gets this much subtracted from its
    completion's outcome advantage, making the advantages [B, T] (process supervision at the step, as
    Lightman et al. arXiv:2305.20050 and Math-Shepherd arXiv:2312.08935 assign it, from a verifier instead
    of a learned reward model). 0.0 turns it off.
    """
    # ------------------------------------------------------------------------------------------------ loss
    loss_type: LossType = "dapo"
    """"grpo" (mean of per-sequence token means, arXiv:2402.03300 eq. 3), "bnpo"/"dapo" (token mean over the
    batch, DAPO arXiv:2503.14476 eq. 8), "dr_grpo" (token sum / (B * L_max), arXiv:2503.20783), "cispo"
    (clipped IS-weight policy gradient, MiniMax-M1 arXiv:2506.13585).
    """
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """"token" or "sequence" (GSPO, arXiv:2507.18071)."""
    importance_sampling_correction: bool = False
    """Correct for the rollout engine's sampler not being the policy the loss scores: weight each token's
    policy term by min(pi_old / pi_sampler, importance_sampling_cap), detached (truncated importance
    sampling, TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"; `core.algorithm.sampler_correction.importance_weights`). pi_sampler is each token's log-prob as
    it was drawn (after temperature, top-k/top-p, min_completion_length), pi_old the scorer's before the
    update; where they are equal nothing changes. Every step logs the gap (`rollout/logp_gap_mean`, `_max`,
    `_frac_above`), and with the correction `rollout/is_weight_mean` and `_frac_capped`. Off by default:
    both engines sample the policy they score up to rounding, and on the demo the correction learned no
    better (BENCHMARKS.md, "The demo in bf16-mixed"). Turn it on where `rollout/logp_gap_frac_above` is
    material, or with top_p/top_k/min_completion_length, whose truncation is a gap by design. TRL's
    `vllm_importance_sampling_mode="token_truncate"` (TRL corrects by default with vLLM only, in mode
    "sequence_mask"); verl: `algorithm.rollout_is` with `rollout_is_level: token`, `rollout_is_mode:
    truncate`.
    """
    importance_sampling_cap: Annotated[float, Range(">= 1", why="below 1 it shrinks on-policy tokens")] = 2.0
    """The truncation C of `importance_sampling_correction`'s weights; 2.0 as Yao et al. 2025 (TRL's
    `vllm_importance_sampling_clip_max` defaults to 3.0, verl's `rollout_is_threshold` to 2.0).
    """
    importance_sampling_mode: ImportanceSamplingMode = "token_truncate"
    """How `importance_sampling_correction` bounds the ratio pi_old / pi_sampler, as TRL's
    `vllm_importance_sampling_mode`: "token_truncate" (each token's ratio clipped into
    [importance_sampling_floor, importance_sampling_cap], Yao et al.'s TIS), "token_mask" (a token whose
    ratio is outside drops out of the loss), "sequence_truncate" / "sequence_mask" (one ratio per
    completion, the product over its tokens, clipped, or the whole completion dropped; TRL's default with
    vLLM is "sequence_mask"). `core.algorithm.sampler_correction.importance_weights`.
    """
    importance_sampling_floor: Annotated[float, Range("> 0, <= 1")] | None = None
    """The lower bound of `importance_sampling_mode`'s ratio (a floor for the truncate modes, below it
    masked for the mask modes); None: no lower bound. TRL: `vllm_importance_sampling_clip_min`.
    """
    epsilon: PositiveFloat = 0.2
    """Lower clip of the ratio, 1 - epsilon (PPO, arXiv:1707.06347)."""
    epsilon_high: PositiveFloat | None = None
    """Upper clip, 1 + epsilon_high (DAPO's clip-higher; for cispo the raw cap of the IS weight). None means
    epsilon, or for cispo 5.0 (TRL's recommended value, ScaleRL arXiv:2510.13786; TRL itself falls back to
    epsilon, a cap of 0.2 that shrinks every weight).
    """
    delta: Annotated[float, Range("> 1")] | None = None
    """Cap of the unclipped ratio, two-sided clipping (INTELLECT-2, arXiv:2505.07291)."""
    beta: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the frozen reference; 0 loads no reference at all. 0.0 as TRL and DAPO
    (DeepSeekMath used 0.04).
    """
    kl_estimator: KLEstimator = "k3"
    """"k1", "k2" or "k3", estimates of KL(pi || pi_ref) per token (Schulman, "Approximating KL divergence",
    2020); "k3" as TRL and DeepSeekMath eq. 4. In the loss (beta > 0 without use_kl_in_reward) k1 is
    refused: its gradient, grad log pi, has mean zero under the policy, so it regularises nothing. k2's
    gradient is the reverse KL's, KL(pi || pi_ref); k3's the forward KL's, KL(pi_ref || pi), unless
    use_bias_correction_kl makes it the reverse KL's. k1 is for use_kl_in_reward.
    """
    use_bias_correction_kl: bool = True
    """Multiply each token's KL term by the importance ratio pi / pi_old, gradient included (at
    importance_sampling_level "sequence", the sequence's ratio): k3's gradient is then the reverse KL's,
    KL(pi || pi_ref), on-policy and off (DeepSeek-V3.2, arXiv:2512.02556). On-policy the ratio is 1, so the
    loss is the same and its gradient is not. True as TRL's `use_bias_correction_kl`, whose KL is k3; with
    k2, whose gradient is the reverse KL's already on-policy, it becomes E_pi[k2]'s: set false to keep it.
    Acts on the KL in the loss only (beta > 0 without use_kl_in_reward).
    """
    use_kl_in_reward: bool = False
    """Put the KL in the reward instead of the loss, as verl's `algorithm.use_kl_in_reward`: reward_i -= beta
    * sum over the completion's tokens of the `kl_estimator` estimate (sampling policy vs reference),
    before the advantages; the loss then has no KL term. Needs beta > 0. verl pairs it with k1
    (`algorithm.kl_penalty: kl`): set kl_estimator "k1" to match.
    """
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, loss - coef * mean token entropy (negative: a penalty)."""
    num_iterations: AtLeastOne = 1
    """Optimisation passes over each rollout, PPO's mu (arXiv:2402.03300 alg. 1), each over its
    `steps_per_generation` mini-batches. With mu > 1 the sampling-time log-probs are kept as the old
    policy's.
    """
    steps_per_generation: AtLeastOne = 1
    """Optimizer steps per rollout: the rollout's groups (one per prompt of the batch) are shuffled, from
    the training random stream that checkpoints keep, and cut into this many mini-batches of whole groups,
    one optimizer step each; with `num_iterations` = mu, mu passes over them (a new shuffle each), so a
    training step makes steps_per_generation x mu optimizer steps, each counted by the trainer's
    `global_step` and `max_steps`, the learning-rate schedule and `ref_model_sync_steps`. Advantages are
    computed over the whole rollout before the cut; the sampling policy's log-probs are taken at rollout
    time, so from the second step on the clipped ratio compares the updated policy with the one that
    sampled. Each step normalises its loss over its own mini-batch (dapo/bnpo: the mini-batch's loss tokens
    on all ranks; grpo: its sequences; dr_grpo: its sequences x max_completion_length), as TRL and verl do.
    A batch must hold at least this many prompts. Checkpoints fall between training steps, so never
    between two mini-batches of one rollout: set `every_n_train_steps` of a `ModelCheckpoint` to a multiple
    of steps_per_generation x num_iterations. TRL: `steps_per_generation` counts forward/backward passes of
    `per_device_train_batch_size` completions, `gradient_accumulation_steps` of them to an optimizer step,
    so this option is TRL's steps_per_generation / gradient_accumulation_steps, and TRL's
    `generation_batch_size` (completions on all processes) is data.batch_size x num_generations x processes
    here; verl: `ppo_mini_batch_size` (prompts) = data.batch_size / steps_per_generation. 1: one optimizer
    step per rollout.
    """
    mask_truncated_completions: bool = False
    """Drop completions that never stopped from the loss (DAPO sec. 3.4)."""
    # ---------------------------------------------------------------------------------------- optimisation
    learning_rate: Annotated[float, Range("> 0", why="at 0 no weight ever changes")] = 1e-6
    """AdamW learning rate; 1e-6 is TRL's GRPO default."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up optimizer steps, then the `lr_scheduler_type` schedule."""
    lr_scheduler_type: ScheduleType = "constant"
    """The learning rate after the warm-up: "constant", or decaying over the rest of the run's optimizer
    steps to `min_lr_ratio` x learning_rate, "linear" or "cosine" (SGDR, arXiv:1608.03983); formulas in
    `grpo_lightning.core.algorithm.schedules`. The run's length is the trainer's max_steps (optimizer
    steps), or its
    epochs x batches x num_iterations x steps_per_generation. TRL: `lr_scheduler_type` (its
    "constant_with_warmup" is "constant" here); verl: `optim.lr_scheduler_type`.
    """
    min_lr_ratio: Annotated[float, Range(">= 0, <= 1", why="a share of learning_rate")] = 0.0
    """The floor of a decaying schedule, as a share of learning_rate, reached at the last step; ignored by
    "constant". verl: `optim.min_lr_ratio`; TRL: `lr_scheduler_kwargs={"min_lr_rate": ...}` with
    "cosine_with_min_lr".
    """
    max_grad_norm: Annotated[float, Range("> 0", why="a negative norm flips the gradient")] | None = 1.0
    """Gradient clipping by global norm, > 0; None disables."""
    micro_batch_size: AtLeastOne | None = None
    """Sequences per forward/backward; each optimizer step's rows (the rollout of prompts x G sequences, or
    its mini-batch with `steps_per_generation`) are split and the gradients accumulated, with the loss
    normalised over all of them, and every micro-batch padded to the rollout's longest row. None: all at
    once.
    """
    max_tokens_per_micro_batch: AtLeastOne | None = None
    """A token budget per micro-batch instead of `micro_batch_size` rows, in the policy update (within each
    optimizer step's rows) and the reference and old-policy passes: rows of similar length go together,
    each micro-batch holding as many as fit in rows x its longest row's tokens (prompt + completion) <= this
    budget, and padded only to its own longest row; with `share_prompt` a prompt's G rows stay in one
    micro-batch. A row (or shared group) longer than the budget alone gets a micro-batch of its own. Under
    DDP or FSDP each rank runs as many micro-batches as the busiest one (each forward/backward
    synchronises them), splitting its widest. The loss and gradients are those of the fixed-size path
    (tests/test_token_budget.py).
    Partition: `grpo_lightning.core.algorithm.token_budget`. Excludes `micro_batch_size`; must be >=
    `max_completion_length`. None: `micro_batch_size`. verl: `use_dynamic_bsz` with
    `ppo_max_token_len_per_gpu`; OpenRLHF: `dynamic_batch_enable`.
    """
    max_bad_steps: AtLeastOne = 3
    """Stop after this many consecutive steps whose loss is not finite (each is skipped)."""
    sync_ref_model: bool = False
    """Move the reference towards the policy every `ref_model_sync_steps` optimizer steps: reference <- alpha
    x policy + (1 - alpha) x reference (TR-DPO, Gorbatovski et al., arXiv:2404.09656;
    `grpo_lightning.core.algorithm.reference_sync`). Needs beta > 0 (a reference to sync) and full
    fine-tuning (with LoRA the reference is the policy's own base weights). The reference is then stored in
    checkpoints. TRL: `sync_ref_model`.
    """
    ref_model_mixup_alpha: Annotated[float, Range(">= 0, <= 1", why="the policy's share")] = 0.6
    """The policy's weight alpha in each sync, in [0, 1]; 1 copies the policy. 0.6 is TRL's default. TRL:
    `ref_model_mixup_alpha`.
    """
    ref_model_sync_steps: AtLeastOne = 512
    """Optimizer steps between syncs; each sync is applied before the next rollout. 512 is TRL's default.
    TRL: `ref_model_sync_steps`.
    """
    # ----------------------------------------------------------------------------------------------- speed
    share_prompt: bool = True
    """Encode each prompt once per group instead of once per completion, in generation (one prefill per
    prompt, its KV cache repeated to the G rows) and in the reference, old-policy and policy passes (the G
    completions attend to one prompt pass, whose gradient sums theirs); Prefix Grouper, arXiv:2506.05433.
    Same log-probs and gradients up to rounding (tests/test_share_prompt.py). A model that cannot share
    (attention without a KV cache, a sliding window in any layer, gradient checkpointing in transformers < 5)
    keeps the unshared path, with a warning.
    """
    packed_sequences: bool = True
    """Pack the reference, old-policy and policy passes: each micro-batch's rows laid end to end in a few
    lines (their prompts and completions, padding only where a line ends), kept apart by one attention
    mask, with position ids restarting at each row; with `share_prompt` a line holds a group's prompt once
    and several of its completions. The LM head runs on the completion tokens only. Same log-probs and
    gradients up to rounding (tests/test_packing.py). On MATH-like rollouts with `share_prompt` and the
    token budget the decoder computes 0.99 positions per token of the rows instead of 1.58
    (`benchmarks/token_budget.py --group`). Needs sdpa or eager attention and full attention in every layer:
    another model (flash attention, a sliding window in any layer) keeps the padded passes, with a warning
    (`grpo_lightning.core.generation.packing`). TRL: `padding_free`; verl: `use_remove_padding`.
    """
    generation_backend: Literal["auto", "eager", "static", "vllm"] = "auto"
    """How rollouts are decoded (`grpo_lightning.training.backends`, one entry per engine). "eager":
    `generate` on the training policy with a dynamic KV cache
    (`grpo_lightning.core.generation.engines.EagerEngine`, the reference path). "static": `generate` with a
    static KV cache on an inference copy of the policy that computes as the loss's scorer does (linear
    weights in the compute dtype, LoRA adapters unmerged, under the trainer's autocast), refreshed in place
    once before each rollout after the weights changed, its decoding step compiled once with CUDA graphs on
    CUDA and run uncompiled on CPU (`grpo_lightning.core.generation.static_engine`); it costs the copy and
    one KV cache (both in the pre-flight's memory estimate) and a compile warm-up per batch shape. Both stop
    decoding finished rows once at most half of a batch of more than 8 rows is live. "vllm": a colocated
    vLLM engine on every rank, pushed the policy's weights before each rollout after they changed
    (`grpo_lightning.core.generation.vllm_engine`; options `vllm_*` below). "auto" (the default): "vllm"
    on CUDA where vLLM imports, else "static" on CUDA; "eager" elsewhere, since on CPU compiling decodes no
    faster and the uncompiled copy is within a few percent of eager (BENCHMARKS.md, "Decoding"). A model
    the static path cannot serve (sliding-window or linear-attention layers, a quantized base, DoRA) falls
    back to "eager" with one warning; a model with a sliding window (`sliding_window`, or `layer_types`:
    `sampling.not_full_attention`) gets one warning for the three options it turns off.
    """
    # ------------------------------------------------------------------------------------------------ vllm
    vllm_max_model_len: PositiveInt | None = None
    """`generation_backend: vllm`: the longest prompt + completion one request may hold (vLLM's
    `max_model_len`); None: max_prompt_length + max_completion_length, or the model's
    `max_position_embeddings` without a max_prompt_length. TRL: `vllm_max_model_length`.
    """
    vllm_kv_cache_gb: PositiveFloat | None = None
    """`generation_backend: vllm`: the KV pool in GB per rank (vLLM's `kv_cache_memory_bytes`). None: on CUDA
    vLLM sizes it from `vllm_gpu_memory_utilization`; on CPU 1 GB (vLLM's own CPU default,
    `VLLM_CPU_KVCACHE_SPACE`, is several GB). The pre-flight's memory estimate counts it.
    """
    vllm_gpu_memory_utilization: Annotated[float, Range("> 0, <= 1")] = 0.3
    """`generation_backend: vllm` on CUDA: the share of each GPU's memory vLLM takes for its weights and KV
    pool when `vllm_kv_cache_gb` is None, beside the trainer's; 0.3 as TRL's colocate default. TRL:
    `vllm_gpu_memory_utilization`.
    """
    vllm_enable_sleep_mode: bool = False
    """`generation_backend: vllm` on CUDA: between rollouts vLLM frees its KV pool and offloads its weights
    to CPU memory (`LLM.sleep(level=1)`), and wakes before the next push, so the update has the GPU to
    itself; costs the offload and reload each step. Ignored on CPU (sleep mode is CUDA-only). TRL:
    `vllm_enable_sleep_mode`.
    """
    vllm_enforce_eager: bool = False
    """`generation_backend: vllm`: no `torch.compile` of vLLM's model and no CUDA graphs: a faster start,
    slower decoding (vLLM's `enforce_eager`). TRL: none.
    """
    cpu_offload: bool = False
    """FSDP2 only (`ModelParallelStrategy`): keep the parameter shards, their gradients and the AdamW state
    in CPU memory, copied to the GPU per layer for forward and backward
    (`torch.distributed.fsdp.CPUOffloadPolicy`); the optimizer step runs on the CPU. Frees the GPU of
    everything but activations, the rollout's gathered weights and KV cache, for a slower step (the
    pre-flight prints the estimate per GPU). verl: `actor.fsdp_config.param_offload` /
    `optimizer_offload`; TRL: DeepSpeed/FSDP `offload_params` in its accelerate config.
    """
    # --------------------------------------------------------------------------------------------- logging
    log_completions_every: Annotated[int, Range(">= 0", why="0 disables the panels")] = 50
    """Steps between TensorBoard text panels of sample completions; 0 disables."""
    preflight: bool = True
    """Before the first step, sample a few completions and report the effective batch, the share cut off by
    `max_completion_length`, the reward audit and LoRA's input gradients in one block
    (`grpo_lightning.training.preflight`).
    """

    @property
    def optimizer_steps_per_batch(self) -> int:
        """The optimizer steps of one training step: num_iterations x steps_per_generation."""
        return self.num_iterations * self.steps_per_generation

    def sampling_settings(
        self, eos_token_ids: Sequence[int], pad_token_id: int, share_prompt: bool
    ) -> SamplingSettings:
        """The settings of the training rollouts: their lengths, temperature, top-p and top-k."""
        return SamplingSettings(
            max_new_tokens=self.max_completion_length,
            min_new_tokens=self.min_completion_length,
            eos_token_ids=tuple(eos_token_ids),
            pad_token_id=pad_token_id,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            share_prompt=share_prompt,
        )

    def __post_init__(self) -> None:
        check_fields(self)

        def bad(option: str, value: object, rule: str) -> ValueError:
            return option_error(self, option, value, rule)

        # Rules that relate two options.
        if self.min_completion_length > self.max_completion_length:
            raise bad("min_completion_length", self.min_completion_length, "must be <= max_completion_length")
        if self.delta is not None and self.delta <= 1 + (self.epsilon_high or self.epsilon):
            raise bad("delta", self.delta, "must be > 1 + epsilon_high (it caps ratios above the clip range)")
        if self.use_kl_in_reward and self.beta == 0:
            raise bad("use_kl_in_reward", True, "needs beta > 0 (beta weighs the KL charged to the reward)")
        if self.kl_estimator == "k1" and self.beta > 0 and not self.use_kl_in_reward:
            raise bad("kl_estimator", "k1", K1_IN_LOSS)
        if self.sync_ref_model and self.beta == 0:
            raise bad("sync_ref_model", True, "needs beta > 0 (with beta 0 there is no reference to sync)")
        for option, (needed, applies) in INERT_UNLESS.items():
            if getattr(self, option) != _DEFAULTS[option] and not applies(self):
                value = getattr(self, option)
                warnings.warn(f"GRPOConfig.{option}={value!r} has no effect without {needed}", stacklevel=3)
        budget = self.max_tokens_per_micro_batch
        if budget is not None and self.micro_batch_size is not None:
            raise bad("max_tokens_per_micro_batch", budget, "set it or micro_batch_size, not both")
        if budget is not None and budget < self.max_completion_length:
            raise bad(
                "max_tokens_per_micro_batch",
                budget,
                f"must be >= max_completion_length={self.max_completion_length} (a row at the limit alone)",
            )


# Options that do nothing unless another is set: that other setting, and the test that it is. Set alone,
# each is warned about, naming both.
INERT_UNLESS = {
    "ref_model_sync_steps": ("sync_ref_model: true", lambda c: c.sync_ref_model),
    "ref_model_mixup_alpha": ("sync_ref_model: true", lambda c: c.sync_ref_model),
    "dynamic_sampling_max_rounds": ("dynamic_sampling: true", lambda c: c.dynamic_sampling),
    "dynamic_sampling_metric": ("dynamic_sampling: true", lambda c: c.dynamic_sampling),
    "min_lr_ratio": ("lr_scheduler_type: linear or cosine", lambda c: c.lr_scheduler_type != "constant"),
    "kl_estimator": ("beta > 0", lambda c: c.beta > 0),
    "use_bias_correction_kl": (
        "beta > 0 and the KL in the loss (use_kl_in_reward: false)",
        lambda c: c.beta > 0 and not c.use_kl_in_reward,
    ),
    "importance_sampling_cap": (
        "importance_sampling_correction: true",
        lambda c: c.importance_sampling_correction,
    ),
}
_DEFAULTS = {f.name: f.default for f in fields(GRPOConfig)}
