"""Dynamic sampling (DAPO): groups with equal rewards are dropped and more prompts sampled until an update
has one informative group per prompt of a batch, with a cap on the extra generation rounds."""

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from grpo_lightning.core.algorithm.dynamic_sampling import GroupBuffer
from grpo_lightning.core.config import GRPOConfig
from grpo_lightning.core.generation.logprobs import completion_logprobs
from grpo_lightning.core.types import Rollout, ScoredGroups, cat_rollouts
from grpo_lightning.io.rows import collate_rows
from grpo_lightning.offline.tiny import build_model
from grpo_lightning.training.module import GRPOModule
from tests import helpers
from tests.helpers import quiet_trainer

G = 4


# ------------------------------------------------------------------------------------------ helpers
def split_reward(completions: list[str], question: list[str], **kwargs) -> list[float]:
    """0 for every completion of a "flat" question (a group without signal), else 0/1 alternating within the
    group, whatever was sampled (a group with signal)."""
    return [0.0 if q.startswith("flat") else float(i % 2) for i, q in enumerate(question)]


def rows(*questions: str) -> list[dict[str, str]]:
    return [{"question": q, "answer": "#### 1"} for q in questions]


class Recorder(L.Callback):
    """After each training batch: the module's `last_rollout` and a copy of the logged metrics."""

    def __init__(self) -> None:
        self.batches: list[SimpleNamespace] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        record, step = pl_module.last_rollout, trainer.global_step
        self.batches.append(SimpleNamespace(record=record, metrics=metrics, step=step))

    @property
    def updates(self) -> list[SimpleNamespace]:
        return [b for b in self.batches if b.record is not None]


class StepSpy:
    """Wraps `module.optimization.optimizer_step`: records each update's rollout and advantages (and
    `hook`'s result)."""

    def __init__(self, module: GRPOModule, hook=None) -> None:
        self.calls: list[SimpleNamespace] = []
        original = module.optimization.optimizer_step

        def spy(module, optimizer, trajectory, *rest):
            extra = hook(trajectory.rollout, trajectory.loss_mask) if hook is not None else None
            self.calls.append(
                SimpleNamespace(
                    rollout=trajectory.rollout,
                    advantages=trajectory.token_advantages.detach().clone(),
                    mask=trajectory.loss_mask,
                    ref_logprobs=trajectory.ref_logprobs,
                    extra=extra,
                )
            )
            return original(module, optimizer, trajectory, *rest)

        module.optimization.optimizer_step = spy


def tiny_module(model_dir: str, reward_funcs=(split_reward,), **grpo) -> GRPOModule:
    """`helpers.tiny_module` with groups of G, `split_reward` and a learning rate that moves the weights."""
    options = dict(num_generations=G, max_completion_length=6, learning_rate=1e-3) | grpo
    return helpers.tiny_module(model_dir, reward_funcs=reward_funcs, **options)


def fit_on_rows(module: GRPOModule, data: list[dict], max_steps: int, batch_size: int = 2) -> Recorder:
    """Train on `data` in order, `batch_size` prompts per batch, for `max_steps` optimizer steps."""
    torch.manual_seed(0)
    loader = DataLoader(data, batch_size=batch_size, collate_fn=lambda batch: collate_rows(batch, None))
    recorder = Recorder()
    trainer = quiet_trainer(max_steps=max_steps, callbacks=[recorder])
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == max_steps
    return recorder


def questions(record) -> list[str]:
    return [prompt[-1]["content"] for prompt in record.prompts]


def fake_groups(rewards: list[list[float]], prompt_width: int, completion_width: int, tag: int):
    """Groups with the given rewards; every id of group i is `tag * 100 + i`, the masks are ragged."""
    N = len(rewards)
    ids = torch.cat([torch.full((G, 1), tag * 100 + i) for i in range(N)])  # [N*G, 1]
    prompt_mask = torch.ones(N * G, prompt_width, dtype=torch.long)
    prompt_mask[:, 0] = 0  # left padding
    completion_mask = torch.ones(N * G, completion_width, dtype=torch.long)
    completion_mask[:, -1] = 0  # right padding
    completion_ids = ids.repeat(1, completion_width)
    rollout = Rollout(
        ids.repeat(1, prompt_width),
        prompt_mask,
        completion_ids,
        completion_mask,
        truncated=torch.zeros(N * G, dtype=torch.bool),
    )
    flat = torch.tensor(rewards).reshape(-1)  # [N*G]
    return ScoredGroups(
        [f"p{tag}.{i}" for i in range(N)], rollout, [f"c{tag}" for _ in range(N * G)], flat[:, None], flat, G
    )


