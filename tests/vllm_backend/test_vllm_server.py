"""The server engine against two real `vllm serve` processes (started once for the module by `cli.py
vllm-serve`'s command, on 127.0.0.1) of the tiny model with its LM head tied to the embedding, as SmolLM2's.

- The push is exact: float32, 3 AdamW steps at lr 1e-3, the sampler's log-probs equal the scorer's within
  1e-5 after every step, through both servers (disk plane, the tied head repacked by the workers'
  extension); a missed push fails it, and so does a prefix cache kept from the old weights.
- LoRA: the adapter alone is pushed after the first push (the base once), exact after every step.
- The router spreads a batch over both servers and sends a continuation to the server that generated it.
- min-p and the repetition penalty reach the servers: their log-probs are the eager engine's definition's.
- Never a wrong model: servers that cannot be reached, serve another architecture or vocabulary, too short
  a context or no large enough LoRA rank are refused in one line each, from a fit's set-up before the
  policy's weights load.
- Never a hang (last, it stops the servers): a frozen server ends a rollout with one error naming it and
  the call within `request_timeout`; a killed one at once.

The engine: `core.generation.vllm_server`."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_lightning.core.generation.vllm_client import ServerError, VLLMServer, served_model
from grpo_lightning.core.generation.vllm_server_options import VLLMServerOptions, check_servers
from grpo_lightning.io.models import LoraOptions, apply_lora
from tests.helpers import arithmetic_data, copy_model, digit_reward, quiet_trainer, tiny_module
from tests.test_min_p_and_repetition_penalty import processed_logprobs
from tests.vllm_backend.helpers import (
    MASK,
    PROMPTS,
    adamw_steps,
    free_port,
    running_servers,
    sampled_gap,
    scored,
    server_engine,
)


@pytest.fixture(scope="module")
def servers(vllm_tied_dir):
    with running_servers(vllm_tied_dir, count=2, lora_rank=8) as servers:
        yield servers


@pytest.fixture(scope="module")
def urls(servers) -> list[str]:
    return [s.url for s in servers]


def tied_model(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_three_adamw_steps_pushed_exactly_through_two_servers(urls, vllm_tied_dir):
    model = tied_model(vllm_tied_dir)
    assert model.config.tie_word_embeddings
    extension = served_model(VLLMServer(urls[0], 10)).worker_extension
    assert extension == "grpo_lightning.io.vllm_worker.PushExtension", "it repacks the tied head on CPU"
    engine = server_engine(urls)
    try:
        assert sampled_gap(engine, model, G=8) < 1e-5, "the first push"
        for step in range(3):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            adamw_steps(model, steps=1, lr=1e-3)
            assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), (
                "every weight moved"
            )
            engine.weights_changed()
            gap = sampled_gap(engine, model, G=8)
            assert gap < 1e-5, f"step {step + 1}: the sampler's log-probs are {gap:.2e} off the scorer's"
        assert engine.refreshes == 4
        served = {VLLMServer(u, 10).get("/weight_info")["weight_version"] for u in urls}
        assert served == {f"policy-{engine.run_id}-4"}, "every server stamped with the last push"
        assert all(s.in_flight == 0 for s in engine.router.servers)
    finally:
        engine.close()


def test_a_missed_push_fails_the_invariant(urls, vllm_tied_dir):
    model = tied_model(vllm_tied_dir)
    engine = server_engine(urls)
    try:
        assert sampled_gap(engine, model) < 1e-5
        adamw_steps(model, steps=1, lr=1e-3)  # not told: the servers keep the old weights
        assert sampled_gap(engine, model) > 1e-3
    finally:
        engine.close()


def test_a_kept_prefix_cache_fails_the_invariant(urls, vllm_tied_dir, monkeypatch):
    """The push without its prefix-cache reset: the prompts' blocks keep the KV of the old weights."""
    model = tied_model(vllm_tied_dir)
    engine = server_engine(urls[:1])
    prompts = torch.arange(2 * 70).view(2, 70) % 390 + 3  # [2, 70]: two whole blocks of 32 each
    long = (prompts, torch.ones_like(prompts))
    try:
        assert sampled_gap(engine, model, prompts=long) < 1e-5  # their blocks cached under these weights
        real_post = VLLMServer.post

        def post(server, route, body=None, timeout=None, cancel=None):
            if route == "/reset_prefix_cache":
                return {"success": True}
            return real_post(server, route, body, timeout, cancel)

        monkeypatch.setattr(VLLMServer, "post", post)
        adamw_steps(model, steps=1, lr=1e-3)
        engine.weights_changed()
        assert sampled_gap(engine, model, prompts=long) > 1e-4
    finally:
        engine.close()


