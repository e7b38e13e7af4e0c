"""The module's predict hook (`training/held_out_loops.py`): one answer per prompt, a rank's padding repeats
(`validation_sets.rank_share`'s marks) left out, greedy answers that the module's own sampling gives."""

import torch

from grpo_lightning.training.held_out_loops import HeldOutLoops
from grpo_lightning.training.validation_sets import COUNTED
from tests.helpers import tiny_module


def test_predict_answers_each_counted_prompt_greedily(tiny_model_dir):
    module = tiny_module(tiny_model_dir, max_completion_length=6)
    module.configure_model()  # the weights load, as a Trainer would have them
    assert isinstance(module, HeldOutLoops)
    prompts = ["What is 2 + 3?", "What is 7 * 6?", "What is 2 + 3?"]
    torch.manual_seed(0)
    answers = module.predict_step({"prompt": prompts, COUNTED: [True, True, False]}, 0)
    assert [a["prompt"] for a in answers] == prompts[:2]  # the repeat a rank padded with is left out
    _, completions, _ = module.rollouts.sample_batch({"prompt": prompts[:2]}, 1, do_sample=False)
    assert [a["completions"] for a in answers] == [[c] for c in completions]  # greedy: the same answers
