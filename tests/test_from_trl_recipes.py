"""`cli.py from-trl`: published TRL recipes (open-r1's, TRL's example command line; `tests/fixtures/
trl_recipes/`, each with its source) convert, list every option they set, and train 2 steps on a tiny
model with only the overrides a CPU and a tiny model need; the TRL version's defaults apply to what a
recipe leaves unset; TRL's spellings mean our values; docs/from_trl.md agrees with `FLAT_NAMES` and the
converter."""

import ast
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

from grpo_lightning.cli import build_cli
from grpo_lightning.cli import main as cli_main
from grpo_lightning.cli.from_trl import chosen_version
from grpo_lightning.core.algorithm.advantages import AdvantageOptions
from grpo_lightning.core.algorithm.schedules import OptimizerOptions
from grpo_lightning.core.config import FLAT_NAMES
from grpo_lightning.core.generation.sampling import SamplingOptions
from grpo_lightning.core.options import trl_value
from grpo_lightning.from_trl.conversion import KINDS, grpo_key
from grpo_lightning.from_trl.converter import ALWAYS, KNOWN, NO_COUNTERPART, config_text, convert, table
from grpo_lightning.from_trl.model_rules import FACTORIES, OPEN_R1_REWARDS
from grpo_lightning.from_trl.output_rules import CHECKPOINT_CLASS
from grpo_lightning.from_trl.recipes import Recipe, read_recipe
from grpo_lightning.from_trl.run_rules import MIXED
from grpo_lightning.from_trl.versions import NEWEST_VERSION, TRL_DEFAULTS, defaults_at
from tests.helpers import recorded_prompt_ids

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "tests" / "fixtures" / "trl_recipes"
# Each fixture and the TRL version it was written for: open-r1 pins trl 0.18.0 (its setup.py); TRL's own
# example is from its main branch, newer than every release in the table.
FIXTURES = {
    "open_r1_math_simple_rl.yaml": "0.18",
    "open_r1_code_demo.yaml": "0.18",
    "open_r1_codeforces_dr_grpo.yaml": "0.18",
    "trl_gspo_command_line.sh": NEWEST_VERSION,
}


def recipe_of(keys: dict, text: str = "") -> Recipe:
    return Recipe("recipe.yaml", keys, "yaml", text)


def rows_of(keys: dict, version: str = NEWEST_VERSION, devices: int | None = None) -> dict:
    return convert(recipe_of(keys), version, devices).rows


def grpo(conversion, flat: str):
    return conversion.read(grpo_key(flat))


# ------------------------------------------------------------------------------------------ the fixtures
@pytest.mark.parametrize("name", FIXTURES)
def test_each_recipe_converts_and_its_table_lists_every_option(name):
    recipe = read_recipe(str(RECIPES / name))
    assert RECIPES.joinpath(name).read_text().startswith("# Source: https://github.com/huggingface/")
    version, line = chosen_version(FIXTURES[name], recipe)
    conversion = convert(recipe, version)
    given = {key: row for key, row in conversion.rows.items() if row.default_from is None}
    assert list(given) == [key for key in recipe.keys if key in given]  # the recipe's order
    assert set(given) == set(recipe.keys)  # every option of the recipe has its row, none invented
    assert {row.kind for row in conversion.rows.values()} <= set(KINDS)
    assert all(row.note for row in conversion.rows.values() if row.kind == "unsupported")
    assert all(row.ours for row in conversion.rows.values() if row.kind == "converted")
    printed = table(conversion, recipe, line)
    for key in recipe.keys:
        assert re.search(rf"^  {re.escape(key)} ", printed, re.M), key
    counts = re.search(r"^(\d+) options: (\d+) mapped, (\d+) converted, (\d+) unsupported", printed, re.M)
    assert int(counts[1]) == len(recipe.keys) == sum(map(int, counts.groups()[1:]))
    written = config_text(conversion, recipe, version)
    for row in conversion.rows.values():  # the unsupported ones travel with the config
        assert (f"#   {row.key}: " in written) == (row.kind == "unsupported"), row.key


