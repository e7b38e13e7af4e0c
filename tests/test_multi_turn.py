"""Multi-turn rollouts with tools: the tool turn's ids (separator kept, template checked), the loop over the
`RolloutEngine` seam on a scripted engine (calls run, finished rows leave the batch, budgets, rollback,
iteration bound, masks and log-probs), one real `EagerEngine` run, and the ids and masks against TRL 1.16's
own `GRPOTrainer._tool_call_loop` on the same prompts, scripts and tool."""

import importlib.resources
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lightning.core.chat_template import PromptOptions
from grpo_lightning.core.generation.engines import EagerEngine
from grpo_lightning.core.generation.multi_turn import ToolRollouts
from grpo_lightning.core.generation.prompts import PromptEncoder
from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.tools.calculator import calculator
from grpo_lightning.core.tools.calls import ToolOptions, ToolRunner
from grpo_lightning.core.tools.turns import check_prefix_preserving, tool_messages, tool_suffix_ids
from grpo_lightning.core.types import Rollout, cat_rollouts
from grpo_lightning.offline.tiny import CHATML_TEMPLATE

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
SCRIPTS = {  # each prompt's turns, in order: the model's text of each assistant turn
    "p0": [CALL.format("6*7") + "<|im_end|>", "The answer is 42.<|im_end|>"],
    "p1": ["No tool: 5.<|im_end|>"],
    "p2": [
        CALL.format("2+2") + "\n" + CALL.format("9**9**9") + "<|im_end|>",
        CALL.format("4*3") + "<|im_end|>",
        "Done.<|im_end|>",
    ],
}
LOGPROB = -0.25  # the scripted engine's log-prob of every token it draws


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


