"""Pre-flight: before the first step, what the run is about to do and what looks wrong, in one block.

On the first training batch (before its step) `Preflight` reports:

- the effective batch: prompts x completions per prompt x devices x accumulation;
- how many of a few completions sampled at the training settings reach `max_completion_length` without
  an EOS, and in how many groups all of them do (a problem when that is most groups: their answers are
  cut off before the `#### N` line, score alike and give no advantage);
- the reward audit (`grpo_lightning.core.rewards.audit.audit_module_rewards`) on the first 200 training rows'
  reference solutions (the batch's when the data module has no `train_rows`);
- with LoRA and gradient checkpointing, whether the input embeddings pass a gradient on;
- the memory per GPU (`grpo_lightning.core.memory`): weights, gradients, optimizer, reference, the rollout's
  gathered weights or the static engine's inference copy, and the KV cache, for the strategy at hand;
  with rollouts from vLLM servers, a line saying that the servers are not in it (their own devices);
- the trainable weights' dtype and the share of them that an update of the learning rate's size changes at
  all: a bf16 weight keeps 8 bits of mantissa, so an AdamW step of ~1e-6 rounds away on nearly every weight
  (float32 master weights with bf16 compute, `precision: bf16-mixed`, keep every update).

Problems are also raised as warnings. Sampling runs under `preserved_rng`, so a run with the pre-flight
draws exactly the completions a run without it would. SIGTERM stops the pre-flight at once
(`stopped_by_sigterm`), as it stops a run after its step.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import FrameType

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.backends import BACKENDS
from grpo_lightning.core.generation.engines import MemoryRequest
from grpo_lightning.core.memory import MemoryEstimate, compute_bytes, estimate_memory, footprint
from grpo_lightning.core.rewards.audit import audit_module_rewards, auditable
from grpo_lightning.core.rng import preserved_rng
from grpo_lightning.io.distributed import is_sharded

UPDATED_WARN_SHARE = 0.5  # below this share of weights changed by an lr-sized step, updates round away
SAMPLED_WEIGHTS = 2**16  # weights read per tensor for that share: a strided sample is as good and cheap
# Above this share of groups cut whole, most prompts give GRPO nothing to learn from. Many cut completions
# alone are no problem: where a group also holds finished ones, GRPO favours those and completions shorten
# (configs/smollm2_cpu.yaml: 5 of 8 cut at 48 tokens before training; `make demo`: mean length 51.5 -> 29).
CUT_GROUPS_WARN_SHARE = 0.5


@dataclass
class PreflightReport:
    """One line per check, and the problems found (each a complete sentence with the fix)."""

    lines: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def text(self) -> str:
        width = max(len(name) for name in self.lines)
        body = [f"  {name:<{width}}  {finding}" for name, finding in self.lines.items()]
        verdict = f"{len(self.problems)} problem(s): see the warnings" if self.problems else "all clear"
        return "\n".join(["GRPO pre-flight:", *body, f"  {'verdict':<{width}}  {verdict}"])


def effective_batch(prompts: int, num_generations: int, devices: int = 1, accumulation: int = 1) -> int:
    """Completions behind one optimizer step."""
    return prompts * num_generations * devices * accumulation


def groups_cut_whole(truncated: Tensor, num_generations: int) -> int:
    """Groups whose every completion reached `max_completion_length` without an EOS."""
    return int(truncated.view(-1, num_generations).all(dim=1).sum())  # [N*G] -> [N, G] -> [N]


def input_gradients_enabled(model: nn.Module) -> bool | None:
    """Whether the input embeddings' output requires grad; None where that does not matter (no gradient
    checkpointing, or every parameter trains, so the embeddings themselves require grad)."""
    # As transformers' own `is_activation_checkpointing` (named `is_gradient_checkpointing` before v5).
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if not checkpointing or all(p.requires_grad for p in model.parameters()):
        return None
    embeddings = model.get_input_embeddings()
    token = torch.zeros(1, 1, dtype=torch.long, device=embeddings.weight.device)  # [1, 1]
    with torch.enable_grad():
        return bool(embeddings(token).requires_grad)  # enable_input_require_grads() hooks this output


def share_of_weights_updated(weights: Sequence[torch.Tensor], step: float) -> float:
    """Share of the weights that change when `step` is added in their own dtype, as an optimizer writes
    them back (AdamW's first updates move each weight by about the learning rate). Reads a strided sample
    of at most `SAMPLED_WEIGHTS` per tensor; sharded (DTensor) weights are judged on the local shard."""
    changed = total = 0
    for weight in weights:
        values = getattr(weight, "_local_tensor", weight).detach().reshape(-1)  # [N]
        values = values[:: max(1, values.numel() // SAMPLED_WEIGHTS)]
        changed += int((values + step != values).sum())
        total += values.numel()
    return changed / max(total, 1)


def run_preflight(
    module: L.LightningModule,
    batch: dict[str, list],
    devices: int = 1,
    accumulation: int = 1,
    samples: int = 4,
    audit_rows: Sequence[dict[str, str]] | None = None,
    precision: str = "32-true",
) -> PreflightReport:
    """Check a `GRPOModule` against its first batch; samples `samples` prompts x `num_generations`.

    The reward audit runs on `audit_rows` (e.g. the first 200 training rows) when given, else on the batch.
    """
    cfg, G = module.grpo, module.grpo.sampling.num_generations
    report = PreflightReport()
    prompts = len(batch["prompt"])
    total = effective_batch(prompts, G, devices, accumulation)
    micro = (
        f"micro-batches of {cfg.update.micro_batch_size}"
        if cfg.update.micro_batch_size
        else "one micro-batch"
    )
    # A training step's rollout is split into steps_per_generation mini-batches, each stepped num_iterations
    # times: the optimizer steps per training step that `max_steps` and the schedule count.
    mini_batches, iterations = cfg.update.steps_per_generation, cfg.update.num_iterations
    report.lines["effective batch"] = (
        f"{prompts} prompts x {G} completions x {devices} device(s) x {accumulation} accumulation = {total} "
        f"completions per step, {mini_batches * iterations} optimizer step(s) each ({mini_batches} "
        f"mini-batch(es) of {total / mini_batches:g} completions x {iterations} iteration(s); {micro})"
    )

    rollout, _ = module.rollouts.sample(batch["prompt"][:samples], G)
    report.lines["memory per GPU"] = memory_line(module, prompts, devices, precision, rollout)
    if (servers := servers_line(cfg)) is not None:
        report.lines["rollout servers"] = servers
    cut, sampled = int(rollout.truncated.sum()), rollout.truncated.numel()
    whole, groups = groups_cut_whole(rollout.truncated, G), sampled // G
    report.lines["completion length"] = (
        f"{cut} of {sampled} sampled completions reached "
        f"max_completion_length={cfg.sampling.max_completion_length}; "
        f"{whole} of {groups} groups were cut whole"
    )
    if whole > CUT_GROUPS_WARN_SHARE * groups:
        report.problems.append(
            f"in {whole} of {groups} groups all completions sampled before training reached "
            f"max_completion_length={cfg.sampling.max_completion_length} without an end-of-sequence "
            "token: their "
            "answers would be cut off before the final line, score alike and give no advantage; raise "
            "grpo.sampling.max_completion_length"
        )

    if audit_rows is None and "question" in batch:
        audit_rows = [{column: values[i] for column, values in batch.items()} for i in range(prompts)]
    if audit_rows and auditable(audit_rows):
        audit = audit_module_rewards(module, audit_rows)
        verdict = "passes" if audit.perfect else "FAILS"
        report.lines["reward audit"] = f"{verdict} on {audit.num_rows} reference solutions"
        if not audit.perfect:
            report.problems.append(
                "the reward audit fails: a policy can earn reward without the right answer\n" + audit.table()
            )
    else:
        report.lines["reward audit"] = (
            "skipped: the data has no `question` and GSM8K-style `answer` (`#### N`) columns to corrupt"
        )

    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    lr = module.grpo.optimizer.learning_rate
    dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in trainable}))
    share = share_of_weights_updated(trainable, lr)
    report.lines["weight precision"] = (
        f"trainable weights in {dtypes}: a step of lr={lr:g} changes {share:.1%} of them"
    )
    if share < UPDATED_WARN_SHARE:
        report.problems.append(
            f"the trainable weights are {dtypes} and an update of the learning rate's size ({lr:g}) changes "
            f"only {share:.1%} of them: the rest round away and the model barely trains. Keep float32 master "
            "weights with bf16 compute (trainer.precision: bf16-mixed, model_options.dtype: float32), or "
            "raise the learning rate"
        )

    enabled = input_gradients_enabled(module.policy)
    if enabled is None:
        report.lines["LoRA input grads"] = "not needed (no gradient checkpointing, or every weight trains)"
    else:
        report.lines["LoRA input grads"] = "enabled" if enabled else "DISABLED"
        if not enabled:
            report.problems.append(
                "gradient checkpointing with frozen input embeddings (LoRA), but their output requires no "
                "grad: with reentrant checkpointing the adapters then get no gradient; call "
                "policy.enable_input_require_grads()"
            )
    return report


def memory_line(module: L.LightningModule, prompts: int, devices: int, precision: str, rollout) -> str:
    """`memory.estimate_memory` for this module, its strategy, its rollout engine and its batch of `prompts`
    per device, prompts at `max_prompt_length` (the rollout's own without one)."""
    prompt_tokens = module.grpo.sampling.max_prompt_length or rollout.input_ids.size(
        1
    ) - rollout.completion_ids.size(1)
    return rollout_memory(
        module, prompts * module.grpo.sampling.num_generations, prompt_tokens, devices, precision
    ).text()


def servers_line(cfg: GRPOConfig) -> str | None:
    """With rollouts from vLLM servers, the pre-flight's line saying that the memory estimate leaves them
    out (they hold their weights and KV cache on devices of their own); None for an engine in the trainer."""
    if cfg.engine.backend != "vllm_server":
        return None
    urls = cfg.engine.vllm_server.urls
    return (
        f"{len(urls)} vLLM server(s) at {', '.join(urls)}: their weights and KV cache are on their own "
        "devices, outside the estimate above (size them with cli.py vllm-serve --gpu-memory-utilization)"
    )


def rollout_memory(
    module: L.LightningModule, sequences: int, prompt_tokens: int, devices: int, precision: str
) -> MemoryEstimate:
    """The memory estimate of `module` with `sequences` rollout rows of `prompt_tokens` prompt tokens on each
    of `devices`, with what its rollout engine holds (`backends.Backend.memory`: the static engine's copy and
    cache shape, vLLM's weights and KV pool)."""
    cfg, policy = module.grpo, module.policy
    value_bytes = compute_bytes(precision, policy)
    engine = module.rollouts.current_engine()
    sharded = is_sharded(policy)
    rollout = MemoryRequest(sequences, prompt_tokens, cfg.sampling.max_completion_length, sharded, precision)
    held = BACKENDS[module.rollouts.backend].memory(engine, policy, rollout)
    return estimate_memory(
        footprint(policy),
        world=devices,
        sharded=is_sharded(policy),
        cpu_offload=cfg.run.cpu_offload,
        reference=module.reference is not None,
        compute_bytes=value_bytes,
        sequences=held.sequences,
        tokens=held.tokens,
        inference_copy_bytes=held.copy_bytes,
        kv_pool_bytes=held.kv_pool_bytes,
    )


@contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM stops what runs inside at once with Lightning's `SIGTERMException` (after Lightning's own
    handler has noted it): a pre-flight is no step to finish first, and its sampling may take minutes. The
    exception ends `fit` as a SIGTERM after a step does: `InterruptCheckpoint` writes its checkpoint and
    `cli.py` exits with status 143. Left alone where SIGTERM is ignored, or outside the main thread."""
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, frame: FrameType | None) -> None:
        if callable(previous):
            previous(signum, frame)
        raise SIGTERMException

    installed = False
    if previous is not signal.SIG_IGN:
        try:
            signal.signal(signal.SIGTERM, stop)
            installed = True
        except ValueError:  # not the main thread: signals are not ours to handle here
            pass
    try:
        yield
    finally:
        if installed:  # None: a handler set outside Python, which signal cannot put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class Preflight(L.Callback):
    """Runs `run_preflight` on the first batch of each `fit`, before its step; keeps it in `report`."""

    def __init__(self, samples: int = 4, audit_rows: int = 200) -> None:
        self.samples = samples
        self.audit_rows = audit_rows
        self.report: PreflightReport | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if self.report is not None:
            return
        # On several ranks a SIGTERM is the interrupt checkpoint's, answered where every rank agrees to stop.
        stopping = stopped_by_sigterm() if trainer.world_size == 1 else nullcontext()
        with stopping, preserved_rng(), torch.no_grad():
            rows = getattr(trainer.datamodule, "train_rows", None)
            self.report = run_preflight(
                pl_module,
                batch,
                trainer.world_size,
                trainer.accumulate_grad_batches,
                self.samples,
                rows[: self.audit_rows] if rows else None,
                trainer.precision,
            )
        rank_zero_info(self.report.text())
        for problem in self.report.problems:
            rank_zero_warn(problem)
