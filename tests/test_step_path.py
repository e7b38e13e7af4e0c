"""How far a training step walks through the package, measured while it runs.

The second `GRPOModule.training_step` of the tiny model (default options and rewards, groups of 2, 8 new
tokens; the first step also builds the rollout engine, once) runs under `sys.setprofile`:

- the step's files: every file of `grpo_lightning/` with a Python function called between the start and
  the end of `training_step` (the module's own file included);
- the hops of the policy's log-prob pass for the loss: at the policy's forward call that the loss
  backpropagates (the step's first call of the policy, or of its decoder, with gradients on), the
  package's files on the call stack from `training_step` down to that call, in order, a file counted again
  only when the stack leaves it for another package file and comes back; the hops are the changes of file
  along that chain (its length minus one). Frames outside the package (torch, Lightning) are passed over.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpo_lightning.training.data import GSM8KDataModule
from grpo_lightning.training.module import GRPOModule
from tests.helpers import quiet_trainer, tiny_module

ROOT = Path(__file__).resolve().parents[1]
# The step walks 26: the module, its rollouts, its optimizer steps (manual optimisation), monitoring and the
# stepping of its schedulers (training/), the group source that samples, checks and scores the update's
# groups (core/group_source.py), the update (core/update.py),
# the rows of each step (core/algorithm/batches.py), the rollout's model tokens
# (core/types.py), the advantages, the loss, the KL section it reads (the weight of its KL term) and the
# sampler/scorer gap (core/algorithm/: one concern a file), the other processes (core/ranks.py, `OneProcess`
# in one process), the reward call and the default rewards (core/rewards/), and seven files of
# core/generation/: the engine seam, the prompts around it, the training scorer, what the model can do (full
# attention, its cache keyword), decoding (with each group's prefill), the log-prob head and the packed
# pass, and core/chat_template.py, the one chat-template render that the prompts and the tool turns share.
# Decoding and the log-prob head are two concerns in two files: the step runs both. A stop request (SIGTERM)
# is answered inside the step: core/stop_requests.py checks between decoding steps, and the interrupt
# checkpoint (training/callbacks/) keeps the step's starting state to write if the step is abandoned.
MAX_STEP_FILES = 26
MAX_LOGPROB_HOPS = 3


def package_file(code_filename: str) -> str | None:
    """`grpo_lightning/...py` for a file of the package, None for any other."""
    path = Path(code_filename)
    if not path.is_absolute() or path.suffix != ".py":
        return None
    try:
        relative = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(relative) if relative.parts[0] == "grpo_lightning" else None


class TracedModule(GRPOModule):
    """Records, for its training step of index `traced_step`, the package files it runs (`step_files`) and
    the chain of package files on the stack at the loss's policy pass (`logprob_chain`)."""

    traced_step = 1

    step_files: set[str] | None = None
    logprob_chain: list[str] | None = None

    def training_step(self, batch, batch_idx):
        if batch_idx != self.traced_step:
            return super().training_step(batch, batch_idx)
        files: set[str] = set()
        file_of: dict = {}  # code object -> its package file (or None), looked up once each

        def profile(frame, event, arg) -> None:
            if event == "call":
                code = frame.f_code
                if code not in file_of:
                    file_of[code] = package_file(code.co_filename)
                if file_of[code] is not None:
                    files.add(file_of[code])

        policy = self.policy
        hooks = [m.register_forward_pre_hook(self._at_policy_forward) for m in (policy, policy.get_decoder())]
        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            return super().training_step(batch, batch_idx)
        finally:
            sys.setprofile(previous)
            for hook in hooks:
                hook.remove()
            self.step_files = files

    def _at_policy_forward(self, module, args) -> None:
        if self.logprob_chain is not None or not torch.is_grad_enabled():
            return  # the rollout's and any frozen pass run without gradients; the loss's pass is the first
        chain: list[str] = []
        frame = sys._getframe(1)
        while frame is not None:
            name = package_file(frame.f_code.co_filename)
            if name is not None and (not chain or chain[-1] != name):
                chain.append(name)
            if frame.f_code is GRPOModule.training_step.__code__:
                break
            frame = frame.f_back
        self.logprob_chain = chain[::-1]  # from training_step down to the policy's forward


def test_a_default_training_step_walks_few_files_and_the_logprob_pass_few_hops(tiny_model_dir):
    module = tiny_module(tiny_model_dir, TracedModule)
    data = GSM8KDataModule(source="arithmetic", arithmetic_size=16, val_size=2)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, data)
    assert trainer.global_step == 2 and module.step_files is not None, "the traced step ran and stepped"

    files = sorted(module.step_files)
    listing = "\n  ".join(files)
    # The trace sees the step: the module, the update and the loss ran inside it.
    for expected in (
        "grpo_lightning/training/module.py",
        "grpo_lightning/core/update.py",
        "grpo_lightning/core/algorithm/loss.py",
    ):
        assert expected in files, f"{expected} not seen in the step:\n  {listing}"
    print(f"\n{len(files)} package files in a training step:\n  {listing}")
    assert len(files) <= MAX_STEP_FILES, (
        f"a default training step runs {len(files)} package files (at most {MAX_STEP_FILES}):\n  {listing}"
    )

    chain = module.logprob_chain
    assert chain is not None, "no policy forward with gradients in the step"
    assert chain[0] == "grpo_lightning/training/module.py", chain
    hops = len(chain) - 1
    print(f"log-prob pass: {hops} hops: {' -> '.join(chain)}")
    assert hops <= MAX_LOGPROB_HOPS, (
        f"the loss's log-prob pass takes {hops} hops (at most {MAX_LOGPROB_HOPS}): {' -> '.join(chain)}"
    )
