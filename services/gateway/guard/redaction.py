"""Streaming PII redaction of a model's output: each detected span becomes the literal "[REDACTED]".

Matching runs on the normalised view of the text (normalize.py: invisible characters removed,
NFKC, look-alike letters folded; docs/design.md, "Guards match a normalised view"), and each span
found there is mapped back to the original characters it came from: those are replaced, and every
other character leaves byte-identical (invisible characters and marks right after a value go
with it). So full-width digits ("４１１１") and digits of other scripts ("٤١١١"), keycaps, no-break,
thin or ideographic spaces and en dashes between groups, zero-width characters inside a number or
an address, and Cyrillic or Greek letters in an address are caught like their plain forms.

What is detected (every number on digit-run boundaries: never preceded or followed by a digit, so
no part of a longer digit run is taken; the whole span, separators included, is replaced):

- Chinese resident ID: 18 chars, `[1-9]` + 16 digits + check char (digit or X/x), in one run or in
  2 to 9 groups of 1-8 (6-8-4 "110105 19491231 002X", 6-4-4-4, 4-4-4-4-2...), each gap one or two
  spaces, a dot or a hyphen (spaces around it allowed); when the groups run on, the first groups
  that hold exactly 18 chars. Redacted only if the ISO 7064 MOD 11-2 check char is right and chars
  7-14 are a real date YYYYMMDD, 1900-2099.
- Bank card: 13-19 digits starting with 2-6 (the issuer ranges of Visa, Mastercard, Amex, JCB,
  UnionPay, Discover), either one run or groups of 4 then 3-6 digits (3 to 5 groups), each gap one
  or two spaces, a dot or a hyphen (spaces around it allowed; gaps may differ): "4111 1111 1111
  1111", "4111.1111.1111.1111", "4111 - 1111 - 1111 - 1111", "3782-822463-10005"; "/" and "_"
  also join a card's groups ("4111/1111/1111/1111"); or two halves, 8 then 5-11 digits ("41111111
  11111111"); or every digit spaced out ("4 1 1 1 ... 1": exactly 13-19 single digits joined by one
  space, not inside a longer such run: it looks two chars behind). Luhn-valid only;
  when the groups run on ("4111 1111 1111 1111 123", a CVV after the card), the longest
  Luhn-valid run of the first 3-5 groups is the card. Loose gaps (issue 35): between groups of 4
  then 3-6 digits, a gap may also be 1-4 of space, tab, newline, "," ";" ":" around at most two
  filler words of 1-10 Latin letters ("4111\n1111\n1111\n1111", "4111 then 1111 then...",
  "4242, then 4242, next 4242 and finally 4242"); such a card is not one when two of its groups
  are years (1900-2099) or its groups count up by 1-100 ("rooms 2101, 2102, 2103 and 2104"). And
  2-digit groups: 13-19 digits as pairs joined by one consistent space, dot or hyphen, the last
  group 1-3 digits ("41 11 11 11 11 11 11 11", "37 82 82 24 63 10 00 5").
- IBAN: two capital letters, two check digits, then groups of 4 letters or digits (2-7 of them)
  and a last group of 1-4, joined by one consistent space or hyphen or nothing: "DE89 3704 0044
  0532 0130 00", "GB82 WEST 1234 5698 7654 32", "NL91ABNA0417164300". Redacted only when the
  country is one that issues IBANs, the length is that country's, and the check digits are right
  (ISO 13616: mod 97 == 1).
- Phone, three shapes only, so that years, counts, versions and constants pass:
  - CN mobile `1[3-9]d d{4} d{4}`, groups joined by nothing or one consistent space, dot or
    hyphen, with an optional "+86"/"0086" prefix: "13812345678", "+86 138 1234 5678",
    "0086-138-1234-5678", "138.1234.5678".
  - International: "+" country code (1-3 digits), then 2-5 groups of 1-8 digits each after a space,
    dot or hyphen, or in parentheses; or the compact "+" and 8-15 digits; 8-15 digits in all (E.164):
    "+1 415-555-0132", "+44 20 7946 0958", "+1 (415) 555-0132", "+14155550132".
  - NANP without "+": optional "1 ", then "(415) 555-0132", or 3-3-4 with one consistent separator
    (space, dot, hyphen): "415-555-0132", "415.555.0132". Area code and exchange start with 2-9.
- E-mail: local@domain.tld, local part `[A-Za-z0-9._%+-]`, dot-separated domain labels, a 2-24
  letter TLD; it must start a word of e-mail characters that is at most 64 chars long. The
  ideographic full stop "。" (U+FF61 is one after NFKC) separates labels too, but before the TLD
  only when that is a common one, so "alice@example.com。Thanks" ends at "com".
- Encoded e-mail: "@" as "%40", "&#64;", "&#x40;", "&commat;" and "." as "%2e", "&#46;",
  "&#x2e;", "&period;" (case-insensitive, leading zeros allowed): "alice%40example.com",
  "alice&#64;example&#46;com"; local part up to 32 chars, up to 3 labels and a TLD.
- Spaced-out e-mail: every char a token of its own, one space between: "a l i c e @ e x a m p l e
  . c o m"; local part up to 20 chars, up to 3 labels of up to 16 and a 2-6 letter TLD; the run
  starts after no e-mail char and ends before no letter, digit or lone char after a space.
- Spelled-out e-mail (case-insensitive): "@" written as "[at]", "(at)", "{at}", "<at>", "[@]"
  (spaces around and inside allowed), " @ " or a bare " at "; "." as "[dot]", "(dot)", "[.]",
  "(.)", " . " or a bare " dot ": "alice at example dot com", "alice [at] example [dot] com", "alice(at)example(dot)com",
  "alice@example[.]com". A local part of up to 32 chars (and one spelled " dot " in it), up to 3
  labels of up to 24 chars and a TLD. A bare " dot " must end in a common TLD (com, net, org, io,
  cn, uk...), and after a bare " at " the dots must be spelled out too, so "look at example.com"
  and "look at the dot in the corner" stay prose; "works at google dot com" is redacted (it reads
  as an address, and is one).

Streaming. Redactor keeps the not-yet-emitted text and, after each feed, emits the longest prefix
that is final: no match could start in it and still change with text yet to come. A match is at
most MAX_PATTERN_CHARS long in the view (its look-ahead included) and its detectors look at most
two chars behind, so whether a match starts at view position i is decided by
view[i-2 : i+MAX_PATTERN_CHARS]. A "cut" is a view char no match can contain: anything outside
`[A-Za-z0-9._%+@()[]{}<>/&#;。-]`, space, tab, newline, "," and ":", or a space, tab, newline, "," or
":" that is not in a loose card gap (a group of 3-6 digits at most two filler words before it and,
counting those, at most two words to the next digit after it, or the text not known that far) nor
a space between an IBAN's groups (an IBAN's start up to it) nor, for a space, inside a number
(between two of digit, ")", "(", "-", ".", space) nor next to a spelled-out marker (a bracket, or the word
before or after it is "at", "dot", "@" or ".", or is the unfinished last word and may still become
one) nor between two one-char tokens of a spaced-out address ("a l i c e", with an "@" near enough
or the text not known far enough yet). Everything up to the
last cut is final and is emitted at once; the trailing candidate run after it (a word that may
become an e-mail, digits and separators that may become an ID, card or phone, a phrase around
"at"/"dot") is held. Prose therefore flows with at most one word of delay, two or three around
the words "at" and "dot", three after a number of 3-6 digits (it may be a card group with filler
words to come). The view is computed char by char, so the view of the held text is the
held part of the whole text's view; the redactor keeps the last two emitted view chars as look-behind
context, and never cuts inside the view of one original char.

Hold-back bound: when the held view grows past max_holdback_chars (>= MAX_PATTERN_CHARS), every
start before its last MAX_PATTERN_CHARS chars is decided too, so that part is emitted, with the
complete matches it holds redacted. The held view never exceeds max_holdback_chars (plus the rest
of one char whose NFKC form is several chars). Invisible characters take no room in the view, so
a run of more than MAX_INVISIBLE_RUN of them in one place counts as a break (a cut): what is held
stays bounded, and a value padded with that many invisible characters in one place is not caught.

Guarantee: for any split of a text into deltas, "".join(feed(d) ...) + flush() == redact(text)[0]
(tests/gateway/test_redaction.py, test_redaction_variants.py: property tests with hypothesis).

Cost (thread CPU, min of 9 runs of 10k-20k feeds of short tokens, Python 3.11 on the shared 2-core
dev box, old and new code in the same run; /tmp scripts, not committed): prose ~7 us a feed()
(was ~4 before normalising), tokens building cards 12-20 us (was 5-8), Chinese ~6 us (was ~5-6),
one endless word held at the full window ~10 us (was 20-29); whole-text redact() of 227k chars of
prose ~46 ms (was 68-79), of 40k Chinese chars 9-10 ms (was 8-13). A region with no digit, "+",
"@", bracket or " at " skips every detector; the held text's view is kept per delta
(normalize.FoldBuffer), ASCII and one-for-one text without a per-char loop. Worst case seen: a
phrase of "at"/"dot" words held at the full window, ~0.2 ms a feed (wall, loaded box); each delta
a digit and 8 invisible characters, ~45 us. With the slash/underscore/8-8/spaced cards, encoded
and spaced-out addresses (same box, same method, 5 runs each, interleaved; loaded by a CI run, so
+-40%): prose 7-12 us (old code 7-12), card tokens 13-20 us (11-16), Chinese 5-9 us (4-7),
one-char words "s p e l l e d" 38 us (8; held up to 42 chars while an "@" may still come),
whole-text of 340k chars of prose 105-130 ms (61-117). With loose card gaps and IBANs (issue 35,
same method, 5 runs of 20k feeds, old code alternately): prose 7.7-11 us (5.8-8.9), card tokens
15-19 us (10-16), tokens mixing numbers and short words 27-51 us (12-23; up to two words after a
group are held and re-checked each feed); a separator far from any digit skips both checks, and a
run of groups (or an IBAN's start) is skipped whole (_chains). Worst cases seen, 4-char deltas of
a text that keeps the window full: "4111 then " repeated ~75 us a feed (old code 22), "GB82 WEST "
repeated ~140 us (13), "41 " repeated ~140 us (100).
O(len(held) + len(delta)) per call, the regexes compiled once at import.
"""

