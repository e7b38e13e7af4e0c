"""Every GRPO option, declared once in the section of the unit that reads it and composed here.

Each unit declares its options as a frozen dataclass beside its code (`SamplingOptions` in
`generation.sampling`, `KLOptions` in `algorithm.kl`, ...), each option by its annotation: its type, its
choices (`Literal`, made of the registry that implements them) and its range (`Range`), which jsonargparse
reads and `--help` prints, and which `check_fields` checks when the section is built; a section's own rules
are in its `__post_init__`. A feature that is off is a section set to None. `GRPOConfig` composes the
sections and holds the rules that cross them.

TRL's names, and the flat names that options had before they had sections, keep working: an option's
`Alias` (or its own name) is its flat name, and `FLAT_NAMES`, derived from the declarations, is the one
table of them. `GRPOConfig(beta=0.04)`, `config.beta` and `model.grpo.beta` in a config file or on the
command line (`cli.sections.sectioned_argv`) all mean `kl.beta`; a checkpoint that stores the flat options
loads through the same table.
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any, ClassVar

from grpo_lightning.core.algorithm.advantages import AdvantageOptions
from grpo_lightning.core.algorithm.dynamic_sampling import DynamicSamplingOptions
from grpo_lightning.core.algorithm.kl import KLOptions
from grpo_lightning.core.algorithm.loss import PolicyLossOptions
from grpo_lightning.core.algorithm.reference_sync import ReferenceSyncOptions
from grpo_lightning.core.algorithm.sampler_correction import SamplerCorrectionOptions
from grpo_lightning.core.algorithm.schedules import OptimizerOptions
from grpo_lightning.core.async_group_source import AsyncRolloutOptions
from grpo_lightning.core.chat_template import PromptOptions
from grpo_lightning.core.flat_names import build_section, default_at, flat_names, sectioned
from grpo_lightning.core.generation.backends import EngineOptions
from grpo_lightning.core.generation.sampling import SamplingOptions
from grpo_lightning.core.generation.scorer import ScoringOptions
from grpo_lightning.core.options import Alias, Range, check_fields, option_error
from grpo_lightning.core.tools.calls import ToolOptions
from grpo_lightning.core.update import UpdateOptions


@dataclass(frozen=True)
class RunOptions:
    """How the run is carried out and reported, outside the algorithm's maths (`GRPOConfig.run`). None of
    them changes the training stream (the rows, the completions drawn, the updates): a resumed run takes
    them as given."""

    # Read by the resume checks (`training.training_state.free_on_resume`); a section without it changes
    # the training stream.
    changes_training: ClassVar[bool] = False

    cpu_offload: bool = False
    """FSDP2 only (`ModelParallelStrategy`): keep the parameter shards, their gradients and the AdamW state
    in CPU memory, copied to the GPU per layer for forward and backward
    (`torch.distributed.fsdp.CPUOffloadPolicy`); the optimizer step runs on the CPU. Frees the GPU of
    everything but activations, the rollout's gathered weights and KV cache, for a slower step (the
    pre-flight prints the estimate per GPU). verl: `actor.fsdp_config.param_offload` /
    `optimizer_offload`; TRL: DeepSpeed/FSDP `offload_params` in its accelerate config.
    """
    log_completions_every: Annotated[int, Range(">= 0", why="0 disables the panels")] = 50
    """Steps between TensorBoard text panels of sample completions; 0 disables."""
    logging_first_step: bool = False
    """Also write the first optimizer step's `train/` metrics, wherever `trainer.log_every_n_steps` falls
    (TRL's `logging_first_step`)."""
    preflight: bool = True
    """Before the first step, sample a few completions and report the effective batch, the share cut off by
    `max_completion_length`, the reward audit and LoRA's input gradients in one block
    (`grpo_lightning.training.callbacks.preflight`).
    """

    def __post_init__(self) -> None:
        check_fields(self)


def _accepting_flat_names(init):
    """`GRPOConfig`'s `__init__`, taking the flat names (`FLAT_NAMES`) beside the sections' keys."""

    @functools.wraps(init)
    def __init__(self, **options: Any) -> None:
        built = sectioned(type(self), options, type(self).__name__)
        init(self, **{key: _section(type(self), key, value) for key, value in built.items()})

    return __init__


def _section(owner: type, key: str, value: Any) -> Any:
    """A section given as a dict (of a config file, a checkpoint, or flat names) built as its class."""
    own = {f.name: f for f in fields(owner)}
    return build_section(owner, key, value) if key in own and isinstance(value, Mapping) else value


@dataclass
class GRPOConfig:
    """Options of the GRPO algorithm, one section per unit (defaults follow TRL's `GRPOConfig` where both have
    the option).

    Each option is documented under its declaration, in its section (`--help` and `--print_config` show
    it), and checked when the section is built. Every option also answers to its flat name (TRL's, where TRL
    has the option): `GRPOConfig(beta=0.04)` is `GRPOConfig(kl=KLOptions(beta=0.04))`, `config.beta` reads
    `config.kl.beta`; `FLAT_NAMES` lists them (docs/reference.md, docs/from_trl.md).
    """

    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """The group and how its completions are drawn (`generation.sampling.SamplingOptions`)."""
    prompts: PromptOptions = field(default_factory=PromptOptions)
    """How chat prompts are rendered: the chat template's keyword arguments (`chat_template`)."""
    dynamic_sampling: Annotated[DynamicSamplingOptions | None, Alias("dynamic_sampling")] = None
    """Dynamic sampling, DAPO's filter of groups without signal (`algorithm.dynamic_sampling`); None: off.
    Flat: `dynamic_sampling: true`."""
    advantages: AdvantageOptions = field(default_factory=AdvantageOptions)
    """Rewards to advantages (`algorithm.advantages.AdvantageOptions`)."""
    loss: PolicyLossOptions = field(default_factory=PolicyLossOptions)
    """The policy loss (`algorithm.loss.PolicyLossOptions`)."""
    kl: KLOptions = field(default_factory=KLOptions)
    """The KL penalty to the reference (`algorithm.kl.KLOptions`)."""
    sampler_correction: Annotated[
        SamplerCorrectionOptions | None, Alias("importance_sampling_correction")
    ] = None
    """The correction for the sampler not being the scored policy (`algorithm.sampler_correction`); None:
    off. Flat: `importance_sampling_correction: true`."""
    async_rollouts: AsyncRolloutOptions = field(default_factory=AsyncRolloutOptions)
    """Sampling ahead of the trainer on the server engine, and the correction of stale batches
    (`async_group_source.AsyncRolloutOptions`); `max_staleness: 0`, the default, samples each batch with the
    policy it trains."""
    update: UpdateOptions = field(default_factory=UpdateOptions)
    """Passes, mini-batches and micro-batches of each rollout (`update.UpdateOptions`)."""
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    """AdamW, its schedule and gradient clipping (`algorithm.schedules.OptimizerOptions`)."""
    reference_sync: Annotated[ReferenceSyncOptions | None, Alias("sync_ref_model")] = None
    """Moving the reference towards the policy (`algorithm.reference_sync`); None: off. Flat:
    `sync_ref_model: true`."""
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    """The layout of the scoring passes (`generation.scorer.ScoringOptions`)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The rollout engine and its options (`generation.backends.EngineOptions`)."""
    tools: ToolOptions = field(default_factory=ToolOptions)
    """The bounds of multi-turn rollouts with tools (`tools.calls.ToolOptions`): read only where the module
    has `tools` or `environment_factory`."""
    run: RunOptions = field(default_factory=RunOptions)
    """Offloading, logging and the pre-flight (`RunOptions`)."""

    def __post_init__(self) -> None:
        check_fields(self)
        # Rules that cross sections.
        if self.reference_sync is not None and self.kl.beta == 0:
            raise ValueError(
                "GRPOConfig.reference_sync (sync_ref_model: true): needs beta > 0 (with beta 0 there is no "
                "reference to sync)"
            )
        staleness, steps = self.async_rollouts.max_staleness, self.update.optimizer_steps_per_batch
        if staleness > 0 and self.engine.backend != "vllm_server":
            raise option_error(
                self.async_rollouts,
                "max_staleness",
                staleness,
                f"sampling ahead needs engine.backend: vllm_server (the servers sample while the trainer "
                f"trains), not {self.engine.backend!r}",
            )
        if staleness % steps:
            raise option_error(
                self.async_rollouts,
                "max_staleness",
                staleness,
                f"must be a multiple of the optimizer steps per batch ({steps}: num_iterations x "
                "steps_per_generation), each batch's staleness in optimizer steps",
            )
        budget = self.update.max_tokens_per_micro_batch
        if budget is not None and budget < self.sampling.max_completion_length:
            raise option_error(
                self.update,
                "max_tokens_per_micro_batch",
                budget,
                f"must be >= max_completion_length={self.sampling.max_completion_length} "
                "(a row at the limit alone)",
            )

    def __getattr__(self, name: str) -> Any:
        """An option read by its flat name (`config.beta` is `config.kl.beta`; a switch: whether its section
        is on)."""
        entry = FLAT_NAMES.get(name) if not name.startswith("__") else None
        if entry is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value: Any = self
        for key in entry.path:
            if value is None:  # an option of a section that is off: its default
                return default_at(type(self), entry.path)
            value = getattr(value, key)
        return value is not None if entry.switch else value

    def __setattr__(self, name: str, value: Any) -> None:
        """An option set by its flat name replaces its section with one that holds the new value."""
        entry = FLAT_NAMES.get(name)
        if entry is None or entry.path == (name,):
            super().__setattr__(name, value)
            return
        if entry.switch:
            raise AttributeError(f"set GRPOConfig.{entry.key} to a section or None, not {name}")
        chain = [self]
        for key in entry.path[:-1]:
            chain.append(getattr(chain[-1], key))
        for key, holder in zip(reversed(entry.path), reversed(chain[1:]), strict=False):
            value = replace(holder, **{key: value})
        super().__setattr__(entry.path[0], value)

    def __setstate__(self, state: dict) -> None:
        """Unpickled options written with flat names are rebuilt into their sections."""
        own = {f.name for f in fields(self)}
        if not set(state) <= own:
            state = vars(type(self)(**state))
        self.__dict__.update(state)

    @property
    def optimizer_steps_per_batch(self) -> int:
        """The optimizer steps of one training step: num_iterations x steps_per_generation."""
        return self.update.optimizer_steps_per_batch


GRPOConfig.__init__ = _accepting_flat_names(GRPOConfig.__init__)
FLAT_NAMES = flat_names(GRPOConfig)  # every option by its flat name: where it sits in the sections
