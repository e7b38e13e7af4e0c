"""The SageMaker entry point, offline: the environment a SageMaker job would set, no AWS."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.sagemaker import METRIC_DEFINITIONS, cli_args, cluster_env, hyperparameters, main
from tests.helpers import gsm8k_rows

SM_ENV = {
    "SM_MODEL_DIR": "/opt/ml/model",
    "SM_CHANNEL_TRAINING": "/opt/ml/input/data/training",
    "SM_CHANNEL_MODEL": "/opt/ml/input/data/model",
    "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
    "SM_NUM_GPUS": "8",
    "SM_HOSTS": '["algo-1", "algo-2"]',
    "SM_CURRENT_HOST": "algo-2",
}


def test_environment_and_hyperparameters_map_onto_the_cli():
    argv = ["--model.grpo.beta", "0.04", "--config", "configs/fsdp_7b_8gpu.yaml", "--trainer.max_steps=5"]
    assert cli_args(argv, SM_ENV) == [
        "--config",
        "configs/fsdp_7b_8gpu.yaml",
        "--data.source",
        "/opt/ml/input/data/training",
        "--model.policy",
        "/opt/ml/input/data/model",
        "--trainer.accelerator",
        "gpu",
        "--trainer.devices",
        "8",
        "--trainer.num_nodes",
        "2",
        "--trainer.default_root_dir",
        "/opt/ml/output/data",
        "--model.grpo.beta",
        "0.04",
        "--trainer.max_steps",
        "5",
    ]
    # A CPU instance, one host, no channels: only the device flags are added.
    assert cli_args(["--data.source", "arithmetic"], {"SM_NUM_GPUS": "0"}) == [
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--data.source",
        "arithmetic",
    ]


def test_hyperparameters_fall_back_to_sm_hps_and_reject_stray_words():
    env = {"SM_HPS": json.dumps({"model.grpo.learning_rate": 1e-5, "data.source": "arithmetic"})}
    assert hyperparameters([], env) == [("model.grpo.learning_rate", "1e-05"), ("data.source", "arithmetic")]
    with pytest.raises(ValueError, match="expected --name value"):
        hyperparameters(["train"], {})
    with pytest.raises(ValueError, match="no value"):
        hyperparameters(["--trainer.max_steps"], {})


def test_multi_node_jobs_name_the_master_and_this_node():
    assert cluster_env(SM_ENV) == {"MASTER_ADDR": "algo-1", "MASTER_PORT": "29500", "NODE_RANK": "1"}
    assert cluster_env({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"}) == {}


def test_a_job_trains_prints_reward_lines_and_writes_the_model(tiny_model_dir, tmp_path, capsys):
    channel = tmp_path / "training"
    channel.mkdir()
    with open(channel / "train.jsonl", "w") as f:
        for row in gsm8k_rows("train", 12):
            f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    env = {
        "SM_MODEL_DIR": str(tmp_path / "model"),
        "SM_CHANNEL_TRAINING": str(channel),
        "SM_CHANNEL_MODEL": tiny_model_dir,
        "SM_OUTPUT_DATA_DIR": str(tmp_path / "output"),
        "SM_NUM_GPUS": "0",
    }
    argv = [
        "--trainer.max_steps",
        "2",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--model.grpo.num_generations",
        "2",
        "--model.grpo.max_completion_length",
        "6",
        "--model.grpo.preflight",
        "false",
        "--data.batch_size",
        "2",
        "--data.val_size",
        "2",
    ]
    main(argv, env)
    printed = capsys.readouterr().out
    rewards = re.findall(METRIC_DEFINITIONS[0]["Regex"], printed)
    assert len(rewards) == 2, printed[-2000:]
    assert all(0.0 <= float(r) <= 2.0 for r in rewards)  # accuracy + format, each in [0, 1]

    exported = AutoModelForCausalLM.from_pretrained(env["SM_MODEL_DIR"])
    final_ckpt = os.path.join(env["SM_OUTPUT_DATA_DIR"], "final.ckpt")
    final = torch.load(final_ckpt, weights_only=False)["state_dict"]
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, final["policy." + name], rtol=0, atol=0, msg=name)
    assert os.path.isfile(os.path.join(env["SM_MODEL_DIR"], "tokenizer.json"))
