"""The pure core: GRPO maths, rewards, sampling and scoring. No Lightning here, and nothing from
`grpo_lightning.training`; from `grpo_lightning.io` only what imports no Lightning (`distributed`)."""
