"""The distributed tests' runs on 2 CPU processes (gloo), all in one launch.

Starting 2 processes costs more than most of these runs: each process imports torch, Lightning and
transformers (about 5 CPU-seconds). So the files whose tests check 2-process runs each name their runs
(`two_rank_jobs(model, out)` in tests/test_distributed.py, test_distributed_resume.py, test_fsdp_options.py,
test_validation_sets.py, test_environment_prompts_ranks.py), the session fixture `two_rank_runs` makes them
all in one launch of this file as a script, one after the other in the same 2 processes (the DDP runs first,
then the FSDP2 ones), and each test reads what its runs wrote under `<two_rank_runs>/<its file's name>/`. Only
the files whose tests pytest runs take part: one file's tests launch that file's runs alone.

A job is `{"call": "tests.<file>:<function>", "cfg": {...}}`: the function runs with `cfg` on every rank.
Each starts from the random state of a fresh process, as it would in a launch of its own.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch

FILES = (
    "test_quiet_runs",  # first: its run counts warnings that Lightning gives once per process
    "test_distributed",
    "test_validation_sets",
    "test_distributed_resume",
    "test_fsdp_options",
    "test_environment_prompts_ranks",
)


def run_jobs(cfg: dict) -> None:
    """Each job of `cfg["jobs"]` in turn, in this process (one rank of the launch)."""
    from grpo_lightning.io.distributed import close_process_group

    fresh_seed = torch.initial_seed()
    for job in cfg["jobs"]:
        torch.manual_seed(fresh_seed)
        os.environ.pop("PL_GLOBAL_SEED", None)  # set by an earlier job's `seed_everything`
        module, function = job["call"].split(":")
        getattr(importlib.import_module(module), function)(job["cfg"])
    close_process_group()


def launch_two_rank_runs(files: set[str], model: str, root: str) -> None:
    """One launch for the runs of `files` (names of FILES) on `model`, each file's into `<root>/<name>/`."""
    from tests.test_distributed import launch

    jobs = []
    for name in (name for name in FILES if name in files):
        out = os.path.join(root, name)
        os.makedirs(out)
        jobs += importlib.import_module(f"tests.{name}").two_rank_jobs(model, out)
    jobs.sort(key=lambda job: job["cfg"]["strategy"] == "fsdp")  # the DDP runs first, then the FSDP2 ones
    launch({"strategy": "ddp and fsdp", "out": root, "jobs": jobs}, timeout=120 * len(jobs), script=__file__)


if __name__ == "__main__":
    run_jobs(json.loads(sys.argv[1]))
