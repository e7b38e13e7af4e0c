"""The rules of `cli.py from-trl` for TRL's `ModelConfig` and `ScriptArguments` and open-r1's additions to
them: the model and its loading, LoRA, its rollout engine (vLLM), the data set and its prompts, the reward
functions by open-r1's names.
"""

from __future__ import annotations

from dataclasses import fields

from grpo_lightning.from_trl.conversion import Conversion, Rules, grpo_key
from grpo_lightning.io.models import LoraOptions, ModelOptions

MODEL_RULES = Rules()


# --------------------------------------------------------------------------------------------- the model
@MODEL_RULES(
    "model_name_or_path",
    "model_revision",
    "trust_remote_code",
    "attn_implementation",
    "model_init_kwargs",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "gradient_checkpointing_use_reentrant",
)
def model(c: Conversion) -> None:
    init = c.get("model_init_kwargs") or {}
    if c.has("model_name_or_path"):
        c.row("model_name_or_path", "mapped", c.put("model.policy", c.get("model_name_or_path")))
    else:
        c.needs.append("model.policy: the recipe names no model (TRL's scripts may pass it in code)")
    own = {f.name for f in fields(ModelOptions)}
    revision = c.get("model_revision", init.get("revision"))
    if revision in (None, "main"):
        c.row("model_revision", "mapped", "", "main: the model's default branch, which is what loads here")
    else:
        c.row("model_revision", "mapped", c.put("model.model_options.revision", revision))
    for key in ("trust_remote_code", "attn_implementation"):
        value = c.get(key, init.get(key))
        if value is not None:
            c.put(f"model.model_options.{key}", value)
        c.row(key, "mapped", f"model.model_options.{key}")
    known = {"dtype", "torch_dtype", "revision", "trust_remote_code", "attn_implementation"}
    rest = {key: init[key] for key in sorted(set(init) - known - own)}
    for key in sorted(set(init) & own - known):
        c.put(f"model.model_options.{key}", init[key])
    if rest:
        c.put("model.model_options.init_kwargs", rest)
    c.row(
        "model_init_kwargs",
        "converted",
        "model.model_options",
        "each key as ModelOptions' option (dtype: see bf16)"
        + (f"; {', '.join(rest)} in model.model_options.init_kwargs" if rest else ""),
    )
    checkpointing = bool(c.get("gradient_checkpointing", False))
    c.row(
        "gradient_checkpointing", "mapped", c.put("model.model_options.gradient_checkpointing", checkpointing)
    )
    reentrant = (c.get("gradient_checkpointing_kwargs") or {}).get("use_reentrant", False)
    for key in ("gradient_checkpointing_kwargs", "gradient_checkpointing_use_reentrant"):
        value = reentrant if key.endswith("kwargs") else c.get(key)
        if value:
            c.row(
                key,
                "unsupported",
                "",
                "reentrant checkpointing: ours always checkpoints with use_reentrant=False",
            )
        else:
            c.row(key, "mapped", "", "use_reentrant=False, as ours always checkpoints")


LORA_OPTIONS = {
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lora_target_modules": "target_modules",
}
PEFT_OFF = {  # PEFT and bitsandbytes options that hold here only at these values
    "lora_modules_to_save": (None, "no modules trained in full beside the adapters"),
    "lora_task_type": ("CAUSAL_LM", "always CAUSAL_LM"),
    "use_rslora": (False, "rank-stabilised LoRA: not here (alpha / r scaling)"),
    "use_dora": (False, "DoRA: not here"),
    "lora_target_parameters": (None, "adapters on parameters (MoE experts): not here"),
    "load_in_8bit": (False, "8-bit bases: not here; load_in_4bit (QLoRA, nf4) is"),
    "bnb_4bit_quant_type": ("nf4", "always nf4"),
    "use_bnb_nested_quant": (True, "always nested (double) quantisation"),
    "bnb_4bit_quant_storage": (None, "the storage dtype is bitsandbytes' default"),
}