from __future__ import annotations

import re
import re._parser as re_parser  # getwidth(): the longest match a detector can make
from collections.abc import Callable
from datetime import date
from itertools import pairwise
from typing import NamedTuple

from services.gateway.guard.normalize import FoldBuffer, fold_map

REDACTED = "[REDACTED]"
MAX_PATTERN_CHARS = 200  # the longest span any detector can match, plus its look-ahead (checked below)
MAX_INVISIBLE_RUN = 8  # invisible characters in one place that still join (more: a break)
_FEW_STARTS = 8  # below this many start positions, _next_match tries each instead of searching

_EMAIL_CHARS = r"A-Za-z0-9._%+\-"
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_SOFT_CHARS = _ALNUM | frozenset("._%+-@()[]{}<>/&#;\u3002")
_SPACED_CHARS = _ALNUM | frozenset(
    "._%+-@"
)  # the one-char tokens of "a l i c e @ e x a m p l e . c o m"  # every char but " " that a match may contain
_SOFT_OR_SPACE = "".join(sorted(_SOFT_CHARS)) + " "
# chars that may sit in a loose card gap (between groups: newlines, commas, filler words); each
# may be a cut or not, like a space (_last_cut_end); ";" is soft anyway (HTML references)
_LOOSE_SEPS = " \t\r\n,;:"
_SOFT_OR_SEP = _SOFT_OR_SPACE + "\t\r\n,:"
_SEP_RX = re.compile(r"[ \t\r\n,:]")  # the chars _last_cut_end decides one by one
_BEFORE_SPACE = frozenset("0123456789)-. ")  # a space inside a number always sits between these...
_AFTER_SPACE = frozenset("0123456789(-. ")  # ...and these
_OPENING = frozenset("[({<")
_CLOSING = frozenset("])}>")
_MARKERS = frozenset(("at", "dot", "@", "."))  # spelled-out "@" and "." between spaces
_MARKER_PREFIXES = frozenset(("", "a", "at", "d", "do", "dot", "@", "."))
_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK_CHARS = "10X98765432"
_NOT_ID_CHARS = re.compile(r"[^0-9Xx]")
_DIGIT_RUN = re.compile(r"[0-9]+")
_ID_GROUP = re.compile(r"[0-9]+[Xx]?")
_GAP = r"(?: ?[.-] ?| {1,2})"  # between two groups of digits: ".", "-", " - ", one or two spaces
_CARD_GAP = r"(?: ?[.-] ?| {1,2}|[/_])"  # a card's groups may also be joined by "/" or "_"
# a loose gap between two card groups: up to 4 of space, tab, newline, ",", ";", ":" around at most
# two filler words of 1-10 Latin letters ("4111 then 1111", "4111,\n1111", "4111 and then 1111")
_SEP_RUN = r"[ \t\r\n,;:]{1,4}"
_FILLER = r"[A-Za-z]{1,10}"
_LOOSE_GAP = rf"(?:{_CARD_GAP}|(?:{_SEP_RUN}{_FILLER}){{0,2}}{_SEP_RUN})"
# is the text before a separator the end of a card group and at most two filler words?
_LOOSE_BEHIND = re.compile(rf"(?:{_SEP_RUN}{_FILLER}){{0,2}}[ \t\r\n,;:]{{0,3}}")  # digits .. separator
# may the text after it still bring the next group, with the filler words left (2 less those behind):
# digits after at most that many words...
_LOOSE_AHEAD = tuple(re.compile(rf"[ \t\r\n,;:]{{0,3}}(?:{_FILLER}{_SEP_RUN}){{0,{k}}}[0-9]") for k in range(3))
# ...or, the text ending first, not known yet
_LOOSE_PARTIAL = (re.compile(r"[ \t\r\n,;:]{0,3}"),) + tuple(
    re.compile(rf"[ \t\r\n,;:]{{0,3}}(?:{_FILLER}{_SEP_RUN}){{0,{k - 1}}}[A-Za-z]{{0,10}}[ \t\r\n,;:]{{0,4}}")
    for k in (1, 2)
)
_LETTERS = re.compile("[A-Za-z]+")
_LOOSE_LOOK = 2 * (4 + 10) + 3  # the most chars _LOOSE_BEHIND spans: the group's last digit is this close
# IBAN: country, 2 check digits, then 11-30 letters and digits in groups of 4 (one consistent
# space or hyphen, or none), the last 1-4; uppercase (as printed), checked mod 97 (ISO 13616)
_IBAN_START = re.compile(r"[A-Z]{2}[0-9]{2}")  # an IBAN's start before a space between its groups...
_IBAN_BEHIND = re.compile(r"[A-Z0-9 -]{0,40}")  # ...then its groups (looser than they are: holds, never cuts)
_IBAN_LOOK = 4 + 40  # the most chars from an IBAN's start to a space inside it
_DIGIT_LOOK = max(_LOOSE_LOOK, _IBAN_LOOK)
# Runs whose every separator inside joins (_in_loose_card / _in_iban would say so): a chain of card
# groups of 3-6 digits with loose gaps, an IBAN's start and what may follow it. _last_cut_end skips
# them whole, so a held window full of groups costs a few regex scans, not a check per separator.
_LOOSE_CHAIN = re.compile(rf"(?<![0-9])[0-9]{{3,6}}(?:(?:{_SEP_RUN}{_FILLER}){{0,2}}{_SEP_RUN}[0-9]{{3,6}}(?![0-9]))+")
_IBAN_CHAIN = re.compile(r"[A-Z]{2}[0-9]{2}[A-Z0-9 -]{1,40}")
_FEW_SEPS = 4  # below this many separators to decide, no chain is looked for
_IBAN_LENGTHS = {
    "AD": 24,
    "AE": 23,
    "AL": 28,
    "AT": 20,
    "AZ": 28,
    "BA": 20,
    "BE": 16,
    "BG": 22,
    "BH": 22,
    "BR": 29,
    "BY": 28,
    "CH": 21,
    "CR": 22,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "DO": 28,
    "EE": 20,
    "EG": 29,
    "ES": 24,
    "FI": 18,
    "FO": 18,
    "FR": 27,
    "GB": 22,
    "GE": 22,
    "GI": 23,
    "GL": 18,
    "GR": 27,
    "GT": 28,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IL": 23,
    "IQ": 23,
    "IS": 26,
    "IT": 27,
    "JO": 30,
    "KW": 30,
    "KZ": 20,
    "LB": 28,
    "LC": 32,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MD": 24,
    "ME": 22,
    "MK": 19,
    "MR": 27,
    "MT": 31,
    "MU": 30,
    "NL": 18,
    "NO": 15,
    "PK": 24,
    "PL": 28,
    "PS": 29,
    "PT": 25,
    "QA": 29,
    "RO": 24,
    "RS": 22,
    "SA": 24,
    "SC": 31,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "ST": 25,
    "SV": 28,
    "TL": 23,
    "TN": 24,
    "TR": 26,
    "UA": 29,
    "VA": 22,
    "VG": 24,
    "XK": 20,
}


