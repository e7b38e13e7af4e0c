"""Token-level step credit: a wrong arithmetic step becomes negative advantage on exactly the generated
tokens that wrote it, on top of the outcome advantage."""

import pytest
import torch
from transformers import AutoTokenizer

from grpo_lightning.core.algorithm.advantages import group_advantages
from grpo_lightning.core.algorithm.credit import step_credit_penalties, token_char_spans
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.rewards.verifiable import accuracy_reward
from grpo_lightning.core.types import Rollout
from tests.test_dynamic_sampling import StepSpy, fit_on_rows, tiny_module

TEXT = "Tom has 3 + 4 = 8 apples. Then 8 × 2 = 16 €.\n#### 16"  # one wrong step, "3 + 4 = 8"
UNICODE = "Émile: 5 × 3 = 16 😀 ok"  # a wrong step with a 2-byte operator, then a 4-byte character


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def tokenizer(request, tiny_model_dir):
    """SmolLM2's real 49k byte-level BPE, and the tests' small BPE (it splits most non-ASCII characters)."""
    path = request.getfixturevalue("smollm2_dir") if request.param == "smollm2" else tiny_model_dir
    return AutoTokenizer.from_pretrained(path)


def encode(tokenizer, text: str) -> list[int]:
    """`text` as a completion: its tokens and the EOS that ended it."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def penalised_text(tokenizer, ids: list[int], penalties: list[float], penalty: float) -> str:
    """The penalised tokens decoded, after checking that they are one run, each charged `penalty`."""
    marked = [i for i, p in enumerate(penalties) if abs(p) > 1e-6]
    assert marked == list(range(marked[0], marked[-1] + 1)), "the penalised tokens are not one run"
    assert all(abs(penalties[i] + penalty) < 1e-6 for i in marked)
    assert all(tokenizer.decode([ids[i]]).strip() for i in (marked[0], marked[-1])), "blank token at an edge"
    return tokenizer.decode([ids[i] for i in marked])


@pytest.mark.parametrize("text", [TEXT, UNICODE])
def test_token_spans_tile_the_decoded_text(tokenizer, text):
    ids = encode(tokenizer, text)
    spans = token_char_spans(tokenizer, ids, text)
    assert spans[-1][0] == spans[-1][1] == len(text)  # EOS is skipped in the text: it spans nothing
    for i, (start, end) in enumerate(spans[:-1]):
        piece = tokenizer.decode([ids[i]])
        if "\ufffd" in piece:  # part of a multi-byte character: the span holds that whole character
            assert end - start in (1, 2) and text[end - 1] not in "\ufffd " and ord(text[end - 1]) > 127
        else:
            assert text[start:end] == piece, (i, piece, text[start:end])
    # In order and without gaps; two spans share a character only when a token stops inside its bytes.
    assert spans[0][0] == 0
    for (_, end), (start, _) in zip(spans[:-1], spans[1:], strict=True):
        assert start == end or (start == end - 1 and ord(text[start]) > 127), (end, start)


def test_only_the_tokens_of_the_wrong_step_are_penalised(tokenizer):
    correct = "Tom has 3 + 4 = 7 apples.\n#### 7"
    texts = [TEXT, correct, UNICODE]
    encoded = [encode(tokenizer, t) for t in texts]
    T = max(map(len, encoded)) + 3  # right padding after the longest
    completion_ids = torch.full((3, T), tokenizer.pad_token_id)
    completion_mask = torch.zeros(3, T, dtype=torch.long)
    for row, ids in enumerate(encoded):
        completion_ids[row, : len(ids)] = torch.tensor(ids)
        completion_mask[row, : len(ids)] = 1

    penalties = step_credit_penalties(tokenizer, completion_ids, completion_mask, penalty=0.5)  # [3, T]

    assert penalties.shape == (3, T) and penalties.dtype == torch.float32
    assert penalties[1].eq(0).all()  # every step verifies: no token is touched
    assert penalised_text(tokenizer, encoded[0], penalties[0].tolist(), 0.5).strip() == "3 + 4 = 8"
    assert penalised_text(tokenizer, encoded[2], penalties[2].tolist(), 0.5).strip() == "5 × 3 = 16"
    assert penalties[:, -3:].eq(0).all()  # padding and EOS never are


def scripted_sample(module, texts: list[str]):
    """Replace sampling by fixed completions (one prompt, G = len(texts)), for a known set of wrong steps."""
    tok = module.tokenizer

    def sample(prompts, num_generations, do_sample=True):
        ids, mask = module.rollouts.encoder.encode(prompts, "cpu")  # [1, P]
        encoded = [encode(tok, t) for t in texts]
        T = max(map(len, encoded))
        completion_ids = torch.tensor([e + [tok.pad_token_id] * (T - len(e)) for e in encoded])  # [G, T]
        completion_mask = torch.tensor([[1] * len(e) + [0] * (T - len(e)) for e in encoded])  # [G, T]
        G = len(texts)
        rollout = Rollout(
            ids.repeat(G, 1),
            mask.repeat(G, 1),
            completion_ids,
            completion_mask,
            truncated=torch.zeros(G, dtype=torch.bool),
        )
        return rollout, tok.batch_decode(completion_ids, skip_special_tokens=True)

    module.rollouts.sample = sample


COMPLETIONS = [
    "3 + 4 = 7\n#### 7",  # right
    "3 + 4 = 8\n#### 8",  # a wrong step, a wrong answer
    "3 * 4 = 7\n#### 7",  # a wrong step, the right answer anyway
    "The answer is 9.\n#### 9",  # no step, a wrong answer
]


@pytest.mark.parametrize("step_credit", [0.0, 0.5])
def test_step_credit_adds_token_penalties_to_the_outcome_advantage(tiny_model_dir, step_credit):
    module = tiny_module(tiny_model_dir, reward_funcs=[accuracy_reward], step_credit=step_credit)
    scripted_sample(module, COMPLETIONS)
    spy = StepSpy(module)
    fit_on_rows(module, [{"question": "What is 3 + 4?", "answer": "#### 7"}], max_steps=1, batch_size=1)

    (call,) = spy.calls
    outcome = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)  # [4]
    if step_credit == 0:  # off: the advantages are the outcome's, one per completion, exactly as before
        torch.testing.assert_close(call.advantages, outcome)
        return
    assert call.advantages.shape == call.rollout.completion_ids.shape  # [B, T]
    penalties = call.advantages - outcome[:, None]  # [B, T]
    ids = call.rollout.completion_ids.tolist()
    assert penalties[0].abs().max() < 1e-6 and penalties[3].abs().max() < 1e-6
    assert penalised_text(module.tokenizer, ids[1], penalties[1].tolist(), 0.5).strip() == "3 + 4 = 8"
    assert penalised_text(module.tokenizer, ids[2], penalties[2].tolist(), 0.5).strip() == "3 * 4 = 7"


def test_step_credit_option_is_checked():
    with pytest.raises(ValueError, match="step_credit"):
        GRPOConfig(step_credit=-0.1)