@MODEL_RULES("use_peft", "load_in_4bit", *LORA_OPTIONS, *PEFT_OFF)
def lora(c: Conversion) -> None:
    on = bool(c.get("use_peft", False))
    c.row(
        "use_peft",
        "mapped",
        c.put("model.lora", {}) if on else "model.lora",
        "" if on else "None: full fine-tuning",
    )
    own = {f.name for f in fields(LoraOptions)}
    for key, ours in LORA_OPTIONS.items():
        if not c.has(key):
            continue
        value = c.get(key)
        if not on:
            c.row(key, "mapped", "", "no effect without use_peft, in TRL too")
        elif key == "lora_target_modules" and value is None:
            c.row(
                key,
                "unsupported",
                "",
                "TRL leaves the target modules to PEFT's default for the architecture (q_proj and v_proj for "
                "Llama and Qwen2); ours: all-linear: set model.lora.target_modules to match",
            )
        else:
            assert ours in own, ours
            c.row(key, "mapped", c.put(f"model.lora.{ours}", value))
    four_bit = bool(c.get("load_in_4bit", False))
    c.row("load_in_4bit", "mapped", c.put("model.model_options.load_in_4bit", four_bit) if four_bit else "")
    for key, (accepted, what) in PEFT_OFF.items():
        value = c.get(key, accepted)
        if key == "use_bnb_nested_quant" and not four_bit:
            c.row(key, "mapped", "", "no effect without load_in_4bit")
        elif value == accepted:
            c.row(key, "mapped", "", what)
        else:
            c.row(key, "unsupported", "", what)


# ------------------------------------------------------------------------------------------------- vLLM
# TRL's options of its vLLM server's own (`trl vllm-serve`'s), as `cli.py vllm-serve`'s flags.
SERVER_FLAGS = {
    "vllm_tensor_parallel_size": "--tensor-parallel-size",
    "vllm_gpu_memory_utilization": "--gpu-memory-utilization",
    "vllm_max_model_length": "--max-model-len",
}
# TRL's options of its client of the servers: ours by the same names (`VLLMServerOptions`' aliases).
CLIENT_OPTIONS = (
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
)


def serve_command(c: Conversion) -> str:
    """The `cli.py vllm-serve` command of a server for the recipe: its model, where the trainer looks for
    it, and the server-side options it sets."""
    words = ["python cli.py vllm-serve", f"--model {c.get('model_name_or_path') or 'MODEL'}"]
    if c.get("vllm_server_base_url") is None:
        for key, flag in (("vllm_server_host", "--host"), ("vllm_server_port", "--port")):
            if c.get(key) is not None:
                words.append(f"{flag} {c.get(key)}")
    for key, flag in SERVER_FLAGS.items():
        if c.get(key) is not None and not (key == "vllm_tensor_parallel_size" and c.get(key) == 1):
            words.append(f"{flag} {c.get(key)}")
    return " ".join(words)


@MODEL_RULES(
    "use_vllm",
    "vllm_mode",
    "vllm_device",
    "vllm_enable_sleep_mode",
    *SERVER_FLAGS,
    *CLIENT_OPTIONS,
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)
def vllm(c: Conversion) -> None:
    on = bool(c.get("use_vllm", False))
    if on and c.get("vllm_mode", "colocate") == "server":
        vllm_servers(c)
    else:
        vllm_colocated(c, on)
    correction = on and bool(c.get("vllm_importance_sampling_correction", False))
    switch = grpo_key("importance_sampling_correction")
    if correction:
        c.put(switch, {})
    c.row(
        "vllm_importance_sampling_correction",
        "mapped" if correction or not c.get("vllm_importance_sampling_correction") else "converted",
        switch,
        ""
        if correction or not c.get("vllm_importance_sampling_correction")
        else "off: TRL applies it with vLLM only",
    )
    for key, ours in (
        ("vllm_importance_sampling_mode", "importance_sampling_mode"),
        ("vllm_importance_sampling_cap", "importance_sampling_cap"),
        ("vllm_importance_sampling_clip_max", "importance_sampling_cap"),
        ("vllm_importance_sampling_clip_min", "importance_sampling_floor"),
    ):
        if correction and c.get(key) is not None:
            c.row(key, "mapped", c.put(grpo_key(ours), c.get(key)))
        c.row(key, "mapped", "", "no effect without the correction, in TRL too")