def _is_valid_id(span: str) -> bool:
    if len(span) != 18 or not span[:17].isdigit():
        return False
    total = sum(int(c) * w for c, w in zip(span, _ID_WEIGHTS, strict=False))  # the 17 weighted digits of 18
    if _ID_CHECK_CHARS[total % 11] != span[17].upper():
        return False
    year, month, day = int(span[6:10]), int(span[10:12]), int(span[12:14])
    if not 1900 <= year <= 2099:
        return False
    try:
        date(year, month, day)
    except ValueError:
        return False
    return True


def _id_length(span: str) -> int:
    """The span, or its first groups, when they hold exactly 18 ID chars that check out."""
    num_chars = 0
    for group in _ID_GROUP.finditer(span):
        num_chars += len(group.group())
        if num_chars >= 18:
            prefix = span[: group.end()]
            return len(prefix) if num_chars == 18 and _is_valid_id(_NOT_ID_CHARS.sub("", prefix)) else 0
    return 0


def _is_luhn(digits: str) -> bool:
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for k, c in enumerate(reversed(digits)):
        d = int(c)
        if k % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_length(span: str) -> int:
    """The longest Luhn-valid card the span starts with: the whole run, or its first 3-5 groups
    (a card followed by one more group, "4111 1111 1111 1111 123", is a card)."""
    groups = list(_DIGIT_RUN.finditer(span))
    if len(groups) == 1:
        return len(span) if _is_luhn(span) else 0
    for k in range(len(groups), 1, -1):  # 2 groups: only the 8-8 shape holds 13 digits
        if _is_luhn("".join(g.group() for g in groups[:k])):
            return groups[k - 1].end()
    return 0