PROBLEMS = [f"What is {a} + 2?" for a in range(8)]


def write_rows(folder: Path, prompt_field: str, as_text: bool) -> str:
    """A train and a test split of 8 arithmetic problems, the prompt column named as the converted config
    reads it: text where the config makes it the user's turn (open-r1's data sets, whose script builds the
    conversation), else chat messages (TRL's conversational format)."""
    folder.mkdir()
    rows = [
        {prompt_field: text if as_text else [{"role": "user", "content": text}], "solution": str(a + 2)}
        for a, text in enumerate(PROBLEMS)
    ]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


# What a CPU and a tiny random model need, and nothing else: the model and data paths, float32 on the CPU
# without vLLM or FlashAttention, sizes a CPU runs in seconds, 2 steps, the run's files in the test's folder,
# and no logger (wandb is not installed).
CPU_OVERRIDES = (
    "--trainer.precision=32-true",
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--model.grpo.engine.backend=auto",
    "--model.grpo.engine.vllm_mode=null",  # open-r1 servers: tests/vllm_backend/test_vllm_server_from_trl.py
    "--model.model_options.attn_implementation=null",
    "--model.grpo.sampling.num_generations=2",
    "--model.grpo.sampling.max_completion_length=8",
    "--model.grpo.sampling.max_prompt_length=256",  # open-r1's system prompts whole (under 200 tokens)
    "--data.batch_size=4",
)
OVERRIDDEN = {"num_generations", "max_completion_length", "max_prompt_length"}


