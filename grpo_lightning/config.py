"""Every GRPO option in one documented place, checked before any model loads."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo")
SCALES = ("group", "batch", "none")
BASELINES = ("mean", "loo")
KL_ESTIMATORS = ("k1", "k2", "k3")
GENERATION_BACKENDS = ("auto", "eager", "static")


# ------------------------------------------------------------------------------------------ option rules
_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list of names",
}


@dataclass(frozen=True)
class Rule:
    """What one option accepts: its type, bounds such as "> 0, <= 1", or a set of choices.

    Args:
        kind: int, float (ints accepted, NaN and inf refused), bool, str, or list (a list of strings); a
            tuple of them for an option of several types.
        bounds: comma-separated comparisons that the value must pass, e.g. ">= 2" or "> 0, <= 1".
        choices: the only values allowed.
        none: None is allowed (it means what the option's docstring says).
        why: the reason, shown after the rule.
    """

    kind: type | tuple[type, ...]
    bounds: str = ""
    choices: tuple[str, ...] = ()
    none: bool = False
    why: str = ""

    def problem(self, value: object) -> str | None:
        """None when `value` is allowed, else the rule it breaks ("must be > 0 and <= 1 (why)")."""
        if value is None:
            return None if self.none else self.expected(type_too=False)
        if not any(_is_kind(value, kind) for kind in self.kinds):
            return self.expected(type_too=True)
        if self.choices and value not in self.choices:
            return self.expected(type_too=False)
        for text in filter(None, (b.strip() for b in self.bounds.split(","))):
            op, bound = text.split()
            if not _COMPARE[op](value, float(bound)):
                return self.expected(type_too=False)
        return None

    @property
    def kinds(self) -> tuple[type, ...]:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)

    def expected(self, type_too: bool) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            bounds = " and ".join(b.strip() for b in self.bounds.split(",") if b.strip())
            if bounds and not type_too:
                text = bounds
            else:
                kind = " or ".join(_KIND_WORDS[k] for k in self.kinds)
                kind = kind.replace("a number", "a finite number")
                text = f"{kind} {bounds}".rstrip()
        text = f"must be {text}" + (" or None" if self.none else "")
        return f"{text} ({self.why})" if self.why else text


def _is_kind(value: object, kind: type) -> bool:
    if kind is float:  # ints are numbers too, booleans are not; NaN and inf pass no bound: refused
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
    return isinstance(value, kind)


def option_error(options: object, option: str, value: object, rule: str) -> ValueError:
    """The one message format of a bad option: `Class.option=value: rule`."""
    return ValueError(f"{type(options).__name__}.{option}={value!r}: {rule}")


def option_differences(
    saved: Mapping, current: Mapping, prefix: str = ""
) -> list[tuple[str, object, object]]:
    """(dotted name, saved value, current value) for each option of `saved` whose value differs in `current`;
    option dataclasses and dicts on both sides are compared option by option ("grpo.top_p"). Names starting
    with "_" are Lightning's bookkeeping (`_instantiator`), not options."""
    rows = []
    for key, theirs in saved.items():
        if key.startswith("_"):
            continue
        theirs, ours = plain_options(theirs), plain_options(current.get(key))
        if isinstance(theirs, dict) and isinstance(ours, dict):
            rows += option_differences(theirs, ours, f"{prefix}{key}.")
        elif theirs != ours:
            rows.append((prefix + key, theirs, ours))
    return rows


def plain_options(value: object) -> object:
    """An option dataclass as a dict (nested), anything else as it is."""
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


def check_options(options: object, rules: dict[str, Rule]) -> None:
    """Raise `option_error` for the first option of the dataclass `options` that breaks its rule."""
    for field in fields(options):
        value = getattr(options, field.name)
        problem = rules[field.name].problem(value)
        if problem is not None:
            raise option_error(options, field.name, value, problem)


@dataclass
class GRPOConfig:
    """Options of the GRPO algorithm (defaults follow TRL's `GRPOConfig` where both have the option).

    Each option is checked when the config is built, against its rule in `GRPO_RULES`.

    Sampling:
        num_generations: completions sampled per prompt, the group size G (DeepSeekMath, arXiv:2402.03300,
            sec. 4.1.2). Default 8. Must be >= 2: advantages are relative to the group.
        max_completion_length: new tokens per completion. Default 256.
        min_completion_length: EOS is suppressed until this many new tokens (`generate`'s `min_new_tokens`);
            equal to `max_completion_length` it fixes the length, as benchmarks need. Default 0. Above 0
            the first tokens are drawn without EOS while the loss scores them under the raw policy, so the
            importance ratio there is off-policy by the EOS probability: keep 0 for training runs.
        max_prompt_length: prompt tokens kept; longer prompts are cut from the left. None keeps all.
            Default 512.
        truncate_prompts: what to do with a prompt over `max_prompt_length`: "left" (cut its start, with a
            warning) or "error". Default "left".
        temperature / top_p / top_k: sampling (temperature > 0, top_p in (0, 1]); top_k 0 disables it.
            Defaults 1.0 / 1.0 / 0. The same temperature scales the logits of the log-probs, as the sampler
            saw them.
        dynamic_sampling: drop the groups whose completions all got the same reward (they carry no
            gradient) and sample the next batches' prompts until an update has one informative group per
            prompt of a batch (DAPO, arXiv:2503.14476, sec. 3.2). Rounds without an update make no optimizer
            step, so `max_steps` still counts updates. Logs `train/dynamic_sampling/frac_dropped` and
            `train/dynamic_sampling/extra_rounds`. Default False.
        dynamic_sampling_metric: the reward function (by name, as logged under `train/rewards/<name>`)
            whose values decide whether a group carries signal, as the DAPO paper filters on accuracy
            (verl: `algorithm.filter_groups.metric=acc`); None filters on the weighted total of the reward
            functions, before any KL in the reward. With a shaped total such as accuracy + format, an
            all-wrong group that differs only in format passes a total-reward filter, and updates made
            of such groups can teach the format while accuracy falls (BENCHMARKS.md measured it).
            Default "accuracy_reward".
        dynamic_sampling_max_rounds: extra generation rounds an update may wait for; after them it is
            topped up with uninformative groups (verl's DAPO recipe stops with an error after 10 rounds,
            `max_num_gen_batches=10`). Default 9.

    Advantages:
        scale_rewards: "group" divides the centred reward by the group's std (GRPO), "batch" by the batch's
            (Hu et al., REINFORCE++, arXiv:2501.03262), "none" only centres (Dr. GRPO, arXiv:2503.20783).
            Default "group".
        baseline: "mean" (group mean, GRPO) or "loo" (leave-one-out, RLOO, arXiv:2402.14740). Default "mean".
        advantage_clip: clamp advantages to [-c, c]. Default None (no clipping).
        step_credit: token-level credit for wrong steps: each generated token that writes part of an
            arithmetic claim that does not verify (`grpo_lightning.steps`, e.g. "3 + 4 = 8") gets this
            much subtracted from its completion's outcome advantage, making the advantages [B, T]
            (process supervision at the step, as Lightman et al. arXiv:2305.20050 and Math-Shepherd
            arXiv:2312.08935 assign it, from a verifier instead of a learned reward model). Default 0.0 (off).

    Loss:
        loss_type: "grpo" (mean of per-sequence token means, arXiv:2402.03300 eq. 3), "bnpo"/"dapo" (token
            mean over the batch, DAPO arXiv:2503.14476 eq. 8), "dr_grpo" (token sum / (B * L_max),
            arXiv:2503.20783), "cispo" (clipped IS-weight policy gradient, MiniMax-M1 arXiv:2506.13585).
            Default "dapo".
        importance_sampling_level: "token" or "sequence" (GSPO, arXiv:2507.18071). Default "token".
        epsilon: lower clip of the ratio, 1 - epsilon (PPO, arXiv:1707.06347). Default 0.2.
        epsilon_high: upper clip, 1 + epsilon_high (DAPO's clip-higher; for cispo the raw cap of the
            IS weight). Default None = epsilon, or for cispo 5.0 (TRL's recommended value, ScaleRL
            arXiv:2510.13786; TRL itself falls back to epsilon, a cap of 0.2 that shrinks every weight).
        delta: cap of the unclipped ratio, two-sided clipping (INTELLECT-2, arXiv:2505.07291). Default None.
        beta: weight of the KL penalty to the frozen reference; 0 loads no reference at all. Default 0.0
            (as TRL and DAPO; DeepSeekMath used 0.04).
        kl_estimator: "k1", "k2" or "k3" (Schulman, "Approximating KL divergence", 2020). Default "k3".
            In the loss (beta > 0 without use_kl_in_reward) k1 is refused when the config is built: its
            gradient, grad log pi, has mean zero under the policy, so it regularises nothing; k2's gradient
            is the KL's own, k3's the reverse KL's. k1 is for use_kl_in_reward.
        use_kl_in_reward: put the KL in the reward instead of the loss, as verl's
            `algorithm.use_kl_in_reward`: reward_i -= beta * sum over the completion's tokens of the
            `kl_estimator` estimate (sampling policy vs reference), before the advantages; the loss then
            has no KL term. Needs beta > 0. verl pairs it with k1 (`algorithm.kl_penalty: kl`): set
            kl_estimator "k1" to match. Default False.
        entropy_coef: weight of the entropy bonus, loss - coef * mean token entropy (negative: a penalty).
            Default 0.0.
        num_iterations: optimisation passes over each rollout, PPO's mu (arXiv:2402.03300 alg. 1). With
            mu > 1 the sampling-time log-probs are kept as the old policy's. Default 1.
        mask_truncated_completions: drop completions that never stopped from the loss (DAPO sec. 3.4).
            Default False.

    Speed:
        share_prompt: encode each prompt once per group instead of once per completion, in generation
            (one prefill per prompt, its KV cache repeated to the G rows) and in the reference, old-policy
            and policy passes (the G completions attend to one prompt pass, whose gradient sums theirs);
            Prefix Grouper, arXiv:2506.05433. Same log-probs and gradients up to rounding
            (tests/test_share_prompt.py). A model that cannot share (attention without a KV cache,
            sliding-window layers, gradient checkpointing in transformers < 5) keeps the unshared path,
            with a warning. Default True.
        generation_backend: how rollouts are decoded. "eager": `generate` on the training policy with a
            dynamic KV cache (`sampling.generate_completions`, the reference path). "static": `generate`
            with a static KV cache on an inference copy of the policy in the compute dtype (bf16 under
            `bf16-mixed`, LoRA adapters merged into it), overwritten in place after every optimizer step;
            on CUDA its decoding step is compiled once (`torch.compile` with CUDA graphs, through
            transformers' `CompileConfig`), on CPU it runs uncompiled (`grpo_lightning.static_rollout`).
            Same sampling (the tokens' distribution is the policy's, tests/test_static_rollout.py); costs
            one more copy of the weights in the compute dtype, on every rank under FSDP2, and a compile
            warm-up (tens of seconds) per batch shape. "auto": "static" on CUDA, "eager" elsewhere. A model
            the static path cannot serve (sliding-window or linear-attention layers, a quantized base,
            DoRA) falls back to "eager" with a warning. Default "auto".

    Optimisation:
        learning_rate: AdamW learning rate. Default 1e-6 (TRL's GRPO default).
        weight_decay: AdamW weight decay. Default 0.0.
        warmup_steps: linear warm-up optimizer steps, then constant. Default 0.
        max_grad_norm: gradient clipping by global norm, > 0; None disables. Default 1.0.
        micro_batch_size: sequences per forward/backward; the rollout of prompts x G sequences is split
            and the gradients accumulated, with the loss normalised over the whole rollout. Default None
            (all at once).
        max_bad_steps: stop after this many consecutive steps whose loss is not finite (each is skipped).
            Default 3.

    Logging:
        log_completions_every: steps between TensorBoard text panels of sample completions; 0 disables.
            Default 50.
        preflight: before the first step, sample a few completions and report the effective batch, the
            share cut off by `max_completion_length`, the reward audit and LoRA's input gradients in one
            block (`grpo_lightning.preflight`). Default True.
    """

    num_generations: int = 8
    max_completion_length: int = 256
    min_completion_length: int = 0
    max_prompt_length: int | None = 512
    truncate_prompts: str = "left"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 9
    dynamic_sampling_metric: str | None = "accuracy_reward"
    scale_rewards: str = "group"
    baseline: str = "mean"
    advantage_clip: float | None = None
    step_credit: float = 0.0
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_kl_in_reward: bool = False
    entropy_coef: float = 0.0
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    micro_batch_size: int | None = None
    max_bad_steps: int = 3
    share_prompt: bool = True
    generation_backend: str = "auto"
    log_completions_every: int = 50
    preflight: bool = True

    def __post_init__(self) -> None:
        check_options(self, GRPO_RULES)

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
            raise bad(
                "kl_estimator",
                "k1",
                "in the loss (beta > 0 without use_kl_in_reward) its gradient has mean zero and regularises "
                "nothing: use 'k2' or 'k3', or use_kl_in_reward: true",
            )


GRPO_RULES = {
    "num_generations": Rule(int, ">= 2", why="advantages compare a group"),
    # None too: generation needs a bound, and loss_type="dr_grpo" divides by it.
    "max_completion_length": Rule(int, "> 0"),
    "min_completion_length": Rule(int, ">= 0"),
    "max_prompt_length": Rule(int, "> 0", none=True),
    "truncate_prompts": Rule(str, choices=("left", "error")),
    "temperature": Rule(float, "> 0"),
    "top_p": Rule(float, "> 0, <= 1"),
    "top_k": Rule(int, ">= 0", why="0 disables it"),
    "dynamic_sampling": Rule(bool),
    "dynamic_sampling_max_rounds": Rule(int, ">= 0"),
    "dynamic_sampling_metric": Rule(str, none=True),  # a reward function's name: GRPOModule checks it
    "scale_rewards": Rule(str, choices=SCALES),
    "baseline": Rule(str, choices=BASELINES),
    "advantage_clip": Rule(float, "> 0", none=True),
    "step_credit": Rule(float, ">= 0", why="it is subtracted from the advantage"),
    "loss_type": Rule(str, choices=LOSS_TYPES),
    "importance_sampling_level": Rule(str, choices=("token", "sequence")),
    "epsilon": Rule(float, "> 0"),
    "epsilon_high": Rule(float, "> 0", none=True),
    "delta": Rule(float, "> 1", none=True),
    "beta": Rule(float, ">= 0"),
    "kl_estimator": Rule(str, choices=KL_ESTIMATORS),
    "use_kl_in_reward": Rule(bool),
    "entropy_coef": Rule(float),  # any finite weight: a negative one penalises entropy
    "num_iterations": Rule(int, ">= 1"),
    "mask_truncated_completions": Rule(bool),
    "learning_rate": Rule(float, ">= 0"),
    "weight_decay": Rule(float, ">= 0"),
    "warmup_steps": Rule(int, ">= 0"),
    "max_grad_norm": Rule(float, "> 0", none=True, why="a negative norm would flip the gradient's sign"),
    "micro_batch_size": Rule(int, ">= 1", none=True),
    "max_bad_steps": Rule(int, ">= 1"),
    "log_completions_every": Rule(int, ">= 0", why="0 disables the panels"),
    "preflight": Rule(bool),
    "share_prompt": Rule(bool),
    "generation_backend": Rule(str, choices=GENERATION_BACKENDS),
}
