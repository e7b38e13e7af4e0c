"""Amazon SageMaker training entry point: SageMaker's environment onto the LightningCLI.

SageMaker (script mode, through the `sagemaker-training` toolkit of its PyTorch images) runs
`python grpo_lightning/sagemaker.py --name value ...` with the job's hyperparameters as arguments and
describes the job in `SM_*` environment variables. This maps them onto `grpo-lightning fit`:

    SM_CHANNEL_TRAINING   --data.source       (a folder with train.jsonl, and test.jsonl for val_split=test)
    SM_CHANNEL_MODEL      --model.policy      (optional: the base model as a save_pretrained folder)
    SM_NUM_GPUS           --trainer.accelerator gpu --trainer.devices N (cpu and 1 device when 0)
    SM_HOSTS              --trainer.num_nodes, and MASTER_ADDR / MASTER_PORT / NODE_RANK for Lightning
    SM_OUTPUT_DATA_DIR    --trainer.default_root_dir (logs and checkpoints, uploaded with the output)
    hyperparameters       --<name> <value>, after the above so that they override them; `config` is the
                          YAML (`--config configs/...yaml`, relative to the source directory)

After training, the policy is written to SM_MODEL_DIR as a plain Hugging Face folder (LoRA merged), which
SageMaker uploads as `model.tar.gz`. Every training step prints `reward: <float>` (and every validation
`val_accuracy: <float>`) on rank 0, for the estimator's `metric_definitions` (METRIC_DEFINITIONS).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

import lightning as L

from grpo_lightning.cli import build_cli
from grpo_lightning.io.export import export_policy
from grpo_lightning.training.module import GRPOModule

METRIC_DEFINITIONS = [
    {"Name": "reward", "Regex": r"reward: ([-+0-9.eE]+|nan)"},
    {"Name": "val_accuracy", "Regex": r"val_accuracy: ([-+0-9.eE]+|nan)"},
]
DEFAULT_MASTER_PORT = "29500"


def hyperparameters(argv: list[str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    """`--name value` / `--name=value` pairs from the command line, else from SM_HPS (a JSON object)."""
    if not argv:
        stored = json.loads(env.get("SM_HPS", "{}"))
        return [(name, v if isinstance(v, str) else json.dumps(v)) for name, v in stored.items()]
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"hyperparameter {arg!r}: expected --name value")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ValueError(f"hyperparameter {arg!r} has no value")
            name, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((name, value))
    return pairs


def cli_args(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """The `grpo-lightning fit` arguments for this SageMaker job: the config, the mapped environment, then
    every other hyperparameter (last, so that an explicit hyperparameter wins)."""
    pairs = hyperparameters(argv, env)
    args = [arg for name, value in pairs if name == "config" for arg in ("--config", value)]
    if "SM_CHANNEL_TRAINING" in env:
        args += ["--data.source", env["SM_CHANNEL_TRAINING"]]
    if "SM_CHANNEL_MODEL" in env:
        args += ["--model.policy", env["SM_CHANNEL_MODEL"]]
    gpus = int(env.get("SM_NUM_GPUS", "0"))
    args += (
        ["--trainer.accelerator", "gpu", "--trainer.devices", str(gpus)]
        if gpus
        else ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    )
    hosts = json.loads(env.get("SM_HOSTS", "[]"))
    if len(hosts) > 1:
        args += ["--trainer.num_nodes", str(len(hosts))]
    if "SM_OUTPUT_DATA_DIR" in env:
        args += ["--trainer.default_root_dir", env["SM_OUTPUT_DATA_DIR"]]
    args += [arg for name, value in pairs if name != "config" for arg in (f"--{name}", value)]
    return args


def cluster_env(env: Mapping[str, str]) -> dict[str, str]:
    """What Lightning's default cluster environment reads to join the nodes: the first host is the master."""
    hosts = json.loads(env.get("SM_HOSTS", "[]"))
    if len(hosts) <= 1:
        return {}
    return {
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": env.get("MASTER_PORT", DEFAULT_MASTER_PORT),
        "NODE_RANK": str(hosts.index(env["SM_CURRENT_HOST"])),
    }


class MetricLines(L.Callback):
    """Prints `reward: <float>` after each training step and `val_accuracy: <float>` after each validation,
    on rank 0 only, for SageMaker's metric regexes (CloudWatch)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if trainer.is_global_zero and "train/reward" in trainer.callback_metrics:
            print(f"reward: {float(trainer.callback_metrics['train/reward']):.6f}", flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and "val/accuracy" in trainer.callback_metrics:
            print(f"val_accuracy: {float(trainer.callback_metrics['val/accuracy']):.6f}", flush=True)


def export_trained(trainer: L.Trainer, module: GRPOModule, out_dir: str) -> None:
    """Save the final checkpoint (sharded under FSDP) and write its policy to `out_dir` from rank 0."""
    ckpt = os.path.join(trainer.default_root_dir, "final.ckpt")
    trainer.save_checkpoint(ckpt)  # every rank: under FSDP each writes its own shards
    if trainer.is_global_zero:
        # A fresh, unsharded module of the same model: the live one may be sharded across the ranks.
        fresh = GRPOModule(
            module.policy_source,
            tokenizer=module.tokenizer,
            reward_funcs=module.reward_funcs,
            model_options=module.model_options,
            lora=module.lora,
        )
        export_policy(fresh, out_dir, ckpt_path=ckpt)  # reads a sharded folder's policy tensors directly
    trainer.strategy.barrier()


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else argv
    os.environ.update(cluster_env(env))
    cli = build_cli(cli_args(argv, env), run=False)
    cli.trainer.callbacks.append(MetricLines())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    export_trained(cli.trainer, cli.model, env.get("SM_MODEL_DIR", "/opt/ml/model"))


if __name__ == "__main__":
    main()
