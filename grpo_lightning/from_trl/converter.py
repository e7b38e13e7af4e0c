"""A TRL recipe as this library's config (`convert`), with a table of what became of each of its options
(`table`) and the config's text (`config_text`); `cli.py from-trl` reads the command line around it.

The recipe (`recipes`: a YAML of `GRPOConfig`, `ModelConfig` and `ScriptArguments` keys, or a TRL
script's command line) is read with the defaults of the TRL version it was written for filled in for every
option it leaves unset (`versions`). `GRPOConfig`'s options map by their flat names (`FLAT_NAMES`, the
one table of TRL's names, derived from the options' declarations, so the converter and the code cannot
disagree); the rest by the rules of `model_rules`, `run_rules` and `output_rules`; an option
with no counterpart is listed with what to do instead, and one that is always so here is accepted at that
value. Nothing is dropped in silence: every option of the recipe has a row, mapped, converted (and how) or
unsupported (and what to do instead), and the unsupported ones are repeated at the top of the written
config.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import warnings

import yaml

from grpo_lightning.core.config import FLAT_NAMES, GRPOConfig
from grpo_lightning.core.flat_names import default_at, section_at
from grpo_lightning.core.options import declared_rule, trl_value
from grpo_lightning.from_trl.conversion import HIDDEN, KINDS, SECRET, Conversion, Row, Unsupported, grpo_key
from grpo_lightning.from_trl.model_rules import MODEL_RULES
from grpo_lightning.from_trl.output_rules import OUTPUT_RULES
from grpo_lightning.from_trl.recipes import Recipe
from grpo_lightning.from_trl.run_rules import RUN_RULES
from grpo_lightning.from_trl.versions import (
    defaults_at,
)
from grpo_lightning.io.models import LoraOptions, ModelOptions

# The reward functions before the validation that reads them; the batch before the checkpoints' cadence.
RULES = (*MODEL_RULES, *RUN_RULES, *OUTPUT_RULES)
ANY = object()  # any value is accepted

# TRL's options that hold here only at these values (ANY: at every value), and what they are here.
ALWAYS: dict[str, tuple[tuple[object, ...] | object, str]] = {
    "ds3_gather_for_generation": ((True,), "FSDP2 gathers the full weights once per rollout"),
    "cast_lm_head_to_fp32": (ANY, "the log-probs always come from a float32 LM head here"),
    "multi_objective_aggregation": (
        ("sum_then_normalize",),
        "the weighted sum, then the group's normalisation",
    ),
    "disable_dropout": ((False,), "set the model config's dropout to 0 (most models have none)"),
    "use_liger_kernel": (
        (False, None),
        "the LM head is chunked in float32 here; Liger's kernels are not used",
    ),
    "use_liger_loss": ((False, None), "the LM head is chunked in float32 here; Liger's kernels are not used"),
    "torch_compile": ((False,), "model.grpo.engine.backend: static compiles the decoding step on CUDA"),
    "generation_kwargs": (
        (None, {}),
        "sampling is temperature, top_p, top_k, min_p and repetition_penalty here",
    ),
    "cache_implementation": ((None,), "the engines keep their own caches"),
    "use_transformers_paged": ((False,), "Hugging Face generate, or the static or vLLM engine"),
    "use_transformers_continuous_batching": ((False,), "Hugging Face generate, or the static or vLLM engine"),
    "transformers_continuous_batching_config": (
        (None,),
        "Hugging Face generate, or the static or vLLM engine",
    ),
    "pad_to_multiple_of": ((None, "auto"), "each micro-batch is padded to its own longest row"),
    "router_aux_loss_coef": ((None, 0.0, 0.001), "no mixture-of-experts auxiliary loss here"),
    "off_policy_mask_threshold": ((None,), "no off-policy sequence masking here"),
    "use_adaptive_entropy": ((False,), "a fixed entropy_coef here"),
    "entropy_coef_min": (ANY, "no effect without use_adaptive_entropy, in TRL too"),
    "entropy_coef_max": (ANY, "no effect without use_adaptive_entropy, in TRL too"),
    "entropy_coef_delta": (ANY, "no effect without use_adaptive_entropy, in TRL too"),
    "entropy_target": (ANY, "no effect without use_adaptive_entropy, in TRL too"),
    "sapo_temperature_neg": (ANY, "no effect: loss_type sapo has no counterpart here"),
    "sapo_temperature_pos": (ANY, "no effect: loss_type sapo has no counterpart here"),
    "vespo_k_pos": (ANY, "no effect: loss_type vespo has no counterpart here"),
    "vespo_lambda_pos": (ANY, "no effect: loss_type vespo has no counterpart here"),
    "vespo_k_neg": (ANY, "no effect: loss_type vespo has no counterpart here"),
    "vespo_lambda_neg": (ANY, "no effect: loss_type vespo has no counterpart here"),
    "vllm_model_impl": (("vllm",), "vLLM's own model code"),
    "vllm_structured_outputs_regex": ((None,), "no structured outputs here"),
    "vllm_guided_decoding_regex": ((None,), "no guided decoding here"),
    "log_completions_hub_repo": ((None,), "completion tables go to the loggers here"),
    "log_unique_prompts": ((False,), "the completions table shows the first prompts' groups"),
    "wandb_log_unique_prompts": ((False, True), "the completions table shows the first prompts' groups"),
    "num_completions_to_print": ((None, 0), "the console shows the first prompt's group"),
    "log_multimodal": (ANY, "no images here"),
    "use_cpu": ((False,), "set trainer.accelerator: cpu"),
    "do_train": (ANY, "cli.py fit trains"),
    "do_predict": ((False,), "cli.py predict answers the test split's prompts"),
}
# TRL's (and open-r1's) options with no counterpart here, and what to do instead.
NO_COUNTERPART = {
    "hub_model_revision": "no Hub push here: huggingface-cli upload REPO FOLDER --revision REV",
    "overwrite_hub_revision": "no Hub push here: huggingface-cli upload REPO FOLDER --revision REV",
    "push_to_hub_revision": "no Hub push here: huggingface-cli upload REPO FOLDER --revision REV",
    "benchmarks": "open-r1's benchmarks: run them on the export (cli.py export) with lighteval",
    "callbacks": "trainer.callbacks takes Lightning callbacks by class path",
    "deepspeed": "trainer.strategy: ModelParallelStrategy (FSDP2; docs/scaling.md)",
    "fsdp": "trainer.strategy: ModelParallelStrategy (FSDP2; docs/scaling.md)",
    "fsdp_config": "trainer.strategy: ModelParallelStrategy (FSDP2; docs/scaling.md)",
    "ddp_find_unused_parameters": "trainer.strategy: a DDPStrategy with its own options",
    "ddp_timeout": "trainer.strategy: a DDPStrategy with its own options",
    "vllm_dtype": "the engine samples in the policy's dtype",
    "vllm_enable_prefix_caching": "vLLM's own default",
}


# Every TRL option the converter knows beside GRPOConfig's flat names (docs/from_trl.md lists them).
KNOWN = MODEL_RULES.keys | RUN_RULES.keys | OUTPUT_RULES.keys | set(ALWAYS) | set(NO_COUNTERPART)

# The plain types of TRL's `ModelConfig` options (TRL is not a dependency); `TrainingArguments`' come from
# transformers' own declarations (`plain_types`). A value of another type is the recipe's error.
MODEL_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "use_peft": (bool,),
    "load_in_4bit": (bool,),
    "load_in_8bit": (bool,),
    "use_rslora": (bool,),
    "use_dora": (bool,),
    "use_bnb_nested_quant": (bool,),
    "trust_remote_code": (bool,),
    "lora_r": (int,),
    "lora_alpha": (int,),
    "lora_dropout": (float,),
}
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def plain_types(annotation: object) -> tuple[type, ...] | None:
    """The plain types (bool, int, float, str) a declared `annotation` allows, None aside; None where it
    allows anything else (a list, a dict: not checked here)."""
    kinds = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    kinds = tuple(k for k in kinds if k is not type(None))
    return kinds if kinds and all(k in TYPE_WORDS for k in kinds) else None


@functools.cache
def training_arguments_types() -> dict[str, tuple[type, ...]]:
    from transformers import TrainingArguments

    found = {f.name: plain_types(f.type) for f in dataclasses.fields(TrainingArguments)}
    return {name: kinds for name, kinds in found.items() if kinds is not None}


def _is(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    # Text: a number too (`--run_name 2024`, which TRL's parser keeps as the text typed).
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def check_types(recipe: Recipe) -> None:
    """Refuse a recipe value that TRL's declared type does not allow (`bf16: maybe`, `max_steps: many`),
    naming its key, rather than read it as something else; `GRPOConfig`'s own options are checked by their
    declared rules (`flat_option`), which also take TRL's spellings of our values."""
    declared = {**training_arguments_types(), **MODEL_CONFIG_TYPES}
    for key, value in recipe.keys.items():
        kinds = declared.get(key)
        if key in FLAT_NAMES or kinds is None or value is None or any(_is(value, k) for k in kinds):
            continue
        expected = " or ".join(TYPE_WORDS[k] for k in kinds)
        shown = HIDDEN if SECRET.search(key) else repr(value)
        raise ValueError(f"{recipe.path}: {key}: {shown} is not {expected}; correct it in the recipe")


