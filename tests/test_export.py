"""Exporting the policy: the best checkpoint at the end of fit, on demand from a checkpoint, LoRA merged
or as an adapter; every export reloads with AutoModelForCausalLM and decodes the module's greedy tokens."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.cli import build_cli
from grpo_lightning.core.generation.sampling import SamplingSettings, generate_completions
from grpo_lightning.io.export import export_policy
from grpo_lightning.io.models import LoraOptions
from grpo_lightning.training.callbacks.export_best import ExportBestCallback
from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import GSM8K_DIR, length_reward, tiny_module

PROMPTS = [
    [{"role": "user", "content": "Tom has 3 apples and gets 4 more. How many?"}],
    [{"role": "user", "content": "A robe takes 2 bolts of blue fiber. How many in total?"}],
]


class ScriptedAccuracy(GRPOModule):
    """Validation reports 0.2, 0.6, 0.4 in turn without generating: the best is the second."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.validations = 0

    def validation_step(self, batch, batch_idx) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/accuracy", (0.2, 0.6, 0.4)[self.validations])
        self.validations += 1


def fit(module: GRPOModule, root, steps: int, callbacks: list, validate: bool = True) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        val_check_interval=1,
        limit_val_batches=None if validate else 0,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    trainer.fit(module, GSM8KDataModule(GSM8K_DIR, batch_size=2, val_size=1, train_size=16))
    return trainer


def greedy_tokens(model, tokenizer, module: GRPOModule) -> torch.Tensor:
    """What the exported model decodes greedily for PROMPTS, prompts encoded exactly as the module does."""
    ids, mask = module.rollouts.encoder.encode(PROMPTS, "cpu")
    return generate_completions(
        model,
        ids,
        mask,
        SamplingSettings(
            max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
        ),
        num_generations=1,
        do_sample=False,
    ).completion_ids  # [2, T]


def policy_weights(ckpt_path: str) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}


@pytest.fixture(scope="module")
def best_run(tiny_model_dir: str, tmp_path_factory):
    """Three steps with validation after each, keeping the best (step 2) and the latest checkpoint."""
    root = tmp_path_factory.mktemp("best_run")
    # The checkpoints of configs/gsm8k_qwen2.5_0.5b.yaml. save_on_train_epoch_end=False: else
    # `val_check_interval=1` (== 1.0) makes Lightning save only at the train epoch's end, with whatever
    # val/accuracy came last. The latest weights need a checkpoint of their own: Lightning 2.6's
    # `save_last` only writes when the top-k one did, so its `last.ckpt` would hold step 2's weights.
    best = ModelCheckpoint(
        root / "ckpt",
        monitor="val/accuracy",
        mode="max",
        save_on_train_epoch_end=False,
        auto_insert_metric_name=False,
        filename="step{step}-acc{val/accuracy:.2f}",
    )
    latest = ModelCheckpoint(root / "ckpt", save_on_train_epoch_end=False, filename="latest-{step}")
    export = ExportBestCallback(out_dir=str(root / "export"))
    module = tiny_module(tiny_model_dir, ScriptedAccuracy, [length_reward], learning_rate=1e-2)
    fit(module, root, 3, [latest, best, export])
    return module, root, export


def test_fit_exports_the_best_checkpoint(best_run) -> None:
    module, root, export = best_run
    # The template names the file; with auto-inserted `val/accuracy=` the `/` would open a sub-folder.
    assert sorted(os.listdir(root / "ckpt")) == ["latest-step=3.ckpt", "step2-acc0.60.ckpt"]
    assert export.exported_from == str(root / "ckpt" / "step2-acc0.60.ckpt")

    best = policy_weights(export.exported_from)
    last = policy_weights(str(root / "ckpt" / "latest-step=3.ckpt"))
    model = AutoModelForCausalLM.from_pretrained(root / "export")
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    exported = model.state_dict()
    assert exported.keys() == best.keys()
    assert all(torch.equal(exported[k], best[k]) for k in best)
    assert not all(torch.equal(best[k], last[k]) for k in best)  # the third step did change the weights

    # The module now holds the best weights too; the export decodes exactly its greedy tokens.
    rollout, _ = module.rollouts.sample(PROMPTS, 1, do_sample=False)
    assert torch.equal(greedy_tokens(model, tokenizer, module), rollout.completion_ids)


def test_export_from_a_checkpoint(best_run, tiny_model_dir: str, tmp_path) -> None:
    _, root, _ = best_run
    last_ckpt = str(root / "ckpt" / "latest-step=3.ckpt")
    out = export_policy(GRPOModule(tiny_model_dir), str(tmp_path / "from_last"), ckpt_path=last_ckpt)
    last = policy_weights(last_ckpt)
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert exported.keys() == last.keys()
    assert all(torch.equal(exported[k], last[k]) for k in last)
    template = AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert AutoTokenizer.from_pretrained(out).chat_template == template


def test_lora_exports_merged_or_as_adapter(tiny_model_dir: str, tmp_path) -> None:
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[length_reward],
        module_options={"lora": LoraOptions(r=4, alpha=8)},
        learning_rate=1e-2,
    )
    fit(module, tmp_path, 1, [ModelCheckpoint(tmp_path / "ckpt", filename="lora")], validate=False)
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if "lora_B" in n)
    rollout, _ = module.rollouts.sample(PROMPTS, 1, do_sample=False)

    # The command's config names no LoRA: the module is rebuilt with the checkpoint's own options.
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  policy: {tiny_model_dir}\ntrainer:\n  logger: false\n")
    merged_dir = str(tmp_path / "merged")
    build_cli(
        [
            "export",
            "--config",
            str(config),
            "--ckpt_path",
            str(tmp_path / "ckpt" / "lora.ckpt"),
            "--out",
            merged_dir,
        ]
    )
    adapter_dir = export_policy(module, str(tmp_path / "adapter"), merge_lora=False)
    assert isinstance(module.policy, PeftModel)  # merging worked on a copy: the live adapter is intact
    assert sorted(f for f in os.listdir(adapter_dir) if f.startswith("adapter_")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name in merged.state_dict())  # a plain model
    adapted = AutoModelForCausalLM.from_pretrained(adapter_dir)  # transformers adds the adapter to the base
    assert any("lora" in name for name in adapted.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    for model in (merged, adapted):
        assert torch.equal(greedy_tokens(model, tokenizer, module), rollout.completion_ids)


class RunsCode:
    """Unpickling this creates a folder: what a checkpoint loaded with weights_only=False could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_export_never_runs_code_from_a_checkpoint(best_run, tiny_model_dir: str, tmp_path) -> None:
    _, root, _ = best_run
    checkpoint = torch.load(root / "ckpt" / "latest-step=3.ckpt", weights_only=True)  # ours loads
    marker = tmp_path / "ran"
    torch.save(checkpoint | {"payload": RunsCode(str(marker))}, tmp_path / "tampered.ckpt")
    with pytest.raises(ValueError, match="it holds Python objects that safe loading refuses"):
        export_policy(
            GRPOModule(tiny_model_dir), str(tmp_path / "out"), ckpt_path=str(tmp_path / "tampered.ckpt")
        )
    assert not marker.exists()
