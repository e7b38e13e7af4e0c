"""The rules of `cli.py from-trl` for TRL's `TrainingArguments`: batch sizes, the run's length, the
learning-rate schedule, precision and evaluation, which live in the trainer, the data module's batch and
the module's options here, or are counted in other units (checkpoints and logging: `output_rules`).
"""

from __future__ import annotations

import math

from grpo_lightning.core.algorithm.schedules import SCHEDULES, OptimizerOptions
from grpo_lightning.core.options import trl_value
from grpo_lightning.from_trl.conversion import (
    Conversion,
    Rules,
    Unsupported,
    grpo_key,
    optimizer_steps_per_batch,
    ratio_of_run,
)

RUN_RULES = Rules()


# ------------------------------------------------------------------------------------------------ batches
@RUN_RULES(
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
)
def batch_sizes(c: Conversion) -> None:
    """TRL counts completions per device and forward/backward pass (0.14: prompts), accumulates
    `gradient_accumulation_steps` passes per optimizer step and samples `steps_per_generation` passes'
    worth at once; here `data.batch_size` is prompts per rank and rollout, each sampled G times,
    `micro_batch_size` completions per forward/backward, `steps_per_generation` optimizer steps per
    rollout."""
    group = c.get("num_generations", 8)
    per_device = c.get("per_device_train_batch_size", 8)
    accumulation = c.get("gradient_accumulation_steps", 1)
    devices = c.devices or 1
    micro = per_device * group if not c.at_least("0.15") else per_device  # completions per pass
    passes = c.get("steps_per_generation") or accumulation  # passes per rollout
    if c.get("generation_batch_size"):
        generated = c.get("generation_batch_size")
        if generated % (micro * devices):
            raise ValueError(
                f"generation_batch_size={generated} is not a multiple of per_device_train_batch_size x "
                f"devices = {micro * devices}, as TRL requires"
            )
        passes = generated // (micro * devices)
    if passes % accumulation:
        raise Unsupported(
            f"a rollout of {passes} passes is not a whole number of optimizer steps of {accumulation} "
            "passes: here a rollout makes whole optimizer steps; set steps_per_generation to a multiple of "
            "gradient_accumulation_steps"
        )
    completions = micro * passes  # per device and rollout
    prompts = math.ceil(completions / group)
    c.put("data.init_args.batch_size", prompts)
    if passes > 1:
        c.put(grpo_key("micro_batch_size"), micro)
    if passes // accumulation > 1:
        c.put(grpo_key("steps_per_generation"), passes // accumulation)
    split = f"{prompts} prompts x {group} completions per rank"
    if completions % group:
        total = completions * devices
        spans = f"{total // group} prompts over {devices} devices" if total % group == 0 else "TRL refuses it"
        ask = "" if c.devices else ": give --devices, the recipe's process count"
        split += (
            f" (rounded up: TRL's {completions} completions per device are not whole groups of {group}; "
            f"{spans}; here each rank samples whole groups{ask})"
        )
    unit = "prompts" if not c.at_least("0.15") else "completions"
    c.row(
        "per_device_train_batch_size",
        "converted",
        "data.init_args.batch_size" + (f", {grpo_key('micro_batch_size')}" if passes > 1 else ""),
        f"TRL {c.version} counts {unit} per device and forward pass: {split}"
        + (f", in micro-batches of {micro}" if passes > 1 else ""),
    )
    c.row(
        "gradient_accumulation_steps",
        "converted",
        f"data.init_args.batch_size, {grpo_key('micro_batch_size')}",
        f"{accumulation} passes per optimizer step: their completions are one step's batch here, in "
        f"micro-batches of {micro} (what trainer.accumulate_grad_batches={accumulation} maps to)",
    )
    for key in ("steps_per_generation", "generation_batch_size"):
        c.row(
            key,
            "converted",
            grpo_key("steps_per_generation"),
            f"TRL counts forward/backward passes: {passes} passes of {accumulation} per optimizer step are "
            f"{passes // accumulation} optimizer step(s) per rollout",
        )


# ---------------------------------------------------------------------------------------- run's length
@RUN_RULES("max_steps", "num_train_epochs")
def run_length(c: Conversion) -> None:
    max_steps = c.get("max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        c.row("max_steps", "mapped", c.put("trainer.max_steps", max_steps), "optimizer steps in both")
        c.row("num_train_epochs", "mapped", "", "no effect: max_steps bounds the run, in TRL too")
        return
    c.row("max_steps", "mapped", "trainer.max_steps", "-1: the epochs bound the run, in both")
    epochs = c.get("num_train_epochs", 3.0)
    if float(epochs).is_integer():
        c.row("num_train_epochs", "mapped", c.put("trainer.max_epochs", int(epochs)))
    elif 0 < epochs < 1:
        c.put("trainer.max_epochs", 1)
        c.put("trainer.limit_train_batches", epochs)
        c.row(
            "num_train_epochs",
            "converted",
            "trainer.max_epochs, trainer.limit_train_batches",
            f"a share of one epoch: max_epochs 1 with limit_train_batches {epochs}",
        )
    else:
        c.row(
            "num_train_epochs",
            "unsupported",
            "",
            "Lightning runs whole epochs: set trainer.max_epochs, or trainer.max_steps to TRL's count "
            "(epochs x rows / prompts per step)",
        )


# --------------------------------------------------------------------------------- learning-rate schedule
@RUN_RULES("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps")
def schedule(c: Conversion) -> None:
    name = c.get("lr_scheduler_type", "linear")
    ours, _ = trl_value(OptimizerOptions, "lr_scheduler_type", name)
    if ours not in SCHEDULES:
        c.row(
            "lr_scheduler_type",
            "unsupported",
            "",
            f"TRL's {name!r} has no counterpart (ours: {', '.join(SCHEDULES)}, after a linear warm-up): "
            "the run keeps our default, constant",
        )
    else:
        spelled = "" if ours == name else f"TRL's {name!r} is {ours!r} here"
        c.put(grpo_key("lr_scheduler_type"), ours)
        c.row(
            "lr_scheduler_type", "converted" if spelled else "mapped", grpo_key("lr_scheduler_type"), spelled
        )
    _schedule_floor(c)
    _warmup(c, name)


def _schedule_floor(c: Conversion) -> None:
    """`lr_scheduler_kwargs`' floor (`min_lr_rate`, or `min_lr` in the learning rate's units) as ours."""
    kwargs = c.get("lr_scheduler_kwargs") or {}
    if not isinstance(kwargs, dict):
        c.row("lr_scheduler_kwargs", "unsupported", "", "not a mapping of the schedule's arguments")
        return
    floor = kwargs.get("min_lr_rate")
    if floor is None and "min_lr" in kwargs:
        floor = kwargs["min_lr"] / c.get("learning_rate", 1e-6)
    rest = sorted(
        k for k, v in kwargs.items() if k not in ("min_lr_rate", "min_lr") and (k, v) != ("num_cycles", 0.5)
    )
    floor_key = grpo_key("min_lr_ratio")
    if floor is not None:
        c.put(floor_key, floor)
    if rest:
        c.row("lr_scheduler_kwargs", "unsupported", "", f"{', '.join(rest)}: no counterpart in our schedules")
    elif floor is not None:
        c.row("lr_scheduler_kwargs", "converted", floor_key, "the floor as a share of learning_rate")
    else:
        c.row("lr_scheduler_kwargs", "mapped", "", "nothing to set")


def _warmup(c: Conversion, schedule_name: str) -> None:
    """The warm-up: `warmup_steps` in optimizer steps, or a share of the run (`warmup_ratio`, or a
    `warmup_steps` below 1, which transformers 5 reads as one), rounded up as transformers does."""
    key, ratio_key = grpo_key("warmup_steps"), grpo_key("warmup_ratio")
    steps, ratio = c.get("warmup_steps", 0), c.get("warmup_ratio", 0.0)
    if schedule_name == "constant" and (steps or ratio):
        c.put(key, 0)
        for name in ("warmup_steps", "warmup_ratio"):
            c.row(name, "converted", key, "no warm-up: transformers' 'constant' schedule ignores it")
        return
    if steps >= 1 or not (steps or ratio):
        c.row("warmup_steps", "mapped", c.put(key, int(steps)))
        note = "no effect: warmup_steps is set, and wins in transformers" if steps and ratio else ""
        c.row("warmup_ratio", "mapped", "", note)
        return
    if steps:  # below 1: a share
        note = "transformers 5 reads a value below 1 as a share"
        c.row("warmup_steps", "converted", c.put(ratio_key, steps), note)
        c.row("warmup_ratio", "mapped", "", "no effect: warmup_steps is set, and wins in transformers")
    else:
        c.row("warmup_ratio", "mapped", c.put(ratio_key, ratio))
        c.row("warmup_steps", "mapped", "", "0: the share sets the warm-up")


# ------------------------------------------------------------------------------------------- precision
MIXED = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


@RUN_RULES("bf16", "fp16", "torch_dtype", "dtype", "tf32")
def precision(c: Conversion) -> None:
    """TRL's `bf16` / `fp16` are mixed precision over the weights as loaded (`dtype`); here a mixed run keeps
    float32 weights (`bf16-mixed`): AdamW's small steps round away in bf16 weights (docs/from_trl.md)."""
    init = c.get("model_init_kwargs") or {}
    dtype_key = next((k for k in ("dtype", "torch_dtype") if c.has(k)), None)
    dtype = c.get(dtype_key) if dtype_key else init.get("dtype", init.get("torch_dtype"))
    # TRL (from 0.19) leaves bf16 unset as "not fp16": a recipe's fp16 wins over bf16's version default.
    fp16_wins = c.get("fp16") and "bf16" not in c.recipe
    chosen = "fp16" if fp16_wins else next((k for k in MIXED if c.get(k)), None)
    mixed = MIXED.get(chosen)
    options_dtype = "model.model_options.dtype"
    if mixed is not None:
        c.put("trainer.precision", mixed)
        c.put(options_dtype, "float32")
        for key in MIXED:
            c.row(key, "converted", "trainer.precision", f"{mixed}: float32 weights, {mixed[:-6]} compute")
        if dtype_key:
            c.row(
                dtype_key, "converted", options_dtype, f"float32 master weights under {mixed} (TRL: {dtype})"
            )
    else:
        c.put("trainer.precision", "32-true")
        for key in MIXED:
            c.row(key, "converted", "trainer.precision", "32-true: no mixed precision, the weights' dtype")
        if dtype_key and dtype is not None:
            c.row(dtype_key, "mapped", c.put(options_dtype, "auto" if dtype == "auto" else str(dtype)))
        elif dtype_key:
            c.row(dtype_key, "mapped", options_dtype, "None: float32, as ours")
    c.row(
        "tf32",
        "unsupported",
        "",
        "TF32 matmuls: torch.set_float32_matmul_precision('high') before the run (Lightning suggests it)",
    )


# -------------------------------------------------------------------------------------------- evaluation
@RUN_RULES(
    "eval_strategy",
    "evaluation_strategy",
    "do_eval",
    "eval_steps",
    "eval_on_start",
    "per_device_eval_batch_size",
    "num_generations_eval",
    "dataset_test_split",
)
def evaluation(c: Conversion) -> None:
    """TRL evaluates on the test split when `eval_strategy` is not "no" (and trains on every train row);
    here validation reads held-out rows (`val_size`) or the test split (`val_split: test`)."""
    strategy = c.get("eval_strategy", c.get("evaluation_strategy", "no"))
    c.row("do_eval", "mapped", "", "no effect in TRL's trainer: eval_strategy decides")
    if strategy == "no":
        c.put("data.init_args.val_size", 0)
        for key in ("eval_strategy", "evaluation_strategy"):
            c.row(key, "converted", "data.init_args.val_size", "no validation: val_size 0 (no rows held out)")
        for key in ("eval_steps", "eval_on_start", "per_device_eval_batch_size", "num_generations_eval"):
            c.row(key, "mapped", "", "no effect without evaluation, in TRL too")
        c.row("dataset_test_split", "mapped", "", "no effect without evaluation, in TRL too")
        return
    split = c.get("dataset_test_split", "test")
    if split != "test":
        raise Unsupported(f"dataset_test_split={split!r}: ours validates on the split named 'test'")
    c.put("data.init_args.val_split", "test")
    c.put("data.init_args.val_size", 64)
    c.put("trainer.num_sanity_val_steps", 0)  # TRL evaluates nothing before training
    c.row("dataset_test_split", "mapped", "data.init_args.val_split", "test")
    for key in ("eval_strategy", "evaluation_strategy"):
        c.row(
            key,
            "converted",
            "data.init_args.val_split, data.init_args.val_size, trainer.num_sanity_val_steps",
            "validation on the first 64 rows of the test split (val_size; TRL evaluates all of it), none "
            "before training (num_sanity_val_steps 0)",
        )
    if strategy == "steps":
        every = c.get("eval_steps") or c.get("logging_steps", 500)
        if every < 1:
            every = ratio_of_run(c, every)
        if every is None:
            c.row(
                "eval_steps",
                "unsupported",
                "",
                "a share of the run needs max_steps: set trainer.val_check_interval",
            )
        else:
            batches = math.ceil(every / optimizer_steps_per_batch(c))
            c.put("trainer.val_check_interval", batches)
            c.put("trainer.check_val_every_n_epoch", None)
            c.row(
                "eval_steps",
                "converted",
                "trainer.val_check_interval",
                f"every {batches} training steps ({every} optimizer steps)",
            )
    group = c.get("num_generations_eval") or c.get("num_generations", 8)
    c.put("model.num_generations_eval", group)
    c.row("num_generations_eval", "mapped", "model.num_generations_eval")
    if c.get("per_device_eval_batch_size"):
        prompts = max(1, c.get("per_device_eval_batch_size") // group)
        c.row(
            "per_device_eval_batch_size",
            "converted",
            c.put("data.init_args.val_batch_size", prompts),
            f"TRL counts completions: {prompts} prompts x {group}",
        )
    started = bool(c.get("eval_on_start"))
    c.row(
        "eval_on_start",
        "unsupported" if started else "mapped",
        "",
        "cli.py validate --config ... scores the untrained policy" if started else "none before training",
    )
    funcs = c.read("model.reward_funcs") or []
    judge = next((f for f in funcs if "accuracy" in f), funcs[0] if funcs else None)
    if judge is not None:
        c.put("model.val_reward", judge)
        c.needs.append(f"model.val_reward: {judge} judges the validation completions (val/accuracy)")
