"""How much signal a sampling temperature gives GRPO before any training (the demo study's first question).

For each `--temperatures` value, the config's policy samples G = `grpo.num_generations` completions for each
of `--prompts` training prompts through `GRPOModule.sample` (the rollout path of training), and the config's
reward functions score them. Per temperature: the mean of each reward, the share of completions cut at
`max_completion_length`, their mean length, the share of groups whose total rewards differ (a group of equal
rewards has zero advantages and teaches nothing) and strict pass@G (a group with at least one `#### N`
answer that is right).

    python benchmarks/sampling_signal.py --config configs/demo_arithmetic.yaml --temperatures 0.5 0.8 1.0

Run from the repo root, where the config's relative paths point; seeded (`--seed`), one thread by default.
Only the config's model and data sections are read: sampling runs without a trainer, in the policy's float32
whatever `trainer.precision` says.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see scripts/demo.py

import lightning as L  # noqa: E402
import torch  # noqa: E402
from compare_options import instantiate, load_config  # noqa: E402

from grpo_lightning.core.config import GRPOConfig  # noqa: E402
from grpo_lightning.core.rewards.verifiable import extract_answer, reference_answer  # noqa: E402
from grpo_lightning.io.rows import collate_rows  # noqa: E402
from grpo_lightning.training.data import GSM8KDataModule  # noqa: E402
from grpo_lightning.training.module import GRPOModule  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "demo_arithmetic.yaml"))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 0.7, 0.8, 1.0])
    parser.add_argument("--prompts", type=int, default=24, help="training prompts per temperature")
    parser.add_argument("--batch", type=int, default=8, help="prompts per sampling call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def signal_at(
    config: dict, temperature: float, rows: list[dict], system_prompt: str | None, batch: int, seed: int
) -> dict:
    model = dict(config["model"])
    grpo = GRPOConfig(**{**model.pop("grpo", {}), "temperature": temperature, "preflight": False})
    funcs = [instantiate(f) for f in model.pop("reward_funcs")]
    module = GRPOModule(policy=model["policy"], grpo=grpo, reward_funcs=funcs)
    module.configure_model()
    L.seed_everything(seed)
    G = grpo.num_generations
    totals, per_func, lengths, cut, signal, solved = [], {f.__name__: [] for f in funcs}, [], 0, 0, 0
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        prompts = collate_rows(part, system_prompt)["prompt"]
        rollout, completions = module.rollouts.sample(prompts, G)
        answers = [row["answer"] for row in part for _ in range(G)]
        scores = [f(completions=completions, answer=answers) for f in funcs]
        for f, values in zip(funcs, scores, strict=True):
            per_func[f.__name__] += values
        total = [sum(values) for values in zip(*scores, strict=True)]
        n_tokens = rollout.completion_mask.sum(dim=1).tolist()
        lengths += n_tokens
        cut += sum(n >= grpo.max_completion_length for n in n_tokens)
        for g, row in enumerate(part):
            group = slice(g * G, (g + 1) * G)
            signal += len(set(total[group])) > 1
            reference = reference_answer(row["answer"])
            solved += any(extract_answer(c, strict=True) == reference for c in completions[group])
        totals += total
    n = len(totals)
    return {
        "temperature": temperature,
        **{name: sum(values) / n for name, values in per_func.items()},
        "truncated": cut / n,
        "length": sum(lengths) / n,
        "groups_with_signal": signal / len(rows),
        "strict_pass_at_G": solved / len(rows),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(args.config, [])
    data = GSM8KDataModule(**config.get("data", {}))
    data.setup("fit")
    rows = list(data.train_rows[: args.prompts])
    results = [
        signal_at(config, t, rows, data.hparams.system_prompt, args.batch, args.seed)
        for t in args.temperatures
    ]
    names = [k for k in results[0] if k != "temperature"]
    G = config["model"].get("grpo", {}).get("num_generations", 8)
    print(f"{args.config}: {len(rows)} training prompts x G = {G}, seed {args.seed}")
    print("| temperature | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in results:
        print(f"| {r['temperature']} | " + " | ".join(f"{r[k]:.3f}" for k in names) + " |")


if __name__ == "__main__":
    main()
