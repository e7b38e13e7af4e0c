"""`cli.py from-trl` on an open-r1 recipe of TRL 0.18's server mode (its model the tiny one, its server URL a
real `vllm serve` process on 127.0.0.1 started by `cli.py vllm-serve`'s command): the written config keeps
the server, and `fit` with it trains 2 steps whose rollouts come from that server, one push per step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from grpo_lightning.cli import build_cli
from grpo_lightning.cli import main as cli_main
from tests.vllm_backend.helpers import running_servers

RECIPE = Path(__file__).parents[1] / "fixtures" / "trl_recipes" / "open_r1_math_simple_rl.yaml"


@pytest.fixture(scope="module")
def server(vllm_model_dir):
    with running_servers(vllm_model_dir, count=1, max_model_len=1024) as servers:
        yield servers[0]


def test_from_trl_on_an_open_r1_server_recipe_trains_against_its_server(server, vllm_model_dir, tmp_path):
    text = RECIPE.read_text(encoding="utf-8")
    text = re.sub(r"^model_name_or_path: .*$", f"model_name_or_path: {vllm_model_dir}", text, flags=re.M)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text + f"vllm_server_base_url: {server.url}\nvllm_server_timeout: 60\n")
    out = tmp_path / "run.yaml"
    cli_main(["from-trl", str(recipe), "--trl-version", "0.18", "--out", str(out)])
    config = yaml.safe_load(out.read_text())
    assert config["model"]["grpo"]["engine"] == {
        "vllm_mode": "server",
        "vllm_server": {"base_url": server.url, "timeout": 60},
    }
    config["model"]["reward_funcs"] = ["tests.helpers.digit_reward"]  # open-r1's need open-r1 installed
    config["model"].pop("reward_weights", None)
    out.write_text(yaml.safe_dump(config))
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"problem": f"What is {a} + 2?", "solution": str(a + 2)} for a in range(8)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = build_cli(
        [
            "fit",
            "--config",
            str(out),
            f"--data.source={data}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.precision=32-true",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=0",
            "--model.model_options.attn_implementation=null",
            "--model.model_options.gradient_checkpointing=false",
            "--model.grpo.sampling.num_generations=2",
            "--model.grpo.sampling.max_completion_length=8",
            "--model.grpo.sampling.max_prompt_length=512",
            "--data.batch_size=4",
        ]
    )
    assert cli.trainer.global_step == 2
    assert cli.model.rollouts.backend == "vllm_server"
    assert cli.model.rollouts.engine.options.urls == [server.url]
    assert cli.model.rollouts.engine.refreshes == 2, "one push per optimizer step"
