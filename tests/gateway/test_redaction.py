"""The streaming PII redactor: what it detects, what it leaves, and that streaming equals whole-text."""

from __future__ import annotations

import random

import pytest

from services.gateway.guard.redaction import MAX_PATTERN_CHARS, REDACTED, Redactor, redact

ID = "11010519491231002X"
PII = [
    ID,
    ID.lower(),
    "4111 1111 1111 1111",
    "4111-1111-1111-1111",
    "4111111111111111",
    "4111-1111 1111 1111",  # mixed separators
    "4111 - 1111 - 1111 - 1111",
    "5500-0000-0000-0004",
    "13812345678",
    "138 1234 5678",
    "+86 138 1234 5678",
    "138.1234.5678",
    "0086-138-1234-5678",
    "+1 415-555-0132",
    "+1 (415) 555-0132",
    "(415) 555-0132",
    "415.555.0132",
    "415-555-0132",
    "+44 20 7946 0958",
    "+14155550132",
    "li.wei+test@example.com.cn",
    "john@x.com",
]
NOT_PII = [
    "11010519491231002Y",  # not a check char
    "110105194912310021",  # wrong check digit
    "110105194913310021",  # month 13 (check digit right for these 17 digits)
    "4111 1111 1111 1112",  # not Luhn
    "12345",
    "for i in range(10):",
    "x = 12345",
    "version 3.11.4",
    "2026-11-30",
    "1700000000000 ms",  # a 13-digit timestamp, not a card range
    "count: 1234567890",
    "pi is 138.12345678",  # a decimal, not a phone with mixed separators
    "192.168.100.200",
    "john@",
    "@example.com",
    "a@b",
]


def stream(text_deltas: list[str], max_holdback_chars: int = MAX_PATTERN_CHARS) -> tuple[str, Redactor]:
    redactor = Redactor(max_holdback_chars)
    out = "".join(redactor.feed(d) for d in text_deltas) + redactor.flush()
    return out, redactor


@pytest.mark.parametrize("pii", PII)
def test_each_pii_shape_is_redacted_whole(pii: str) -> None:
    assert redact(f"see {pii}, ok") == (f"see {REDACTED}, ok", 1)
    assert redact(pii) == (REDACTED, 1)


@pytest.mark.parametrize("text", NOT_PII)
def test_non_pii_passes_unchanged(text: str) -> None:
    assert redact(text) == (text, 0)
    assert stream(list(text))[0] == text


def test_the_id_check_digit_and_date_are_checked() -> None:
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    body = "11010519491231002"
    check = "10X98765432"[sum(int(c) * w for c, w in zip(body, weights, strict=True)) % 11]
    assert body + check == ID
    for wrong in "0123456789":
        if wrong != check:
            assert redact(body + wrong)[1] == 0
    # a right check digit over an impossible date (Feb 30) is still not an ID
    bad_date = "11010519490230001"
    bad_check = "10X98765432"[sum(int(c) * w for c, w in zip(bad_date, weights, strict=True)) % 11]
    assert redact(bad_date + bad_check)[1] == 0


@pytest.mark.parametrize(
    "text",
    ["94111111111111111", "41111111111111111", "1" + ID, ID + "1", "513812345678", "138123456789", "04155550132x"],
)
def test_digits_inside_longer_digit_runs_are_not_redacted(text: str) -> None:
    assert redact(text) == (text, 0)


def test_mixed_text_counts_each_span_and_keeps_the_rest() -> None:
    text = f"我的身份证号是{ID}，卡号 4111 1111 1111 1111, mail li.wei+test@example.com.cn. Call +1 415-555-0132!"
    out, num = redact(text)
    assert num == 4
    assert out == f"我的身份证号是{REDACTED}，卡号 {REDACTED}, mail {REDACTED}. Call {REDACTED}!"


def test_split_id_is_redacted_as_in_the_brief() -> None:
    out, redactor = stream(["My ID is 1101", "0519491231", "002X."])
    assert out == f"My ID is {REDACTED}."
    assert redactor.num_redacted == 1


