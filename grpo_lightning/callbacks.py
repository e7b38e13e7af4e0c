"""Lightning callbacks for evaluating and watching a GRPO run.

- `GSM8KAccuracyCallback`: GSM8K accuracy every N training steps, for any LightningModule holding a Hugging
  Face causal LM and its tokenizer (the attribute names are options).
- `ValidationResultsWriter`: one JSON line per validation completion (question, completion, extracted
  answer, reference, correct), for `python cli.py validate`.
- `CompletionsPanel` and `CollapseMonitor`: a TensorBoard text table of sample completions with their
  rewards and advantages, and alarms when the policy collapses, the rewards carry no signal, or completions
  run out of tokens. Both read the `RolloutRecord` that `GRPOModule` leaves in `last_rollout` after each step.
- `RewardAuditCallback` / `audit_reward_funcs`: the reward functions scored on the data's own reference
  solutions and on corrupted copies of them, reported before training starts.
- `ExportBestCallback`: at the end of `fit`, the best checkpoint's policy exported with `save_pretrained`.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.data import DEFAULT_SYSTEM_PROMPT, GSM8KDataModule, collate_rows
from grpo_lightning.distributed import gathered_for_generation, is_sharded
from grpo_lightning.export import export_policy
from grpo_lightning.metrics import GSM8KAccuracy
from grpo_lightning.resume import preserved_rng
from grpo_lightning.rewards import audit_rewards, extract_answer, reference_answer
from grpo_lightning.sampling import generate_completions

__all__ = [
    "AUDIT_CASES",
    "AuditReport",
    "CollapseMonitor",
    "CompletionsPanel",
    "ExportBestCallback",
    "GSM8KAccuracyCallback",
    "RewardAuditCallback",
    "RolloutRecord",
    "ValidationResultsWriter",
    "audit_module_rewards",
    "audit_reward_funcs",
    "auditable",
    "completions_table",
    "generate_answers",
    "logging_step",
    "prompt_text",
    "stop_token_ids",
]


def _resolve(obj: object, path: str) -> object:
    """`getattr` along a dotted path: `"model.backbone"` -> `obj.model.backbone`."""
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def logging_step(trainer: L.Trainer) -> int:
    """The step at which Lightning logs the current training batch's metrics, counted from 0.

    One per training step (one rollout), however many optimizer steps it holds, so it is also the step that
    `every_n_steps` counts. Lightning's own LearningRateMonitor reads the same counter.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# ------------------------------------------------------------------------------------------ evaluation