def _loose_card_length(span: str) -> int:
    """A card whose groups may be split by newlines, commas or filler words: as _card_length, but
    when a gap holds more than the plain separators, not a list of years ("2019, then 2020...") nor
    of numbers that count up ("rooms 2101, 2102, 2103 and 2104")."""
    length = _card_length(span)
    card = span[:length]
    if length and any(c.isalpha() or c in "\t\r\n,;:" for c in card):
        groups = [int(g) for g in _DIGIT_RUN.findall(card)]
        years = sum(1 for g in groups if 1900 <= g <= 2099)
        ascending = all(0 < b - a <= 100 for a, b in pairwise(groups))  # room or line numbers in a row
        if years >= 2 or ascending:
            return 0
    return length


def _iban_length(span: str) -> int:
    """The span, when it is an IBAN of its country's length whose check digits are right (mod 97)."""
    compact = span.replace(" ", "").replace("-", "")
    if _IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return 0
    moved = compact[4:] + compact[:4]
    return len(span) if int("".join(str(int(c, 36)) for c in moved)) % 97 == 1 else 0


def _e164_length(span: str) -> int:
    return len(span) if 8 <= sum(c.isdigit() for c in span) <= 15 else 0


def _whole(span: str) -> int:
    return len(span)


def _spaced_card_length(span: str) -> int:
    return len(span) if _is_luhn(span.replace(" ", "")) else 0


def _encoded_length(span: str) -> int:
    """An encoded address needs an encoded "@" or "." (plain ones are the plain detector's)."""
    return len(span) if _ENCODED_HINT.search(span) else 0


