"""The offline learning demo: held-out accuracy before, GRPO fine-tuning, held-out accuracy after.

    python scripts/demo.py --config configs/demo_arithmetic.yaml

Everything comes from the YAML (the same file `cli.py fit` takes); the summary goes to
`<default_root_dir>/summary.json`.
"""

import json
import os
import sys
import time

from grpo_lightning.cli import build_cli


def main(args: list[str]) -> None:
    cli = build_cli(args, run=False)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    before = trainer.validate(module, data)[0]
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    after = trainer.validate(module, data)[0]
    summary = {
        "accuracy_before": before["val/accuracy_strict"],
        "accuracy_after": after["val/accuracy_strict"],
        "lenient_accuracy_before": before["val/accuracy"],
        "lenient_accuracy_after": after["val/accuracy"],
        "format_before": before["val/format"],
        "format_after": after["val/format"],
        "steps": trainer.global_step,
        "seconds": round(seconds, 1),
        "heldout_problems": len(data.val_rows),
    }
    path = os.path.join(trainer.default_root_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    print(f"summary written to {path}; TensorBoard: tensorboard --logdir {trainer.default_root_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
