"""The rules of `cli.py from-trl` for what a run writes: TRL's checkpoints (`save_*`, a Lightning
`ModelCheckpoint` here) and its logging (`logging_*`, `report_to`: Lightning's loggers; `log_completions`:
the completions tables).
"""

from __future__ import annotations

import math
import os

from grpo_lightning.from_trl.conversion import (
    Conversion,
    Rules,
    Unsupported,
    grpo_key,
    optimizer_steps_per_batch,
    ratio_of_run,
)

OUTPUT_RULES = Rules()
CHECKPOINT_CLASS = "lightning.pytorch.callbacks.ModelCheckpoint"


# ------------------------------------------------------------------------------------------- checkpoints
@OUTPUT_RULES(
    "output_dir",
    "overwrite_output_dir",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "save_only_model",
    "save_safetensors",
    "resume_from_checkpoint",
)
def checkpoints(c: Conversion) -> None:
    if c.has("output_dir"):
        c.row("output_dir", "mapped", c.put("trainer.default_root_dir", c.get("output_dir")))
    c.row("overwrite_output_dir", "mapped", "", "each fit writes a new version folder: nothing to overwrite")
    c.row("save_safetensors", "mapped", "", "cli.py export writes safetensors")
    c.row(
        "save_only_model",
        "unsupported" if c.get("save_only_model") else "mapped",
        "",
        "a checkpoint holds the optimizer's state too; cli.py export writes the model alone",
    )
    c.row("resume_from_checkpoint", "unsupported", "", "cli.py fit --ckpt_path FILE (or last)")
    strategy = c.get("save_strategy", "steps")
    limit = c.get("save_total_limit")
    keep = -1 if limit is None or limit > 1 else limit
    every: dict[str, int] = {}
    if strategy == "no":
        c.row("save_strategy", "converted", c.put("trainer.enable_checkpointing", False), "no checkpoints")
        c.row("save_steps", "mapped", "", "no effect without save_strategy steps, in TRL too")
    elif strategy == "epoch":
        every = {"every_n_epochs": 1}
        c.row("save_steps", "mapped", "", "no effect without save_strategy steps, in TRL too")
    elif strategy == "steps":
        steps = c.get("save_steps", 500)
        steps = ratio_of_run(c, steps) if steps < 1 else int(steps)
        if steps is None:
            c.row(
                "save_steps", "unsupported", "", "a share of the run needs max_steps: set every_n_train_steps"
            )
            c.row(
                "save_strategy",
                "unsupported",
                "",
                "see save_steps: add a ModelCheckpoint(every_n_train_steps=N)",
            )
        else:
            per_batch = optimizer_steps_per_batch(c)
            steps = math.ceil(steps / per_batch) * per_batch  # checkpoints fall between training steps
            every = {"every_n_train_steps": steps}
            c.row(
                "save_steps",
                "converted",
                "trainer.callbacks",
                f"a ModelCheckpoint every {steps} optimizer steps",
            )
    else:
        c.row(
            "save_strategy",
            "unsupported",
            "",
            f"{strategy!r}: add a ModelCheckpoint callback monitoring a val/ metric",
        )
    if every:
        callback = {"class_path": CHECKPOINT_CLASS, "init_args": {**every, "save_top_k": keep}}
        c.put("trainer.callbacks", [callback])
        c.row("save_strategy", "converted", "trainer.callbacks", f"a ModelCheckpoint ({', '.join(every)})")
    if not every:
        c.row("save_total_limit", "mapped", "", "no effect without checkpoints")
    elif limit is None or limit == 1:
        c.row("save_total_limit", "converted", "trainer.callbacks", f"save_top_k {keep}")
    else:
        c.row(
            "save_total_limit",
            "unsupported",
            "trainer.callbacks",
            "every checkpoint is kept: a ModelCheckpoint keeps the K newest only of a monitored metric "
            "(delete older ones, or monitor one)",
        )


# ---------------------------------------------------------------------------------------------- logging
LOGGERS = {  # TRL's report_to names -> Lightning's logger and the options a recipe sets for it
    "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
    "wandb": "lightning.pytorch.loggers.WandbLogger",
    "mlflow": "lightning.pytorch.loggers.MLFlowLogger",
    "comet_ml": "lightning.pytorch.loggers.CometLogger",
}
WANDB_OPTIONS = {"wandb_project": "project", "wandb_entity": "entity", "wandb_run_group": "group"}