def scripted_turn(tokenizer, context_ids: list[int]) -> list[int]:
    """The scripted model's next turn after `context_ids`: its prompt's script, at the turn the number of
    assistant headers in the context says."""
    context = tokenizer.decode(context_ids)
    prompt = next(name for name in SCRIPTS if f"user\n{name}<|im_end|>" in context)
    turn = context.count("<|im_start|>assistant") - 1
    return tokenizer(SCRIPTS[prompt][turn], add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """A `RolloutEngine` whose model writes `SCRIPTS`; it records each call's row count."""

    def __init__(self, tokenizer, settings: SamplingSettings) -> None:
        self.tokenizer, self.settings, self.batches = tokenizer, settings, []

    def generate(self, model, prompt_ids, prompt_mask, *, num_generations, do_sample=True, settings=None):
        s = settings or self.settings
        prompt_ids = prompt_ids.repeat_interleave(num_generations, 0)  # [B, P]
        prompt_mask = prompt_mask.repeat_interleave(num_generations, 0)
        self.batches.append(prompt_ids.size(0))
        turns = [
            scripted_turn(self.tokenizer, p[m.bool()].tolist())[: s.max_new_tokens]
            for p, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        T = max(len(t) for t in turns)
        ids = torch.full((len(turns), T), s.pad_token_id)  # [B, T]
        mask = torch.zeros(len(turns), T, dtype=torch.long)
        for row, turn in enumerate(turns):
            ids[row, : len(turn)], mask[row, : len(turn)] = torch.tensor(turn), 1
        truncated = torch.tensor([t[-1] not in s.eos_token_ids for t in turns])
        return Rollout(prompt_ids, prompt_mask, ids, mask, truncated, LOGPROB * mask.float())

    def weights_changed(self): ...
    def refresh(self, model, device): ...
    def metrics(self):
        return {}


def settings_of(tokenizer, max_new_tokens: int) -> SamplingSettings:
    return SamplingSettings(
        max_new_tokens=max_new_tokens,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )


def run(tokenizer, max_new_tokens=1000, G=2, **options):
    engine = ScriptedEngine(tokenizer, settings_of(tokenizer, max_new_tokens))
    tools = ToolRollouts(engine, tokenizer, ToolRunner([calculator], ToolOptions(**options)))
    prompts = [[{"role": "user", "content": name}] for name in SCRIPTS]
    ids, mask = PromptEncoder(tokenizer).encode(prompts, "cpu")
    rollout, turns = tools.generate(torch.nn.Linear(1, 1), ids, mask, num_generations=G)
    return rollout, turns.counts, engine


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_tool_turn_keeps_the_separator_after_the_assistant_turn(tokenizer):
    suffix = tool_suffix_ids(tokenizer, tool_messages([("calculator", "42"), ("calculator", "7")], True))
    assert tokenizer.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = CHATML_TEMPLATE  # no tools in this template: the results as a user turn
    assert tool_suffix_ids(plain, tool_messages([("calculator", "42")], False)) == tool_suffix_ids(
        tokenizer, tool_messages([("calculator", "42")], True)
    )


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(tokenizer):
    changing = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    changing.chat_template = "{{ messages | length }}" + CHATML_TEMPLATE  # the count changes the start
    with pytest.raises(
        ValueError, match="^the chat template does not render .*get_training_chat_template"
    ) as e:
        check_prefix_preserving(changing, False)
    assert "\n" not in str(e.value)
    check_prefix_preserving(tokenizer, True)


CLOSED_THINKING = "<think>\n\n</think>\n\n"  # what the template below writes under enable_thinking=False


def thinking_template(template: str) -> str:
    """Qwen2.5's template with Qwen3's `enable_thinking=False`: a closed thinking block opening each answer
    (the generation prompt's and an answered assistant turn's), so that conversations stay prefixes."""
    turn = "{{- '<|im_start|>' + message.role + '\\n' + message.content"
    header = "{{- '<|im_start|>assistant\\n'"
    assert template.count(turn) == 1 and template.count(header) == 1
    closed = (
        "{%- set closed = '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined "
        "and not enable_thinking else '' %}\n"
    )
    return closed + template.replace(
        turn,
        "{{- '<|im_start|>' + message.role + '\\n' + (closed if message.role == 'assistant' else '') "
        "+ message.content",
    ).replace(header, header + " + closed")


def test_the_tool_turn_is_rendered_with_the_runs_chat_template_kwargs(tokenizer):
    """The next assistant header after the tool results is the template's under the run's
    `chat_template_kwargs`, as the prompt's is: here a closed thinking block, as Qwen3's template opens an
    answer under `enable_thinking=False`."""
    thinking = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    thinking.chat_template = thinking_template(tokenizer.chat_template)
    off = PromptOptions(chat_template_kwargs={"enable_thinking": False})
    results = tool_messages([("calculator", "42")], True)
    default = tool_suffix_ids(thinking, results)
    assert default == tool_suffix_ids(tokenizer, results)  # the template's default: no block
    assert tool_suffix_ids(thinking, results, off) == default + tokens(tokenizer, CLOSED_THINKING)

    engine = ScriptedEngine(thinking, settings_of(thinking, 1000))
    tools = ToolRollouts(engine, thinking, ToolRunner([calculator]), off)
    ids, mask = PromptEncoder(thinking, options=off).encode([[{"role": "user", "content": "p0"}]], "cpu")
    assert thinking.decode(ids[0][mask[0].bool()]).endswith("<|im_start|>assistant\n" + CLOSED_THINKING)
    rollout, _ = tools.generate(torch.nn.Linear(1, 1), ids, mask, num_generations=1)
    first_turn = tokens(thinking, SCRIPTS["p0"][0])
    suffix = tool_suffix_ids(thinking, results, off)
    completion = rollout.completion_ids[0, : int(rollout.completion_mask[0].sum())].tolist()
    assert completion == first_turn + suffix + tokens(thinking, SCRIPTS["p0"][1])
    assert rollout.tool_mask[0].tolist()[: len(completion)] == (
        [1] * len(first_turn) + [0] * len(suffix) + [1] * len(tokens(thinking, SCRIPTS["p0"][1]))
    )


def expected_row(tokenizer, name: str, results: list[list[str]]) -> tuple[list[int], list[int]]:
    """The ids and tool mask of a row of prompt `name` whose tool turns return `results`."""
    ids, own = [], []
    for turn, text in enumerate(SCRIPTS[name]):
        ids += tokens(tokenizer, text)
        own += [1] * len(tokens(tokenizer, text))
        if turn < len(results):
            suffix = tool_suffix_ids(
                tokenizer, tool_messages([("calculator", r) for r in results[turn]], True)
            )
            ids, own = ids + suffix, own + [0] * len(suffix)
    return ids, own


RESULTS = {
    "p0": [["42"]],
    "p1": [],
    "p2": [["4", "{'error': '9**387420489 exceeds 1e+15 in magnitude'}"], ["12"]],  # TRL's str(error)
}


def test_loop_runs_the_calls_and_appends_their_ids(tokenizer):
    rollout, counts, engine = run(tokenizer)
    assert engine.batches == [6, 4, 2]  # p1's rows leave after turn 1, p0's after turn 2
    for row, name in enumerate(n for n in SCRIPTS for _ in range(2)):
        ids, own = expected_row(tokenizer, name, RESULTS[name])
        n = len(ids)
        assert rollout.completion_ids[row, :n].tolist() == ids
        assert rollout.completion_mask[row].tolist() == [1] * n + [0] * (rollout.completion_ids.size(1) - n)
        assert rollout.tool_mask[row, :n].tolist() == own and not rollout.tool_mask[row, n:].any()
        expected_logprobs = torch.tensor(own, dtype=torch.float32) * LOGPROB
        assert torch.equal(rollout.sampler_logprobs[row, :n], expected_logprobs)
    assert not rollout.truncated.any()
    assert (counts.calls, counts.failures) == (2 * (1 + 3), 2)
    assert counts.metrics(rollout.completion_ids.size(0)) == {
        "tools/call_frequency": 8 / 6,
        "tools/failure_frequency": 0.25,
    }
    assert "The answer is 42." in tokenizer.decode(rollout.completion_ids[0])


def test_each_row_comes_back_as_the_messages_trl_rewards_read(tokenizer):
    engine = ScriptedEngine(tokenizer, settings_of(tokenizer, 1000))
    tools = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    ids, mask = PromptEncoder(tokenizer).encode([[{"role": "user", "content": "p0"}]], "cpu")
    _, turns = tools.generate(torch.nn.Linear(1, 1), ids, mask, num_generations=1)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    assert turns.messages == [
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "42"},
            {"role": "assistant", "content": "The answer is 42."},
        ]
    ]


