"""Token sampling: penalties and logit bias, temperature, top-k, top-p, per-request seeded
generator, watermark bias.

The order, as in vLLM's sampler: OpenAI's logit_bias and presence/frequency penalties change the
raw logits (so greedy rows honour them too), then temperature, watermark bias, top-k and top-p.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from schemas.messages import GenerateRequest


class NonFiniteLogits(ValueError):
    """The model produced NaN or inf logits for a request; that request fails, others go on."""


def sample(
    logits: torch.Tensor, request: GenerateRequest, generator: torch.Generator, bias: torch.Tensor | None = None
) -> int:
    """Pick the next token from one row of float32 logits [vocab], penalties and logit_bias
    already applied (adjust_logits).

    temperature 0 is greedy. The generator is the request's own, seeded from its seed, so the
    same request yields the same tokens whatever else shares the batch. `bias` [vocab] (the
    watermark's delta on green tokens) is added after the temperature, so delta is the shift in
    log-probability whatever the temperature; it is deterministic too, so tokens stay so.
    """
    # -inf is a grammar mask's "never" (sample_batch checked the model's own logits before it)
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise NonFiniteLogits("the model produced non-finite logits")
    if request.temperature == 0.0:
        return int(torch.argmax(logits if bias is None else logits + bias))
    scaled = logits / request.temperature
    if bool(torch.isposinf(scaled).any()):  # a temperature so small (1e-300) that it overflows: its limit, greedy
        return int(torch.argmax(logits if bias is None else logits + bias))
    logits = scaled
    if bias is not None:
        logits = logits + bias
    if request.top_k > 0 and request.top_k < logits.shape[-1]:
        kth = torch.topk(logits, request.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if request.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # drop tokens once the mass before them already reaches top_p; the first always stays, also for a
        # top_p that float32 rounds to 0 (1e-300: every token would be dropped)
        drop = (cumulative - sorted_probs) >= request.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    requests: list[GenerateRequest],
    generators: list[torch.Generator],
    biases: list[torch.Tensor | None],
    output_ids: list[list[int]] | None = None,
    token_biases: list[TokenBias | None] | None = None,
    top_logprobs: list[int | None] | None = None,
    mask: Callable[[torch.Tensor], None] | None = None,
) -> SampledRows:
    """Next tokens, model entropies and raw logprobs of a step's rows: logits [rows, vocab]
    float32, which it changes (penalties and logit_bias are added in place).

    A row's token is None when its logits are not finite (that request fails). `output_ids`
    (each row's generated tokens so far) and `token_biases` (each row's logit_bias) feed
    `adjust_logits`; `top_logprobs` (each row's request.logprobs, None: not asked) sizes the
    alternatives `raw_logprobs` lists. The entropy and the logprobs are the model's own, from one
    log-softmax taken before anything changes the logits (docs/design.md, "Structured output,
    tools and logprobs"). `mask` (the grammar's, services/worker/engine/grammar.py) sets the
    logits a constrained row may not take to -inf, after the penalties and bias and before
    temperature, watermark and truncation. The checks, the entropy, the penalties and the bias run once over the
    batch, greedy rows without a watermark bias take one batched argmax; only rows that draw at
    random (or carry a watermark bias) go through `sample`, each with its own generator, so a
    request's tokens do not depend on what shares its batch.
    """
    # a finite row sum means every logit is finite (NaN and inf propagate): one cheap reduction,
    # and the element-wise check only for the rows it flags
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    for row in [r for r, ok in enumerate(finite) if not ok]:
        finite[row] = bool(torch.isfinite(logits[row]).all())
    logp = torch.log_softmax(logits.float(), dim=-1)  # a new tensor: adjust_logits' in-place changes miss it
    entropies = entropies_of(logp).tolist()
    logits = adjust_logits(logits, requests, output_ids, token_biases)
    if mask is not None:
        mask(logits)
    argmax = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int | None] = []
    for row, (request, generator, bias) in enumerate(zip(requests, generators, biases, strict=True)):
        if not finite[row]:
            tokens.append(None)
        elif request.temperature == 0.0 and bias is None:
            tokens.append(argmax[row])
        else:
            tokens.append(sample(logits[row], request, generator, bias))
    logprobs, tops = raw_logprobs(logp, tokens, top_logprobs)
    return SampledRows(tokens, entropies, logprobs, tops)


class SampledRows(NamedTuple):
    """What sample_batch gives per row of a step."""

    tokens: list[int | None]  # None: the row's logits were not finite
    entropies: list[float]  # the model's token entropy (nats)
    logprobs: list[float | None]  # the sampled token's raw logprob (None where the token is)
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, raw logprob), most likely first; None: not asked


# The lowest logprob reported (OpenAI's floor): keeps a vanishing probability finite on the wire.
MIN_LOGPROB = -9999.0


def raw_logprobs(
    logp: torch.Tensor, tokens: list[int | None], top_logprobs: list[int | None] | None
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """The sampled token's logprob of every row (one gather) and, for rows whose request asks k
    alternatives, the k most likely (one topk over only those rows, with the largest k): a step
    where nobody asks costs the gather alone. `logp` [rows, vocab] is the raw log-softmax."""
    index = torch.tensor([t if t is not None else 0 for t in tokens], dtype=torch.long).unsqueeze(1)
    taken = logp.gather(1, index).squeeze(1).tolist()
    logprobs = [None if t is None else max(lp, MIN_LOGPROB) for t, lp in zip(tokens, taken, strict=True)]
    tops: list[list[tuple[int, float]] | None] = [None] * len(tokens)
    asking = {r: k for r, k in enumerate(top_logprobs or []) if k and tokens[r] is not None}  # row -> k
    if asking:
        k_max = min(max(asking.values()), logp.shape[-1])
        values, ids = torch.topk(logp.index_select(0, torch.tensor(list(asking))), k_max, dim=-1)  # largest first
        for (row, k), row_values, row_ids in zip(asking.items(), values.tolist(), ids.tolist(), strict=True):
            tops[row] = [(i, max(v, MIN_LOGPROB)) for i, v in zip(row_ids[:k], row_values[:k], strict=True)]
    return logprobs, tops


@dataclass(frozen=True)
class TokenBias:
    """One request's logit_bias as tensors: token ids [n] int64 and their biases [n] float32."""

    ids: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, logit_bias: dict[str, float] | None) -> TokenBias | None:
        """The tensors of a request's logit_bias (keys are token ids as strings); None when empty."""
        if not logit_bias:
            return None
        ids = torch.tensor([int(k) for k in logit_bias], dtype=torch.long)
        return cls(ids, torch.tensor(list(logit_bias.values()), dtype=torch.float32))


def has_penalties(request: GenerateRequest) -> bool:
    """True when the request's presence or frequency penalty is not 0."""
    return request.presence_penalty != 0.0 or request.frequency_penalty != 0.0


@torch.inference_mode()  # the model's logits are inference tensors: changed in place only in this mode
def adjust_logits(
    logits: torch.Tensor,
    requests: list[GenerateRequest],
    output_ids: list[list[int]] | None,
    token_biases: list[TokenBias | None] | None,
) -> torch.Tensor:
    """logits [rows, vocab] float32 with OpenAI's penalties and logit_bias applied to each row, in
    place (the step's logits are not read again; the entropy is taken before).

    For row r and token j, with c[j] the count of j in output_ids[r] (the tokens generated so
    far, not the prompt: OpenAI's definition, and vLLM's):
        logits[r, j] += bias[r][j] - c[j] * frequency_penalty[r] - (c[j] > 0) * presence_penalty[r]
    Batched and sparse: only the (row, token) cells a row generated or biases change, so a step
    costs O(tokens generated) whatever the vocabulary.
    """
    if not logits.is_contiguous():
        logits = logits.contiguous()
    cells = logits.view(-1)  # cell of (row, token): row * vocab + token
    vocab_size = logits.shape[-1]
    penalised = [r for r, req in enumerate(requests) if output_ids and output_ids[r] and has_penalties(req)]
    if output_ids and penalised:
        lengths = torch.tensor([len(output_ids[r]) for r in penalised])
        flat = torch.frombuffer(
            array.array("q", itertools.chain.from_iterable(output_ids[r] for r in penalised)), dtype=torch.long
        )
        keys = torch.tensor(penalised).index_select(0, segment_ids(lengths)) * vocab_size + flat
        keys, counts = torch.unique(keys, return_counts=True)  # each generated (row, token) once, c[j] times
        row = keys // vocab_size
        frequency = torch.tensor([req.frequency_penalty for req in requests]).index_select(0, row)
        presence = torch.tensor([req.presence_penalty for req in requests]).index_select(0, row)
        cells.index_add_(0, keys, -(counts.float() * frequency + presence))
    biased = [(r, bias) for r, bias in enumerate(token_biases or []) if bias is not None]
    if biased:
        sizes = torch.tensor([len(bias.ids) for _, bias in biased])
        keys = torch.tensor([r for r, _ in biased]).index_select(0, segment_ids(sizes)) * vocab_size
        keys += torch.cat([bias.ids for _, bias in biased])  # a request's ids are distinct (dict keys)
        cells.index_add_(0, keys, torch.cat([bias.values for _, bias in biased]))
    return logits


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """[sum(lengths)] int64: i repeated lengths[i] times, every length >= 1.

    Like torch.repeat_interleave, which measured 10-50x slower on the CPU for a few dozen
    segments. (Likewise index_select rather than tensor[index]: aten::index took ~12 ms for 16k
    indices on a loaded 2-core machine, index_select 0.02 ms.)"""
    marks = torch.zeros(int(lengths.sum()), dtype=torch.long)
    marks.index_fill_(0, lengths.cumsum(0)[:-1], 1)
    return marks.cumsum(0)


def token_entropies(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax over the last dim of `logits` [..., vocab]: token_entropy, batched."""
    return entropies_of(torch.log_softmax(logits.float(), dim=-1))


def entropies_of(logp: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each distribution given as log-probabilities over the last dim."""
    return -(logp.exp() * logp).sum(dim=-1)


def token_entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of softmax(logits) over [vocab]: the model's own uncertainty at this step,
    before temperature, truncation and watermark (a health signal of the model, not of sampling)."""
    return float(token_entropies(logits))