# -------------------------------------------------------------------------------------------- the Hub
@OUTPUT_RULES("push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token")
def hub(c: Conversion) -> None:
    push = bool(c.get("push_to_hub", False))
    if not push:
        c.row("push_to_hub", "mapped", "", "False: no push")
        for key in ("hub_model_id", "hub_strategy", "hub_private_repo", "hub_token"):
            c.row(key, "mapped", "", "no effect without push_to_hub, in TRL too")
        return
    # TRL's repo when hub_model_id is unset: the output folder's name, in the user's namespace.
    repo = c.get("hub_model_id") or os.path.basename(os.path.normpath(c.get("output_dir") or "")) or "REPO"
    private = bool(c.get("hub_private_repo"))
    flags = f"--push-to-hub {repo}" + (" --private true" if private else "")
    push = f"cli.py export {flags}"
    command = f"cli.py export --config RUN/config.yaml --ckpt_path last {flags}"
    c.row("push_to_hub", "converted", push, f"pushed once, after training: {command}")
    c.row("hub_model_id", "converted", push, "the repo of the export's push after training")
    if private:
        c.row("hub_private_repo", "converted", "cli.py export --private true", "the push creates it private")
    else:
        c.row("hub_private_repo", "mapped", "", "the Hub's default visibility")
    c.row("hub_strategy", "converted", push, "the export pushes the final model once, not at each save")
    if c.get("hub_token") is not None:
        c.row("hub_token", "unsupported", "", "no token in the config: set HF_TOKEN, or hf auth login")
    else:
        c.row("hub_token", "mapped", "", "huggingface_hub's token: HF_TOKEN or the cached login")


@OUTPUT_RULES(
    "logging_steps",
    "logging_strategy",
    "logging_first_step",
    "logging_dir",
    "log_level",
    "log_level_replica",
    "log_on_each_node",
    "report_to",
    "run_name",
    "disable_tqdm",
    "log_completions",
    *WANDB_OPTIONS,
)
def logging(c: Conversion) -> None:
    steps = c.get("logging_steps", 500)
    steps = ratio_of_run(c, steps) if steps < 1 else int(steps)
    if steps is None:
        c.row(
            "logging_steps",
            "unsupported",
            "",
            "a share of the run needs max_steps: set trainer.log_every_n_steps",
        )
    else:
        c.row("logging_steps", "mapped", c.put("trainer.log_every_n_steps", steps))
    strategy = c.get("logging_strategy", "steps")
    c.row(
        "logging_strategy",
        "mapped" if strategy == "steps" else "unsupported",
        "",
        "every log_every_n_steps"
        if strategy == "steps"
        else "Lightning logs by steps: set trainer.log_every_n_steps",
    )
    first = bool(c.get("logging_first_step"))
    c.row("logging_first_step", "mapped", c.put(grpo_key("logging_first_step"), first))
    for key, hint in (
        ("log_level", "Lightning's messages: logging.getLogger('lightning.pytorch').setLevel(...)"),
        ("log_level_replica", "the other ranks print nothing but warnings here"),
        ("log_on_each_node", "rank 0 logs, once"),
    ):
        c.row(key, "unsupported", "", hint)
    every = (steps or 1) if c.get("log_completions") else 0
    c.row(
        "log_completions",
        "converted",
        c.put(grpo_key("log_completions_every"), every),
        f"a table of completions every {every} steps, as TRL logs them"
        if every
        else "0: no completion tables",
    )
    if c.has("disable_tqdm"):
        c.row("disable_tqdm", "converted", c.put("trainer.enable_progress_bar", not c.get("disable_tqdm")))
    targets = c.get("report_to", "all")  # transformers 4's default; 5's is "none"
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if not c.has("report_to"):
        pass  # Lightning's default logger
    elif targets in ([], ["none"]):
        c.row("report_to", "converted", c.put("trainer.logger", False), "no logger")
    elif targets == ["all"]:
        c.row("report_to", "mapped", "trainer.logger", "Lightning's default logger (TensorBoard)")
    else:
        loggers = []
        for name in targets:
            if name not in LOGGERS:
                raise Unsupported(f"report_to {name!r}: Lightning's loggers here are {', '.join(LOGGERS)}")
            init = (
                {"save_dir": c.get("logging_dir") or c.get("output_dir", ".")} if name != "comet_ml" else {}
            )
            if c.get("run_name"):
                init["name"] = c.get("run_name")
            logger = {"class_path": LOGGERS[name], "init_args": init}
            if name == "wandb":  # `project` is WandbLogger's own; the rest go to wandb.init
                if c.get("wandb_project"):
                    init["project"] = c.get("wandb_project")
                passed = {
                    ours: c.get(key)
                    for key, ours in WANDB_OPTIONS.items()
                    if c.get(key) and ours != "project"
                }
                if passed:
                    logger["dict_kwargs"] = passed
            loggers.append(logger)
        c.put("trainer.logger", loggers if len(loggers) > 1 else loggers[0])
        c.row(
            "report_to",
            "converted",
            "trainer.logger",
            ", ".join(LOGGERS[n].rsplit(".", 1)[1] for n in targets),
        )
    wandb = "wandb" in targets
    for key in (*WANDB_OPTIONS, "run_name", "logging_dir"):
        used = wandb if key in WANDB_OPTIONS else bool(targets) and targets not in (["none"], ["all"])
        c.row(
            key,
            "converted" if used else "mapped",
            "trainer.logger" if used else "",
            "" if used else "no logger reads it",
        )
