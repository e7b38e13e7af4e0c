"""Evaluating a policy on GSM8K: answers generated for evaluation, and accuracy during training (the
per-completion results of a validation run: `callbacks.results_writer`).

- `generate_answers`: decoded completions of chat prompts, greedy or sampled, for any Hugging Face causal LM.
- `GSM8KAccuracyCallback`: GSM8K accuracy every N training steps, for any LightningModule holding a Hugging
  Face causal LM and its tokenizer (the attribute names are options).
"""

from __future__ import annotations

from contextlib import nullcontext
from operator import attrgetter

import lightning as L
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.core.chat_template import PromptOptions
from grpo_lightning.core.generation.engines import EagerEngine, RolloutEngine
from grpo_lightning.core.generation.prompts import PromptEncoder, PromptSampler
from grpo_lightning.core.generation.sampling import SamplingSettings, stop_token_ids
from grpo_lightning.core.metrics import GSM8KAccuracy
from grpo_lightning.core.rng import preserved_rng
from grpo_lightning.io.distributed import gathered_for_generation
from grpo_lightning.io.rows import DEFAULT_SYSTEM_PROMPT, collate_rows
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.step_metrics import logging_step

__all__ = ["GSM8KAccuracyCallback", "generate_answers"]


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict[str, str]]],
    *,
    num_generations: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    engine: RolloutEngine | None = None,
    prompt_options: PromptOptions = PromptOptions(),
) -> list[str]:
    """Decoded completions of chat `prompts`, `num_generations` per prompt (greedy when 1), grouped.
    `engine`: the rollout engine to sample through (a `GRPOModule`'s, whose stop ids it keeps); default
    `generate` on `model` itself. `prompt_options`: how the chat template renders the prompts (a
    `GRPOModule`'s `grpo.prompts`, as its training prompts)."""
    if engine is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token is not None else tokenizer.eos_token_id
        settings = SamplingSettings(
            max_new_tokens=max_new_tokens,
            eos_token_ids=tuple(stop_token_ids(model, tokenizer)),
            pad_token_id=pad,
        )
        engine = EagerEngine(settings)
    settings = engine.settings.for_evaluation(max_new_tokens, temperature)
    sampler = PromptSampler(PromptEncoder(tokenizer, options=prompt_options), engine, settings)
    _, completions = sampler.sample(model, prompts, num_generations, do_sample=num_generations > 1)
    return completions


def module_engine(pl_module: L.LightningModule, model: PreTrainedModel) -> RolloutEngine | None:
    """The engine a module samples its `model` through (a `GRPOModule`'s rollouts' `current_engine`, for its
    policy), so that evaluations decode as training does; None for another module or model."""
    rollouts = getattr(pl_module, "rollouts", None)
    if rollouts is None or model is not getattr(pl_module, "policy", None):
        return None
    return rollouts.current_engine()


def module_prompt_options(pl_module: L.LightningModule) -> PromptOptions:
    """How a module's chat prompts are rendered: a `GRPOModule`'s `grpo.prompts`, the template's defaults for
    another module."""
    options = getattr(getattr(pl_module, "grpo", None), "prompts", None)
    return options if isinstance(options, PromptOptions) else PromptOptions()