@contextmanager
def _left_padded(tokenizer: PreTrainedTokenizerBase):
    """Left padding and a pad token for batched generation, restoring the caller's settings afterwards
    (another module may well train with right padding)."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = pad


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS plus every EOS of the model's generation config (chat models often have two)."""
    ids = {tokenizer.eos_token_id}
    config_eos = model.generation_config.eos_token_id
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict[str, str]]],
    *,
    num_generations: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
) -> list[str]:
    """Decoded completions of chat `prompts`, `num_generations` per prompt (greedy when 1), grouped."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template, and the GSM8K prompts are chat messages")
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    device = next(model.parameters()).device
    with _left_padded(tokenizer):
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        rollout = generate_completions(
            model,
            enc["input_ids"].to(device),  # [N, P]
            enc["attention_mask"].to(device),  # [N, P]
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            eos_token_ids=stop_token_ids(model, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            temperature=temperature,
            do_sample=num_generations > 1,
        )
    return tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)


class GSM8KAccuracyCallback(L.Callback):
    """GSM8K accuracy of the model on a fixed held-out subset after every `every_n_steps` training steps.

    Works with any LightningModule that holds a Hugging Face causal LM (or a PEFT wrapper of one) and its
    tokenizer, found at `model_attr` / `tokenizer_attr` (dotted paths allowed). The problems are those
    `GSM8KDataModule(source, val_split=split, val_size=num_problems)` validates on; under DDP each rank
    evaluates a shard and `GSM8KAccuracy` sums the counts over ranks. Results go to every logger as
    `{prefix}accuracy`, `{prefix}accuracy_strict`, `{prefix}pass@k`, `{prefix}maj@k`, ... at the current
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
        model = _resolve(pl_module, self.model_attr)
        tokenizer = _resolve(pl_module, self.tokenizer_attr)
        rows = self.data.val_rows[rank::world_size]
        metric = GSM8KAccuracy(k=self.num_generations).to(pl_module.device)
        system_prompt = self.data.hparams.system_prompt
        # Sharded (FSDP2): full weights once for the whole shard, as in training, so that `generate` needs
        # no collective: ranks may stop at different lengths, and make different numbers of calls.
        with gathered_for_generation(model):
            for start in range(0, len(rows), self.batch_size):
                batch = collate_rows(rows[start : start + self.batch_size], system_prompt)
                completions = generate_answers(
                    model,
                    tokenizer,
                    batch["prompt"],
                    num_generations=self.num_generations,
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
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


class ValidationResultsWriter(L.Callback):
    """Writes every validation completion of the last validation run to a JSON-lines file.

    One line per completion: `question`, `sample` (index among the problem's samples), `completion`,
    `extracted` (the lenient answer, as `val/accuracy` reads it, or null), `answer` (the reference number)
    and `correct`. Needs a `validation_step` that returns `{"completions": [...]}` with the `k` samples
    of each problem contiguous, as `GRPOModule` does. `path=None` writes nothing; under DDP rank r > 0
    writes `<path>.rank<r>`.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._records: list[dict] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._records = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.path is None:
            return
        completions, answers = outputs["completions"], batch["answer"]
        k = len(completions) // len(answers)
        for i, completion in enumerate(completions):
            question, answer = batch["question"][i // k], reference_answer(answers[i // k])
            extracted = extract_answer(completion)
            self._records.append(
                {
                    "question": question,
                    "sample": i % k,
                    "completion": completion,
                    "extracted": extracted,
                    "answer": answer,
                    "correct": extracted == answer,
                }
            )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is None or trainer.sanity_checking:
            return
        path = self.path if trainer.global_rank == 0 else f"{self.path}.rank{trainer.global_rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for record in self._records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        correct = sum(r["correct"] for r in self._records)
        rank_zero_info(f"{len(self._records)} validation completions ({correct} correct) written to {path}")


# ------------------------------------------------------------------------------------------ watching the run
@dataclass
class RolloutRecord:
    """What one GRPO training step sampled and how it was scored, for callbacks to read.

    Rows are completions, prompt i's group in rows i*G .. i*G+G-1. Tensors are detached and on the CPU.
    """

    prompts: list  # N prompts: chat messages or strings
    completions: list[str]  # N*G decoded completions
    reward_names: list[str]  # F reward function names
    rewards_per_func: Tensor  # [N*G, F] NaN where a function answered None
    rewards: Tensor  # [N*G] weighted total
    advantages: Tensor  # [N*G]
    completion_lengths: Tensor  # [N*G] tokens, EOS included
    truncated: Tensor  # [N*G] bool: hit max_completion_length without EOS
    num_generations: int
    entropy: float  # mean token entropy of the policy on the completions
    extra: dict[str, list] = field(default_factory=dict)  # reward functions' `log_extra` columns, [N*G] each


def prompt_text(prompt: list[dict[str, str]] | str) -> str:
    """The question of a prompt: the last message's content for chat prompts."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _markdown_cell(text: str, max_chars: int) -> str:
    """Text that stays inside one Markdown table cell and shows literally (TensorBoard renders Markdown)."""
    if len(text) > max_chars:
        text = text[:max_chars] + " …"
    for char in "\\`*_[]#":  # Markdown's own characters, the backslash first
        text = text.replace(char, "\\" + char)
    return html.escape(text, quote=False).replace("|", "&#124;").replace("\n", "<br>")


def completions_table(record: RolloutRecord, num_prompts: int = 2, max_chars: int = 1000) -> str:
    """A Markdown table of the first `num_prompts` groups: each completion with its rewards and advantage,
    then the columns the reward functions logged with `log_extra`."""
    header = ["prompt", "completion", *record.reward_names, "reward", "advantage", "tokens", *record.extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    G = record.num_generations
    for i in range(min(num_prompts, len(record.prompts))):
        for row in range(i * G, (i + 1) * G):
            prompt = _markdown_cell(prompt_text(record.prompts[i]), max_chars) if row == i * G else ""
            length = f"{int(record.completion_lengths[row])}{' (cut)' if record.truncated[row] else ''}"
            cells = [
                prompt,
                _markdown_cell(record.completions[row], max_chars),
                *(f"{float(v):.3f}" for v in record.rewards_per_func[row]),
                f"{float(record.rewards[row]):.3f}",
                f"{float(record.advantages[row]):+.3f}",
                length,
                *(_markdown_cell(str(values[row]), max_chars) for values in record.extra.values()),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class CompletionsPanel(L.Callback):
    """Every `every_n_steps` training steps (from the first), a TensorBoard text panel `completions`:
    the completions of a few prompts with each completion's rewards per function, total and advantage, and
    the columns reward functions logged with TRL's `log_extra(column, values)`.

    Reads `pl_module.last_rollout` (a `RolloutRecord`); only TensorBoard loggers get the panel.
    """

    def __init__(self, every_n_steps: int = 50, num_prompts: int = 2, max_chars: int = 1000) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.num_prompts = num_prompts
        self.max_chars = max_chars

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        step = logging_step(trainer)
        record = getattr(pl_module, "last_rollout", None)
        if record is None or step % self.every_n_steps:
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or not trainer.is_global_zero:
            return
        table = completions_table(record, self.num_prompts, self.max_chars)
        for logger in loggers:
            logger.experiment.add_text("completions", table, global_step=step)


class CollapseMonitor(L.Callback):
    """Per-step diversity of the sampled groups, and warnings when a run stops being able to learn.

    Logs `monitor/frac_identical_groups` (groups whose G completions are all the same text),
    `monitor/distinct_per_group` (mean number of distinct completions per group), and three 0/1 alarms
    that turn on once their condition has held for `patience` consecutive steps, each with a warning:

    - `monitor/collapse`: at least `identical_fraction` of the groups are identical (the policy has
      stopped exploring; token entropy `train/entropy` usually falls with it);
    - `monitor/no_signal`: at least `no_signal_fraction` of the groups have equal rewards throughout (all
      wrong or all right), so their advantages, and the gradient, are zero;
    - `monitor/truncation`: at least `truncated_fraction` of the completions hit `max_completion_length`.

    Reads `pl_module.last_rollout` (a `RolloutRecord`).
    """

    ALARMS = ("collapse", "no_signal", "truncation")

    def __init__(
        self,
        patience: int = 3,
        identical_fraction: float = 0.5,
        no_signal_fraction: float = 1.0,
        truncated_fraction: float = 0.9,
    ) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.thresholds = {
            "collapse": identical_fraction,
            "no_signal": no_signal_fraction,
            "truncation": truncated_fraction,
        }
        self.streaks = dict.fromkeys(self.ALARMS, 0)

    def update(self, record: RolloutRecord) -> dict[str, float]:
        """Fold in one step's rollout: returns its metrics and warns when an alarm goes off."""
        G = record.num_generations
        groups = [record.completions[i : i + G] for i in range(0, len(record.completions), G)]
        distinct = [len(set(group)) for group in groups]
        grouped = record.rewards.view(-1, G)  # [N, G]
        fractions = {
            "collapse": sum(d == 1 for d in distinct) / len(groups),
            "no_signal": float((grouped.max(dim=1).values - grouped.min(dim=1).values < 1e-6).float().mean()),
            "truncation": float(record.truncated.float().mean()),
        }
        metrics = {
            "monitor/frac_identical_groups": fractions["collapse"],
            "monitor/distinct_per_group": sum(distinct) / len(groups),
        }
        for alarm in self.ALARMS:
            self.streaks[alarm] = self.streaks[alarm] + 1 if fractions[alarm] >= self.thresholds[alarm] else 0
            metrics[f"monitor/{alarm}"] = float(self.streaks[alarm] >= self.patience)
            if self.streaks[alarm] == self.patience:  # once per episode, not on every step after
                rank_zero_warn(self._message(alarm, fractions[alarm], record))
        return metrics

    def _message(self, alarm: str, fraction: float, record: RolloutRecord) -> str:
        steps = f"for {self.patience} steps"
        if alarm == "collapse":
            return (
                f"policy collapse: {fraction:.0%} of groups sampled {record.num_generations} identical "
                f"completions {steps} (token entropy {record.entropy:.3f}); raise the temperature or lower "
                f"the learning rate"
            )
        if alarm == "no_signal":
            return (
                f"no learning signal: {fraction:.0%} of groups got equal rewards {steps} (mean reward "
                f"{float(record.rewards.mean()):.3f}), so their advantages are zero; the task is too hard or "
                f"too easy for the model, or a reward function is broken (run `cli.py audit`)"
            )
        return (
            f"{fraction:.0%} of completions hit max_completion_length {steps}: raise it, or penalise length"
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        record = getattr(pl_module, "last_rollout", None)
        if record is None:
            return
        metrics = self.update(record)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(record.completions))


# ------------------------------------------------------------------------------------------ reward audit
AUDIT_CASES = ("reference", "wrong_number", "two_answers", "no_answer")


@dataclass
class AuditReport:
    """The reward functions on reference solutions and corrupted copies (see `audit_reward_funcs`)."""

    num_rows: int
    means: dict[str, dict[str, float]]  # {function: {case: mean reward}}, NaN where every value was None
    totals: dict[str, float]  # {case: mean weighted total reward}
    rates: dict[str, float]  # reference: share at full marks; corrupted cases: share scoring >= reference

    @property
    def perfect(self) -> bool:
        """Every reference at full marks and no corrupted copy scoring as well as its reference."""
        return self.rates["reference"] == 1.0 and all(self.rates[c] == 0.0 for c in AUDIT_CASES[1:])

    def table(self) -> str:
        width = max(len("total (weighted)"), *(len(name) for name in self.means))
        lines = [
            f"reward audit on {self.num_rows} reference solutions: mean reward per case",
            f"{'':<{width}}" + "".join(f"{case:>14}" for case in AUDIT_CASES),
        ]
        rows = [*self.means.items(), ("total (weighted)", self.totals)]
        rows.append(("rate", self.rates))
        for name, values in rows:
            lines.append(f"{name:<{width}}" + "".join(f"{values[case]:>14.3f}" for case in AUDIT_CASES))
        lines.append(
            "rate: for reference, the share at full marks (should be 1); for a corruption, the share scoring "
            "at least as much as its reference (should be 0)"
        )
        verdict = "OK" if self.perfect else "NOT PERFECT: a policy can earn reward without the answer"
        lines.append(f"verdict: {verdict}")
        return "\n".join(lines)


def audit_reward_funcs(
    reward_funcs: Sequence[Callable],
    questions: Sequence[str],
    answers: Sequence[str],
    weights: Sequence[float] | None = None,
    prompts: Sequence | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> AuditReport:
    """Score the reference solutions and their corrupted copies (`grpo_lightning.rewards.audit_rewards`) row
    by row, and total them with `weights` as training does (a None reward counts 0).

    The functions are called as in training: `prompts` are the rows' prompts (by default each question as a
    user message) and `completion_ids` come from `tokenizer` when given. Full marks are the highest total
    the audit sees anywhere. A sound reward gives every reference full marks, and every corrupted copy
    (changed final number, two different final answers, no answer) less than its own reference: a
    corruption that scores as well is a way to earn reward without the answer.
    """
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    prompts = list(prompts) if prompts is not None else [[{"role": "user", "content": q}] for q in questions]
    per_row = [
        audit_rewards(reward_funcs, [q], [a], [p], tokenizer)
        for q, a, p in zip(questions, answers, prompts, strict=True)
    ]
    names = list(per_row[0])
    scores = torch.tensor(
        [[[row[name][case] for name in names] for case in AUDIT_CASES] for row in per_row]
    )  # [R, C, F] NaN where None
    totals = (scores.nan_to_num(0.0) * torch.tensor(weights)).sum(dim=-1)  # [R, C]
    at_full_marks = totals[:, 0] >= totals.max() - 1e-6  # [R]
    as_good_as_reference = totals[:, 1:] >= totals[:, :1] - 1e-6  # [R, C-1]
    rates = [at_full_marks.float().mean().item(), *as_good_as_reference.float().mean(dim=0).tolist()]
    means = scores.nanmean(dim=0).T.tolist()  # [F][C]
    return AuditReport(
        num_rows=len(per_row),
        means={name: dict(zip(AUDIT_CASES, means[f], strict=True)) for f, name in enumerate(names)},
        totals=dict(zip(AUDIT_CASES, totals.mean(dim=0).tolist(), strict=True)),
        rates=dict(zip(AUDIT_CASES, rates, strict=True)),
    )


def auditable(rows: Sequence[dict]) -> bool:
    """Whether the audit can corrupt these rows: each has a `question` and a GSM8K `answer` (`#### N`)."""
    return bool(rows) and all(
        isinstance(r.get("question"), str) and "####" in str(r.get("answer", "")) for r in rows
    )


def audit_module_rewards(pl_module: L.LightningModule, rows: Sequence[dict]) -> AuditReport:
    """`audit_reward_funcs` on data rows with a module's `reward_funcs` (and `reward_weights`, if any), the
    rows' own prompts when they have them and the module's tokenizer for `completion_ids`."""
    if not auditable(rows):
        raise ValueError(
            "the reward audit corrupts GSM8K-style reference solutions: it needs a `question` column and an "
            "`answer` column ending in '#### <number>' on every row"
        )
    weights = getattr(pl_module, "reward_weights", None)
    return audit_reward_funcs(
        pl_module.reward_funcs,
        [r["question"] for r in rows],
        [r["answer"] for r in rows],
        None if weights is None else weights.tolist(),
        [r["prompt"] for r in rows] if all("prompt" in r for r in rows) else None,
        getattr(pl_module, "tokenizer", None),
    )


class RewardAuditCallback(L.Callback):
    """Before training, audits the module's `reward_funcs` (and `reward_weights`) on the first `num_rows`
    training rows of the data module (`train_rows`, as `GSM8KDataModule` has); warns with the table when
    the audit is not perfect."""

    def __init__(self, num_rows: int = 200) -> None:
        self.num_rows = num_rows

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = getattr(trainer.datamodule, "train_rows", None)
        if not rows or not auditable(rows[: self.num_rows]) or not trainer.is_global_zero:
            return
        report = audit_module_rewards(pl_module, rows[: self.num_rows])
        if report.perfect:
            rank_zero_info(f"reward audit on {report.num_rows} reference solutions: OK")
        else:
            rank_zero_warn("the reward audit is not perfect:\n" + report.table())


# ------------------------------------------------------------------------------------------ export
class ExportBestCallback(L.Callback):
    """At the end of `fit`, loads the best checkpoint's policy weights into the module (as
    `trainer.test(ckpt_path="best")` would) and exports them with `export_policy`: `save_pretrained` model and
    tokenizer in `out_dir`, loadable with `AutoModelForCausalLM.from_pretrained`.

    The best checkpoint is the `best_model_path` of the first `ModelCheckpoint` that monitors a metric (a
    run may also keep the latest weights with an unmonitored one); without one, or when no validation ran,
    the final weights are exported, with a warning. A sharded (FSDP) policy is not exported here: the
    warning gives the `grpo-lightning export` command that reads the checkpoint folder in one process.

    Args:
        out_dir: where to write. Default `<trainer.log_dir or default_root_dir>/export`.
        merge_lora: merge a LoRA adapter into the weights (a plain model) or save the adapter alone.
        model_attr / tokenizer_attr: where the module keeps the model and the tokenizer.
    """

    def __init__(
        self,
        out_dir: str | None = None,
        merge_lora: bool = True,
        model_attr: str = "policy",
        tokenizer_attr: str = "tokenizer",
    ) -> None:
        self.out_dir = out_dir
        self.merge_lora = merge_lora
        self.model_attr = model_attr
        self.tokenizer_attr = tokenizer_attr
        self.exported_from: str | None = None  # the checkpoint exported, None for the final weights

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitored = [c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
        best = (monitored[0].best_model_path if monitored else "") or None
        if best is None:
            rank_zero_warn(
                "ExportBestCallback: no best checkpoint (no monitor, or no validation ran): "
                "exporting the final weights"
            )
        out_dir = self.out_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "export")
        if is_sharded(_resolve(pl_module, self.model_attr)):
            # Each rank holds a shard: the export reads the checkpoint folder in one process instead.
            rank_zero_warn(
                "ExportBestCallback: the policy is sharded (FSDP), so nothing was exported; export in one "
                f"process: grpo-lightning export --config <this run's config> --ckpt_path "
                f"{best or '<a checkpoint>'} --out {out_dir}"
            )
            return
        if trainer.is_global_zero:
            export_policy(
                pl_module,
                out_dir,
                ckpt_path=best,
                merge_lora=self.merge_lora,
                model_attr=self.model_attr,
                tokenizer_attr=self.tokenizer_attr,
            )
            rank_zero_info(f"exported {'the final weights' if best is None else best} to {out_dir}")
        self.exported_from = best
