"""TRL's `examples/scripts/grpo_agent.py` (TRL 1.16), its tool and its three reward functions as the example
writes them: the tool returns a list (SQL rows) that `query_reward` finds with `isinstance(result, list)`, and
a failed query's `{'error': ...}` reaches the rewards as TRL's text. With `tool_call_timeout: null` (TRL's
way: the tool in the trainer's thread) the tool's `SIGALRM` bound works and the rewards are TRL's; with the
default bound the call fails, and a warning says why and what to set."""

import json
import re
import signal
import sqlite3
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from datasets import Dataset

from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.tools import calls
from grpo_lightning.core.tools.calls import ToolCall, ToolOptions, ToolRunner
from grpo_lightning.training.data import PromptDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer
from tests.test_tool_rollouts import BuyingEngine

# ----------------------------------------------- from TRL's examples/scripts/grpo_agent.py, as it is there


def query_reward(completions, answer, **kwargs):
    """
    Reward query strategy:
    - Penalize more than 2 queries
    - Penalize generic queries (LIMIT 1 / PRAGMA)
    - Reward usage of WHERE
    - Reward evidence supporting the final answer
    """
    rewards = []

    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []

        # collect all SQL queries and tool results
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])

        # --- penalize too many queries ---
        if len(sql_queries) > 3:
            reward -= 1.5

        # --- check query quality ---
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4  # small bonus for WHERE usage

        # --- evidence check: do queries support the answer? ---
        combined_results = []
        error_detected = False

        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)

        # if error detected, penalize heavily
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5

        rewards.append(reward)

    return rewards


def correctness_reward(completions, answer, **kwargs):
    """
    Reward Yes/No correctness.
    Model must provide final answer enclosed in stars — *yes* or *no*.
    Does not reward informal yes/no buried in text.
    """
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()

        # detect form *yes* or *no*
        match = re.search(r"\*(yes|no)\*", raw)
        guess = match.group(1) if match else None

        reward = 0.0

        if guess is None:
            reward -= 0.5  # invalid format
        elif guess == ans.lower():
            reward += 0.6  # correct under required format
        else:
            reward -= 1.0  # wrong answer

        rewards.append(reward)

    return rewards


def structure_reward(completions, **kwargs):
    """
    Reward proper assistant structure.
    Encourages a logical sequence: tool call + response + optional extra content.
    """
    rewards = []

    for completion in completions:
        has_call = False
        has_response = False
        has_other = False

        for turn in completion:
            role = turn.get("role")
            if role == "assistant" and turn.get("tool_calls"):
                has_call = True
            elif role == "tool":
                has_response = True
            else:
                content = turn.get("content")
                if content and content.strip() not in ["", "<think>"]:
                    has_other = True

        # Reward sequences
        if has_call and has_response:
            if has_other:
                reward = 0.1
            else:
                reward = 0.05  # still positive even without extra text
        elif has_call and not has_response:
            reward = -0.15
        else:
            reward = 0.0  # neutral if no call

        rewards.append(reward)

    return rewards


class TimeoutError(Exception):  # noqa: A001  (the example's own name)
    """Raised when a function call times out."""

    pass


@contextmanager
def timeout(seconds):
    """Context manager that raises TimeoutError if execution exceeds time limit."""

    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    BioGRID is a curated biological database that compiles protein, genetic, and chemical interactions from multiple organisms. It provides researchers with experimentally verified interaction data to support studies in systems biology and functional genomics.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """  # noqa: E501
    with timeout(5):
        conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
        cursor = conn.cursor()
        try:
            cursor.execute(sql_command)
            results = cursor.fetchall()
        finally:
            conn.close()
    return results


# ------------------------------------------------------------------------------------------------ the test
# Each question's scripted model: the SQL it runs (None: no call), its final answer; the reference answer.
SCRIPTS = {
    "APEX1": ("SELECT * FROM interactions WHERE Aliases_Interactor_A = 'APEX1'", "*Yes*", "yes"),
    "LIMITED": ("SELECT * FROM interactions LIMIT 1", "*No*", "no"),
    "MISSING": ("SELECT * FROM nowhere WHERE gene = 'MISSING'", "*No*", "yes"),
    "SILENT": (None, "I think so.", "no"),
}
# What TRL's `_tool_call_loop` hands these rewards, worked out from grpo_agent.py by hand. APEX1: one WHERE
# (+0.4), rows found for a "yes" (+2.0). LIMITED: LIMIT 1 (-1.0) without WHERE (-0.5), rows found for a "no"
# (-1.5). MISSING: one WHERE (+0.4); the failed query's result is TRL's text "{'error': ...}", neither a dict
# nor a list, so no error is detected and no rows are found for a "yes" (-1.5). SILENT: no query (-1.5).
TRL_REWARDS = {
    "query_reward": {"APEX1": 2.4, "LIMITED": -3.0, "MISSING": -1.1, "SILENT": -1.5},
    "correctness_reward": {"APEX1": 0.6, "LIMITED": 0.6, "MISSING": -1.0, "SILENT": -0.5},
    "structure_reward": {"APEX1": 0.1, "LIMITED": 0.1, "MISSING": 0.1, "SILENT": 0.0},
}


@pytest.fixture
def biogrid(tmp_path, monkeypatch):
    """The example's `biogrid.db`, in the working directory where its tool opens it: one interaction."""
    monkeypatch.chdir(tmp_path)
    conn = sqlite3.connect("biogrid.db")
    conn.execute("CREATE TABLE interactions (Aliases_Interactor_A TEXT, Aliases_Interactor_B TEXT)")
    conn.execute("INSERT INTO interactions VALUES ('APEX1', 'TP53')")
    conn.commit()
    conn.close()


