"""The sampler's penalties and logit bias on hand-made logits: OpenAI's formula, row by row."""

from __future__ import annotations

import collections

import pytest
import torch

from services.worker.engine.sampler import TokenBias, adjust_logits, sample, sample_batch, segment_ids

from .factories import make_request

VOCAB = 12


def hand_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """float32 [rows, VOCAB], random but fixed."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def openai_formula(
    row: torch.Tensor, output_ids: list[int], presence: float, frequency: float, bias: dict[str, float] | None = None
) -> torch.Tensor:
    """OpenAI's definition, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    counts = collections.Counter(output_ids)
    expected = row.clone()
    for j in range(VOCAB):
        expected[j] -= counts[j] * frequency + (1.0 if counts[j] > 0 else 0.0) * presence
        expected[j] += (bias or {}).get(str(j), 0.0)
    return expected


def test_segment_ids_repeat_each_index_its_length():
    assert segment_ids(torch.tensor([2, 1, 3])).tolist() == [0, 0, 1, 2, 2, 2]
    assert segment_ids(torch.tensor([4])).tolist() == [0, 0, 0, 0]


def test_penalties_follow_openais_formula():
    logits = hand_logits(1)
    history = [3, 3, 3, 5, 7, 3]
    request = make_request(presence_penalty=0.5, frequency_penalty=0.3)
    adjusted = adjust_logits(logits.clone(), [request], [history], None)
    torch.testing.assert_close(adjusted[0], openai_formula(logits[0], history, 0.5, 0.3))
    # token 3 (four times) loses 4 * 0.3 + 0.5, a token never generated nothing
    assert float(logits[0, 3] - adjusted[0, 3]) == pytest.approx(1.7)
    assert adjusted[0, 4] == logits[0, 4]


def test_penalties_change_the_distribution_as_the_formula_says():
    """At temperature 1, p'(j) is proportional to p(j) * exp(-(c[j] * frequency + (c[j] > 0) * presence))."""
    logits = hand_logits(1, seed=1)
    history = [1, 1, 2]
    request = make_request(presence_penalty=1.0, frequency_penalty=0.5)
    probs = torch.softmax(adjust_logits(logits.clone(), [request], [history], None)[0], dim=-1)
    weights = torch.softmax(logits[0], dim=-1).clone()
    weights[1] *= torch.exp(torch.tensor(-(2 * 0.5 + 1.0)))
    weights[2] *= torch.exp(torch.tensor(-(1 * 0.5 + 1.0)))
    torch.testing.assert_close(probs, weights / weights.sum())


def test_negative_penalties_favour_what_was_generated():
    logits = torch.zeros(1, VOCAB)
    adjusted = adjust_logits(logits.clone(), [make_request(presence_penalty=-2.0)], [[9]], None)
    assert int(torch.argmax(adjusted[0])) == 9 and float(adjusted[0, 9]) == 2.0


def test_batched_rows_with_different_penalties_do_not_interfere():
    logits = hand_logits(4, seed=2)
    requests = [
        make_request(presence_penalty=2.0),
        make_request(),  # no penalty: its history must not matter
        make_request(frequency_penalty=1.5, logit_bias={"0": 10.0}),
        make_request(presence_penalty=-1.0, frequency_penalty=0.25),
    ]
    histories = [[1, 1, 4], [1, 2, 3], [4, 4, 4, 0], [11]]
    adjusted = adjust_logits(logits.clone(), requests, histories, [TokenBias.of(r.logit_bias) for r in requests])
    for row, (request, history) in enumerate(zip(requests, histories, strict=True)):
        expected = openai_formula(
            logits[row], history, request.presence_penalty, request.frequency_penalty, request.logit_bias
        )
        torch.testing.assert_close(adjusted[row], expected)
        alone = adjust_logits(logits[row : row + 1].clone(), [request], [history], [TokenBias.of(request.logit_bias)])
        torch.testing.assert_close(adjusted[row], alone[0])
    assert torch.equal(adjusted[1], logits[1])


