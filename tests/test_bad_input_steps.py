"""Step counts honour `max_steps`: with several optimizer steps per rollout (`steps_per_generation` x
`num_iterations`) the run stops at `max_steps`, part-way through the last rollout if it must, warning up
front and naming both options; the schedule's last step is a real one (a learning rate above its floor)."""

import lightning as L
import pytest

from grpo_lightning.training.data.gsm8k import GSM8KDataModule
from tests.helpers import length_reward, quiet_trainer, tiny_module


class LearningRates(L.Callback):
    """The learning rate of every optimizer step, as it is taken."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_max_steps_is_the_number_of_optimizer_steps_and_the_last_one_learns(tiny_model_dir, tmp_path):
    steps_per_generation, num_iterations, max_steps = 2, 2, 3  # 4 optimizer steps per rollout
    module = tiny_module(
        tiny_model_dir,
        reward_funcs=[length_reward],
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        lr_scheduler_type="linear",
        learning_rate=0.01,
    )
    rates = LearningRates()
    trainer = quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=[rates])
    data = GSM8KDataModule("arithmetic", None, batch_size=2, val_size=2)
    per_batch = steps_per_generation * num_iterations
    with pytest.warns(
        UserWarning, match=f"trainer.max_steps={max_steps} is not a multiple of the {per_batch} "
    ):
        trainer.fit(module, data)
    assert trainer.global_step == max_steps == len(rates.rates)
    # Linear decay over exactly the steps taken: 1, 2/3, 1/3 of the rate; none spent at 0.
    assert rates.rates == pytest.approx([0.01 * (max_steps - s) / max_steps for s in range(max_steps)])
    assert rates.rates[-1] > 0
