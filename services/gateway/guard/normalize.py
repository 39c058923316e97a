"""The text both guards match on: one character at a time, NFKC, invisible characters removed,
look-alike letters folded to Latin (docs/design.md, "Guards match a normalised view").

Each character of the input becomes zero or more characters of the view, by itself alone:

1. Default-ignorable code points are removed: zero-width space and joiners (U+200B-U+200D), bidi
   marks and embeddings (U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), word joiner and
   invisible operators (U+2060-U+2064), U+FEFF, soft hyphen U+00AD, Mongolian vowel separator,
   variation selectors, tags, Hangul fillers (the Default_Ignorable_Code_Point property of the
   Unicode Character Database, DerivedCoreProperties.txt, listed in ``_DEFAULT_IGNORABLE``).
2. NFKC of that one character: full-width digits and letters become ASCII ("４" -> "4", "＠" ->
   "@"), no-break and ideographic spaces become " ", mathematical letters their plain letter.
   Digits of other scripts become ASCII digits ("٤١١١" -> "4111", by their Unicode decimal
   value), and enclosing or overlaid marks (keycaps "4\ufe0f\u20e3", strike-throughs) are removed.
   Combining marks (category Mn) are removed, alone or inside a precomposed letter (its NFD):
   "e\u0301" and "é" both read "e", so an accent put on a letter hides nothing.
3. Look-alike letters become the Latin letter they look like (``CONFUSABLES``): the Cyrillic,
   Greek, Armenian and Latin-extension letters that Unicode's confusables.txt (UTS #39, security
   data, https://www.unicode.org/Public/security/latest/confusables.txt) maps to one ASCII letter.
   The target keeps the source's case (confusables.txt maps the I-like capitals to "l", because
   "I" and "l" are confusable with each other; here Cyrillic "І" and Greek "Ι" become "I").
   Small capitals ("ɪɢɴᴏʀᴇ") become the lower-case letter. Dashes (U+2010-U+2013, U+2043, U+2212)
   become "-". (The ideographic full stop "。" stays: the e-mail detector reads it as a dot only
   inside an address, redaction.py.)

Because every character is mapped alone, the view of a concatenation is the concatenation of the
views: a stream's view grows delta by delta, and a span found in the view maps back to the
characters of the original it came from (``fold_map``), so the redactor replaces the original text
in place and leaves everything else byte-identical. ``fold`` is the same view without the map.
Characters outside ASCII are looked up in ``_FOLD``, which computes and remembers each code point
on first sight (at most ``_MAX_CACHED`` of them), so str.translate does the work at C speed.
"""

from __future__ import annotations

import unicodedata

# Default_Ignorable_Code_Point (DerivedCoreProperties.txt, Unicode 15), inclusive ranges.
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)