@pytest.mark.parametrize("name", FIXTURES)
def test_each_converted_recipe_trains_two_steps_with_cpu_overrides(
    name, tiny_model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "run.yaml"
    cli_main(["from-trl", str(RECIPES / name), "--trl-version", FIXTURES[name], "--out", str(out)])
    config = yaml.safe_load(out.read_text())
    data_options = config["data"]["init_args"]
    recipe = read_recipe(str(RECIPES / name)).keys
    # open-r1's script makes the prompt column's text the user's turn, after its system prompt; TRL's
    # script keeps TRL's standard format.
    assert data_options.get("chat_prompt", False) == ("dataset_prompt_column" in recipe)
    assert data_options.get("system_prompt") == recipe.get("system_prompt")
    # open-r1's reward functions need the open-r1 package (installed from its repository, not PyPI), and
    # TRL's script passes its own in code: a reward of the tests' stands in for them, in the file, where
    # jsonargparse imports them.
    config["model"]["reward_funcs"] = ["tests.helpers.digit_reward"]
    config["model"].pop("reward_weights", None)
    out.write_text(yaml.safe_dump(config))
    field = data_options.get("prompt_field", "prompt")
    source = write_rows(tmp_path / "data", field, as_text=data_options.get("chat_prompt", False))
    seen = recorded_prompt_ids(monkeypatch)
    cli = build_cli(
        [
            "fit",
            "--config",
            str(out),
            f"--model.policy={tiny_model_dir}",
            f"--data.source={source}",
            f"--trainer.default_root_dir={tmp_path}",
            *CPU_OVERRIDES,
        ]
    )
    assert cli.trainer.global_step == 2
    # Everything else is the converted config's: every option it sets is the module's.
    by_path = {entry.path: flat for flat, entry in FLAT_NAMES.items()}

    def leaves(options: dict, path: tuple = ()):
        for key, value in options.items():
            if (*path, key) in by_path and not isinstance(value, dict):
                yield by_path[(*path, key)], value
            elif isinstance(value, dict):
                yield from leaves(value, (*path, key))

    checked = dict(leaves(config["model"]["grpo"]))
    assert len(checked) >= 10
    for flat, value in checked.items():
        if flat not in OVERRIDDEN and FLAT_NAMES[flat].path[0] != "engine":  # the engine is overridden
            assert getattr(cli.model.grpo, flat) == value, flat
    assert cli.datamodule.hparams.seed == config["data"]["init_args"]["seed"]
    # The policy's prompts are the chat template's rendering of the conversation open-r1 builds.
    system = [{"role": "system", "content": recipe["system_prompt"]}] if "system_prompt" in recipe else []
    renders = {
        tuple(
            cli.model.tokenizer.apply_chat_template(
                [*system, {"role": "user", "content": problem}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for problem in PROBLEMS
    }
    assert len(seen) >= 2 * 4 and {tuple(ids) for ids in seen} <= renders


def test_the_fixtures_convert_as_their_recipes_say():
    """A few numbers of each fixture, against the recipe's own comments and TRL's rules."""
    codeforces = convert(read_recipe(str(RECIPES / "open_r1_codeforces_dr_grpo.yaml")), "0.18")
    # "total_samples_per_batch = num_gpus * grad_accumulation_steps * per_device_batch_size = 8 * 32 * 4"
    # "unique_prompts_per_batch = total_samples_per_batch / num_generations = 1024 / 16 = 64": 8 per GPU.
    assert codeforces.read("data.init_args.batch_size") == 8
    assert grpo(codeforces, "micro_batch_size") == 4
    assert grpo(codeforces, "loss_type") == "dr_grpo" and grpo(codeforces, "scale_rewards") == "none"
    assert grpo(codeforces, "lr_scheduler_type") == "constant" and grpo(codeforces, "max_grad_norm") == 0.2
    assert grpo(codeforces, "warmup_ratio") == 0.1  # of the run's length, which epochs bound
    assert codeforces.rows["save_steps"].kind == "unsupported"  # 0.05 of an unknown length
    assert codeforces.read("model.reward_funcs") == ["open_r1.rewards.cf_code_reward"]
    assert codeforces.read("model.reward_weights") == [1.0]  # code_format's 0.1 left out with it
    code = convert(read_recipe(str(RECIPES / "open_r1_code_demo.yaml")), "0.18", devices=7)
    assert grpo(code, "warmup_ratio") == 0.03  # ceil(0.03 x 500) = 15 steps at the run's start
    assert grpo(code, "min_lr_ratio") == 0.1 and grpo(code, "beta") == 0.01
    (checkpoint,) = code.read("trainer.callbacks")
    assert checkpoint == {
        "class_path": CHECKPOINT_CLASS,
        "init_args": {"every_n_train_steps": 50, "save_top_k": 1},
    }
    assert "32 prompts over 7 devices" in code.rows["per_device_train_batch_size"].note  # 16 x 4 x 7 / 14
    gspo = convert(read_recipe(str(RECIPES / "trl_gspo_command_line.sh")), NEWEST_VERSION)
    assert gspo.read("model.lora") == {"target_modules": ["q_proj", "v_proj"], "dropout": 0.05}
    assert gspo.read("data.init_args.batch_size") == 8  # 8 completions x 8 passes / 8 per prompt
    assert grpo(gspo, "steps_per_generation") == 4  # 8 passes, 2 per optimizer step
    assert grpo(gspo, "epsilon") == 3e-4 and grpo(gspo, "importance_sampling_level") == "sequence"
    math = convert(read_recipe(str(RECIPES / "open_r1_math_simple_rl.yaml")), "0.18")
    assert math.read("data.init_args.val_split") == "test" and math.read("trainer.val_check_interval") == 100
    assert math.read("model.val_reward") == "trl.rewards.accuracy_reward"
    assert math.read("data.init_args.batch_size") == 19  # 16 x 8 = 128 completions: 18.3 groups of 7


# --------------------------------------------------------------------------------- TRL versions' defaults
def test_a_recipe_without_beta_gets_its_trl_versions_default():
    old = convert(recipe_of({"learning_rate": 1e-6}), "0.18")
    assert grpo(old, "beta") == 0.04 and grpo(old, "loss_type") == "bnpo"
    assert old.rows["beta"].default_from.endswith("v0.14.0/trl/trainer/grpo_config.py")
    new = convert(recipe_of({"learning_rate": 1e-6}), "1.16")
    assert grpo(new, "beta") == 0.0 and grpo(new, "loss_type") == "dapo"
    assert grpo(new, "max_completion_length") == 512 and grpo(old, "max_completion_length") == 256
    first = convert(recipe_of({}), "0.14")
    assert grpo(first, "temperature") == 0.9 and grpo(first, "loss_type") == "grpo"
    # TRL 0.14 counted prompts per device: 1 prompt x 8 accumulation steps, 8 completions per pass.
    assert first.read("data.init_args.batch_size") == 8 and grpo(first, "micro_batch_size") == 8
    assert grpo(convert(recipe_of({"beta": 0.1}), "0.18"), "beta") == 0.1  # the recipe's own value wins
    assert "beta" not in defaults_at("0.18", {"beta": 0.1})


def test_conditional_defaults_follow_the_recipe():
    with_vllm = convert(recipe_of({"use_vllm": True}), "0.26")
    assert with_vllm.read("model.grpo.sampler_correction") == {"mode": "sequence_mask", "cap": 3.0}
    assert convert(recipe_of({"use_vllm": False}), "0.26").read("model.grpo.sampler_correction") is None
    vllm_014 = convert(recipe_of({"use_vllm": True}), "0.14")
    assert "top_k" not in vllm_014.rows and grpo(vllm_014, "top_k") is None  # vLLM had none: ours, 0
    assert grpo(convert(recipe_of({}), "0.14"), "top_k") == 50  # generate's default top-k
    assert "lora_dropout" not in convert(recipe_of({}), "0.18").rows  # no LoRA, no LoRA default


def test_every_version_default_has_a_source_and_the_table_is_ordered():
    for row in TRL_DEFAULTS:
        assert row.source.startswith(("https://github.com/huggingface/trl/", "trl ", "transformers")), row
    for a, b in zip(TRL_DEFAULTS, TRL_DEFAULTS[1:], strict=False):
        if a.option == b.option:
            assert tuple(map(int, a.since.split("."))) < tuple(map(int, b.since.split("."))), (a, b)
    assert {row.option for row in TRL_DEFAULTS} <= KNOWN | set(FLAT_NAMES)


def test_the_version_comes_from_the_option_then_the_recipe_then_the_newest():
    named = recipe_of({}, "# trl==0.18.0\nbeta: 0.0\n")
    assert chosen_version(None, named)[0] == "0.18"
    assert chosen_version("0.26.1", named)[0] == "0.26"
    version, line = chosen_version(None, recipe_of({}))
    assert version == NEWEST_VERSION and "--trl-version" in line
    assert "newest known" in chosen_version("2.3", named)[1]
    with pytest.raises(ValueError, match="from 0.14 on"):
        chosen_version("0.13", named)


# ------------------------------------------------------------------------------------------- spellings
@pytest.mark.parametrize(
    ("keys", "flat", "ours"),
    [
        ({"scale_rewards": False}, "scale_rewards", "none"),
        ({"scale_rewards": True}, "scale_rewards", "group"),
        ({"scale_rewards": "batch"}, "scale_rewards", "batch"),
        ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 5}, "lr_scheduler_type", "constant"),
        ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 5}, "warmup_steps", 5),
        ({"lr_scheduler_type": "constant", "warmup_steps": 5}, "warmup_steps", 0),  # transformers ignores it
        (
            {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
            "lr_scheduler_type",
            "cosine",
        ),
        (
            {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
            "min_lr_ratio",
            0.1,
        ),
        (
            {"lr_scheduler_kwargs": {"min_lr": 1e-7}, "learning_rate": 1e-6},
            "min_lr_ratio",
            pytest.approx(0.1),
        ),
        ({"warmup_steps": 0.1, "max_steps": 200}, "warmup_ratio", 0.1),  # transformers 5: a ratio
        ({"warmup_ratio": 0.03}, "warmup_ratio", 0.03),
        ({"warmup_ratio": 0.1, "warmup_steps": 7, "max_steps": 500}, "warmup_steps", 7),  # steps win
        ({"top_k": None}, "top_k", 0),
        ({"max_grad_norm": 0}, "max_grad_norm", None),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs",
            {"enable_thinking": False},
        ),
    ],
)
def test_trls_spellings_mean_our_values(keys, flat, ours):
    conversion = convert(recipe_of(keys), NEWEST_VERSION)
    assert grpo(conversion, flat) == ours
    spelled = [key for key in keys if conversion.rows[key].kind == "converted"]
    assert all(conversion.rows[key].note for key in spelled)


def test_trls_mixed_precision_is_the_trainers_over_float32_weights():
    for flag, precision in MIXED.items():
        conversion = convert(recipe_of({flag: True}), NEWEST_VERSION)
        assert conversion.read("trainer.precision") == precision and conversion.rows[flag].kind == "converted"


def test_open_r1s_rewards_import():
    for name, path in OPEN_R1_REWARDS.items():
        assert (path is None) == (name in FACTORIES), name
        if path is not None and path.startswith("trl."):  # TRL is installed beside us; open-r1 is not
            module, function = path.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(module), function)), path


