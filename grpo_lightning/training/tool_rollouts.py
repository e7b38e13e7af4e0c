"""Multi-turn rollouts for `GRPOModule`, through TRL 1.16's three entry points, with TRL's meaning:

- `tools=[fn, ...]`: typed functions with a Google-style docstring (or their import paths), shown to the
  chat template as `tools=` (or in a Hermes system prompt where the template cannot show tools), called by
  the policy in `<tool_call>` blocks (`core.generation.multi_turn.ToolRollouts`).
- `environment_factory=Cls` or `{name: Cls}`: one instance per rollout sample, `reset(**row)` before the
  sample is drawn (the text it returns, if any, is appended to the last user message; a row with only an
  `environment` column starts from an empty user turn, so that text is the whole prompt), its public methods
  the sample's tools besides `tools`; a `get_reward()` method is a reward source of its own (weight 1, named
  after the class), the only one where the module has no reward functions. With a dict, each row's
  `environment` column picks the environment.
- `rollout_func(prompts, module)`: the whole rollout in the user's hands. It gets one prompt per sample (each
  prompt repeated G times) and returns `prompt_ids`, `completion_ids` and `logprobs` (lists per sample),
  optionally `env_mask` (1 on the policy's tokens, 0 on tokens the loss must not count) and any other field,
  which reaches the reward functions as a keyword.

The reward functions then get what TRL's get in such runs: the prompts as the policy saw them (with the
environments' observations), the completions as chat messages (each assistant turn with its `tool_calls`,
each result a `tool` message) and `environments=`. Validation, test and predict sample through the same
loop, greedily where they decode greedily.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from lightning.pytorch.utilities import rank_zero_info
from transformers import TrainerState

from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.sampling import stop_token_ids
from grpo_lightning.core.options import warn_inert
from grpo_lightning.core.rewards.scoring import RewardInputs
from grpo_lightning.core.tools.calls import (
    CallFailed,
    CallTimeout,
    RowToolRunner,
    ToolOptions,
    call_within,
    describe,
    sets_signal_handler,
    signal_handler_advice,
)
from grpo_lightning.core.tools.schemas import (
    Tool,
    template_renders_tools,
    tool_name,
    tool_schema,
    with_tools_in_system_prompt,
)
from grpo_lightning.core.tools.turns import (
    rendering_with,
    training_template,
    training_template_note,
    with_tool_turns_as_user_turns,
)
from grpo_lightning.core.types import Rollout
from grpo_lightning.io.hparams import import_object, resolve_callable
from grpo_lightning.io.rows import ENVIRONMENT_COLUMN, ENVIRONMENT_PROMPT
from grpo_lightning.training.rollout_lists import rollout_of_lists

ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")  # what a rollout_func must return
NOT_TOOLS = ("reset", "get_reward")  # an environment's public methods that the policy does not call


@dataclass
class SampledTurns:
    """What a multi-turn rollout hands the reward functions beyond its ids and text, one entry per sample."""

    prompts: list  # the prompts as the policy saw them (an environment's observation appended)
    messages: list[list[dict]] | None = None  # each completion as chat messages; None: plain completions
    environments: list | None = None  # each sample's environment instance
    keywords: dict[str, object] = field(default_factory=dict)  # a rollout_func's extra fields
    metrics: dict[str, float] = field(default_factory=dict)  # tools/call_frequency, tools/failure_frequency

    def reward_inputs(
        self, batch: dict[str, list], rollout: Rollout, completions: list[str], state: TrainerState
    ) -> RewardInputs:
        """The reward functions' inputs: the batch's columns per sample, and these turns."""
        inputs = RewardInputs.of_rollout(batch, rollout, completions, state)
        keywords = dict(self.keywords)
        if self.environments is not None:
            keywords["environments"] = self.environments
        return replace(inputs, prompts=list(self.prompts), messages=self.messages, keywords=keywords)


def prompt_answers(prompts: list, completions: list[str], turns: SampledTurns | None) -> list[dict]:
    """`predict_step`'s answers: `{"prompt", "completions"}` per prompt, its samples contiguous, and with a
    multi-turn rollout's messages each sample's `transcripts` (its tool calls and results)."""
    k = len(completions) // len(prompts)
    answers = [{"prompt": p, "completions": completions[i * k : (i + 1) * k]} for i, p in enumerate(prompts)]
    for i, answer in enumerate(answers if turns is not None and turns.messages is not None else []):
        answer["transcripts"] = turns.messages[i * k : (i + 1) * k]
    return answers


def environment_tools(environment: object) -> list[Tool]:
    """The methods of `environment` the policy may call: its class's public functions but `reset` and
    `get_reward`, bound to it (read on the class: reading the instance would run its properties)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    ]


