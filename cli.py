"""Entry point: `python cli.py fit --config configs/smollm2_cpu.yaml` (see README.md)."""

from grpo_lightning.cli import main

if __name__ == "__main__":
    main()