# --------------------------------------------------------------------------------------- GRPOConfig's
def flat_option(c: Conversion, name: str) -> None:
    """A `GRPOConfig` option by its flat name: at its section's key (`FLAT_NAMES`), TRL's spelling of one of
    our values made ours (the option's declared `TRLValues`); a value of no choice or range of ours is
    unsupported, the default kept."""
    entry = FLAT_NAMES[name]
    given = c.get(name)
    value, spelled = trl_value(section_at(GRPOConfig, entry.path), entry.path[-1], given)
    note = f"TRL's {given!r} is {value!r} here" if spelled else ""
    key = grpo_key(name)
    if entry.switch:
        c.row(name, "mapped", c.put(key, (c.read(key) or {}) if value else None))
        return
    switch = next((n for n, e in FLAT_NAMES.items() if e.switch and e.path == entry.path[:1]), None)
    if switch is not None and not c.read(grpo_key(switch)):
        c.row(name, "mapped", "", f"no effect without {switch}: true, in TRL too")
        return
    problem = declared_rule(section_at(GRPOConfig, entry.path), entry.path[-1]).problem(value)
    if problem is not None:
        default = default_at(GRPOConfig, entry.path)
        c.row(name, "unsupported", "", f"{value!r} here {problem}: the run keeps our default, {default!r}")
        return
    c.row(name, "converted" if note else "mapped", c.put(key, value), note)