class EnvironmentReward:
    """The reward of the environments of class `cls`: each sample's `get_reward()` where its environment is
    of that class exactly, None (no opinion) elsewhere; awaited when `get_reward` is async. A `get_reward`
    that does not return within `seconds` (`ToolOptions.environment_timeout`; None: called in this thread with
    no bound) is that sample's None, with a warning naming the class; one that raises stops the run in one
    line naming it."""

    def __init__(self, cls: type, seconds: float | None = ToolOptions.environment_timeout) -> None:
        self.cls, self.__name__, self.seconds = cls, cls.__name__, seconds

    def __call__(self, environments: Sequence[object] | None = None, **kwargs: object) -> object:
        ours = [type(e) is self.cls for e in environments or []]
        if not inspect.iscoroutinefunction(self.cls.get_reward):
            return [self._bounded(e) if mine else None for e, mine in zip(environments, ours, strict=True)]

        async def rewards() -> list:
            return [
                await self._awaited(e) if mine else None for e, mine in zip(environments, ours, strict=True)
            ]

        return rewards()

    def _bounded(self, environment: object) -> object:
        try:
            return call_within(environment.get_reward, self.seconds, f"{self.__name__}.get_reward")
        except CallTimeout as error:
            return self._missing(error)
        except CallFailed as error:
            raise _user_code_error(f"{self.__name__}.get_reward()", error, self.seconds) from None

    async def _awaited(self, environment: object) -> object:
        try:
            return await asyncio.wait_for(environment.get_reward(), self.seconds)
        except TimeoutError:
            return self._missing(
                CallTimeout(f"{self.__name__}.get_reward did not return within {self.seconds:g} s")
            )
        except Exception as error:
            raise _user_code_error(
                f"{self.__name__}.get_reward()", CallFailed(error, describe(error))
            ) from None

    def _missing(self, error: CallTimeout) -> None:
        warnings.warn(
            f"{error} (tools.environment_timeout): that sample has no {self.__name__} reward", stacklevel=2
        )
        return None


def _user_code_error(what: str, error: CallFailed | CallTimeout, bound: float | None = None) -> RuntimeError:
    """The one-line error of user code that failed: `what` it was (a class's method, a function) and why;
    where it ran in a thread of its own (under `bound`, or on the rollout thread of rollouts sampled ahead)
    and set a signal handler there, what to set."""
    if isinstance(error, CallTimeout):
        return RuntimeError(f"{error} (tools.environment_timeout): raise the bound or fix the environment")
    if sets_signal_handler(error, bound):
        return RuntimeError(f"{what} raised {error}: {signal_handler_advice('tools.environment_timeout')}")
    return RuntimeError(f"{what} raised {error}")


def _user_call(what: str, function: Callable[[], object], seconds: float | None) -> object:
    """`function()` (an environment's constructor or `reset`), bounded by `seconds` (None: in this thread,
    no bound); what goes wrong is one `RuntimeError` line naming `what`."""
    try:
        return call_within(function, seconds, what)
    except (CallTimeout, CallFailed) as error:
        raise _user_code_error(what, error, seconds) from None


def _uncallable(tool: object) -> str | None:
    """Why the policy could never call `tool` through its schema (a JSON object of named arguments), or
    None: a class, a lambda (no name to call it by), `*args` or `**kwargs`, positional-only arguments, a
    method taken from its class (its `self` would be missing)."""
    if inspect.isclass(tool):
        return "is a class, not a function (an environment class goes to environment_factory)"
    if getattr(tool, "__name__", None) == "<lambda>":
        return "is a lambda, which has no name for the model to call it by: define it with def"
    try:
        parameters = inspect.signature(tool).parameters
    except (TypeError, ValueError):
        return "has no signature to read its arguments from"
    for parameter in parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            stars = "*" if parameter.kind == parameter.VAR_POSITIONAL else "**"
            return (
                f"takes {stars}{parameter.name}, which a call cannot fill (it passes a JSON object of named "
                "arguments): name and type each argument"
            )
        if parameter.kind == parameter.POSITIONAL_ONLY:
            return f"takes {parameter.name} positional-only, which a call cannot fill: drop the /"
    first = next(iter(parameters), None)
    if first in ("self", "cls") and not inspect.ismethod(tool) and "." in getattr(tool, "__qualname__", ""):
        return (
            f"is the method {tool.__qualname__} taken from its class, so its {first} would be missing: give "
            "the class as environment_factory (its methods become each sample's tools), or a bound method"
        )
    return None