def test_a_spelling_without_counterpart_is_unsupported_with_a_hint():
    rows = rows_of({"lr_scheduler_type": "inverse_sqrt", "loss_type": "sapo"})
    assert (
        rows["lr_scheduler_type"].kind == "unsupported"
        and "TRL's 'inverse_sqrt'" in rows["lr_scheduler_type"].note
    )
    assert rows["loss_type"].kind == "unsupported" and "dapo" in rows["loss_type"].note  # our default kept
    assert rows_of({"scale_rewards": False})["scale_rewards"].note == "TRL's False is 'none' here"
    first = convert(recipe_of({"logging_first_step": True, "logging_steps": 5}), NEWEST_VERSION)
    assert first.rows["logging_first_step"].kind == "mapped" and grpo(first, "logging_first_step") is True


def test_the_hand_tables_never_name_an_option_declared_here():
    """`ALWAYS` and `NO_COUNTERPART` hold TRL's options that no option of ours declares: a flat name (an
    option's `Alias`, TRL's name, or its own; `FLAT_NAMES`) is converted from its declaration before them, so
    a row of it there would never be read, its value and hint drifting from the option's."""
    for hand_table in (ALWAYS, NO_COUNTERPART):
        assert sorted(set(hand_table) & set(FLAT_NAMES)) == []
    assert "max_tool_calling_iterations" in FLAT_NAMES  # TRL's name, declared as an Alias: no hand row
    rows = rows_of({"max_tool_calling_iterations": 3})
    assert rows["max_tool_calling_iterations"].kind == "mapped"
    assert (
        rows["max_tool_calling_iterations"].ours
        == "model.grpo." + FLAT_NAMES["max_tool_calling_iterations"].key
    )