def always_option(c: Conversion, name: str) -> None:
    accepted, what = ALWAYS[name]
    value = c.get(name)
    c.row(name, "mapped" if accepted is ANY or value in accepted else "unsupported", "", what)


# ------------------------------------------------------------------------------------------ conversion
UNKNOWN = "not an option of TRL's GRPOConfig, ModelConfig or ScriptArguments that this converter knows"


def convert(recipe: Recipe, version: str, devices: int | None = None) -> Conversion:
    """The recipe's config and rows under TRL `version`'s defaults; ValueError names an option whose value
    no option of ours takes where the recipe's intent is clear (a batch that no rank can split)."""
    check_types(recipe)
    c = Conversion(recipe.keys, defaults_at(version, recipe.keys), version, devices)
    for keys, function in RULES:
        if any(c.has(key) for key in keys):
            try:
                function(c)
            except Unsupported as err:
                for key in keys:
                    c.row(key, "unsupported", "", str(err))
    names = [n for n in [*recipe.keys, *c.defaults] if n not in c.rows]
    names.sort(key=lambda n: not (n in FLAT_NAMES and FLAT_NAMES[n].switch))  # sections on before options
    for name in names:
        if name in FLAT_NAMES:
            flat_option(c, name)
        elif name in ALWAYS:
            always_option(c, name)
        elif name in NO_COUNTERPART:
            c.row(name, "unsupported", "", NO_COUNTERPART[name])
        else:
            c.row(name, "unsupported", "", UNKNOWN)
    order = [*recipe.keys, *c.defaults]
    c.rows = {key: c.rows[key] for key in sorted(c.rows, key=order.index)}  # as the recipe lists them
    _check(c, recipe.path)
    return c