class QueryingEngine(BuyingEngine):
    """The scripted model: the question's query as a Hermes call, then its final answer."""

    def turn(self, context: str) -> str:
        gene = next(gene for gene in SCRIPTS if f"Does the gene {gene} " in context)
        sql, final, _ = SCRIPTS[gene]
        if sql is None or "<tool_response>" in context:
            return f"{final}<|im_end|>"
        call = {"name": "query_biogrid", "arguments": {"sql_command": sql}}
        return f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>"


def test_grpo_agents_rewards_are_trls(tiny_model_dir, biogrid):
    grpo = GRPOConfig(
        num_generations=2,
        max_completion_length=200,
        preflight=False,
        log_completions_every=0,
        tool_call_timeout=None,
    )
    module = GRPOModule(
        tiny_model_dir,
        reward_funcs=[correctness_reward, structure_reward, query_reward],
        grpo=grpo,
        tools=[query_biogrid],
    )
    engine = QueryingEngine(module.tokenizer, max_new_tokens=200)
    module.rollouts.build_engine = lambda: engine
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Does the gene {gene} interact with TP53?"}],
            "answer": answer,
        }
        for gene, (_, _, answer) in SCRIPTS.items()
    ]
    data = PromptDataModule(source=Dataset.from_list(rows), batch_size=4, val_size=0, seed=0)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, data)
    record = module.last_rollout
    genes = [re.search(r"the gene (\w+)", p[-1]["content"]).group(1) for p in record.prompts]
    for column, name in enumerate(record.reward_names):
        scores = record.rewards_per_func[:, column].view(len(genes), 2)  # [prompts, G]
        got = {gene: [round(x, 5) for x in scores[i].tolist()] for i, gene in enumerate(genes)}
        assert got == {gene: [reward, reward] for gene, reward in TRL_REWARDS[name].items()}, name


def test_under_the_default_bound_a_signal_setting_tool_fails_and_says_what_to_set(biogrid):
    call = [ToolCall("query_biogrid", {"sql_command": "SELECT * FROM interactions"})]
    with pytest.warns(UserWarning, match=r"tool query_biogrid .* set tools.call_timeout: null"):
        [[(_, bounded)]] = ToolRunner([query_biogrid], ToolOptions())([call])
    assert "main thread" in bounded  # the error the model reads
    [[(_, unbounded)]] = ToolRunner([query_biogrid], ToolOptions(call_timeout=None))([call])
    assert unbounded == [("APEX1", "TP53")]  # the rows themselves, as TRL hands them on


def test_on_the_rollout_thread_a_signal_setting_tool_says_to_set_max_staleness_0(biogrid, monkeypatch):
    """Rollouts sampled ahead (`max_staleness` > 0) run every call on the rollout thread, where no bound
    helps: with `call_timeout: null` the tool still fails there, and the warning names both settings."""
    monkeypatch.setattr(calls, "_WARNED_SIGNAL_TOOLS", set())
    call = [ToolCall("query_biogrid", {"sql_command": "SELECT * FROM interactions"})]
    runner = ToolRunner([query_biogrid], ToolOptions(call_timeout=None))
    said = r"tool query_biogrid .* set async_rollouts.max_staleness: 0 and tools.call_timeout: null"
    with ThreadPoolExecutor(1, thread_name_prefix=calls.ROLLOUT_THREAD) as rollout_thread:
        with pytest.warns(UserWarning, match=said):
            [[(_, content)]] = rollout_thread.submit(runner, [call]).result()
    assert "main thread" in content  # the error the model reads
    # Another thread of the user's own (a notebook's event loop): no advice about settings that do not help.
    monkeypatch.setattr(calls, "_WARNED_SIGNAL_TOOLS", set())
    with ThreadPoolExecutor(1) as own_thread, warnings.catch_warnings():
        warnings.simplefilter("error")
        [[(_, content)]] = own_thread.submit(runner, [call]).result()
    assert "main thread" in content