def test_the_budget_covers_every_turn_and_rolls_back_a_tool_turn_that_would_pass_it(tokenizer):
    full, _, _ = run(tokenizer)
    p2_ids, p2_own = expected_row(tokenizer, "p2", RESULTS["p2"])
    first_turn = len(tokens(tokenizer, SCRIPTS["p2"][0]))
    first_suffix = p2_own.index(1, first_turn) - first_turn  # the first tool turn's length
    # Room for the first turn but not its tool turn: rolled back, the sample ends with the model's turn.
    rollout, counts, engine = run(tokenizer, max_new_tokens=first_turn + first_suffix - 1, G=1)
    assert rollout.completion_mask[2].sum() == first_turn and rollout.tool_mask[2].sum() == first_turn
    assert not rollout.truncated[2]
    # Room for the tool turn and 3 tokens of the next: that turn is cut, the sample truncated.
    budget = first_turn + first_suffix + 3
    rollout, _, _ = run(tokenizer, max_new_tokens=budget, G=1)
    assert rollout.completion_ids[2, :budget].tolist() == p2_ids[:budget]
    assert rollout.tool_mask[2, :budget].tolist() == p2_own[:budget]
    assert bool(rollout.truncated[2]) and int(rollout.completion_mask[2].sum()) == budget
    assert int(rollout.completion_mask.sum(1).max()) <= budget