def test_lora_adapter_pushes_exactly(urls, vllm_tied_dir):
    base = tied_model(vllm_tied_dir)
    model = apply_lora(base, LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-2)
    engine = server_engine(urls)
    try:
        assert sampled_gap(engine, model) < 1e-5, "the first push: the base and the adapter"
        first = engine.push_bytes
        for step in range(3):
            adamw_steps(model, steps=1, lr=1e-3)
            engine.weights_changed()
            gap = sampled_gap(engine, model)
            assert gap < 1e-5, f"step {step + 1}: {gap:.2e}"
        adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
        assert engine.push_bytes == adapter_bytes < first, "after the first push, the adapter alone"
        assert engine.router.model == f"policy-{engine.run_id}-4"
    finally:
        engine.close()


def test_min_p_and_the_repetition_penalty_reach_the_servers(urls, vllm_tied_dir):
    """The request carries both: the servers' processed log-probs are those of their definition on the eager
    engine (`processed_logprobs`)."""
    model = tied_model(vllm_tied_dir)
    engine = server_engine(urls[:1])
    knobs = {"temperature": 0.8, "min_p": 0.05, "repetition_penalty": 1.8}
    settings = replace(engine.settings, **knobs)
    try:
        rollout = engine.generate(model, PROMPTS, MASK, num_generations=4, settings=settings)
    finally:
        engine.close()
    done = rollout.completion_mask.bool()
    assert (rollout.sampler_logprobs - processed_logprobs(model, rollout, settings))[done].abs().max() < 1e-5
    raw = scored(model, rollout, settings.temperature)
    assert (rollout.sampler_logprobs - raw)[done].abs().max() > 1e-3, "the knobs changed the distribution"


def test_the_router_spreads_a_batch_and_keeps_a_continuation(urls, vllm_tied_dir):
    model = tied_model(vllm_tied_dir)
    engine = server_engine(urls, max_in_flight=8)
    try:
        engine.refresh(model, torch.device("cpu"))
        router = engine.router
        picked = []
        real_run = router._pick

        def pick(prompt):
            server = real_run(prompt)
            picked.append((tuple(prompt), server.url))
            return server

        router._pick = pick
        prompts = torch.arange(3, 3 + 16 * 6).view(16, 6) % 390 + 3  # [16, 6]
        rollout = engine.generate(model, prompts, torch.ones_like(prompts), num_generations=2)
        assert {url for _, url in picked} == set(urls), "both servers took requests"
        row = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
        first_server = dict(picked)[tuple(prompts[0].tolist())]
        follow_up = prompts[0].tolist() + row + [5, 6, 7]  # a tool turn appended
        picked.clear()
        engine.generate(model, torch.tensor([follow_up]), torch.ones(1, len(follow_up)), num_generations=1)
        assert picked[0][1] == first_server, "the sample's next turn goes to the server holding its prefix"
    finally:
        engine.close()