def vllm_colocated(c: Conversion, on: bool) -> None:
    """No vLLM, or TRL's colocated engine: ours on every rank; the servers' options have no effect."""
    backend = grpo_key("generation_backend")
    c.row(
        "use_vllm",
        "converted" if on else "mapped",
        c.put(backend, "vllm") if on else backend,
        "vllm: a vLLM engine colocated in each training process"
        if on
        else "our default, auto: HF generate on CPU, the static engine (or vLLM where it imports) on CUDA",
    )
    c.row("vllm_mode", "mapped", "", "colocated" if on else "no effect without use_vllm, in TRL too")
    c.row("vllm_device", "unsupported", "", "vLLM shares each training process's GPU here")
    size = c.get("vllm_tensor_parallel_size", 1)
    c.row(
        "vllm_tensor_parallel_size", "mapped" if size == 1 else "unsupported", "", "one GPU per engine here"
    )
    if c.has("vllm_max_model_length") and c.get("vllm_max_model_length") is not None:
        c.put(grpo_key("vllm_max_model_len"), c.get("vllm_max_model_length"))
    c.row("vllm_max_model_length", "mapped", grpo_key("vllm_max_model_len"))
    for key in CLIENT_OPTIONS:
        c.row(key, "mapped", "", "no effect without use_vllm and vllm_mode: server, in TRL too")
    # vllm_gpu_memory_utilization and vllm_enable_sleep_mode: the colocated engine's own, by their flat names.


def vllm_servers(c: Conversion) -> None:
    """TRL's server mode: the rollouts from vLLM servers started apart (`cli.py vllm-serve`), the trainer's
    client options by their own names; the servers' options become the command that starts them."""
    command = serve_command(c)
    mode = c.put(grpo_key("vllm_mode"), "server")
    c.row("use_vllm", "converted", mode, "vllm_server: the rollouts come from running vLLM servers")
    c.row("vllm_mode", "mapped", mode, f"the servers kept: start each with {command}")
    c.needs.append(f"start the vLLM servers before fit: {command}")
    c.row(
        "vllm_device",
        "converted",
        "cli.py vllm-serve",
        "the servers use the GPUs they are started on: CUDA_VISIBLE_DEVICES=... before their command",
    )
    for key, flag in SERVER_FLAGS.items():
        if c.get(key) is None or (key == "vllm_tensor_parallel_size" and c.get(key) == 1):
            c.row(key, "mapped", "", "the servers' own default")
        else:
            c.row(
                key,
                "converted",
                f"cli.py vllm-serve {flag} {c.get(key)}",
                f"a flag of the servers: {command}",
            )
    c.row("vllm_enable_sleep_mode", "mapped", "", "no effect with vllm_mode: server, in TRL too")
    # vllm_server_base_url, _host, _port, _timeout, vllm_group_port: ours by the same names (FLAT_NAMES).


# ---------------------------------------------------------------------------------------------- the data
DATA_CLASS = "grpo_lightning.training.data.PromptDataModule"
ENVIRONMENT_DATA_CLASS = "grpo_lightning.training.data.EnvironmentPromptDataModule"  # reset writes prompts