# Letters that render like one Latin letter (from confusables.txt; see the module docstring).
CONFUSABLES: dict[str, str] = {
    # Cyrillic
    "А": "A",
    "В": "B",
    "Е": "E",
    "К": "K",
    "М": "M",
    "Н": "H",
    "О": "O",
    "Р": "P",
    "С": "C",
    "Т": "T",
    "У": "Y",
    "Х": "X",
    "Ѕ": "S",
    "І": "I",
    "Ј": "J",
    "Ү": "Y",
    "Ѵ": "V",
    "Ӏ": "I",
    "Ԍ": "G",
    "Ԛ": "Q",
    "Ԝ": "W",
    "а": "a",
    "е": "e",
    "о": "o",
    "р": "p",
    "с": "c",
    "у": "y",
    "х": "x",
    "ѕ": "s",
    "і": "i",
    "ј": "j",
    "һ": "h",
    "ԁ": "d",
    "ԛ": "q",
    "ԝ": "w",
    "ү": "y",
    "ѵ": "v",
    "ѡ": "w",
    "ҽ": "e",
    "ӏ": "i",
    "г": "r",
    # Greek
    "Α": "A",
    "Β": "B",
    "Ε": "E",
    "Ζ": "Z",
    "Η": "H",
    "Ι": "I",
    "Κ": "K",
    "Μ": "M",
    "Ν": "N",
    "Ο": "O",
    "Ρ": "P",
    "Τ": "T",
    "Υ": "Y",
    "Χ": "X",
    "Ϲ": "C",
    "Ϳ": "J",
    "ϒ": "Y",
    "α": "a",
    "γ": "y",
    "ι": "i",
    "ν": "v",
    "ο": "o",
    "ρ": "p",
    "σ": "o",
    "υ": "u",
    "ϲ": "c",
    "ϳ": "j",
    "ϱ": "p",
    # Armenian
    "Ս": "U",
    "Տ": "S",
    "Օ": "O",
    "հ": "h",
    "ո": "n",
    "ռ": "n",
    "ս": "u",
    "ց": "g",
    "օ": "o",
    # Latin letters that are not ASCII but read as one
    "ı": "i",
    "ȷ": "j",
    "ɑ": "a",
    "ɡ": "g",
    "ɩ": "i",
    "ɪ": "i",
    "ʏ": "y",
    "ʋ": "u",
    # small capitals (Latin Extensions, Phonetic Extensions): read as the lower-case letter
    "ᴀ": "a",
    "ʙ": "b",
    "ᴄ": "c",
    "ᴅ": "d",
    "ᴇ": "e",
    "ꜰ": "f",
    "ɢ": "g",
    "ʜ": "h",
    "ᴊ": "j",
    "ᴋ": "k",
    "ʟ": "l",
    "ᴍ": "m",
    "ɴ": "n",
    "ᴏ": "o",
    "ᴘ": "p",
    "ꞯ": "q",
    "ʀ": "r",
    "ꜱ": "s",
    "ᴛ": "t",
    "ᴜ": "u",
    "ᴠ": "v",
    "ᴡ": "w",
    "ᴢ": "z",
    # dashes and the minus sign (NFKC leaves them; confusables.txt maps them to "-")
    "\u2010": "-",
    "\u2012": "-",
    "\u2013": "-",
    "\u2043": "-",
    "\u2212": "-",
}

# Marks drawn around or through the character before them: keycaps ("4\ufe0f\u20e3"), circles,
# strike-throughs ("4\u0336"); they hide nothing a reader cannot see through, so they go too.
_DECORATIONS = frozenset(
    [chr(c) for c in range(0x0334, 0x0339)]
    + [chr(c) for c in range(0x20DD, 0x20E5)]
    + ["\u0488", "\u0489", "\u20e9", "\u20ea", "\u20ee", "\u20ef", "\ua670", "\ua671", "\ua672"]
)

BREAK = "\x00"  # what fold_map puts for a run of invisible characters longer than asked
_MAX_CACHED = 65_536  # distinct non-ASCII code points remembered; more are computed each time


def _is_ignorable(code: int) -> bool:
    return any(lo <= code <= hi for lo, hi in _DEFAULT_IGNORABLE)


def _without_marks(c: str) -> str:
    """c without its combining marks (category Mn, after NFD), recomposed: "é" -> "e"."""
    parts = unicodedata.normalize("NFD", c)
    if len(parts) == 1:
        return c
    return unicodedata.normalize("NFC", "".join(p for p in parts if unicodedata.category(p) != "Mn"))


def _fold_one(c: str) -> str:
    if _is_ignorable(ord(c)) or c in _DECORATIONS or unicodedata.category(c) == "Mn":
        return ""
    if c in CONFUSABLES:
        return CONFUSABLES[c]
    if (base := _without_marks(c)) != c:  # "é" -> "e", Cyrillic "ё" -> "е" -> "e"
        return "".join(_fold_one(b) for b in base)
    digit = unicodedata.decimal(c, None)  # a digit of another script ("٤", "४"): its ASCII digit
    return str(digit) if digit is not None and not c.isascii() else c


def fold_char(ch: str) -> str:
    """The view of one character: "" (invisible), or its NFKC form with look-alikes folded."""
    if _is_ignorable(ord(ch)):
        return ""
    return "".join(_fold_one(c) for c in unicodedata.normalize("NFKC", ch))


class _FoldTable(dict[int, str]):
    """str.translate's table: code point -> view, filled on first sight of each code point."""

    def __missing__(self, code: int) -> str:
        view = fold_char(chr(code))
        if len(self) < _MAX_CACHED:
            self[code] = view
        return view