def _check(c: Conversion, where: str) -> None:
    """Build the converted options as `fit` will: a value they refuse is the recipe's error, named."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            GRPOConfig(**(c.read("model.grpo") or {}))
            ModelOptions(**(c.read("model.model_options") or {}))
            if c.read("model.lora") is not None:
                LoraOptions(**c.read("model.lora"))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: the converted options are refused: {err}") from None
    c.needs.extend(f"warning: {w.message}" for w in caught)


# -------------------------------------------------------------------------------------- what it prints
def _short(value: object, width: int = 30) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def table(c: Conversion, recipe: Recipe, version_line: str) -> str:
    """The rows, the recipe's first, then the defaults of TRL's version; what a run still needs; counts."""
    rows = list(c.rows.values())
    given = [r for r in rows if r.default_from is None]
    defaults = [r for r in rows if r.default_from is not None]
    width = max([len(r.key) for r in rows] + [10])
    ours_width = max([len(r.ours) for r in rows] + [4])

    def line(r: Row) -> str:
        cells = f"  {r.key:<{width}}  {_short(r.value):<30}  {r.kind:<11}  {r.ours or '-':<{ours_width}}"
        return (cells + "  " + r.note).rstrip()

    out = [f"{recipe.path} ({recipe.form}); {version_line}", ""]
    out += [f"  {'option':<{width}}  {'value':<30}  {'':<11}  {'here':<{ours_width}}  how / what to do", ""]
    out += [line(r) for r in given]
    if defaults:
        out += ["", f"  TRL {c.version}'s defaults for options the recipe leaves unset:"]
        out += [line(r) for r in defaults]
    if c.needs:
        out += ["", *[f"  note: {need}" for need in c.needs]]
    counts = {kind: sum(r.kind == kind for r in given) for kind in KINDS}
    out += [
        "",
        f"{len(given)} options: "
        + ", ".join(f"{n} {kind}" for kind, n in counts.items())
        + f"; {len(defaults)} unset options take TRL {c.version}'s defaults",
    ]
    return "\n".join(out)


# The written config's keys in the order `--print_config` shows them; others after, as they came.
ORDER = {
    "seed_everything": None,
    "trainer": None,
    "model": (
        "policy",
        "reward_funcs",
        "reward_weights",
        "val_reward",
        "num_generations_eval",
        "model_options",
        "lora",
        "grpo",
    ),
    "data": ("class_path", "init_args"),
}


def _ordered(config: dict, order: dict) -> dict:
    ranked = [k for k in order if k in config] + [k for k in config if k not in order]
    return {
        k: _ordered(config[k], dict.fromkeys(order[k])) if isinstance(order.get(k), tuple) else config[k]
        for k in ranked
    }


def config_text(c: Conversion, recipe: Recipe, version: str) -> str:
    """The config as `cli.py fit --config` reads it, the unsupported options listed in comments at the top."""
    head = [
        f"# {recipe.path} converted by `cli.py from-trl` (TRL {version}'s defaults for what it leaves unset)"
    ]
    unsupported = [r for r in c.rows.values() if r.kind == "unsupported"]
    if unsupported:
        head.append("# No counterpart here (the run goes without them):")
        head += [f"#   {r.key}: {_short(r.value, 60)}: {r.note}" for r in unsupported]
    config = _ordered(c.config, ORDER)

    return "\n".join(head) + "\n" + yaml.safe_dump(config, sort_keys=False, width=110, allow_unicode=True)