@MODEL_RULES(
    "dataset_name",
    "dataset_config",
    "dataset_train_split",
    "dataset_streaming",
    "dataset_mixture",
    "dataset_prompt_column",
    "system_prompt",
    "chat_template",
    "dataloader_num_workers",
    "remove_unused_columns",
    "shuffle_dataset",
    "seed",
    "data_seed",
)
def data(c: Conversion) -> None:
    c.put("data.class_path", DATA_CLASS)
    if c.has("dataset_name"):
        c.row("dataset_name", "mapped", c.put("data.init_args.source", c.get("dataset_name")))
    else:
        c.needs.append(
            "data.init_args.source: the recipe names no data set (TRL's scripts load theirs in code): set it "
            "to a hub id, a folder or a file of prompts; or, where model.environment_factory's reset writes "
            f"every prompt (TRL's train_dataset=None), set data.class_path to {ENVIRONMENT_DATA_CLASS} and "
            "keep only its batch_size and seed"
        )
    config_name = c.get("dataset_config")
    c.row("dataset_config", "mapped", c.put("data.init_args.config_name", config_name) if config_name else "")
    split = c.get("dataset_train_split", "train")
    if split == "train":
        c.row("dataset_train_split", "mapped", "", "the train split is read, as ours")
    else:
        c.row(
            "dataset_train_split",
            "unsupported",
            "",
            f"ours trains on the 'train' split: save {split!r} as a folder's train.jsonl (or with "
            "save_to_disk) and set data.init_args.source to it",
        )
    streaming = bool(c.get("dataset_streaming"))
    c.row("dataset_streaming", "unsupported" if streaming else "mapped", "", "the rows are read whole")
    c.row(
        "dataset_mixture",
        "unsupported",
        "",
        "open-r1's mixture of data sets: concatenate them into one (datasets.concatenate_datasets, then "
        "save_to_disk) and set data.init_args.source to it",
    )
    if c.has("dataset_prompt_column"):  # open-r1's script: the column's text is the user's turn
        column = c.get("dataset_prompt_column")
        field = [c.put("data.init_args.prompt_field", column)] if column != "prompt" else []
        c.row(
            "dataset_prompt_column",
            "mapped",
            ", ".join([*field, c.put("data.init_args.chat_prompt", True)]),
            "the column's text is the user's turn of a conversation rendered through the chat template, as "
            "open-r1's script makes it (a column of chat messages is taken as it is)",
        )
    system_prompt = c.get("system_prompt")
    if system_prompt is None:
        c.row("system_prompt", "mapped", "", "None: nothing to set")
    else:
        c.row("system_prompt", "mapped", c.put("data.init_args.system_prompt", system_prompt))
    template = c.get("chat_template")
    c.row(
        "chat_template",
        "mapped",
        c.put("model.model_options.chat_template", template) if template is not None else "",
        "" if template is not None else "None: the tokenizer's own",
    )
    if c.has("dataloader_num_workers"):
        c.row(
            "dataloader_num_workers",
            "mapped",
            c.put("data.init_args.num_workers", c.get("dataloader_num_workers")),
        )
    c.row(
        "remove_unused_columns",
        "mapped" if not c.get("remove_unused_columns") else "converted",
        "",
        "every column reaches the reward functions here",
    )
    shuffled = c.get("shuffle_dataset", True)
    c.row(
        "shuffle_dataset",
        "mapped" if shuffled else "unsupported",
        "",
        "the training rows are always shuffled, in a seeded order a resumed run continues",
    )
    seed = c.get("seed", 42)
    c.put("seed_everything", seed)
    c.put("data.init_args.seed", c.get("data_seed") if c.get("data_seed") is not None else seed)
    c.row(
        "seed",
        "converted",
        "seed_everything, data.init_args.seed",
        "sampling and initialisation, and the data's order (its own seed here)",
    )
    c.row("data_seed", "mapped", "data.init_args.seed")