class GSM8KAccuracyCallback(L.Callback):
    """GSM8K accuracy of the model on a fixed held-out subset after every `every_n_steps` training steps.

    Works with any LightningModule that holds a Hugging Face causal LM (or a PEFT wrapper of one) and its
    tokenizer, found at `model_attr` / `tokenizer_attr` (dotted paths allowed). The problems are those
    `GSM8KDataModule(source, val_split=split, val_size=num_problems)` validates on; under DDP each rank
    evaluates a shard and `GSM8KAccuracy` sums the counts over ranks. A `GRPOModule`'s policy is sampled
    through the module's own rollout engine (`generation_backend`: the static engine's inference copy,
    refreshed first if the weights changed), so evaluation decodes as training does. Results go to every
    logger as
    `{prefix}accuracy`, `{prefix}accuracy_strict`, `{prefix}pass_at_k`, `{prefix}maj_at_k`, ... at the current
    step, and into `trainer.callback_metrics`, so `EarlyStopping` / `ModelCheckpoint` can monitor them.

    Args:
        source: GSM8K folder (with `test.jsonl`), a `.jsonl` file, "arithmetic" or a hub dataset name.
        split: "test" (the test split) or "holdout" (rows held out of the train split).
        num_problems: size of the fixed subset. Default 64.
        every_n_steps: training steps (batches) between evaluations. Default 100.
        batch_size: prompts per `generate` call. Default 16.
        num_generations: samples per problem; 1 decodes greedily. Default 1.
        max_new_tokens: completion budget. Default 256.
        temperature: sampling temperature when `num_generations > 1`. Default 1.0.
        system_prompt: the system message asking for `#### N`.
        model_attr / tokenizer_attr: where the module keeps the model and the tokenizer.
        prefix: metric name prefix. Default "gsm8k/".
    """

    def __init__(
        self,
        source: str = "openai/gsm8k",
        split: str = "test",
        num_problems: int = 64,
        every_n_steps: int = 100,
        batch_size: int = 16,
        num_generations: int = 1,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        model_attr: str = "policy",
        tokenizer_attr: str = "tokenizer",
        prefix: str = "gsm8k/",
    ) -> None:
        if every_n_steps < 1 or num_problems < 1 or batch_size < 1 or num_generations < 1:
            raise ValueError("every_n_steps, num_problems, batch_size and num_generations must be >= 1")
        self.data = GSM8KDataModule(source, system_prompt, val_split=split, val_size=num_problems)
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.num_generations = num_generations
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.model_attr = model_attr
        self.tokenizer_attr = tokenizer_attr
        self.prefix = prefix

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.data.setup()  # reads the rows once; a no-op on later calls

    def evaluate(self, pl_module: L.LightningModule, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """Score this rank's shard of the subset; the returned metrics are global when DDP is running."""
        model = attrgetter(self.model_attr)(pl_module)
        tokenizer = attrgetter(self.tokenizer_attr)(pl_module)
        rows = self.data.val_rows[rank::world_size]
        metric = GSM8KAccuracy(k=self.num_generations).to(pl_module.device)
        system_prompt, prompt_options = self.data.hparams.system_prompt, module_prompt_options(pl_module)
        engine = module_engine(pl_module, model)  # GRPOModule's: the engine (and copy) training samples from
        if engine is not None:
            engine.refresh(model, pl_module.device)  # every rank, rows or not: a collective under FSDP2
        # Sharded (FSDP2): full weights once for the whole shard, as in training, so that `generate` needs
        # no collective: ranks may stop at different lengths, and make different numbers of calls.
        live = engine is None or engine.reads_live_weights
        with gathered_for_generation(model) if live else nullcontext():
            for start in range(0, len(rows), self.batch_size):
                batch = collate_rows(rows[start : start + self.batch_size], system_prompt)
                completions = generate_answers(
                    model,
                    tokenizer,
                    batch["prompt"],
                    num_generations=self.num_generations,
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    engine=engine,
                    prompt_options=prompt_options,
                )
                metric.update(completions, batch["answer"])
        return metric.compute()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = logging_step(trainer)
        if (step + 1) % self.every_n_steps:
            return
        # Sampled evaluations must not move the training stream: with or without this callback (or in a run
        # resumed from a checkpoint), training then draws the same completions.
        with preserved_rng():
            results = self.evaluate(pl_module, trainer.global_rank, trainer.world_size)
        metrics = {f"{self.prefix}{key}": value for key, value in results.items()}
        # Straight to the loggers: `self.log` from a batch hook only reaches them on `log_every_n_steps`.
        for logger in trainer.loggers:
            logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
        for name, value in metrics.items():
            pl_module.log(name, value, logger=False, prog_bar=name == f"{self.prefix}accuracy")