# ------------------------------------------------------------------------------------------ batch sizes
@pytest.mark.parametrize(
    ("keys", "devices", "batch", "micro", "steps"),
    [
        ({"per_device_train_batch_size": 16, "num_generations": 16}, None, 1, None, None),
        (
            {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4, "num_generations": 16},
            None,
            4,
            16,
            None,
        ),
        (
            {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 8},
            None,
            8,
            8,
            4,
        ),
        ({"per_device_train_batch_size": 4, "generation_batch_size": 64}, 2, 4, 4, 8),  # 64 / (4 x 2) passes
        (
            {"per_device_train_batch_size": 4, "num_generations": 8},
            2,
            1,
            None,
            None,
        ),  # half a group per device
    ],
)
def test_completions_per_device_become_prompts_per_step(keys, devices, batch, micro, steps):
    conversion = convert(recipe_of(keys), NEWEST_VERSION, devices)
    assert conversion.read("data.init_args.batch_size") == batch
    assert grpo(conversion, "micro_batch_size") == micro
    assert grpo(conversion, "steps_per_generation") == steps


def test_a_rollout_of_part_of_an_optimizer_step_is_unsupported():
    rows = rows_of({"gradient_accumulation_steps": 4, "steps_per_generation": 6})
    assert (
        rows["steps_per_generation"].kind == "unsupported" and "multiple" in rows["steps_per_generation"].note
    )