# ------------------------------------------------------------------------------------- reward functions
NEEDS_OPEN_R1 = "needs open-r1 installed (pip install -e . in its repository)"
# open-r1's reward names (its `get_reward_funcs` registry) -> the function, or None for one its registry
# builds with arguments (written as a function of yours).
OPEN_R1_REWARDS: dict[str, str | None] = {
    "accuracy": "trl.rewards.accuracy_reward",
    "format": "open_r1.rewards.format_reward",
    "tag_count": "open_r1.rewards.tag_count_reward",
    "reasoning_steps": "open_r1.rewards.reasoning_steps_reward",
    "length": "open_r1.rewards.len_reward",
    "code": "open_r1.rewards.code_reward",
    "binary_code": "open_r1.rewards.binary_code_reward",
    "ioi_code": "open_r1.rewards.ioi_code_reward",
    "cf_code": "open_r1.rewards.cf_code_reward",
    "cosine": None,
    "repetition_penalty": None,
    "code_format": None,
    "soft_overlong_punishment": None,
}
FACTORIES = {  # what builds each of open-r1's rewards that take arguments
    "cosine": "trl.rewards.get_cosine_scaled_reward(...)",
    "repetition_penalty": "trl.rewards.get_repetition_penalty_reward(ngram_size, max_penalty)",
    "code_format": "open_r1.rewards.get_code_format_reward(language)",
    "soft_overlong_punishment": (
        "trl.rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)"
    ),
}
# open-r1's script arguments that its registry passes to its reward functions.
REWARD_ARGUMENTS = (
    "cosine_min_value_wrong",
    "cosine_max_value_wrong",
    "cosine_min_value_correct",
    "cosine_max_value_correct",
    "cosine_max_len",
    "repetition_n_grams",
    "repetition_max_penalty",
    "code_language",
    "code_eval_test_batch_size",
    "code_eval_scoring_mode",
    "parallel_code_exec_per_proc",
    "e2b_router_url",
    "morph_router_url",
    "code_provider",
    "ioi_provider",
    "max_completion_len",
    "soft_punish_cache",
)


def reward_path(name: str) -> tuple[str | None, str]:
    """The import path of a recipe's reward function (open-r1's registry name, or a path), and a note; None
    with what to do for one that has no importable function."""
    if "." in name:
        return name, ""
    if name not in OPEN_R1_REWARDS:
        return None, f"{name!r} is not one of open-r1's reward names: give its import path"
    path = OPEN_R1_REWARDS[name]
    if path is None:
        return (
            None,
            f"open-r1 builds {name!r} with arguments ({FACTORIES[name]}): define it in a module of yours",
        )
    if path.startswith("open_r1."):
        return path, f"{name}: {path} ({NEEDS_OPEN_R1})"
    return path, f"{name}: {path} (TRL's copy of open-r1's, math-verify against `solution`)"


@MODEL_RULES("reward_funcs", "reward_weights", *REWARD_ARGUMENTS)
def rewards(c: Conversion) -> None:
    for key in REWARD_ARGUMENTS:
        c.row(
            key,
            "unsupported",
            "",
            "an argument open-r1's registry passes its reward functions: named by import path they take "
            "their own defaults; for this value, wrap the function (functools.partial) in a module of yours",
        )
    names = c.get("reward_funcs")
    weights = c.get("reward_weights")
    if names is None:
        c.needs.append(
            "model.reward_funcs: the recipe names none (TRL's scripts pass them in code): list their import "
            "paths (trl.rewards.accuracy_reward, ...); without them the GSM8K rewards run, or, with "
            "model.environment_factory, its get_reward alone (as TRL)"
        )
        if weights is not None:
            c.row("reward_weights", "mapped", c.put("model.reward_weights", weights))
        return
    names = [names] if isinstance(names, str) else list(names)
    found = [(i, *reward_path(name)) for i, name in enumerate(names)]
    kept = [(i, path) for i, path, _ in found if path is not None]
    left_out = [note for _, path, note in found if path is None]
    notes = [note for _, path, note in found if path is not None and note]
    if kept:
        c.put("model.reward_funcs", [path for _, path in kept])
    c.row(
        "reward_funcs",
        "unsupported" if left_out else "converted" if notes else "mapped",
        "model.reward_funcs",
        "; ".join(notes + [f"left out: {note}" for note in left_out]),
    )
    if weights is None:
        return
    if left_out and isinstance(weights, list) and len(weights) == len(names):
        weights = [weights[i] for i, _ in kept]
    c.row(
        "reward_weights",
        "converted" if left_out else "mapped",
        c.put("model.reward_weights", weights),
        "the weights of the functions kept" if left_out else "",
    )