@pytest.mark.parametrize("ceiling", ["model", "engine"])
def test_a_tool_turn_that_would_fill_the_context_is_rolled_back(tokenizer, ceiling):
    """The context ends at the model's positions, or below them at the engine's own `max_model_len` (vLLM's,
    which refuses a longer prompt)."""
    engine = ScriptedEngine(tokenizer, settings_of(tokenizer, 1000))
    tools = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    ids, mask = PromptEncoder(tokenizer).encode([[{"role": "user", "content": "p0"}]], "cpu")
    _, own = expected_row(tokenizer, "p0", RESULTS["p0"])
    first, tool = own.index(0), own.count(0)
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(max_position_embeddings=1024)
    for room, length in ((first + tool, first), (first + tool + 1, len(own))):
        limit = int(mask.sum()) + room
        if ceiling == "model":
            model.config.max_position_embeddings = limit
        else:
            engine.max_model_len = limit
        rollout, _ = tools.generate(model, ids, mask, num_generations=1)
        assert int(rollout.completion_mask.sum()) == length


def test_max_tool_calling_iterations_bounds_the_rounds(tokenizer):
    rollout, counts, engine = run(tokenizer, G=1, max_calling_iterations=1)
    assert engine.batches == [3, 2]  # one round of calls
    ids, own = expected_row(tokenizer, "p2", RESULTS["p2"][:1])
    two_turns = (
        len(tokens(tokenizer, SCRIPTS["p2"][0])) + (own.count(0)) + len(tokens(tokenizer, SCRIPTS["p2"][1]))
    )
    assert int(rollout.completion_mask[2].sum()) == two_turns
    assert counts.calls == 3


def test_tool_mask_survives_select_and_cat(tokenizer):
    rollout, _, _ = run(tokenizer, G=1)
    part = rollout.select(torch.tensor([1, 2]), trim=True)
    assert torch.equal(part.tool_mask, rollout.tool_mask[1:3, : part.completion_ids.size(1)])
    plain = Rollout(
        rollout.prompt_ids[:1],
        rollout.prompt_mask[:1],
        rollout.completion_ids[:1, :3],
        torch.ones(1, 3, dtype=torch.long),
        torch.tensor([True]),
    )
    both = cat_rollouts([rollout, plain], tokenizer.pad_token_id)
    assert torch.equal(both.tool_mask[:3], rollout.tool_mask)
    assert both.tool_mask[3].tolist()[:3] == [1, 1, 1] and not both.tool_mask[3, 3:].any()


def test_runs_on_the_eager_engine(tiny_model_dir, tokenizer):
    """The tiny random model calls no tool: the loop returns the engine's own first turn, every token
    the model's; each row's context is its own left-padded prompt."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    settings = settings_of(tokenizer, 12)
    engine = EagerEngine(settings)
    tools = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    prompts = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Hi"}]]
    ids, mask = PromptEncoder(tokenizer).encode(prompts, "cpu")
    torch.manual_seed(0)
    rollout, turns = tools.generate(model, ids, mask, num_generations=2)
    counts = turns.counts
    torch.manual_seed(0)
    plain = engine.generate(model, ids, mask, num_generations=2)
    T = plain.completion_ids.size(1)
    assert torch.equal(rollout.completion_ids[:, :T], plain.completion_ids)
    assert torch.equal(rollout.tool_mask[:, :T], plain.completion_mask)
    assert torch.equal(rollout.sampler_logprobs[:, :T], plain.sampler_logprobs)
    assert counts.calls == 0


def trl_tool_call_loop(tokenizer, prompt_texts: list[str], max_completion_length: int):
    """TRL 1.16's own `GRPOTrainer._tool_call_loop` with a stand-in `self`, the same scripted model and the
    calculator: (completion ids, tool mask) per row."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from trl.chat_template_utils import add_response_schema, parse_response

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = tokenizer.chat_template
    add_response_schema(tok)
    prompts = [[{"role": "user", "content": name}] for name in prompt_texts]
    prompt_ids = [
        list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in prompts
    ]
    completion_ids = [scripted_turn(tok, ids)[:max_completion_length] for ids in prompt_ids]
    completions = [
        [parse_response(tok, c, prefix=p, tools=[calculator])]
        for p, c in zip(prompt_ids, completion_ids, strict=True)
    ]

    def single_turn(ids_list, images, fields, num_generations, has_tool_images):
        turns = [scripted_turn(tok, ids) for ids in ids_list]
        return turns, [[LOGPROB] * len(t) for t in turns]

    trainer = SimpleNamespace(
        max_tool_calling_iterations=10**9,
        _sync_tool_dicts=[{"calculator": calculator}] * len(prompts),
        _async_tool_dicts=[{}] * len(prompts),
        use_vllm=False,
        _is_vlm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024)),
        max_completion_length=max_completion_length,
        processing_class=tok,
        _tokenizer=tok,
        chat_template=None,
        chat_template_kwargs={},
        environment_factories=None,
        tools=[calculator],
        _generate_single_turn=single_turn,
    )
    trainer._get_tool_suffix_ids = lambda messages: trl_grpo.GRPOTrainer._get_tool_suffix_ids(
        trainer, messages
    )
    logprobs = [[LOGPROB] * len(c) for c in completion_ids]
    tool_mask, _, ids, logprobs, calls, failures, _ = trl_grpo.GRPOTrainer._tool_call_loop(
        trainer, prompts, prompt_ids, completion_ids, completions, logprobs, None, None
    )
    return ids, tool_mask, logprobs, calls, failures


