"""The pure core: GRPO maths, rewards, sampling and scoring. No Lightning here, and nothing from the layers
above (`grpo_lightning.io`, `grpo_lightning.training`): what it needs from them comes in as objects."""
