"""Every shipped config trains: 2 steps of each YAML in configs/, with its precision, weight dtype, LoRA,
strategy and algorithm options, on CPU with a tiny model and a dense reward substituted; most trainable
weights must move. A bf16 copy of a weight does not move under an update below half its ulp: the shipped
one-GPU config once trained bf16 weights at lr 1e-6 and changed 0.2% of them in 2 steps."""

from __future__ import annotations

import glob
import os
from unittest import mock

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.strategies import ModelParallelStrategy

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.models import LoraOptions, ModelOptions
from grpo_lightning.training.callbacks.preflight import share_of_weights_updated
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import length_reward, quiet_trainer

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))
SMALL = {  # the rollout's size only: everything that decides the update's precision is the config's
    "num_generations": 4,
    "max_completion_length": 8,
    "max_prompt_length": 64,
    "micro_batch_size": None,
    "log_completions_every": 0,
    "preflight": False,
}


class TrainableWeights(L.Callback):
    """The trainable weights when training starts (after the precision plugin converted them) and ends."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    @staticmethod
    def snapshot(module: GRPOModule) -> dict[str, torch.Tensor]:
        local = {
            n: getattr(p, "_local_tensor", p) for n, p in module.policy.named_parameters() if p.requires_grad
        }
        return {
            n: p.detach().clone() for n, p in local.items()
        }  # FSDP2, world size 1: the shard is the whole

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self.snapshot(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = self.snapshot(pl_module)


def strategy_of(trainer_cfg: dict) -> str | ModelParallelStrategy:
    """The config's strategy on one CPU process: FSDP2 keeps its sharding and mixed-precision policy."""
    strategy = trainer_cfg.get("strategy", "auto")
    if isinstance(strategy, dict) and strategy["class_path"].endswith("ModelParallelStrategy"):
        return ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=1, process_group_backend="gloo"
        )
    assert strategy == "auto", f"no CPU stand-in for strategy {strategy!r}"
    return strategy


def two_steps_of(path: str, model_dir: str, tmp_path, **grpo) -> tuple[GRPOModule, float]:
    """2 training steps of the config at `path` on `model_dir` (`grpo` overriding its options): the module
    and the share of its trainable weights that moved."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    trainer_cfg, model_cfg = cfg["trainer"], cfg["model"]
    options = model_cfg.get("model_options", {})
    lora = model_cfg.get("lora")
    config = GRPOConfig(**model_cfg.get("grpo", {}))  # the config's sections
    # A prompt that shows tools is never cut (the Hermes system prompt, for a template without tools): whole.
    small = SMALL | ({"max_prompt_length": None} if model_cfg.get("tools") else {})
    for name, value in (small | grpo).items():  # by flat name: each replaces its section's value
        setattr(config, name, value)
    L.seed_everything(0)
    module = GRPOModule(
        model_dir,
        reward_funcs=[length_reward],
        grpo=config,
        tools=model_cfg.get("tools"),  # multi-turn rollouts, for a config that gives the policy tools
        model_options=ModelOptions(
            dtype=options.get("dtype", "float32"),
            gradient_checkpointing=options.get("gradient_checkpointing", False),
        ),
        lora=LoraOptions(**lora) if lora else None,
    )
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
    )
    weights = TrainableWeights()
    trainer = quiet_trainer(
        strategy=strategy_of(trainer_cfg),
        devices=1,
        precision=trainer_cfg.get("precision", "32-true"),
        max_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[weights],
        default_root_dir=str(tmp_path),
    )
    # The strategy sets MASTER_PORT, WORLD_SIZE... in this process: restored, for later subprocesses.
    with mock.patch.dict(os.environ):
        try:
            trainer.fit(module, data)
        finally:
            close_process_group()
    assert trainer.global_step == 2
    moved = sum(int((weights.start[n] != weights.end[n]).sum()) for n in weights.start)
    return module, moved / sum(w.numel() for w in weights.start.values())


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_moves_most_trainable_weights_in_two_steps(path, tiny_model_dir, tmp_path):
    module, moved = two_steps_of(path, tiny_model_dir, tmp_path)
    # Embedding rows of tokens never seen get no gradient (13% of the tiny model's weights); LoRA's A
    # matrices get their first gradient in the second step (B starts at 0). bf16 weights at lr 1e-6: 0.2%.
    assert moved > (0.4 if module.lora else 0.8), f"{moved:.1%} of the trainable weights moved"


@pytest.mark.parametrize(
    ("dtype", "lr", "low", "high"),
    [(torch.bfloat16, 1e-6, 0.0, 0.05), (torch.bfloat16, 1e-2, 0.95, 1.0), (torch.float32, 1e-6, 0.95, 1.0)],
)
def test_share_of_weights_an_update_changes(dtype, lr, low, high):
    torch.manual_seed(0)
    weights = [torch.randn(300, 200, dtype=dtype) * 0.02, torch.ones(200, dtype=dtype)]  # a matrix, a norm
    share = share_of_weights_updated(weights, lr)
    assert low <= share <= high
    # The same as stepping each weight by lr in its own dtype, as the optimizer writes it back.
    stepped = sum(int((w.float().add(lr).to(dtype) != w).sum()) for w in weights) / sum(
        w.numel() for w in weights
    )
    assert share == pytest.approx(stepped)


def test_preflight_warns_when_bf16_weights_would_not_move(tiny_model_dir, tmp_path):
    module = GRPOModule(
        tiny_model_dir,
        reward_funcs=[length_reward],
        grpo=GRPOConfig(**(SMALL | {"preflight": True, "learning_rate": 1e-6})),
    )
    data = GSM8KDataModule(
        source="arithmetic", system_prompt=None, arithmetic_size=30, batch_size=2, val_size=2
    )
    trainer = quiet_trainer(
        precision="bf16-true", max_steps=1, limit_val_batches=0, default_root_dir=str(tmp_path)
    )
    with pytest.warns(UserWarning, match=r"bfloat16 and an update .* changes only \d\.\d% of them") as caught:
        trainer.fit(module, data)
    (problem,) = [str(w.message) for w in caught if "round away" in str(w.message)]
    share = float(problem.split("changes only ")[1].split("%")[0])
    assert share < 5, problem