def _checked_tools(tools: Sequence[Tool], names: Sequence[str]) -> None:
    """Refuse, in one line naming it, a tool the policy could never call (`_uncallable`), one without a JSON
    schema (a type hint or its docstring's `Args:` line missing), and two tools of one name; `names` say
    where each comes from (`tools[0]`, `environment_factory Shop's method buy`)."""
    for tool, name in zip(tools, names, strict=True):
        problem = _uncallable(tool)
        if problem is not None:
            raise ValueError(f"{name} ({tool_name(tool)!r}) {problem}")
        try:
            tool_schema(tool)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None
    called = [tool_name(tool) for tool in tools]
    for twice in sorted({name for name in called if called.count(name) > 1}):
        where = [name for name, each in zip(names, called, strict=True) if each == twice]
        raise ValueError(
            f"two tools are named {twice!r} ({', '.join(where)}): the model could not tell them apart"
        )


def _resolved(value: object, option: str) -> object:
    """A tool, environment class or rollout function given as itself or as its import path."""
    if isinstance(value, str):
        try:
            return import_object(value)
        except (ImportError, ValueError) as err:
            raise ValueError(f"{option}={value!r}: cannot import it ({err})") from None
    return resolve_callable(value, option)


class ToolSampling:
    """The multi-turn rollouts of one module: its `tools`, `environment_factory` or `rollout_func` (see the
    module's docstring), bounded by `options` (`GRPOConfig.tools`). `owner`: the module a `rollout_func` is
    handed.

    Each environment class is built once here, as TRL probes it: it must have a `reset` method. With
    `max_staleness` > 0 (`async_rollouts`: the next batches roll out while this one is scored), each batch
    gets environments of its own rather than the pool's, and a `rollout_func` is refused: its sampling cannot
    be held to one weight version."""

    def __init__(
        self,
        tools: Sequence[Tool | str] | None = None,
        environment_factory: Callable | str | Mapping[str, Callable | str] | None = None,
        rollout_func: Callable | str | None = None,
        options: ToolOptions | None = None,
        owner: object | None = None,
        max_staleness: int = 0,
    ) -> None:
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ValueError(
                "rollout_func samples the whole rollout itself: pass it without tools or environment_factory"
            )
        if rollout_func is not None and max_staleness > 0:
            raise ValueError(
                f"rollout_func with async_rollouts.max_staleness={max_staleness}: a rollout function samples "
                "on its own, so its batches cannot be held to the weight version they are stamped with; "
                "set max_staleness: 0"
            )
        self.fresh_environments = max_staleness > 0
        self.options = options or ToolOptions()
        self.tools = [_resolved(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])]
        self.rollout_func = None if rollout_func is None else _resolved(rollout_func, "rollout_func")
        _checked_tools(self.tools, [f"tools[{i}]" for i in range(len(self.tools))])
        self.multi_environment = isinstance(environment_factory, Mapping)
        if environment_factory is None:
            factories = {}
        elif self.multi_environment:
            factories = {
                str(name): _resolved(cls, f"environment_factory[{name!r}]")
                for name, cls in environment_factory.items()
            }
        else:
            factories = {None: _resolved(environment_factory, "environment_factory")}
        self.factories: dict[str | None, Callable] = factories
        self.pool: dict[str | None, list] = {}  # instances reused across batches, as TRL's pool
        self.rewards: list[EnvironmentReward] = []
        for name in factories:
            probe = self._built(name)
            if not callable(getattr(probe, "reset", None)):
                shown = f"environment_factory[{name!r}]" if name is not None else "environment_factory"
                raise ValueError(f"{shown}: an environment must have a reset(**row) method")
            self.pool[name] = [probe]
            methods = environment_tools(probe)
            where = f"environment_factory {type(probe).__qualname__}'s method"
            _checked_tools(
                [*self.tools, *methods],
                [
                    *(f"tools[{i}]" for i in range(len(self.tools))),
                    *(f"{where} {tool_name(m)}" for m in methods),
                ],
            )
            has_reward = callable(getattr(type(probe), "get_reward", None))
            if has_reward and all(reward.cls is not type(probe) for reward in self.rewards):
                self.rewards.append(EnvironmentReward(type(probe), self.options.environment_timeout))
        self._owner = None if owner is None else weakref.ref(owner)
        self._chat_template: str | None = None  # TRL's training template, where the run needs one
        self._template_chosen = False

    def _rendering_template(self, tokenizer, renders_tools: bool, prompt_options) -> str | None:
        """The chat template the run's prompts and tool turns render with, chosen once before any prompt is
        encoded (`tools.turns.training_template`): None, the tokenizer's own; else TRL's training copy of
        it, said in one line."""
        if not self._template_chosen:
            self._chat_template = training_template(tokenizer, renders_tools, prompt_options)
            self._template_chosen = True
            if self._chat_template is not None:
                rank_zero_info(training_template_note(tokenizer.chat_template))
        return self._chat_template

    @classmethod
    def of(
        cls,
        tools: Sequence[Tool | str] | None,
        environment_factory: Callable | str | Mapping | None,
        rollout_func: Callable | str | None,
        options: ToolOptions,
        owner: object,
        max_staleness: int = 0,
    ) -> ToolSampling | None:
        """The module's multi-turn rollouts, or None where it samples single turns. `options` set away from
        their defaults are warned about where nothing reads them (no `tools` nor `environment_factory`)."""
        if not tools and environment_factory is None:
            for option in fields(options):
                warn_inert(options, option.name, "tools or environment_factory")
        if not tools and environment_factory is None and rollout_func is None:
            return None
        return cls(tools, environment_factory, rollout_func, options, owner, max_staleness)

    @property
    def supplied_keywords(self) -> set[str] | None:
        """The reward keywords these rollouts add beyond the data's columns; None where they are not known
        before the first rollout (a `rollout_func`'s fields)."""
        if self.rollout_func is not None:
            return None
        return {"environments"} if self.factories else set()

    def with_rewards(self, funcs: list[Callable], weights: list[float]) -> tuple[list[Callable], list[float]]:
        """The module's reward functions and weights with each environment class's `get_reward`, weight 1."""
        return funcs + list(self.rewards), weights + [1.0] * len(self.rewards)

    def _built(self, name: str | None) -> object:
        """A new environment of `environment_factory` (`name`'s, with a dict), bounded by
        `environment_timeout`, its failure one line naming its class."""
        factory = self.factories[name]
        what = f"environment_factory {getattr(factory, '__qualname__', repr(factory))}()"
        return _user_call(what, factory, self.options.environment_timeout)

    def _environments(self, batch: dict[str, list], G: int) -> tuple[list, list[str | None]]:
        """One environment per sample (G per row), reused from the pool (new ones where batches are sampled
        ahead), and each one's name."""
        rows = len(batch["prompt"])
        if self.multi_environment:
            if ENVIRONMENT_COLUMN not in batch:
                raise ValueError(
                    "environment_factory is a dict of environments: every row needs an 'environment' column "
                    "naming its own"
                )
            names = [batch[ENVIRONMENT_COLUMN][i] for i in range(rows) for _ in range(G)]
        else:
            names = [None] * (rows * G)
        handed: dict[str | None, int] = {}
        environments = []
        for name in names:
            if name not in self.factories:
                raise ValueError(
                    f"a row's environment={name!r} is none of environment_factory's: {list(self.factories)}"
                )
            if self.fresh_environments:
                environments.append(self._built(name))
                continue
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self._built(name))
            handed[name] = index + 1
            environments.append(pool[index])
        return environments, names

    def sample(
        self, rollouts, batch: dict[str, list], num_generations: int, do_sample: bool = True
    ) -> tuple[Rollout, list[str], SampledTurns]:
        """`num_generations` samples of each of `batch`'s prompts through `rollouts` (a `PolicyRollouts`):
        the rollout, its decoded completions, and what the reward functions get beyond them."""
        if self.rollout_func is not None:
            return self._sample_by_function(rollouts, batch, num_generations)
        G, prompts = num_generations, batch["prompt"]
        if not isinstance(prompts[0], list):
            raise ValueError("tools and environment_factory need chat prompts (lists of messages), not text")
        row_prompts = [prompt for prompt in prompts for _ in range(G)]
        environments, names = self._environments(batch, G) if self.factories else (None, [])
        row_tools = [list(self.tools) for _ in row_prompts]
        if environments is not None:
            columns = [key for key in batch if not key.startswith("_")]
            for i, environment in enumerate(environments):
                row = {key: batch[key][i // G] for key in columns}
                if self.multi_environment:
                    row.pop(ENVIRONMENT_COLUMN)  # which environment it is, not what to reset it to
                if row.get("prompt") == ENVIRONMENT_PROMPT:  # no prompt of its own: reset writes it, as TRL
                    row.pop("prompt")
                observation = _user_call(
                    f"{type(environment).__qualname__}.reset(**row)",
                    lambda environment=environment, row=row: environment.reset(**row),
                    self.options.environment_timeout,
                )
                if observation is not None:
                    last = row_prompts[i][-1]
                    row_prompts[i] = [
                        *row_prompts[i][:-1],
                        {**last, "content": last["content"] + observation},
                    ]
                row_tools[i] += environment_tools(environment)
        runner = RowToolRunner(row_tools, self.options)
        tokenizer = rollouts.tokenizer
        schemas = [
            [runner.row_schemas[i][name] for name in runner.row_tools[i]] for i in range(len(row_tools))
        ]
        renders_tools = template_renders_tools(tokenizer, list(runner.schemas.values()), rollouts.cfg.prompts)
        chat_template = self._rendering_template(tokenizer, renders_tools, rollouts.cfg.prompts)
        if not renders_tools:
            row_prompts = [
                with_tools_in_system_prompt(with_tool_turns_as_user_turns(p), s)
                for p, s in zip(row_prompts, schemas, strict=True)
            ]
            schemas = None
        # Rows of one group with one prompt and one tool set: the group's prompt encoded (and prefilled) once.
        shared = all(
            row_prompts[i] == row_prompts[i - i % G] and (schemas is None or schemas[i] == schemas[i - i % G])
            for i in range(len(row_prompts))
        )
        encoded = row_prompts[::G] if shared else row_prompts
        encoded_tools = None if schemas is None else schemas[::G] if shared else schemas
        with rollouts.ready_engine() as (engine, device), rendering_with(tokenizer, chat_template):
            ids, mask = rollouts.encoder.encode(encoded, device, tools=encoded_tools)
            rollout, turns = ToolRollouts(engine, tokenizer, runner, rollouts.cfg.prompts).generate(
                rollouts.policy, ids, mask, num_generations=G if shared else 1, do_sample=do_sample
            )
        completions = rollouts.encoder.decode(rollout)
        sampled = SampledTurns(
            prompts=row_prompts,
            messages=turns.messages,
            environments=environments,
            metrics=turns.counts.metrics(len(row_prompts)),
        )
        return rollout, completions, sampled

    def _sample_by_function(
        self, rollouts, batch: dict[str, list], G: int
    ) -> tuple[Rollout, list[str], SampledTurns]:
        """The rollout a `rollout_func` returns, checked and padded into a `Rollout`."""
        row_prompts = [prompt for prompt in batch["prompt"] for _ in range(G)]
        owner = self._owner() if self._owner is not None else None
        try:
            output = self.rollout_func(row_prompts, owner)
        except Exception as error:  # the user's code: named, in one line
            name = getattr(self.rollout_func, "__qualname__", repr(self.rollout_func))
            raise RuntimeError(f"rollout_func {name} raised {describe(error)}") from error
        if not isinstance(output, Mapping):
            raise ValueError(f"rollout_func must return a dict, got a {type(output).__name__}")
        missing = [key for key in ROLLOUT_FUNC_KEYS if key not in output]
        if missing:
            raise ValueError(f"rollout_func must return {list(ROLLOUT_FUNC_KEYS)}; it lacks {missing}")
        extra = {key: value for key, value in output.items() if key not in ROLLOUT_FUNC_KEYS}
        env_mask = extra.pop("env_mask", None)
        device = rollouts.device or next(rollouts.policy.parameters()).device
        eos = stop_token_ids(rollouts.policy, rollouts.tokenizer)
        rollout = rollout_of_lists(
            output["prompt_ids"],
            output["completion_ids"],
            output["logprobs"],
            env_mask,
            rows=len(row_prompts),
            pad_token_id=rollouts.tokenizer.pad_token_id,
            eos_token_ids=eos,
            vocab_size=rollouts.policy.get_input_embeddings().num_embeddings,
            device=device,
        )
        completions = rollouts.encoder.decode(rollout)
        return rollout, completions, SampledTurns(prompts=row_prompts, keywords=extra)