def _spelled_length(span: str) -> int:
    """Spelled-out addresses need a marker that is not plain "@" / "." (those are the plain
    e-mail detector's, with its own word bound)."""
    return len(span) if any(c in " []{}()<>" for c in span) else 0


class _Detector(NamedTuple):
    rx: re.Pattern[str]
    length: Callable[[str], int]  # length of the valid span the match starts with; 0: none
    hint: re.Pattern[str]  # every match contains a match of this (cheap) pattern
    lookahead: int = 1  # chars its pattern reads past the end of a match
    max_chars: int | None = None  # its longest match when a look-ahead, not the pattern, bounds it


def _bracketed(inner: str) -> str:
    inner = rf" ?(?:{inner}) ?"
    return rf" ?(?:\[{inner}\]|\({inner}\)|\{{{inner}\}}|<{inner}>) ?"


_ATOM = r"[A-Za-z0-9_%+-](?:[A-Za-z0-9._%+-]{0,30}[A-Za-z0-9_%+-])?"
# a label of the plain detector; "。" (U+3002, and U+FF61 after NFKC) is a dot between labels,
# but before a final label only when that is a common TLD: "alice@example.com。Thanks" ends at "com"
_DOMAIN_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,22}[A-Za-z0-9])?"
_B_AT, _B_DOT = _bracketed("at|@"), _bracketed(r"dot|\.")
_TLDS = r"(?:com|net|org|edu|gov|mil|info|biz|io|ai|dev|app|cn|uk|de|fr|jp|ru|ca|au|nl|es|ch|se|br|kr|hk|tw|sg|eu)"
_END = r"(?![A-Za-z0-9-])(?!\.[A-Za-z0-9])"
_LOCAL = rf"(?<![A-Za-z0-9._%+\-]){_ATOM}(?:(?:{_B_DOT}| dot ){_ATOM})?"
# after "@", " @ " or a bracketed [at]: any dots; a final spelled " dot " needs a listed TLD
_SPELLED_AT = (
    rf"{_LOCAL}(?:{_B_AT}| @ |@){_LABEL}(?:(?:\.| \. |{_B_DOT}| dot ){_LABEL}){{0,2}}"
    rf"(?:(?:\.| \. |{_B_DOT})[A-Za-z]{{2,12}}| dot {_TLDS}){_END}"
)
# after a bare " at ": spelled dots only, so "look at example.com" stays prose
_BARE_AT = rf"{_LOCAL} at {_LABEL}(?:(?:{_B_DOT}| dot ){_LABEL}){{0,2}}(?:{_B_DOT}[A-Za-z]{{2,12}}| dot {_TLDS}){_END}"

# "@" and "." percent-encoded or as HTML character references: "alice%40example.com",
# "alice&#64;example.com", "alice&#x40;example&#46;com", "alice&commat;example&period;com"
_ENC_AT = r"(?:@|%40|&#0{0,3}64;|&#x0{0,3}40;|&commat;)"
_ENC_DOT = r"(?:\.|%2e|&#0{0,3}46;|&#x0{0,3}2e;|&period;)"
_ENCODED = (
    rf"(?<![A-Za-z0-9._%+\-@&#;])[A-Za-z0-9._%+\-]{{1,32}}{_ENC_AT}"
    rf"{_LABEL}(?:{_ENC_DOT}{_LABEL}){{0,2}}{_ENC_DOT}[A-Za-z]{{2,12}}(?![A-Za-z0-9-])(?!{_ENC_DOT}[A-Za-z0-9])"
)
# every char spaced out: "a l i c e @ e x a m p l e . c o m"; each token is one char, the first
# not after another such char, the last not before a letter or digit, nor a lone one after a space
_SPACED = (
    r"(?<![A-Za-z0-9._%+\-@])[A-Za-z0-9](?: [A-Za-z0-9._%+\-]){0,19} @ "
    r"[A-Za-z0-9](?: [A-Za-z0-9-]){0,15}(?: \. [A-Za-z0-9](?: [A-Za-z0-9-]){0,15}){0,2}"
    r" \. [A-Za-z](?: [A-Za-z]){1,5}(?![A-Za-z0-9])(?! [A-Za-z0-9](?![A-Za-z0-9]))"
)
# a space inside a _SPACED match has its "@" at most this far after it (20 local tokens)...
_SPACED_AT_AFTER = 2 * 20
# ...or at most this far before it (" " + a 31-char label + 2 more of " . " and 31 + " . " and 11)
_SPACED_AT_BEFORE = 1 + 31 + 2 * 34 + 14

_DIGIT, _PLUS, _AT_SIGN = re.compile("[0-9]"), re.compile(r"\+"), re.compile("@")
_SPELLED_HINT, _BARE_HINT = re.compile(r"[@\[({<]"), re.compile(" at ", re.IGNORECASE | re.ASCII)
_SPACED_DIGITS_HINT = re.compile("[2-6] [0-9] [0-9] [0-9] ")
_ENCODED_HINT, _SPACED_HINT = re.compile(r"%40|%2e|&", re.IGNORECASE), re.compile(" @ ")
_ANY_HINT = re.compile(r"[0-9+@\[({<&]| at |%2e", re.IGNORECASE | re.ASCII)  # one of the hints above

