"""What a `GRPOModule` keeps of its arguments as hyper-parameters (`save_own_hyperparameters`): those of its
own class's `__init__`, made portable (`io.hparams.portable_hparams`), so that
`load_from_checkpoint(ckpt)` rebuilds it and the loggers get the same plain values.
"""

from __future__ import annotations

import copy
from types import FrameType

import lightning as L
from lightning.pytorch.utilities.parsing import collect_init_args

from grpo_lightning.io.hparams import portable_hparams


def save_own_hyperparameters(
    module: L.LightningModule, frame: FrameType, base: type, **sources: object
) -> None:
    """`module.save_hyperparameters()` from the `frame` of `base.__init__`, less the model `sources` (a hub
    id or folder is kept, a built model or tokenizer is not), and less what a subclass fixed: an argument
    that its `__init__` takes no more. The LightningCLI's hyper-parameters (`_instantiator`) are its config's,
    for its own instantiation: kept whole."""
    module.save_hyperparameters(ignore=list(sources), frame=frame)
    own = own_arguments(frame, base)
    for key in set(module.hparams) - own if "_instantiator" not in module.hparams else ():
        del module.hparams[key]
    portable_hparams(module.hparams, {k: v for k, v in sources.items() if k in own})
    module._hparams_initial = copy.deepcopy(module._hparams)  # what the loggers get: the same plain values


def own_arguments(frame: FrameType, base: type) -> set[str]:
    """The arguments that the module's own class takes back, from `base.__init__`'s `frame`: those of
    its most specific `__init__` (and those its `**kwargs` passed on). Lightning collects every `__init__`'s
    arguments up the class chain, so a subclass that fixes one of ours (`super().__init__(policy,
    reward_funcs=[mine], **kwargs)`) would get it twice when `load_from_checkpoint` calls it with them all."""
    return set(collect_init_args(frame, [], classes=(base,))[-1])
