"""The data modules: `PromptDataModule` (prompts in TRL's format, `prompts`) and its GSM8K preset
(`GSM8KDataModule`, `gsm8k`). A config names them by their class path here
(`grpo_lightning.training.data.PromptDataModule`).
"""

from grpo_lightning.training.data.gsm8k import GSM8KDataModule
from grpo_lightning.training.data.prompts import PromptDataModule

__all__ = ["GSM8KDataModule", "PromptDataModule"]