# Every pattern looks at most 2 chars behind its start and `lookahead` chars past its end.
_DETECTORS = (
    _Detector(
        re.compile(rf"(?<![0-9])[1-9](?:[0-9]{{16}}[0-9Xx]|[0-9]{{0,7}}(?:{_GAP}[0-9]{{1,8}}){{1,8}}[Xx]?)(?![0-9])"),
        _id_length,
        _DIGIT,
    ),
    _Detector(
        re.compile(
            rf"(?<![0-9])(?:[2-6][0-9]{{12,18}}"
            rf"|[2-6][0-9]{{3}}{_LOOSE_GAP}[0-9]{{3,6}}(?:{_LOOSE_GAP}[0-9]{{3,6}}){{1,3}}"
            rf"|[2-6][0-9]{{7}}{_CARD_GAP}[0-9]{{5,11}}"  # 8-8: "41111111 11111111"
            r"|[2-6][0-9](?P<p>[ .-])[0-9]{2}(?:(?P=p)[0-9]{2}){4,7}(?:(?P=p)[0-9]{1,3})?)(?![0-9])"  # "41 11 11..."
        ),
        _loose_card_length,
        _DIGIT,
    ),
    _Detector(
        re.compile(
            r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?P<i>[ -]?)[A-Z0-9]{4}(?:(?P=i)[A-Z0-9]{4}){1,6}"
            r"(?:(?P=i)[A-Z0-9]{1,4})?(?![A-Za-z0-9])"
        ),
        _iban_length,
        _DIGIT,
    ),
    _Detector(  # every digit spaced: exactly 13-19 single digits, not part of a longer run
        re.compile(r"(?<![0-9])(?<![0-9] )[2-6](?: [0-9]){12,18}(?![0-9])(?! [0-9])"),
        _spaced_card_length,
        _SPACED_DIGITS_HINT,
        lookahead=2,
    ),
    _Detector(
        re.compile(r"(?<![0-9])(?:(?:\+|00)86[ .-]?)?1[3-9][0-9](?P<m>[ .-]?)[0-9]{4}(?P=m)[0-9]{4}(?![0-9])"),
        _whole,
        _DIGIT,
    ),
    _Detector(
        re.compile(
            r"(?<![0-9A-Za-z+])\+[1-9][0-9]{0,2}"
            r"(?:[0-9]{7,12}|(?:[ .-]?\([0-9]{1,4}\)|[ .-][0-9]{1,8}){2,5})(?![0-9])"
        ),
        _e164_length,
        _PLUS,
    ),
    _Detector(
        re.compile(
            r"(?<![0-9])(?:1[ .-])?(?:\([2-9][0-9]{2}\)[ .-]?[2-9][0-9]{2}[ .-][0-9]{4}"
            r"|[2-9][0-9]{2}(?P<s>[ .-])[2-9][0-9]{2}(?P=s)[0-9]{4})(?![0-9])"
        ),
        _whole,
        _DIGIT,
    ),
    _Detector(
        re.compile(
            rf"(?<![{_EMAIL_CHARS}@\u3002])(?=[{_EMAIL_CHARS}@\u3002]{{6,64}}(?![{_EMAIL_CHARS}@\u3002]))"
            rf"[{_EMAIL_CHARS}]{{1,62}}@(?:{_DOMAIN_LABEL}[.\u3002])*{_DOMAIN_LABEL}"
            rf"(?:\.[A-Za-z]{{2,24}}|\u3002{_TLDS})(?![A-Za-z0-9-])"
        ),
        _whole,
        _AT_SIGN,
        max_chars=64,
    ),
    _Detector(re.compile(_SPELLED_AT, re.IGNORECASE | re.ASCII), _spelled_length, _SPELLED_HINT, lookahead=2),
    _Detector(re.compile(_BARE_AT, re.IGNORECASE | re.ASCII), _whole, _BARE_HINT, lookahead=2),
    _Detector(re.compile(_ENCODED, re.IGNORECASE | re.ASCII), _encoded_length, _ENCODED_HINT, lookahead=12),
    _Detector(re.compile(_SPACED, re.IGNORECASE | re.ASCII), _whole, _SPACED_HINT, lookahead=3),
)


def _check_widths() -> None:
    """Every detector's longest match plus its look-ahead fits in MAX_PATTERN_CHARS."""
    for d in _DETECTORS:
        width = d.max_chars or int(re_parser.parse(d.rx.pattern, d.rx.flags).getwidth()[1])
        if width + d.lookahead > MAX_PATTERN_CHARS:
            raise ValueError(f"{d.rx.pattern[:40]!r}... matches up to {width} chars; raise {MAX_PATTERN_CHARS=}")


_check_widths()


def _next_match(detector: _Detector, text: str, pos: int, stop: int) -> tuple[int, int] | None:
    """The first valid match of detector starting in [pos, stop), or None."""
    if not detector.hint.search(text, pos):
        return None
    if stop - pos <= _FEW_STARTS:  # try each start rather than search the rest of the text
        for start in range(pos, stop):
            if (m := detector.rx.match(text, start)) is not None and (length := detector.length(m.group())):
                return start, start + length
        return None
    while (m := detector.rx.search(text, pos)) is not None and m.start() < stop:
        if length := detector.length(m.group()):
            return m.start(), m.start() + length
        pos = m.start() + 1
    return None


