"""vLLM's outputs as a `Rollout` (`core/generation/vllm_requests.rollout_of`), without vLLM: stand-ins with
the fields of its `RequestOutput` / `CompletionOutput` / `Logprob`. Ragged completions are right-padded with
the pad id, a row ends only on a stop id, each token's log-prob is the one vLLM gave for that token, and a
greedy request's one completion is repeated to the group."""

from types import SimpleNamespace

import torch

from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.generation.vllm_requests import rollout_of

SETTINGS = SamplingSettings(max_new_tokens=4, eos_token_ids=(2, 7), pad_token_id=0)
PROMPTS = torch.tensor([[0, 5, 6], [8, 9, 4]])  # [2, 3] left-padded
PROMPT_MASK = (PROMPTS != 0).long()


def completion(tokens: list[int], logprobs: list[float] | None = None):
    """A vLLM completion: its ids and, per step, a dict of id -> Logprob with the drawn id (and another)."""
    steps = None
    if logprobs is not None:
        steps = [
            {token: SimpleNamespace(logprob=lp), 99: SimpleNamespace(logprob=-50.0)}
            for token, lp in zip(tokens, logprobs, strict=True)
        ]
    return SimpleNamespace(token_ids=tokens, logprobs=steps)


def test_sampled_outputs_become_a_padded_rollout_with_the_drawn_tokens_logprobs():
    outputs = [
        SimpleNamespace(outputs=[completion([3, 2], [-0.5, -0.25]), completion([4, 4, 4, 4], [-1.0] * 4)]),
        SimpleNamespace(outputs=[completion([7], [-2.0]), completion([5, 6, 2], [-0.1, -0.2, -0.3])]),
    ]
    rollout = rollout_of(outputs, PROMPTS, PROMPT_MASK, 2, SETTINGS, do_sample=True)
    assert rollout.completion_ids.tolist() == [[3, 2, 0, 0], [4, 4, 4, 4], [7, 0, 0, 0], [5, 6, 2, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert rollout.truncated.tolist() == [False, True, False, False]  # 7 is a stop id too
    expected = [[-0.5, -0.25, 0, 0], [-1.0] * 4, [-2.0, 0, 0, 0], [-0.1, -0.2, -0.3, 0]]
    torch.testing.assert_close(rollout.sampler_logprobs, torch.tensor(expected))
    assert torch.equal(rollout.prompt_ids, PROMPTS.repeat_interleave(2, dim=0))


def test_a_greedy_completion_is_repeated_to_the_group_and_has_no_sampler_logprobs():
    outputs = [SimpleNamespace(outputs=[completion([3, 2])]), SimpleNamespace(outputs=[completion([6])])]
    rollout = rollout_of(outputs, PROMPTS, PROMPT_MASK, 3, SETTINGS, do_sample=False)
    assert rollout.completion_ids.tolist() == [[3, 2]] * 3 + [[6, 0]] * 3
    assert rollout.truncated.tolist() == [False] * 3 + [True] * 3
    assert rollout.sampler_logprobs is None