# --------------------------------------------------------------------------------- reading and bad input
def test_the_command_line_form_reads_as_trls_parser_does(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(
        "# a comment naming x.py\naccelerate launch --config_file z.yaml examples/scripts/x.py \\\n"
        '  --learning_rate 1e-5 --use_peft --lora_target_modules "q_proj", "v_proj" --beta=0.0 \\\n'
        "  --reward_weights 1.0 0.5 --output_dir out --gradient_checkpointing false\n"
    )
    keys = read_recipe(str(path)).keys
    assert keys == {
        "learning_rate": 1e-5,
        "use_peft": True,
        "lora_target_modules": ["q_proj", "v_proj"],
        "beta": 0.0,
        "reward_weights": [1.0, 0.5],
        "output_dir": "out",
        "gradient_checkpointing": False,
    }
    yaml_path = tmp_path / "r.yaml"
    yaml_path.write_text("learning_rate: 1e-6\nmax_steps: 10\n")  # YAML 1.1 reads 1e-6 as text
    assert read_recipe(str(yaml_path)).keys == {"learning_rate": 1e-6, "max_steps": 10}


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "no such recipe file"),
        ("- a\n- b\n", [], "neither a YAML mapping"),
        ("beta: 0.1\n", ["--trl-version", "zero"], "not a version number"),
        ("beta: 0.1\n", ["--devices", "0"], "--devices=0: must be >= 1"),
        ("per_device_train_batch_size: 4\ngeneration_batch_size: 6\n", [], "generation_batch_size=6"),
        ("sync_ref_model: true\nbeta: 0.0\n", [], "sync_ref_model: true): needs beta > 0"),
        ("beta: 0.1\n", ["--out", "{exists}"], "the file exists; add --overwrite"),
    ],
)
def test_bad_input_is_one_error_line(content, args, message, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    if content is not None:
        recipe.write_text(content)
    exists = tmp_path / "exists.yaml"
    exists.write_text("kept\n")
    with pytest.raises(SystemExit) as stop:
        cli_main(["from-trl", str(recipe), *[a.format(exists=exists) for a in args]])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and message in err[0] and len(err) == 2  # and the GRPO_DEBUG hint
    assert exists.read_text() == "kept\n"


def test_without_out_the_config_goes_to_stdout_and_the_table_to_stderr(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("beta: 0.04\nscale_rewards: false\nuse_liger_kernel: true\n")
    cli_main(["from-trl", str(recipe), "--trl-version", "0.18"])
    out, err = capsys.readouterr()
    config = yaml.safe_load(out)
    assert config["model"]["grpo"]["advantages"]["scale_rewards"] == "none"
    assert "#   use_liger_kernel: " in out and "3 options: 1 mapped, 1 converted, 1 unsupported" in err


# -------------------------------------------------------------------------------------- docs/from_trl.md
DOC = ROOT / "docs" / "from_trl.md"


def doc_section(heading: str) -> str:
    """The text of docs/from_trl.md's "## " section whose heading starts with `heading`."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## " + heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def table_rows(section: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def first_column_names(section: str) -> set[str]:
    return {name for cells in table_rows(section) for name in re.findall(r"`(\w+)`", cells[0])}


def test_the_docs_name_every_flat_option_and_only_known_ones():
    text = DOC.read_text(encoding="utf-8")
    documented = {name.rstrip(".") for name in re.findall(r"`model\.grpo\.([\w.]+)", text)}
    keys = {entry.key for entry in FLAT_NAMES.values()}
    assert set(FLAT_NAMES) <= documented, sorted(set(FLAT_NAMES) - documented)
    assert documented <= set(FLAT_NAMES) | keys, sorted(documented - set(FLAT_NAMES) - keys)


def test_the_docs_tables_name_every_option_the_converter_knows_and_no_other():
    names = first_column_names(doc_section("Option by option")) | first_column_names(
        doc_section("Other TRL options")
    )
    assert KNOWN - names == set(), sorted(KNOWN - names)
    assert names - KNOWN - set(FLAT_NAMES) == set(), sorted(names - KNOWN - set(FLAT_NAMES))


def test_the_docs_mapping_rows_are_the_converters():
    """The doc's TRL script converted: each row of "Option by option" that names one of `GRPOConfig`'s
    options (`model.grpo.<flat name>`) is where the converter puts the TRL option."""
    script = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)[1]
    call = next(
        n
        for n in ast.walk(ast.parse(script))
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "GRPOConfig"
    )
    recipe = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    conversion = convert(recipe_of(recipe), NEWEST_VERSION)
    checked = 0
    for cells in table_rows(doc_section("Option by option")):
        name, ours = re.findall(r"`(\w+)`", cells[0])[0], cells[2].strip("`")
        if name in recipe and ours.startswith("model.grpo."):
            row = conversion.rows[name]
            if row.ours:
                assert grpo_key(ours.removeprefix("model.grpo.")) in row.ours.split(", "), name
                checked += 1
            else:  # an option of a section that is off (ref_model_mixup_alpha without sync_ref_model)
                assert row.note.startswith("no effect without"), name
    assert checked >= 20


@pytest.mark.parametrize(
    "cells",
    table_rows(doc_section("Other TRL options")),
    ids=lambda cells: cells[1].strip("`"),
)
def test_each_row_of_other_trl_options_is_what_the_converter_does(cells):
    names = re.findall(r"`(\w+)`", cells[0])
    recipe = yaml.safe_load(cells[1].strip("`"))
    conversion = convert(recipe_of(recipe), NEWEST_VERSION)
    name = next(n for n in names if n in conversion.rows)
    row = conversion.rows[name]
    assert row.kind == cells[3], (name, row.note)
    assert (row.ours or "—") == cells[2].replace("`", ""), name


def test_the_docs_version_table_is_trl_versions():
    section = doc_section("`cli.py from-trl`")
    header = next(line for line in section.splitlines() if line.startswith("| option |"))
    versions = [cell.strip() for cell in header.strip("|").split("|")][1:]
    rows = table_rows(section)
    assert len(rows) >= 10
    for cells in rows:
        option = cells[0].strip("`")
        for version, cell in zip(versions, cells[1:], strict=True):
            assert defaults_at(version, {})[option][0] == ast.literal_eval(cell.strip("`")), (option, version)


def test_trl_s_spellings_are_declared_at_each_option():
    """`TRLValues` in an option's annotation: TRL's value made ours, a bool told apart from a number."""
    assert trl_value(AdvantageOptions, "scale_rewards", False) == ("none", True)
    assert trl_value(SamplingOptions, "top_k", None) == (0, True)
    assert trl_value(SamplingOptions, "top_k", 1) == (1, False)  # a value of ours: kept
    assert trl_value(OptimizerOptions, "max_grad_norm", 0) == (None, True)
    assert trl_value(OptimizerOptions, "max_grad_norm", False) == (False, False)  # not TRL's 0


def test_a_private_push_is_in_the_command_to_run():
    rows = rows_of({"push_to_hub": True, "hub_model_id": "me/run", "hub_private_repo": True})
    assert rows["push_to_hub"].note.endswith("--ckpt_path last --push-to-hub me/run --private true")
    assert rows["hub_model_id"].ours == "cli.py export --push-to-hub me/run --private true"


@pytest.mark.parametrize("name", [n for n in FIXTURES if n.startswith("open_r1")])
def test_open_r1_server_recipes_keep_their_servers(name):
    """open-r1's recipes run TRL 0.18's server mode: the config selects the server engine, and the servers'
    own options become the `cli.py vllm-serve` command printed under the table."""
    recipe = read_recipe(str(RECIPES / name))
    conversion = convert(recipe, FIXTURES[name])
    assert conversion.read("model.grpo.engine.vllm_mode") == "server"
    assert conversion.read("model.grpo.engine.backend") is None  # vllm_mode names it
    assert conversion.rows["vllm_mode"].kind == "mapped"
    command = f"python cli.py vllm-serve --model {recipe.keys['model_name_or_path']}"
    if "vllm_gpu_memory_utilization" in recipe.keys:
        command += f" --gpu-memory-utilization {recipe.keys['vllm_gpu_memory_utilization']}"
        assert conversion.rows["vllm_gpu_memory_utilization"].kind == "converted"
    assert conversion.needs[0] == f"start the vLLM servers before fit: {command}"


def test_server_recipes_map_the_client_options_and_print_the_server_flags():
    keys = {
        "model_name_or_path": "Qwen/Qwen2.5-7B",
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_host": "10.0.0.2",
        "vllm_server_port": 8001,
        "vllm_server_timeout": 600,
        "vllm_group_port": 51300,
        "vllm_tensor_parallel_size": 2,
        "vllm_max_model_length": 4096,
    }
    conversion = convert(recipe_of(keys), NEWEST_VERSION)
    assert conversion.read("model.grpo.engine.vllm_server") == {
        "host": "10.0.0.2",
        "port": 8001,
        "timeout": 600,
        "group_port": 51300,
    }
    command = (
        "python cli.py vllm-serve --model Qwen/Qwen2.5-7B --host 10.0.0.2 --port 8001 "
        "--tensor-parallel-size 2 --max-model-len 4096"
    )
    assert conversion.rows["vllm_tensor_parallel_size"].ours == "cli.py vllm-serve --tensor-parallel-size 2"
    assert conversion.rows["vllm_max_model_length"].note == f"a flag of the servers: {command}"
    assert conversion.read("model.grpo.engine.vllm") is None  # the colocated engine's options stay unset
    assert not [need for need in conversion.needs if need.startswith("warning")]
    colocated = convert(recipe_of({**keys, "vllm_mode": "colocate"}), NEWEST_VERSION)
    assert colocated.read("model.grpo.engine.vllm_server") is None
    assert colocated.rows["vllm_server_port"].note.startswith("no effect without")
    assert colocated.read("model.grpo.engine.backend") == "vllm"


def test_a_recipe_without_data_says_how_an_environment_writes_the_prompts():
    """TRL's docs' no-data recipe (`GRPOConfig(max_steps=1000)`, `train_dataset=None`, an environment whose
    `reset` writes each prompt): the need line names the data module to use, and its kept options build it."""
    keys = {"model_name_or_path": "Qwen/Qwen3-0.6B", "max_steps": 1000}
    conversion = convert(recipe_of(keys), NEWEST_VERSION)
    [need] = [n for n in conversion.needs if n.startswith("data.init_args.source")]
    path, *kept = re.search(r"set data.class_path to (\S+) and keep only its (\w+) and (\w+)", need).groups()
    module_name, _, class_name = path.rpartition(".")
    data = getattr(importlib.import_module(module_name), class_name)(
        **{key: conversion.read("data")["init_args"][key] for key in kept}
    )
    data.setup("fit")
    assert data.train_rows == [{"prompt": [{"role": "user", "content": ""}]}] * data.hparams.batch_size
    assert conversion.read("trainer.max_steps") == 1000  # which the data module requires