class _View(NamedTuple):
    """The normalised text matched on: `lo` chars of context (the last two chars already emitted,
    for look-behinds), then the view of the held raw text; origin maps view[lo + k] to its raw index."""

    text: str
    lo: int
    origin: list[int] | None  # None: view[lo:] is the raw text itself

    def raw(self, k: int) -> int:
        """Raw index of the char view[k] (k >= lo) came from."""
        return k - self.lo if self.origin is None else self.origin[k - self.lo]

    def is_boundary(self, k: int) -> bool:
        """Whether k falls between the views of two raw chars (not inside one char's expansion)."""
        return self.origin is None or k <= self.lo or k >= len(self.text) or self.raw(k) != self.raw(k - 1)

    def snap_up(self, k: int) -> int:
        while not self.is_boundary(k):
            k += 1
        return k

    def snap_down(self, k: int) -> int:
        while not self.is_boundary(k):
            k -= 1
        return k


def _view(context: str, raw: str) -> _View:
    text, origin = fold_map(raw, MAX_INVISIBLE_RUN)
    return _View(context + text, len(context), origin)


def _find_spans(view: _View, pos: int, stop: int) -> list[tuple[int, int]]:
    """Non-overlapping PII spans starting in [pos, stop): leftmost first, the longest at a tie;
    each ends on a raw char boundary (a span covers whole raw chars)."""
    text = view.text
    if not _ANY_HINT.search(text, pos):  # most prose: no detector can match
        return []
    found = [_next_match(d, text, pos, stop) for d in _DETECTORS]
    spans: list[tuple[int, int]] = []
    while candidates := [s for s in found if s is not None]:
        start, end = min(candidates, key=lambda s: (s[0], -s[1]))
        end = view.snap_up(end)
        spans.append((start, end))
        found = [
            s if s is None or s[0] >= end else _next_match(d, text, end, stop)
            for d, s in zip(_DETECTORS, found, strict=True)
        ]
    return spans


def _replace(raw: str, view: _View, spans: list[tuple[int, int]], raw_end: int) -> str:
    """raw[:raw_end] with each span's raw chars replaced by REDACTED: from the char of its first
    view char up to the char of the view char after it (so invisible characters and marks right
    after a value go with it; a span that ends the view ends the text, flush or whole text)."""
    parts: list[str] = []
    i = 0
    for start, stop in spans:
        raw_start = view.raw(start)
        raw_stop = view.raw(stop) if stop < len(view.text) else len(raw)
        parts += (raw[i:raw_start], REDACTED)
        i = raw_stop
    parts.append(raw[i:raw_end])
    return "".join(parts)


def redact(text: str) -> tuple[str, int]:
    """Whole-text redaction (non-streaming bodies): the redacted text and the number of spans replaced."""
    view = _view("", text)
    spans = _find_spans(view, 0, len(view.text))
    return _replace(text, view, spans, len(text)), len(spans)


def _space_may_join(text: str, b: int) -> bool:
    """Whether the space text[b] may be inside a match: in a number, or next to a spelled-out
    marker (" at ", " dot ", " @ ", " [at] ", "(dot) "...), or next to a word that may become one."""
    n = len(text)
    before = text[b - 1] if b > 0 else ""
    after = text[b + 1] if b + 1 < n else ""
    if before in _BEFORE_SPACE and (not after or after in _AFTER_SPACE):
        return True
    if after in _OPENING or before in _CLOSING or before in _OPENING or after in _CLOSING:
        return True
    if _between_spaced_chars(text, b):  # "a l i c e @ ..."
        return True
    j = text.find(" ", b + 1)
    token_after = text[b + 1 : j if j >= 0 else n].lower()
    if token_after in (_MARKERS if j >= 0 else _MARKER_PREFIXES):
        return True
    i = text.rfind(" ", 0, b)
    token_before = text[i + 1 : b].lower()
    return token_before in _MARKERS or (i < 0 and token_before.endswith(("at", "dot", "@")))


def _between_spaced_chars(text: str, b: int) -> bool:
    """Whether the space text[b] may join two one-char tokens of a spaced-out address (_SPACED):
    the char before it is not after another token char, the one after it not before a letter or
    digit (or the text ends there: not known yet)."""
    n = len(text)
    if b < 1 or b + 1 >= n:
        return True
    if text[b - 1] not in _SPACED_CHARS or text[b + 1] not in _SPACED_CHARS:
        return False
    if not ((b < 2 or text[b - 2] not in _SPACED_CHARS) and (b + 2 >= n or text[b + 2] not in _ALNUM)):
        return False
    # spaced-out prose with no "@" near enough ("s p e l l e d"): not an address
    return (
        b + _SPACED_AT_AFTER >= n
        or text.find("@", b, b + _SPACED_AT_AFTER + 1) >= 0
        or text.rfind("@", max(0, b - _SPACED_AT_BEFORE), b) >= 0
    )