def test_rows_without_penalties_or_bias_are_untouched():
    logits = hand_logits(3)
    before = logits.clone()
    requests = [make_request(frequency_penalty=2.0), make_request(), make_request(logit_bias={"3": -100.0})]
    adjusted = adjust_logits(logits, requests, [[1, 2], [1, 2], []], [None, None, TokenBias.of({"3": -100.0})])
    assert torch.equal(adjusted[1], before[1])
    assert not torch.equal(adjusted[0], before[0]) and not torch.equal(adjusted[2], before[2])
    plain = [make_request(), make_request()]
    assert torch.equal(adjust_logits(before.clone()[:2], plain, [[1], [2]], [None, None]), before[:2])


def test_logit_bias_minus_100_bans_a_token():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 3.0  # the model's favourite, about 60% of the mass
    request = make_request(temperature=1.0, logit_bias={"5": -100.0})
    bias = TokenBias.of(request.logit_bias)
    banned = adjust_logits(logits.clone(), [request], [[]], [bias])[0]
    draws = {sample(banned, request, torch.Generator().manual_seed(s)) for s in range(300)}
    assert 5 not in draws and len(draws) > 5
    unbiased = {sample(logits[0], request, torch.Generator().manual_seed(s)) for s in range(300)}
    assert 5 in unbiased


def test_logit_bias_plus_100_forces_a_token_at_temperature_0():
    logits = hand_logits(2, seed=3)
    least_likely = int(torch.argmin(logits[0]))
    forced = make_request(temperature=0.0, logit_bias={str(least_likely): 100.0})
    plain = make_request(temperature=0.0)
    tokens = sample_batch(
        logits,
        [forced, plain],
        [torch.Generator()] * 2,
        [None, None],
        [[], []],
        [TokenBias.of(forced.logit_bias), None],
    ).tokens
    assert tokens == [least_likely, int(torch.argmax(logits[1]))]


def test_greedy_rows_honour_penalties():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    penalised, plain = make_request(temperature=0.0, frequency_penalty=2.0), make_request(temperature=0.0)
    tokens, entropies, _, _ = sample_batch(
        logits, [penalised, plain], [torch.Generator()] * 2, [None, None], [[1], [1]], [None, None]
    )
    assert tokens == [2, 1]  # 5 - 2 < 4: the penalised row's greedy choice moves
    assert entropies[0] == pytest.approx(entropies[1])  # the entropy is the model's own, before penalties


def test_random_rows_honour_penalties_and_bias_with_a_watermark():
    """A row that samples (temperature > 0, watermark bias) gets the adjusted logits too."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 8.0  # ~99.9% of the mass
    request = make_request(temperature=1.0, presence_penalty=2.0, logit_bias={"2": -20.0})
    watermark = torch.zeros(VOCAB)
    draws = [
        sample_batch(
            logits.clone(),
            [request],
            [torch.Generator().manual_seed(s)],
            [watermark],
            [[2]],
            [TokenBias.of(request.logit_bias)],
        )[0][0]
        for s in range(100)
    ]
    assert 2 not in draws


def test_same_seed_and_history_give_the_same_tokens():
    """Penalties are a pure function of the output so far: a regenerated request draws the same."""
    logits = hand_logits(1, seed=4)
    request = make_request(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.4, seed=11)

    def draw() -> list[int | None]:
        generator = torch.Generator().manual_seed(request.effective_seed)
        history: list[int] = []
        for _ in range(20):
            token = sample_batch(logits.clone(), [request], [generator], [None], [history], [None])[0][0]
            assert token is not None
            history.append(token)
        return list(history)

    first = draw()
    assert draw() == first and len(set(first)) > 1


@pytest.mark.parametrize(
    "params", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300}]
)
def test_vanishing_temperature_or_top_p_picks_the_most_likely_token(params):
    # 1e-300 overflows logits / temperature to inf, and rounds to 0 in float32 (every token dropped by
    # top_p): either crashed the engine, and a redelivered request crashed every worker that took it.
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    request = make_request("x", **params)
    picks = {sample(logits.clone(), request, torch.Generator().manual_seed(s)) for s in range(20)}
    assert picks == {1}
    rows = sample_batch(logits.clone()[None], [request], [torch.Generator().manual_seed(0)], [None])
    assert rows.tokens == [1]
