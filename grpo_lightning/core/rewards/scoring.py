"""Running reward functions over a rollout exactly as TRL 1.16's `GRPOTrainer` calls them, and checking
what they return in one place, with errors that name the function at fault.

A reward function is called with keywords only::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=...,
       **columns)

- `prompts`: one per completion (a prompt's group repeats it): text, or a list of chat messages;
- `completions`: text, or, when the prompts are chat messages, a list of one assistant message
  `[{"role": "assistant", "content": text}]` (read it as `completion[0]["content"]`);
- `completion_ids`: the completion's token ids, end-of-sequence token included, padding left out;
- `trainer_state`: a `transformers.TrainerState` with `global_step` (optimizer steps so far), `max_steps`
  (the run's optimizer steps, computed from the epochs where they bound it, as TRL's), `epoch` (fractional)
  and `num_train_epochs`;
- `log_extra(column, values)`: a column of one value per completion for the completions panel;
- `log_metric(name, value)`: a scalar, logged as `train/<name>` (the mean over the step's calls);
- every data column but `prompt`, one value per completion (`answer`, `solution`, ...); a column named like
  one of the keywords above is refused (`check_column_names`): it would replace that keyword.

Each function gets its own copies of these lists, and what it returns is checked before the next is called.

A function may be `async def` (or return an awaitable): those of one call run concurrently, as in TRL.
It must return a list (or tuple) with one real number or `None` (does not apply) per completion.
`weighted_groups` then weighs the functions' rewards into each completion's total.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import TrainerState

from grpo_lightning.core.rewards.verifiable import accuracy_reward, format_reward, reward_name
from grpo_lightning.core.types import Rollout, ScoredGroups

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
__all__ = [
    "RewardInputs",
    "RewardLog",
    "Scores",
    "call_reward",
    "check_column_names",
    "check_reward_weights",
    "checked_reward_functions",
    "required_columns",
    "score_completions",
    "trainer_state",
]
# The keywords every reward function gets; any other parameter it requires is a data column.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_column_names(columns: Iterable[str], where: str) -> None:
    """Refuse a data column named like one of `CALL_KEYWORDS`: in the call it would replace what that keyword
    gives every reward function (TRL's call raises on `prompts`, `completions` and `completion_ids`, and
    replaces the others' columns silently). `ValueError` naming `where` and the column."""
    for name in columns:
        if name in CALL_KEYWORDS:
            raise ValueError(
                f"{where}: the data column {name!r} has the name of a keyword every reward function is given "
                f"({', '.join(CALL_KEYWORDS)}) and would replace it: rename the column"
            )


def trainer_state(
    global_step: int = 0, max_steps: int = -1, epoch: float = 0.0, num_epochs: int = 1
) -> TrainerState:
    """The `trainer_state` a reward function gets: the `transformers.TrainerState` TRL passes."""
    return TrainerState(
        global_step=global_step, max_steps=max_steps, epoch=epoch, num_train_epochs=num_epochs
    )


def required_columns(fn: Callable) -> list[str]:
    """The data columns a reward function cannot run without: its parameters without a default other than
    the keywords every call passes (TRL's `accuracy_reward(completions, solution, **kwargs)` needs
    `solution`). A function whose signature cannot be read needs none that can be named."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in CALL_KEYWORDS
    ]


@dataclass
class RewardInputs:
    """What the reward functions score: B completions, each with its prompt and data columns."""

    prompts: list  # [B] text, or chat messages
    completions: list[str]  # [B] decoded text
    completion_ids: list[list[int]] | None = None  # [B] token ids without padding
    columns: dict[str, list] = field(default_factory=dict)  # every data column but `prompt`, [B] each
    state: TrainerState = field(default_factory=trainer_state)
    # [B] multi-turn completions as chat messages (assistant turns, tool results), as TRL hands them over
    messages: list[list[dict]] | None = None
    # what a multi-turn rollout adds to every call (`environments`, a rollout function's fields), as it is:
    # not copied per function, so that they read the environments themselves
    keywords: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_column_names(self.columns, "the reward functions' inputs")
        for name, values in {"prompts": self.prompts, **self.columns}.items():
            if len(values) != len(self.completions):
                raise ValueError(f"{name} has {len(values)} values for {len(self.completions)} completions")

    @classmethod
    def of_groups(
        cls,
        batch: dict[str, list],
        completions: list[str],
        completion_ids: list[list[int]],
        state: TrainerState,
    ) -> RewardInputs:
        """The inputs for `batch`'s groups of completions (prompt-major, G per prompt): each prompt and every
        other data column repeated G times, as TRL repeats them."""
        k = len(completions) // len(batch["prompt"])
        columns = {
            key: [v for v in values for _ in range(k)] for key, values in batch.items() if key != "prompt"
        }
        prompts = [p for p in batch["prompt"] for _ in range(k)]
        return cls(prompts, completions, completion_ids, columns, state)

    @classmethod
    def of_rollout(
        cls, batch: dict[str, list], rollout: Rollout, completions: list[str], state: TrainerState
    ) -> RewardInputs:
        """`of_groups` for `rollout`'s completions of `batch`'s prompts, their token ids taken from the
        rollout (end-of-sequence token included, padding left out)."""
        rows = zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ids = [row[mask.bool()].tolist() for row, mask in rows]
        return cls.of_groups(batch, completions, ids, state)

    @property
    def conversational(self) -> bool:
        return bool(self.prompts) and isinstance(self.prompts[0], list)

    def trl_completions(self) -> list:
        """The completions as TRL hands them over: one assistant message each for chat prompts (a multi-turn
        completion's messages)."""
        if self.messages is not None:
            return [list(messages) for messages in self.messages]
        if not self.conversational:
            return list(self.completions)
        return [[{"role": "assistant", "content": text}] for text in self.completions]


class RewardLog:
    """Collects what reward functions log through `log_extra` and `log_metric` during one scoring."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.extra: dict[str, list] = {}  # column -> one value per completion
        self.metrics: dict[str, list[float]] = {}  # name -> every value logged under it

    def log_extra(self, column: str, values: Sequence) -> None:
        """A column of the completions panel, one value per completion (as TRL's `log_extra`)."""
        values = list(values)
        if len(values) != self.size:
            raise ValueError(f"log_extra({column!r}) got {len(values)} values for {self.size} completions")
        self.extra[str(column)] = values

    def log_metric(self, name: str, value: float) -> None:
        """A scalar for the loggers, averaged over the step (as TRL's `log_metric`)."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def metric_means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.metrics.items()}


@dataclass
class Scores:
    """One scoring of a rollout: the rewards and what the functions logged."""

    rewards: Tensor  # [B, F] float32, NaN where a function answered None
    extra: dict[str, list]  # log_extra columns, [B] values each
    metrics: dict[str, float]  # log_metric means


def _describe(value: object) -> str:
    """What a wrong return value is, with the fix where there is an obvious one."""
    kind = type(value).__name__
    if value is None:
        return "None (return a list: [None] * len(completions) when the function does not apply)"
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        return f"a {type(value).__module__.split('.')[0]} {kind} (return value.tolist())"
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        return "a generator (return a list, e.g. list(...))"
    return f"a {kind}: {str(value)[:80]!r}"


def _check_values(fn: Callable, values: object, inputs: RewardInputs) -> list[float | None]:
    """The reward contract, for every return shape: a list or tuple of one real number or None per
    completion, none of them NaN or inf. Raises `RuntimeError` naming the function and a completion."""
    name, completions = reward_name(fn), inputs.completions
    first = f"first completion: {completions[0][:200]!r}"
    expected = "must return a list with one float (or None) per completion"
    if not isinstance(values, (list, tuple)):
        raise RuntimeError(f"reward function {name!r} {expected}; it returned {_describe(values)}; {first}")
    if len(values) != len(completions):
        raise RuntimeError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions; "
            + first
        )
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, numbers.Real):
            raise RuntimeError(
                f"reward function {name!r} {expected}; value {i} is {_describe(v)}, "
                f"for completion {i}: {completions[i][:200]!r}"
            )
        if v is not None and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
            # float32 is where rewards are summed and normalised: beyond its range a finite value is inf.
            why = (
                ""
                if not math.isfinite(v)
                else f" (beyond float32's range, +-{FLOAT32_MAX:.3g}: scale it down)"
            )
            raise RuntimeError(
                f"reward function {name!r} returned {v} for completion {i}{why}: {completions[i][:200]!r}"
            )
    return [None if v is None else float(v) for v in values]


def check_reward_weights(weights: Sequence[object], reward_funcs: Sequence[Callable]) -> None:
    """Each of `reward_weights` is a finite number within float32's range (the rewards are weighted in
    float32); else `ValueError` naming the option, the weight and its reward function."""
    for i, (weight, fn) in enumerate(zip(weights, reward_funcs, strict=True)):
        number = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and abs(weight) <= FLOAT32_MAX):
            raise ValueError(
                f"model.reward_weights[{i}]={weight!r}, the weight of reward function {reward_name(fn)!r}: "
                "must be a finite number"
            )


def checked_reward_functions(
    reward_funcs: Sequence[Callable] | None,
    reward_weights: Sequence[object] | None,
    other_sources: int = 0,
) -> tuple[list[Callable], list[float]]:
    """The module's reward functions and one weight each (default 1.0), checked; `ValueError` naming the
    option otherwise. `other_sources`: the rewards that come besides them (an environment's `get_reward`);
    without any, the default is `[accuracy_reward, format_reward]` and an empty list is refused, with some
    (TRL's rule) None and `[]` are no function: the environments own the reward."""
    if reward_funcs is None:
        funcs = [] if other_sources else [accuracy_reward, format_reward]
    else:
        funcs = list(reward_funcs)
    if not funcs and not other_sources:
        raise ValueError(
            "reward_funcs is empty: GRPO needs a reward source, reward functions or an environment_factory "
            "whose environment has a get_reward() method"
        )
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward_funcs")
    check_reward_weights(weights, funcs)
    check_reward_names(funcs)
    return funcs, weights


def check_reward_names(reward_funcs: Sequence[Callable]) -> None:
    """Each reward function's name (`reward_name`) is its own: its metrics (`train/rewards/<name>`), its
    column in the completions panel and dynamic sampling's metric go by it. `ValueError` naming both."""
    first_of: dict[str, int] = {}
    for i, fn in enumerate(reward_funcs):
        name = reward_name(fn)
        if name in first_of:
            raise ValueError(
                f"model.reward_funcs[{i}] is named {name!r}, as reward_funcs[{first_of[name]}] is: each "
                "reward's metrics go by its name (train/rewards/<name>); give one a name of its own (a "
                "function of another name, or a __name__ set on the object)"
            )
        first_of[name] = i


def _raised(fn: Callable, err: Exception, inputs: RewardInputs) -> RuntimeError:
    return RuntimeError(
        f"reward function {reward_name(fn)!r} raised {type(err).__name__}: {err}; "
        f"first completion: {inputs.completions[0][:200]!r}"
    )


def _run_async(awaitables: list) -> list:
    """Await `awaitables` concurrently; in a thread of its own where an event loop already runs (Jupyter)."""

    async def gather() -> list:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _call_all(reward_funcs: Sequence[Callable], inputs: RewardInputs, log: RewardLog) -> list[list]:
    """Each function's checked values. Each is called with its own copies of the inputs, so that nothing one
    of them changes in its lists reaches the next (nor the completions kept for logging), and its values are
    checked right after its call, so that an error names the function at fault; awaitable results are
    awaited together, as TRL gathers them, and checked then."""
    arguments = {
        "prompts": inputs.prompts,
        "completions": inputs.trl_completions(),
        "completion_ids": inputs.completion_ids,
        "trainer_state": inputs.state,
        **inputs.columns,
    }
    results: list = []
    for fn in reward_funcs:
        own = copy.deepcopy(arguments)
        try:
            result = fn(**own, **inputs.keywords, log_extra=log.log_extra, log_metric=log.log_metric)
        except Exception as err:
            raise _raised(fn, err, inputs) from err
        results.append(result if inspect.isawaitable(result) else _check_values(fn, result, inputs))
    pending = [i for i, result in enumerate(results) if inspect.isawaitable(result)]
    for i, outcome in zip(pending, _run_async([results[i] for i in pending]), strict=True):
        if isinstance(outcome, Exception):
            raise _raised(reward_funcs[i], outcome, inputs) from outcome
        results[i] = _check_values(reward_funcs[i], outcome, inputs)
    return results


def call_reward(fn: Callable, inputs: RewardInputs, log: RewardLog | None = None) -> list[float | None]:
    """One reward function's checked values for `inputs` (see the module's docstring for the call)."""
    return _call_all([fn], inputs, log or RewardLog(len(inputs.completions)))[0]


def score_completions(reward_funcs: Sequence[Callable], inputs: RewardInputs) -> Scores:
    """Call every reward function TRL's way and stack the results.

    Returns `Scores` whose `rewards` are `[B, F]` float32 with NaN where a function answered `None` (not
    applicable). Raises `RuntimeError` naming the function when it raises, returns anything but one real
    number or None per completion, or returns NaN or inf, and when some completion gets `None` from every
    function (it would have no reward at all). A function that answers `None` for a whole batch only warns:
    in a mixed data set it may not apply.
    """
    log = RewardLog(len(inputs.completions))
    columns_out = []
    for fn, values in zip(reward_funcs, _call_all(reward_funcs, inputs, log), strict=True):
        if all(v is None for v in values):
            warnings.warn(
                f"reward function {reward_name(fn)!r} returned None for every completion of this batch",
                stacklevel=2,
            )
        columns_out.append([math.nan if v is None else v for v in values])
    rewards = torch.tensor(columns_out, dtype=torch.float32).T  # [B, F]
    unscored = rewards.isnan().all(dim=1)  # [B]
    if unscored.any():
        i = int(unscored.nonzero()[0])
        names = [reward_name(fn) for fn in reward_funcs]
        raise RuntimeError(
            f"no reward function {names} scored completion {i} (all returned None): "
            f"{inputs.completions[i][:200]!r}"
        )
    return Scores(rewards, log.extra, log.metric_means())


def weighted_groups(
    prompts: list, rollout: Rollout, completions: list[str], rewards_per_func: Tensor, weights: Tensor, G: int
) -> ScoredGroups:
    """The rollout's groups with their rewards per function `[B, F]` and their weighted total `[B]`, where a
    function that answered None (NaN, not applicable) counts 0."""
    rewards = (rewards_per_func.nan_to_num(0.0) * weights).sum(dim=1)  # [B]
    return ScoredGroups(prompts, rollout, completions, rewards_per_func, rewards, G)