def test_prose_is_emitted_without_waiting_for_flush() -> None:
    redactor = Redactor()
    assert redactor.feed("Hello world, ") == "Hello world,"
    assert redactor.held == " "  # may still be the space of " at example dot com"
    assert redactor.feed("how") == " "  # "how" may still become how@example.com
    assert redactor.feed(" are") == "how "
    assert redactor.held == "are"
    assert redactor.feed(" at") == ""  # "are at" may be the start of "are at example dot com"
    assert redactor.feed(" the") == ""
    assert redactor.feed(" cat.") == "are at the "
    assert redactor.flush() == "cat."


def test_candidates_are_held_until_decided() -> None:
    redactor = Redactor()
    assert redactor.feed("card 4111 1111 ") == "card "
    assert redactor.held == "4111 1111 "
    assert redactor.feed("1111 1111") == ""
    # up to two words after a group may still be filler before a fifth group ("... then 123")
    assert redactor.feed(" thanks") == ""
    assert redactor.feed(" for") == ""
    assert redactor.feed(" paying") == f"{REDACTED} thanks for "
    assert redactor.flush() == "paying"
    assert redactor.num_redacted == 1


def test_email_domain_may_still_grow() -> None:
    redactor = Redactor()
    assert redactor.feed("to john@x.co") == "to "
    assert redactor.feed("m.cn") == ""
    assert redactor.feed(" now") == f"{REDACTED} "


def test_window_below_the_longest_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match="max_holdback_chars"):
        Redactor(MAX_PATTERN_CHARS - 1)


@pytest.mark.parametrize("max_holdback_chars", [MAX_PATTERN_CHARS, MAX_PATTERN_CHARS + 16])
def test_held_text_never_exceeds_the_window(max_holdback_chars: int) -> None:
    rng = random.Random(7)
    redactor = Redactor(max_holdback_chars)
    text = "9" * 500 + "x" * 300 + "4111-1111-1111-1111-" * 20 + ID * 10
    out = []
    i = 0
    while i < len(text):
        size = rng.randint(1, 12)
        out.append(redactor.feed(text[i : i + size]))
        assert len(redactor.held) <= max_holdback_chars
        i += size
    assert "".join(out) + redactor.flush() == redact(text)[0]


CORPUS = [
    f"My ID is {ID}.",
    "Pay 4111 1111 1111 1111 or 5500-0000-0000-0004 now",
    "bad 4111 1111 1111 1112, ok",
    "Tel +86 138 1234 5678 / 13812345678",
    "(415) 555-0132 or +1 415-555-0132",
    "mail li.wei+test@example.com.cn.",
    "x = 12345; 2026-11-30 v3.11.4",
]


def splits_2_and_3(text: str) -> list[list[str]]:
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            out.append([text[:i], text[i:j], text[j:]])
    return out


@pytest.mark.parametrize("text", CORPUS)
def test_every_2_and_3_way_split_streams_like_whole_text(text: str) -> None:
    expected, num = redact(text)
    for deltas in splits_2_and_3(text):
        out, redactor = stream(deltas)
        assert out == expected, deltas
        assert redactor.num_redacted == num


def random_text(rng: random.Random, num_pieces: int) -> str:
    pieces = (
        PII
        + NOT_PII
        + [
            "the",
            "model",
            "says",
            " ",
            " ",
            ", ",
            ". ",
            "\n",
            "(",
            ")",
            "-",
            "+",
            "1",
            "42",
            "007",
            "x",
            "@",
            "你好",
            "，",
            "..",
            "4111",
            "2024",
            " 555",
            "abcdefghijklmnopqrstuvwxyz0123456789" * 2,
        ]
    )
    return "".join(rng.choice(pieces) + rng.choice(["", " ", "", "-", ".", "+"]) for _ in range(num_pieces))


def random_split(rng: random.Random, text: str) -> list[str]:
    deltas, i = [], 0
    while i < len(text):
        size = rng.choice([1, 1, 2, 3, 4, 7, 15, 40])
        deltas.append(text[i : i + size])
        i += size
    return deltas


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_of_long_texts_stream_like_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    text = random_text(rng, 80)
    expected, num = redact(text)
    for max_holdback_chars in (MAX_PATTERN_CHARS, MAX_PATTERN_CHARS + 40):
        for _ in range(5):
            out, redactor = stream(random_split(rng, text), max_holdback_chars)
            assert out == expected
            assert redactor.num_redacted == num