def policy_with_config(model_dir: str, folder, **changes) -> str:
    """A copy of `model_dir` whose config.json says `changes` (its weights never load in these tests)."""
    copy = copy_model(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return copy


def test_a_fit_against_servers_that_cannot_serve_the_policy_stops_before_its_weights_load(
    urls, vllm_tied_dir, tmp_path, no_weights
):
    """Each refusal of `check_servers`, from a fit's set-up: the policy's config alone is read (`no_weights`:
    loading the weights fails the test), the LoRA rank from the module's options."""

    def refused(match: str, policy: str = vllm_tied_dir, lora: LoraOptions | None = None, **grpo) -> None:
        options = {"vllm_mode": "server", "vllm_server_base_url": urls[0], "vllm_server_timeout": 30, **grpo}
        module = tiny_module(policy, reward_funcs=[digit_reward], module_options={"lora": lora}, **options)
        started = time.monotonic()
        with pytest.raises(ServerError, match=match):
            quiet_trainer(default_root_dir=str(tmp_path), max_steps=1).fit(module, arithmetic_data(4))
        assert module.policy is None and time.monotonic() - started < 30

    wider = policy_with_config(vllm_tied_dir, tmp_path / "wider", vocab_size=512)
    refused(rf"^vLLM server {urls[0]} serves .* with 400 tokens: the policy's vocabulary has 512$", wider)
    qwen = policy_with_config(vllm_tied_dir, tmp_path / "qwen", architectures=["Qwen2ForCausalLM"])
    refused(r"a LlamaForCausalLM: the policy is a Qwen2ForCausalLM$", qwen)
    refused(
        r"max_model_len=128: prompt \+ completion need 164", max_prompt_length=64, max_completion_length=100
    )
    refused(r"with --max-lora-rank 8: the policy's adapter has rank 16", lora=LoraOptions(r=16))
    nobody = f"http://127.0.0.1:{free_port()}"
    refused(
        r"not reachable within vllm_server_timeout=2 s", vllm_server_base_url=nobody, vllm_server_timeout=2
    )


def test_servers_refused_before_training(urls, vllm_tied_dir):
    config = AutoConfig.from_pretrained(vllm_tied_dir)
    options = VLLMServerOptions(base_url=urls[0], timeout=30)
    assert check_servers(options, config, 64, lora_rank=4)[0].vocab_size == config.vocab_size
    started = time.monotonic()
    nobody = VLLMServerOptions(base_url=f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(ServerError, match=r"not reachable within vllm_server_timeout=2 s"):
        check_servers(nobody, config, 64, None)
    assert time.monotonic() - started < 10
    other = AutoConfig.from_pretrained(vllm_tied_dir, vocab_size=512)
    with pytest.raises(
        ServerError, match=rf"{urls[0]} serves .* with 400 tokens: the policy's vocabulary has 512"
    ):
        check_servers(options, other, 64, None)
    other = AutoConfig.from_pretrained(vllm_tied_dir, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ServerError, match=r"a LlamaForCausalLM: the policy is a Qwen2ForCausalLM"):
        check_servers(options, other, 64, None)
    with pytest.raises(ServerError, match=r"max_model_len=128: prompt \+ completion need 300"):
        check_servers(options, config, 300, None)
    with pytest.raises(ServerError, match=r"with --max-lora-rank 8: the policy's adapter has rank 16"):
        check_servers(options, config, 64, lora_rank=16)


def test_a_fit_trains_against_the_servers_exactly(urls, vllm_tied_dir):
    """2 optimizer steps of `GRPOModule` with TRL's `vllm_mode: server`: every rollout samples the weights of
    its moment (the sampler's log-probs are the scorer's), one push per step."""
    from grpo_lightning.core.config import GRPOConfig
    from grpo_lightning.training.module import GRPOModule

    gaps = []

    class Checked(GRPOModule):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            sample = self.rollouts.sample

            def checked_sample(prompts, num_generations, do_sample=True):
                rollout, completions = sample(prompts, num_generations, do_sample)
                if do_sample:
                    with torch.no_grad():
                        logprobs, _ = self.rollouts.scorer(self.policy, rollout, slice(None))
                    gaps.append(
                        float(
                            (rollout.sampler_logprobs - logprobs)[rollout.completion_mask.bool()].abs().max()
                        )
                    )
                return rollout, completions

            self.rollouts.sample = checked_sample

    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2,
        max_prompt_length=64,
        max_completion_length=8,
        learning_rate=1e-3,
        preflight=False,
        log_completions_every=0,
        vllm_mode="server",
        vllm_server_base_url=urls,
        vllm_server_timeout=30,
    )
    module = Checked(vllm_tied_dir, reward_funcs=[digit_reward], grpo=grpo)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, arithmetic_data(8))
    assert module.rollouts.backend == "vllm_server" and trainer.global_step == 2
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps
    assert module.rollouts.engine.refreshes == 2, "one push per optimizer step"


def test_a_frozen_then_killed_server_ends_the_rollout_in_one_line(servers, vllm_tied_dir):
    """Last: it stops the module's servers."""
    model = tied_model(vllm_tied_dir)
    engine = server_engine([servers[1].url], request_timeout=5)
    try:
        engine.refresh(model, torch.device("cpu"))
        os.killpg(servers[1].process.pid, signal.SIGSTOP)  # alive, answering nothing
        started = time.monotonic()
        with pytest.raises(ServerError) as frozen:
            engine.generate(model, PROMPTS, MASK, num_generations=2)
        assert time.monotonic() - started < 15
        assert str(frozen.value) == (
            f"vLLM server {servers[1].url}: POST /v1/completions failed: no answer within 5 s"
        )
        os.killpg(servers[1].process.pid, signal.SIGKILL)
        servers[1].process.wait(30)
        with pytest.raises(ServerError, match=rf"^vLLM server {servers[1].url}: POST /v1/completions failed"):
            engine.generate(model, PROMPTS, MASK, num_generations=2)
    finally:
        engine.close()