def _last_cut_end(text: str, lo: int) -> int:
    """Index just past the last char of text[lo:] that no match can contain; lo if none."""
    hard_end = max(len(text.rstrip(_SOFT_OR_SEP)), lo)  # just past the last char no match contains
    if hard_end == len(text):
        return hard_end
    seps = [m.start() for m in _SEP_RX.finditer(text, hard_end)]
    chains = _chains(text, hard_end) if len(seps) >= _FEW_SEPS else []
    for b in reversed(seps):  # separators after it: each may or may not join what is around it
        while chains and chains[-1][0] >= b:
            chains.pop()
        if chains and b < chains[-1][1]:  # inside a chain: joins
            continue
        if text[b] == " " and _space_may_join(text, b):
            continue
        # a loose card gap or an IBAN's space has a digit at most _DIGIT_LOOK chars before it
        if _DIGIT.search(text, max(0, b - _DIGIT_LOOK), b) is None:
            return b + 1
        if not (_in_loose_card(text, b) or _in_iban(text, b)):
            return b + 1
    return hard_end


def _chains(text: str, pos: int) -> list[tuple[int, int]]:
    """Spans (start, end) from pos on whose every separator strictly inside joins, sorted by start."""
    spans = [m.span() for m in _LOOSE_CHAIN.finditer(text, pos)]
    spans += [(m.start() + 4, m.end()) for m in _IBAN_CHAIN.finditer(text, pos) if " " in m.group()]
    return sorted(spans)


def _in_loose_card(text: str, b: int) -> bool:
    """Whether the separator text[b] may be in a loose card gap: a group of digits before it, at
    most two filler words between, and the next group after it (or the text not known that far)."""
    lo = max(0, b - _LOOSE_LOOK - 1)
    last = max(text.rfind(d, lo, b) for d in "0123456789")  # the group's last digit
    if last < 0:
        return False
    first = last
    while first > 0 and text[first - 1] in "0123456789" and last - first < 6:
        first -= 1
    if not 3 <= last - first + 1 <= 6 or (first > 0 and text[first - 1] in "0123456789"):
        return False  # a card group has 3-6 digits
    if _LOOSE_BEHIND.fullmatch(text, last + 1, b) is None:
        return False
    left = 2 - len(_LETTERS.findall(text, last + 1, b))
    return _LOOSE_AHEAD[left].match(text, b + 1) is not None or _LOOSE_PARTIAL[left].fullmatch(text, b + 1) is not None


def _in_iban(text: str, b: int) -> bool:
    """Whether the space text[b] may be between two groups of an IBAN ("GB82 WEST 1234...")."""
    if text[b] != " ":
        return False
    return any(_IBAN_BEHIND.fullmatch(text, m.end(), b) for m in _IBAN_START.finditer(text, max(0, b - _IBAN_LOOK), b))


class Redactor:
    """Redacts one stream. feed() returns the text safe to emit now; flush() the rest at the end."""

    def __init__(self, max_holdback_chars: int = MAX_PATTERN_CHARS) -> None:
        if max_holdback_chars < MAX_PATTERN_CHARS:
            raise ValueError(
                f"{max_holdback_chars=} must be >= {MAX_PATTERN_CHARS=}, the longest span a detector matches"
            )
        self.max_holdback_chars = max_holdback_chars
        self._context = ""  # the view of the last two emitted chars (look-behind context)
        self._held = FoldBuffer(MAX_INVISIBLE_RUN)  # the held text, as received, and its view
        self._num_redacted = 0

    @property
    def num_redacted(self) -> int:
        """Spans replaced so far in this stream."""
        return self._num_redacted

    @property
    def held(self) -> str:
        """Text received but not emitted yet (its normalised view is at most max_holdback_chars)."""
        return self._held.raw

    def feed(self, text: str) -> str:
        """Adds a delta; returns the redacted text that is final now (may be "")."""
        self._held.append(text)
        view = self._view()
        end = _last_cut_end(view.text, view.lo)
        if len(view.text) - end > self.max_holdback_chars:
            end = len(view.text) - MAX_PATTERN_CHARS  # every start before it is decided
        end = view.snap_down(end)
        return self._emit(view, end) if end > view.lo else ""

    def flush(self) -> str:
        """Ends the stream: returns the held rest, redacted."""
        view = self._view()
        out = self._emit(view, len(view.text)) if self._held.raw else ""
        self._context, self._held = "", FoldBuffer(MAX_INVISIBLE_RUN)
        return out

    def _view(self) -> _View:
        return _View(self._context + self._held.view, len(self._context), self._held.origin)

    def _emit(self, view: _View, stop: int) -> str:
        """Redacts and emits the held text up to view index stop (a raw boundary), and every match
        starting before it; keeps the last two emitted view chars as context."""
        raw = self._held.raw
        spans = _find_spans(view, view.lo, stop)
        end = max(stop, spans[-1][1]) if spans else stop
        raw_end = view.raw(end) if end < len(view.text) else len(raw)
        out = _replace(raw, view, spans, raw_end)
        self._num_redacted += len(spans)
        if end > view.lo:
            self._context = view.text[max(0, end - 2) : end]
        self._held.drop(end - view.lo, raw_end)
        return out