@pytest.mark.parametrize(
    "case", ["all turns", "last turn cut", "tool turn fills the budget", "tool turn rolled back"]
)
def test_ids_and_masks_equal_trls_tool_call_loop(tokenizer, case):
    names = ["p0", "p1"]  # results that are plain numbers: TRL writes a result as str(result), as we do
    ids, own = expected_row(tokenizer, "p0", RESULTS["p0"])
    first, tool = own.index(0), own.count(0)
    budget, length = {
        "all turns": (len(ids) + 50, len(ids)),
        "last turn cut": (first + tool + 4, first + tool + 4),
        "tool turn fills the budget": (first + tool, first + tool),  # no token left for the next turn
        "tool turn rolled back": (first + tool - 1, first),
    }[case]
    trl_ids, trl_mask, trl_logprobs, trl_calls, trl_failures = trl_tool_call_loop(tokenizer, names, budget)
    assert len(trl_ids[0]) == length  # the case is the one named
    engine = ScriptedEngine(tokenizer, settings_of(tokenizer, budget))
    tools = ToolRollouts(engine, tokenizer, ToolRunner([calculator]))
    prompt_ids, mask = PromptEncoder(tokenizer).encode(
        [[{"role": "user", "content": n}] for n in names], "cpu"
    )
    rollout, turns = tools.generate(torch.nn.Linear(1, 1), prompt_ids, mask, num_generations=1)
    counts = turns.counts
    for row in range(len(names)):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :n].tolist() == trl_ids[row]
        assert rollout.tool_mask[row, :n].tolist() == trl_mask[row]
        assert rollout.sampler_logprobs[row, :n].tolist() == trl_logprobs[row]
    assert (counts.calls, counts.failures) == (trl_calls, trl_failures) == (1, 0)


@pytest.mark.parametrize("group_size", [1, 2])
def test_packed_scoring_of_a_multi_turn_rollout_equals_the_padded_one(tiny_model_dir, tokenizer, group_size):
    """A multi-turn completion_mask stays 1 on a prefix (tool tokens are context the scorer attends to), the
    holes are in tool_mask alone: packed rows score every model token as the padded pass does."""
    from grpo_lightning.core.generation.packing import PackedLogProbScorer
    from grpo_lightning.core.generation.scorer import LogProbScorer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout, _, _ = run(tokenizer, G=2)
    n = int(rollout.completion_mask[0].sum())
    assert (rollout.tool_mask[0, :n] == 0).any() and rollout.tool_mask[0, n - 1] == 1  # a hole inside
    rows = slice(0, rollout.completion_ids.size(0))
    with torch.no_grad():
        padded, _ = LogProbScorer(num_generations=2)(model, rollout, rows)
        packed, _ = PackedLogProbScorer(num_generations=2, share_prompt=group_size == 2)(model, rollout, rows)
    own = (rollout.completion_mask * rollout.tool_mask).bool()  # [B, T] the loss's tokens
    torch.testing.assert_close(packed[own], padded[own], atol=1e-4, rtol=0)
    torch.testing.assert_close(packed, padded * rollout.completion_mask, atol=1e-4, rtol=0)