class _UnevenTable(dict[int, str]):
    """str.translate's table that keeps only the chars whose view is not exactly one char."""

    def __missing__(self, code: int) -> str:
        kept = "" if len(_FOLD[code]) == 1 else chr(code)
        if len(self) < _MAX_CACHED:
            self[code] = kept
        return kept


_FOLD = _FoldTable({c: chr(c) for c in range(128)})
_UNEVEN = _UnevenTable(dict.fromkeys(range(128), ""))


def fold(text: str) -> str:
    """The normalised view of `text` (ASCII comes back as it is)."""
    if text.isascii():
        return text
    return text.translate(_FOLD)


def fold_map(text: str, max_invisible_run: int | None = None) -> tuple[str, list[int] | None]:
    """(view, origin): origin[k] is the index in `text` of the character view[k] came from; None
    when every character maps to exactly one (then view[k] came from text[k]).

    With max_invisible_run, a run of more invisible characters than that in one place becomes one
    BREAK in the view (at the run's first index) instead of nothing: the redactor's bound on how
    much raw text one view character may stand for.
    """
    if text.isascii():
        return text, None
    if not text.translate(_UNEVEN):  # one char for one: positions do not move
        return text.translate(_FOLD), None
    parts: list[str] = []
    origin: list[int] = []
    table = _FOLD
    run_start, run_len = 0, 0
    for i, ch in enumerate(text):
        view = table[ord(ch)]
        if not view:
            if run_len == 0:
                run_start = i
            run_len += 1
            continue
        if max_invisible_run is not None and run_len > max_invisible_run:
            parts.append(BREAK)
            origin.append(run_start)
        run_len = 0
        parts.append(view)
        if len(view) == 1:
            origin.append(i)
        else:
            origin.extend([i] * len(view))
    if max_invisible_run is not None and run_len > max_invisible_run:
        parts.append(BREAK)
        origin.append(run_start)
    return "".join(parts), origin


class FoldBuffer:
    """The view of a text that grows at its end and is consumed from its start (a stream's held
    text): always what fold_map(raw, max_invisible_run) gives, kept up to date per delta instead
    of recomputed, so a feed costs its delta, not everything held."""

    def __init__(self, max_invisible_run: int) -> None:
        self.max_invisible_run = max_invisible_run
        self.raw = ""
        self.view = ""
        self.origin: list[int] | None = None  # as fold_map's: None while each char maps to one
        self._run_start = 0  # the trailing run of invisible characters of raw: where it starts...
        self._run_len = 0  # ...and how long it is (0: raw does not end with one)

    def append(self, delta: str) -> None:
        """Adds text at the end."""
        if not delta:
            return
        base = len(self.raw)
        self.raw += delta
        if delta.isascii() or not delta.translate(_UNEVEN):  # one char for one: no invisible ones
            if self.origin is not None:
                self.origin.extend(range(base, base + len(delta)))
            self.view += delta if delta.isascii() else delta.translate(_FOLD)
            self._run_len = 0
            return
        origin = self.origin if self.origin is not None else list(range(len(self.view)))
        parts: list[str] = []
        for i, ch in enumerate(delta, base):
            view = _FOLD[ord(ch)]
            if not view:
                if self._run_len == 0:
                    self._run_start = i
                self._run_len += 1
                if self._run_len == self.max_invisible_run + 1:  # where fold_map puts its BREAK
                    parts.append(BREAK)
                    origin.append(self._run_start)
                continue
            self._run_len = 0
            parts.append(view)
            if len(view) == 1:
                origin.append(i)
            else:
                origin.extend([i] * len(view))
        self.view += "".join(parts)
        self.origin = origin

    def drop(self, view_end: int, raw_end: int) -> None:
        """Forgets view[:view_end] and raw[:raw_end]: raw_end is where view[view_end] comes from
        (or the end of raw, when view_end is the end of the view)."""
        self.raw = self.raw[raw_end:]
        self.view = self.view[view_end:]
        if self.origin is not None:
            self.origin = [o - raw_end for o in self.origin[view_end:]] if self.raw else None
        if self._run_len:
            self._run_start -= raw_end
            if self._run_start < 0:  # the run left with the dropped text (it was all dropped)
                self._run_len = 0
