"""Token sampling: temperature, top-k, top-p, per-request seeded generator, watermark bias."""

from __future__ import annotations

import torch

from schemas.messages import GenerateRequest


class NonFiniteLogits(ValueError):
    """The model produced NaN or inf logits for a request; that request fails, others go on."""


def sample(
    logits: torch.Tensor, request: GenerateRequest, generator: torch.Generator, bias: torch.Tensor | None = None
) -> int:
    """Pick the next token from one row of float32 logits [vocab].

    temperature 0 is greedy. The generator is the request's own, seeded from its seed, so the
    same request yields the same tokens whatever else shares the batch. `bias` [vocab] (the
    watermark's delta on green tokens) is added after the temperature, so delta is the shift in
    log-probability whatever the temperature; it is deterministic too, so tokens stay so.
    """
    if not torch.isfinite(logits).all():
        raise NonFiniteLogits("the model produced non-finite logits")
    if request.temperature == 0.0:
        return int(torch.argmax(logits if bias is None else logits + bias))
    logits = logits / request.temperature
    if bias is not None:
        logits = logits + bias
    if request.top_k > 0 and request.top_k < logits.shape[-1]:
        kth = torch.topk(logits, request.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if request.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # drop tokens once the mass before them already reaches top_p (the first always stays)
        drop = (cumulative - sorted_probs) >= request.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    requests: list[GenerateRequest],
    generators: list[torch.Generator],
    biases: list[torch.Tensor | None],
) -> tuple[list[int | None], list[float]]:
    """Next tokens and model entropies of a step's rows: logits [rows, vocab] float32.

    Returns (tokens, entropies), one per row; a row's token is None when its logits are not
    finite (that request fails). The checks and the entropy run once over the batch, greedy rows
    without a bias take one batched argmax; only rows that draw at random (or carry a watermark
    bias) go through `sample`, each with its own generator, so a request's tokens do not depend
    on what shares its batch.
    """
    # a finite row sum means every logit is finite (NaN and inf propagate): one cheap reduction,
    # and the element-wise check only for the rows it flags
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    for row in [r for r, ok in enumerate(finite) if not ok]:
        finite[row] = bool(torch.isfinite(logits[row]).all())
    entropies = token_entropies(logits).tolist()
    argmax = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int | None] = []
    for row, (request, generator, bias) in enumerate(zip(requests, generators, biases, strict=True)):
        if not finite[row]:
            tokens.append(None)
        elif request.temperature == 0.0 and bias is None:
            tokens.append(argmax[row])
        else:
            tokens.append(sample(logits[row], request, generator, bias))
    return tokens, entropies


def token_entropies(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax over the last dim of `logits` [..., vocab]: token_entropy, batched."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of softmax(logits) over [vocab]: the model's own uncertainty at this step,
    before temperature, truncation and watermark (a health signal of the model, not of sampling)."""
    return float(token_entropies(logits))
