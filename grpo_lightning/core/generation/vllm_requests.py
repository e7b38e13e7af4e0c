"""What crosses into and out of vLLM for one rollout: `SamplingParams` of our `SamplingSettings`
(`sampling_params`, one to one; greedy draws once), the requests decoded one engine step at a time with a
stop check between steps (`decoded`), and the `Rollout` of vLLM's `RequestOutput`s (`rollout_of`, with
each drawn token's processed log-prob). vLLM is imported on first use.

No Lightning here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.core.generation.sampling import SamplingSettings
from grpo_lightning.core.stop_requests import check, checked_only
from grpo_lightning.core.types import Rollout


def sampling_params(settings: SamplingSettings, num_generations: int, do_sample: bool):
    """`SamplingParams` of one prompt's group: `SamplingSettings` mapped one to one; greedy draws once, with
    no knob but the lengths (as the eager path's greedy decoding)."""
    from vllm import SamplingParams

    s = settings
    sampled = {**s.vllm_knobs(), "logprobs": 0}
    return SamplingParams(
        n=num_generations if do_sample else 1,
        max_tokens=s.max_new_tokens,
        min_tokens=s.min_new_tokens,
        stop_token_ids=list(s.eos_token_ids),
        detokenize=False,
        **(sampled if do_sample else {"temperature": 0.0}),
    )


def decoded(llm, prompts: list[dict], params, lora_request) -> list:
    """The finished `RequestOutput` of each of `prompts` (in their order), as `llm.generate` returns them,
    decoded here one engine step at a time: a stop request (SIGTERM) is answered between two steps
    (`core.stop_requests.check`), never inside one, and every request still running is aborted first, so
    that the engine is left empty, as after a finished rollout, and its next use starts clean."""
    engine = llm.llm_engine
    with checked_only():
        ids = llm.enqueue(prompts, params, lora_request=lora_request, use_tqdm=False)  # vLLM's own ids
        finished = []
        try:
            while engine.has_unfinished_requests():
                check()
                finished += [output for output in engine.step() if output.finished]
        except BaseException:
            engine.abort_request(ids, internal=True)  # those finished are gone already
            raise
    # As `LLM.generate` orders them: a request's outer id counts the requests made.
    return sorted(finished, key=lambda output: int(output.request_id))


def rollout_of(
    outputs: list,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    G: int,
    settings: SamplingSettings,
    do_sample: bool,
) -> Rollout:
    """The `Rollout` of vLLM's `RequestOutput`s, one per prompt of `prompt_ids` `[N, P]`: N*G rows,
    completions right-padded with the pad id, each drawn token's processed log-prob (0 after the end; None
    greedy)."""
    rows = [c for out in outputs for c in out.outputs]
    if not do_sample:  # one greedy completion per prompt, repeated to the group
        rows = [row for row in rows for _ in range(G)]
    device = prompt_ids.device
    T = max(1, max(len(c.token_ids) for c in rows))
    ids = torch.full((len(rows), T), settings.pad_token_id, dtype=torch.long)  # [N*G, T]
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # [N*G, T]
    logprobs = torch.zeros((len(rows), T), dtype=torch.float32)  # [N*G, T]
    eos = set(settings.eos_token_ids)
    ended = torch.zeros(len(rows), dtype=torch.bool)  # [N*G]
    for i, completion in enumerate(rows):
        tokens = list(completion.token_ids)
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1
        ended[i] = bool(tokens) and tokens[-1] in eos
        if do_sample:
            logprobs[i, : len(tokens)] = torch.tensor(
                [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
            )
    return Rollout(
        prompt_ids.repeat_interleave(G, dim=0),  # [N*G, P]
        prompt_mask.repeat_interleave(G, dim=0),
        ids.to(device),
        mask.to(device),
        (~ended).to(device),
        logprobs.to(device) if do_sample else None,
    )