SIGNAL, FLAT = [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------ the buffer
def test_buffer_fills_an_update_with_informative_groups_across_rounds():
    buffer = GroupBuffer(max_extra_rounds=5)
    buffer.add(fake_groups([FLAT, FLAT], prompt_width=3, completion_width=4, tag=1))
    assert not buffer.ready()
    buffer.add(fake_groups([FLAT, SIGNAL], prompt_width=5, completion_width=2, tag=2))
    assert not buffer.ready()
    buffer.add(fake_groups([SIGNAL, SIGNAL], prompt_width=2, completion_width=6, tag=3))
    assert buffer.ready()
    groups, stats = buffer.pop(pad_token_id=0)

    assert stats == {"frac_dropped": 3 / 6, "extra_rounds": 2.0}
    assert groups.prompts == ["p2.1", "p3.0"]  # the oldest informative groups; p3.1 is not carried over
    assert groups.rewards.tolist() == SIGNAL + SIGNAL
    rollout = groups.rollout
    assert rollout.prompt_ids.shape == (2 * G, 5) and rollout.completion_ids.shape == (2 * G, 6)
    # Round 2's rows: prompts already 5 wide; completions right-padded from 2 to 6 columns.
    assert rollout.prompt_ids[:G].unique().tolist() == [201]
    assert rollout.completion_ids[:G, :2].unique().tolist() == [201]
    assert rollout.completion_ids[:G, 2:].eq(0).all()
    assert rollout.completion_mask[:G].sum(1).tolist() == [1] * G
    # Round 3's rows: prompts left-padded from 2 to 5 columns, the real tokens kept at the right.
    assert rollout.prompt_ids[G:, :3].eq(0).all() and rollout.prompt_ids[G:, 3:].unique().tolist() == [300]
    assert rollout.prompt_mask[G:].tolist() == [[0, 0, 0, 0, 1]] * G
    assert buffer.rounds == 0 and not buffer.kept  # emptied for the next update


def test_buffer_at_the_cap_tops_up_with_the_latest_uninformative_groups():
    buffer = GroupBuffer(max_extra_rounds=1)
    buffer.add(fake_groups([FLAT, FLAT], prompt_width=3, completion_width=4, tag=1))
    assert not buffer.ready()
    buffer.add(fake_groups([SIGNAL, FLAT], prompt_width=3, completion_width=4, tag=2))
    assert buffer.ready()  # one informative group of two, but the one extra round allowed is spent
    with pytest.warns(UserWarning, match="found 1 of 2 groups"):
        groups, stats = buffer.pop(pad_token_id=0)
    assert groups.prompts == ["p2.0", "p2.1"]
    assert stats == {"frac_dropped": 3 / 4, "extra_rounds": 1.0}


def test_buffer_judges_groups_on_the_named_reward_not_a_shaped_total():
    """An all-wrong group whose format rewards differ has an unequal total but no accuracy signal (DAPO
    filters on accuracy); a group with one right answer has it."""
    phantom = fake_groups([SIGNAL], prompt_width=3, completion_width=4, tag=1)  # total varies...
    phantom.rewards_per_func = torch.stack([torch.zeros(G), phantom.rewards], dim=1)  # ...accuracy is flat
    right = fake_groups([SIGNAL], prompt_width=3, completion_width=4, tag=2)
    right.rewards_per_func = torch.stack([right.rewards, torch.ones(G)], dim=1)  # [G, (accuracy, format)]
    on_accuracy, on_total = GroupBuffer(max_extra_rounds=5, metric=0), GroupBuffer(max_extra_rounds=5)
    for buffer in (on_accuracy, on_total):
        buffer.add(ScoredGroups.cat([phantom, right], pad_token_id=0))
    assert [g.prompts for g in on_accuracy.kept] == [["p2.0"]]
    assert [g.prompts for g in on_total.kept] == [["p1.0", "p2.0"]]


def test_dynamic_sampling_metric_must_name_a_reward_function(tiny_model_dir):
    expected = r"dynamic_sampling.metric='accuracy_reward' \(dynamic_sampling_metric\) .*\['split_reward'\]"
    with pytest.raises(ValueError, match=expected):
        tiny_module(tiny_model_dir, dynamic_sampling=True)  # the default metric, absent from split_reward
    tiny_module(tiny_model_dir, dynamic_sampling=True, dynamic_sampling_metric=None)  # the total: always
    tiny_module(tiny_model_dir)  # without dynamic sampling the option is not read


def test_padding_groups_to_a_common_width_keeps_every_logprob():
    """Rows of two rounds with different prompt and completion widths score the same once stacked."""
    model = build_model(400).eval()
    torch.manual_seed(0)

    def rollout(P: int, T: int, real_prompt: int, real_completion: int) -> Rollout:
        prompt_mask = torch.zeros(2, P, dtype=torch.long)
        prompt_mask[:, P - real_prompt :] = 1
        completion_mask = torch.zeros(2, T, dtype=torch.long)
        completion_mask[:, :real_completion] = 1
        prompt_ids = torch.randint(3, 400, (2, P)).masked_fill(prompt_mask == 0, 0)
        completion_ids = torch.randint(3, 400, (2, T)).masked_fill(completion_mask == 0, 0)
        truncated = torch.zeros(2, dtype=torch.bool)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)

    parts = [
        rollout(P=4, T=7, real_prompt=3, real_completion=7),
        rollout(P=9, T=3, real_prompt=9, real_completion=2),
    ]
    stacked = cat_rollouts(parts, pad_token_id=0)
    assert stacked.input_ids.shape == (4, 9 + 7)
    with torch.no_grad():
        together = completion_logprobs(model, stacked.input_ids, stacked.attention_mask, 7)[0]  # [4, 7]
        for i, part in enumerate(parts):
            T = part.completion_ids.size(1)
            alone = completion_logprobs(model, part.input_ids, part.attention_mask, T)[0]  # [2, T]
            real = part.completion_mask.bool()
            rows_of_part = together[2 * i : 2 * i + 2, :T]  # [2, T]
            torch.testing.assert_close(rows_of_part[real], alone[real], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ in training
def test_dynamic_sampling_trains_only_on_informative_groups(tiny_model_dir):
    module = tiny_module(tiny_model_dir, dynamic_sampling=True, dynamic_sampling_metric="split_reward")
    spy = StepSpy(module)
    data = rows("flat 0", "flat 1", "flat 2", "signal 3", "signal 4", "signal 5")
    recorder = fit_on_rows(module, data, max_steps=1)

    assert [b.step for b in recorder.batches] == [0, 0, 1]  # three generation rounds for one update
    (update,) = recorder.updates
    assert questions(update.record) == ["signal 3", "signal 4"]  # the flat groups never reach the loss
    (call,) = spy.calls
    assert call.rollout.completion_ids.size(0) == 2 * G and call.advantages.shape == (2 * G,)
    assert (call.advantages.view(2, G).abs().sum(dim=1) > 0).all()  # every trained group has a signal
    assert update.metrics["train/dynamic_sampling/frac_dropped"] == pytest.approx(3 / 6)
    assert update.metrics["train/dynamic_sampling/extra_rounds"] == 2.0
    assert update.metrics["train/frac_reward_zero_std"] == 0.0


def test_dynamic_sampling_rounds_are_capped(tiny_model_dir):
    module = tiny_module(
        tiny_model_dir, dynamic_sampling=True, dynamic_sampling_max_rounds=1, dynamic_sampling_metric=None
    )
    spy = StepSpy(module)
    data = rows(*(f"flat {i}" for i in range(8)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the top-up warning, tested on the buffer
        recorder = fit_on_rows(module, data, max_steps=2)

    assert [b.step for b in recorder.batches] == [0, 1, 1, 2]  # an update every second round, no more
    assert [questions(u.record) for u in recorder.updates] == [["flat 2", "flat 3"], ["flat 6", "flat 7"]]
    for update in recorder.updates:
        assert update.metrics["train/dynamic_sampling/frac_dropped"] == 1.0
        assert update.metrics["train/dynamic_sampling/extra_rounds"] == 1.0
    assert [call.rollout.completion_ids.size(0) for call in spy.calls] == [2 * G, 2 * G]  # the usual size


def test_without_dynamic_sampling_every_batch_is_an_update(tiny_model_dir):
    module = tiny_module(tiny_model_dir)
    assert not module.grpo.dynamic_sampling  # off by default
    spy = StepSpy(module)
    data = rows("flat 0", "flat 1", "flat 2", "signal 3", "signal 4", "signal 5")
    recorder = fit_on_rows(module, data, max_steps=3)

    assert [b.step for b in recorder.batches] == [1, 2, 3]
    assert [questions(u.record) for u in recorder.updates] == [
        ["flat 0", "flat 1"],
        ["flat 2", "signal 3"],
        ["signal 4", "signal 5"],
    ]
    assert spy.calls[0].advantages.eq(0).all()  # flat groups are trained on, with zero advantages
    assert recorder.updates[0].metrics["train/frac_reward_zero_std"] == 1.0
    assert not any(key.startswith("train/dynamic_sampling") for key in recorder.updates[-1].metrics)


def test_dynamic_sampling_options_are_checked():
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds"):
        GRPOConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=-1)
