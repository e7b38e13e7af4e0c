"""The data modules: `PromptDataModule` (prompts in TRL's format, `prompts`), its GSM8K preset
(`GSM8KDataModule`, `gsm8k`) and the prompts an environment writes (`EnvironmentPromptDataModule`,
`environment_prompts`: TRL's `train_dataset=None`). A config names them by their class path here
(`grpo_lightning.training.data.PromptDataModule`).
"""

from grpo_lightning.training.data.environment_prompts import EnvironmentPromptDataModule
from grpo_lightning.training.data.gsm8k import GSM8KDataModule
from grpo_lightning.training.data.prompts import PromptDataModule

__all__ = ["EnvironmentPromptDataModule", "GSM8KDataModule", "PromptDataModule"]
