"""The memory estimate against measured figures: the bytes of a tiny model's weights, gradients, AdamW state
and KV cache after a real step, the static engine's inference copy and KV storage after real rollouts, and
the figures the 7B and LoRA configs' comments state."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.memory import ModelFootprint, compute_bytes, estimate_memory, footprint
from grpo_lightning.io.models import LoraOptions, apply_lora
from tests.test_preflight import BATCH, module_for

CONFIGS = Path(__file__).parent.parent / "configs"


def tiny_llama() -> LlamaForCausalLM:
    """4 query heads, 2 KV heads of 8: the KV cache is half the size it would be with one per query head."""
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("lora", [False, True])
def test_estimate_equals_the_bytes_after_one_real_step(lora):
    model = tiny_llama()
    if lora:
        model = apply_lora(model, LoraOptions(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, fused=True)  # as GRPOModule.configure_optimizers
    ids = torch.randint(0, 50, (3, 7))  # [B, T]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    estimate = estimate_memory(footprint(model), compute_bytes=4)
    assert estimate.gpu["weights"] == tensor_bytes(model.parameters())
    assert estimate.gpu["gradients"] == tensor_bytes(p.grad for p in trainable)
    states = [t for state in optimizer.state.values() for t in state.values()]
    assert estimate.gpu["optimizer"] == tensor_bytes(states)
    if lora:  # the frozen base has no gradients nor optimizer state
        assert estimate.gpu["gradients"] < estimate.gpu["weights"] / 10


def test_kv_cache_estimate_equals_the_generated_cache():
    model = tiny_llama().eval()
    ids = torch.randint(0, 50, (3, 5))  # [B, P]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    cache = out.past_key_values
    measured = tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    tokens = cache.get_seq_length()  # the last new token is sampled but never run through the model
    estimate = estimate_memory(footprint(model), compute_bytes=4, sequences=3, tokens=tokens)
    assert tokens == 5 + 4 - 1
    assert estimate.gpu["KV cache"] == measured


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_static_engine_estimate_equals_its_copy_and_caches(tiny_model_dir, tied):
    """Under `bf16-mixed` the copy holds bf16 linear weights and float32 embeddings and norms (a tied head
    gets a bf16 weight of its own); two batches of different rows share one KV storage. The pre-flight's
    terms are those bytes, exactly."""
    from transformers import AutoTokenizer

    from grpo_lightning.core.config import GRPOConfig
    from grpo_lightning.training.callbacks.preflight import rollout_memory
    from grpo_lightning.training.module import GRPOModule

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    grpo = GRPOConfig(
        num_generations=2, max_completion_length=4, generation_backend="static", preflight=False
    )
    module = GRPOModule(LlamaForCausalLM(config), tokenizer, grpo=grpo)
    rollouts = module.rollouts
    rollouts.place(torch.device("cpu"), "bf16-mixed")  # as a bf16-mixed trainer places them
    rollout, _ = module.rollouts.sample(["3 + 4 =", "2 * 5 - 1 =", "7 ="], 2)
    module.rollouts.sample(["1 + 1 ="], 2)  # 2 rows: a view of the 6-row storage
    engine = rollouts.engine
    estimate = rollout_memory(module, 3 * 2, rollout.prompt_ids.size(1), devices=1, precision="bf16-mixed")
    assert estimate.gpu["inference copy"] == engine.copy.nbytes()
    assert estimate.gpu["KV cache"] == engine.cache_nbytes()
    assert "generate gather" not in estimate.gpu
    policy_bytes = tensor_bytes(module.policy.parameters())
    embedding = module.policy.get_input_embeddings().weight.numel()
    head = embedding * 2 if tied else 0  # the untied bf16 head
    assert policy_bytes / 2 < engine.copy.nbytes() - head < policy_bytes  # bf16 linears, float32 the rest
    layer = engine.caches.caches[6].layers[0]
    assert engine.cache_nbytes() == 2 * 2 * tensor_bytes([layer.keys])  # one storage: 2 layers, keys, values


def test_strategies_split_what_they_shard():
    model = ModelFootprint(
        weight_bytes=800,
        parameters=200,
        trainable_bytes=800,
        trainable_tensors=2,
        layers=1,
        kv_heads=1,
        head_dim=1,
    )
    single = estimate_memory(model, reference=True)
    assert single.gpu == {
        "weights": 800,
        "gradients": 800,
        "optimizer": 1608,
        "reference": 800,
        "KV cache": 4,
    }
    ddp = estimate_memory(model, world=4, reference=True)
    assert ddp.gpu == single.gpu  # each DDP rank holds everything
    fsdp = estimate_memory(model, world=4, sharded=True, reference=True)
    assert fsdp.gpu == {
        "weights": 200,
        "gradients": 200,
        "optimizer": 408,  # step counts are per tensor on every rank
        "reference": 200,
        "generate gather": 400,  # 200 weights in bf16
        "KV cache": 4,
    }
    offload = estimate_memory(model, world=4, sharded=True, cpu_offload=True, reference=True)
    assert offload.gpu == {"generate gather": 400, "KV cache": 4}
    static = estimate_memory(model, world=4, sharded=True, reference=True, inference_copy_bytes=400)
    assert static.gpu == {  # the copy on every rank, refreshed one unit at a time; nothing gathered whole
        **{k: v for k, v in fsdp.gpu.items() if k != "generate gather"},
        "inference copy": 400,
        "refresh gather": 0,  # this footprint names no unit
    }
    assert offload.cpu == {
        k: v for k, v in fsdp.gpu.items() if k in ("weights", "gradients", "optimizer", "reference")
    }
    assert offload.text().endswith("per GPU + activations; in CPU memory per process: 0.0 GB")


def test_compute_bytes_follow_the_precision_flag():
    model = tiny_llama()
    assert compute_bytes("bf16-mixed", model) == 2 and compute_bytes("32-true", model) == 4
    assert compute_bytes("32-true", model.to(torch.bfloat16)) == 2


def test_preflight_prints_the_estimate(tiny_model_dir):
    module = module_for(tiny_model_dir, grpo={"beta": 0.04, "max_prompt_length": 10})
    from grpo_lightning.training.callbacks.preflight import run_preflight

    line = run_preflight(module, BATCH, samples=1).lines["memory per GPU"]
    expected = estimate_memory(
        footprint(module.policy), reference=True, compute_bytes=4, sequences=2 * 4, tokens=10 + 3
    )
    assert line == expected.text()
    assert "reference" in line and "generate gather" not in line


# ----------------------------------------------------------------------------- the configs' comments
# Qwen2.5 shapes as the configs' comments state them (no download here). The largest FSDP2 unit of the 7B
# is the root's own: its untied embedding and LM head (2 x 152064 x 3584) and final norm.
QWEN_7B = {
    "parameters": 7.62e9,
    "layers": 28,
    "kv_heads": 4,
    "head_dim": 128,
    "root": 2 * 152064 * 3584 + 3584,
}
QWEN_1_5B = {"parameters": 1.54e9, "layers": 28, "kv_heads": 2, "head_dim": 128, "root": 0}
# LoRA r=16 on all linear layers of Qwen2.5-1.5B (hidden 1536, KV 256, MLP 8960), per layer:
# r x (in + out) for q, o (1536 -> 1536), k, v (1536 -> 256), gate, up (1536 -> 8960), down (8960 -> 1536).
LORA_1_5B = 28 * 16 * (2 * 3072 + 2 * 1792 + 3 * 10496)


def config_estimate(name: str, shape: dict, trainable: int, weight_bytes: int, cpu_offload: bool = False):
    """The estimate of a GPU config, whose rollouts take the static engine (`generation_backend: auto` on
    CUDA): its copy in bf16 (FSDP2 gathers every weight in bf16; LoRA's base is bf16), its cache rows a power
    of two, prompts bucketed by 64."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    grpo, trainer, data = GRPOConfig(**config["model"]["grpo"]), config["trainer"], config["data"]
    lora = config["model"].get("lora") is not None
    assert grpo.generation_backend == "auto" and trainer["accelerator"] == "gpu"
    rows = data["batch_size"] * grpo.num_generations
    model = ModelFootprint(
        weight_bytes=int(shape["parameters"] * weight_bytes) + (trainable * 4 if lora else 0),
        parameters=int(shape["parameters"]),
        trainable_bytes=trainable * 4,
        trainable_tensors=0,  # a few thousand float32 step counts: kilobytes
        layers=shape["layers"],
        kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        largest_unit_parameters=shape["root"],
    )
    sharded = "ModelParallelStrategy" in str(trainer.get("strategy"))
    return estimate_memory(
        model,
        world=trainer["devices"],
        sharded=sharded,
        cpu_offload=cpu_offload,
        reference=grpo.beta > 0 and not lora,
        compute_bytes=2,  # bf16-mixed
        sequences=1 << (rows - 1).bit_length(),
        tokens=-(-grpo.max_prompt_length // 64) * 64 + grpo.max_completion_length,
        inference_copy_bytes=int(shape["parameters"] + (trainable if lora else 0)) * 2,
    )


@pytest.mark.parametrize(
    ("name", "shape", "trainable", "weight_bytes"),
    [
        ("fsdp_7b_8gpu.yaml", QWEN_7B, int(QWEN_7B["parameters"]), 4),  # float32 master weights
        ("lora_1.5b_24gb.yaml", QWEN_1_5B, LORA_1_5B, 2),  # bfloat16 base, float32 adapters
    ],
)
def test_config_comments_state_the_estimate(name, shape, trainable, weight_bytes):
    comments = " ".join(
        line.lstrip("# ").strip()
        for line in (CONFIGS / name).read_text().splitlines()
        if line.startswith("#")
    )
    comments = re.sub(r"\s+", " ", comments)
    assert config_estimate(name, shape, trainable, weight_bytes).text() in comments
    if name.startswith("fsdp"):
        offloaded = config_estimate(name, shape, trainable, weight_bytes, cpu_offload=True).text()
        assert offloaded in comments
