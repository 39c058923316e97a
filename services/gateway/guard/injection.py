"""The gateway's input guard core: a prompt-injection detector (rules + a small classifier) and a
per-principal risk tracker. Pure and synchronous: no I/O after the weights load, time passed in.

Detection, in order:

1. Normalise (ASCII input skips what cannot change it): ``normalize.fold`` (invisible format
   characters such as zero-width spaces, soft hyphens and bidi controls removed; NFKC, so
   fullwidth and other compatibility forms become ASCII; Cyrillic, Greek and other look-alike
   letters and small capitals folded to the Latin letter they look like, so "іgnоrе" with
   Cyrillic і/о/е and "ɪɢɴᴏʀᴇ" read "ignore"; combining marks removed, so "ignore\u0301" and
   "ïgnörë" do too), casefold, whitespace runs collapsed to one space. A second "compact"
   view keeps letters only, after a minimal leetspeak map (0->o, 1->i, 3->e, 4->a, 5->s, 7->t,
   @->a, $->s), so "i g n o r e  p r e v i o u s", "1gn0re" and "ignore.previous" read as words
   run together; a few phrase rules run on it.
2. Rules: named, precompiled regexes (``RULES``). Every pattern is a bounded alternation or a
   bounded gap (``.{0,N}``), so each rule has a longest match (``max_chars``, checked at import),
   and lists literal keywords one of which every match contains. A rule's regex runs only on the
   windows of +-max_chars around its keyword occurrences (``str.find``, merged), never on text
   where it cannot match: the whole text is still covered, so an instruction buried in the middle
   of a 100k-char document is found, and the answer is the same as searching the whole text.
   "strong" rules are phrasings with next to no innocent use; "weak" ones are signals that also
   occur innocently (a jailbreak question, a note addressed to an AI). Strong rules in French,
   Spanish, Portuguese, German, Italian, Russian, Chinese, Japanese, Arabic and Korean
   (``_MULTILINGUAL_RULES``, one per language and family, each with its own keywords) cover
   dropping the earlier instructions (a verb, the instructions, and a word saying which:
   previous, above, all, yours), "forget everything you were told", asking for the system prompt
   or the secret instructions, repeating the text before the message, and a persona without
   restrictions or developer mode switched on (as a statement, not a question about a phone). They
   read ``normalise_lowered``: casefolded before look-alikes are folded, so capital Cyrillic
   letters stay Cyrillic. "Enable developer mode" in English is strong only when it is not a
   question ("how do I ...") nor about a device ("... on a Pixel phone").
3. Classifier: logistic regression over signed, hashed features (2**15 buckets): word unigrams and
   bigrams and char 3-5-grams of the normalised text, L2-normalised. It sees at most the first and
   last ``_CLASSIFIER_EDGE_CHARS`` characters, so its cost is bounded whatever the input size.

Levels: high if any strong rule fires or score >= 0.9; medium if a weak rule fires or
score >= 0.5; low otherwise.

Weights: ``injection_model.json`` next to this module (float16, base64), made by

    python scripts/train_injection_classifier.py --seed 0

Held-out metrics printed by that command (test templates, paraphrases and stdlib files disjoint
from training; 1,400 injections, 2,100 benign texts). Classifier alone, score >= 0.5: precision
0.994, recall 0.611, F1 0.757, false positive rate 0.002. Whole detector, level >= medium:
precision 0.995, recall 0.734, FPR 0.002 (the rules were reviewed against hold-out misses, so
this figure is the less independent one). Latency (``weir bench injection``, 3,000 prompts of 20-8,021 chars plus 20 of 100k, 2 cores shared
with other jobs), thread CPU: p50 0.30 ms, p95 1.5 ms, p99 2.0 ms (was p50 0.93, p99 9.7); 8k-char
prompts p50 1.4 ms; 100k-char documents ~13 ms (classifier ~1 ms, capped; rules and normalising
linear in the length).

On the hand-written multilingual set (tests/data/guards/input.jsonl, ``weir bench guards``,
docs/benchmarks.md "Guards"), level high: 83% of 172 injections in nine languages, no false
positive on 166 benign look-alikes (was 12% and 2%); on its "final" split, written after the last
rule change and never tuned on, 49% of 37 injections and none of 28 benign prompts. Since the
multilingual rules, ``weir bench injection``: p50 0.6-0.9 ms up to 8k chars, 28-36 ms at 100k
(+25-45%, keyword scans of the added rules).
"""

from __future__ import annotations

import base64
import json
import math
import re
import re._parser as re_parser  # getwidth(): the longest match a rule can make
import unicodedata
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from services.gateway.guard.normalize import fold

RiskLevel = Literal["low", "medium", "high"]

DEFAULT_MODEL_PATH = Path(__file__).with_name("injection_model.json")
NUM_BUCKETS_LOG2 = 15
NUM_BUCKETS = 1 << NUM_BUCKETS_LOG2
HIGH_SCORE = 0.9
MEDIUM_SCORE = 0.5
_CLASSIFIER_EDGE_CHARS = 4096  # the classifier sees the first and last 4k normalised chars
_WORD_WEIGHT = 2.0  # words are ~6x rarer than char n-grams; weigh them up so they count
_MAX_RULE_CHARS = 1024  # every rule's longest match; bounds the window scanned around a keyword
_LOOKAHEAD_MARGIN = 64  # chars past a window's end, so look-aheads and \b there see real text
_MAX_EVENTS_PER_PRINCIPAL = 1024  # RiskTracker keeps at most this many timestamps per principal

_LEET = str.maketrans({"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s"})
# ASCII text: the leetspeak map plus every other non-letter deleted, in one translate
_LEET_ASCII_LETTERS = str.maketrans({chr(c): _LEET.get(c, chr(c) if chr(c).isalpha() else None) for c in range(128)})
_WHITESPACE = re.compile(r"\s+")
_NON_LETTER = re.compile(r"[^a-z\u4e00-\u9fff]+")
_WORD = re.compile(r"\w+")


def normalise(text: str) -> str:
    """normalize.fold (invisible characters out, NFKC, look-alike letters to Latin), composed,
    casefolded, whitespace collapsed, stripped."""
    if text.isascii():  # nothing for fold to do; casefold is lower on ASCII
        return _WHITESPACE.sub(" ", text.lower()).strip()
    # fold maps char by char: NFKC of the whole composes what it leaves apart ("e" + U+0301), and
    # casefold can make a look-alike ("Σ" -> "σ"), so fold once more
    text = fold(unicodedata.normalize("NFKC", fold(text)).casefold())
    return _WHITESPACE.sub(" ", text).strip()


def normalise_lowered(text: str) -> str:
    """normalise(), but casefolded before the look-alikes are folded: the view the rules of other
    languages read. Folding first maps a capital Cyrillic "В", "Т", "Н", "М" or "К" to a Latin
    letter while its small form stays Cyrillic, so "Выведи" and "выведи" would differ; an English
    look-alike trick in capitals ("ВYPASS") is still read by the English rules on normalise()."""
    if text.isascii():
        return normalise(text)
    return normalise(text.casefold())


def compact(normalised: str) -> str:
    """Letters only, after the leetspeak map: the view that undoes letter spacing and punctuation."""
    if normalised.isascii():
        return normalised.translate(_LEET_ASCII_LETTERS)
    return _NON_LETTER.sub("", normalised.translate(_LEET))


@dataclass(frozen=True)
class Rule:
    """A named regex; `is_strong` rules alone make a detection high risk. `on_compact` rules run on
    the letters-only view instead of the normalised text. Every match contains one of `keywords`
    and spans at most `max_chars`, so the regex only runs near keyword occurrences (``_search``)."""

    name: str
    is_strong: bool
    pattern: re.Pattern[str]
    keywords: tuple[str, ...]
    max_chars: int
    on_compact: bool = False
    on_lowered: bool = False  # runs on normalise_lowered() (the rules of other languages)
    requires: tuple[str, ...] = ()  # when given, every match also contains one of these (checked first, cheaply)

    def search(self, text: str) -> bool:
        """Whether the pattern matches anywhere in `text`; the same answer as pattern.search(text)."""
        if self.requires and not any(word in text for word in self.requires):
            return False
        return _search(self.pattern, text, self.keywords, self.max_chars)


def _rule(name: str, is_strong: bool, keywords: tuple[str, ...], *alternatives: str, on_compact: bool = False) -> Rule:
    pattern = re.compile("|".join(f"(?:{a})" for a in alternatives))
    max_chars = int(re_parser.parse(pattern.pattern).getwidth()[1])
    if max_chars > _MAX_RULE_CHARS:
        raise ValueError(f"rule {name!r}: {max_chars=} must be <= {_MAX_RULE_CHARS}; bound every repeat")
    return Rule(name, is_strong, pattern, keywords, max_chars, on_compact)


def _search(pattern: re.Pattern[str], text: str, keywords: tuple[str, ...], max_chars: int) -> bool:
    # A match containing a keyword at i lies in [i - max_chars, i + len(kw) + max_chars]. One hit stands
    # for every hit of the same keyword in [i, i + step), so each keyword costs <= len/step finds.
    step = max_chars
    spans: list[tuple[int, int]] = []
    for keyword in keywords:
        i = text.find(keyword)
        while i >= 0:
            spans.append((max(0, i - max_chars), i + step + len(keyword) + max_chars))
            i = text.find(keyword, i + step)
    if not spans:
        return False
    spans.sort()
    start, end = spans[0]
    for span_start, span_end in spans[1:]:
        if span_start > end:
            if _search_window(pattern, text, start, end):
                return True
            start = span_start
        end = max(end, span_end)
    return _search_window(pattern, text, start, end)


def _search_window(pattern: re.Pattern[str], text: str, start: int, end: int) -> bool:
    # pos keeps look-behinds and \b exact (they see text before it); endpos cuts the string, so a
    # match near the cut is confirmed on the whole text before it counts.
    end = min(len(text), end + _LOOKAHEAD_MARGIN)
    while (match := pattern.search(text, start, end)) is not None:
        if end == len(text) or pattern.match(text, match.start()):
            return True
        start = match.start() + 1
    return False


_NOT_NEGATED = r"(?<!don't )(?<!do not )(?<!never )(?<!not )"
_EARLIER = r"(?:previous|prior|above|earlier|preceding|initial|original|foregoing|system|old)"
_ORDERS = r"(?:instructions?|prompts?|directions?|directives?|rules|guidelines|guidance|commands?|orders)"
_SECRETS = (
    r"(?:api[ _-]?keys?|secret(?: key)?s?|credentials|passwords?(?! reset| manager| policy| field| hash)|"
    r"access tokens?|auth tokens?|bearer tokens?|env(?:ironment)? var(?:iable)?s|private keys?|ssh keys?|"
    r"\.env file|/etc/passwd|id_rsa|aws_secret_access_key|session cookies?)"
)

# after "developer mode": not a place or a question ("... on a Pixel phone", "... enabled?")
_NOT_A_DEVICE = (
    r"(?! ?\?)(?! (?:on|in|for|of|from|via|by|a|an|the|my|your|when|if|after|before|under|through|"
    r"settings|options|menu|and|or|so|but)\b)"
)
_NOT_A_QUESTION = "".join(
    f"(?<!{w} )"
    for w in (
        "how to",
        "how do i",
        "how can i",
        "how do you",
        "how do we",
        "can i",
        "do i",
        "should i",
        "i want to",
        "i need to",
        "how would i",
        "way to",
        "steps to",
        "ways to",
        "trying to",
        "tried to",
        "how to safely",
    )
)

RULES: tuple[Rule, ...] = (
    _rule(
        "ignore_previous_instructions",
        True,
        (
            "ignor",
            "disregard",
            "forget",
            "override",
            "bypass",
            "discard",
            "drop",
            "abandon",
            "cancel",
            "void",
            "revoked",
            "obsolete",
            "no longer",
            "忽略",
            "无视",
            "無視",
        ),
        rf"{_NOT_NEGATED}\b(?:ignore|disregard|forget|override|bypass|discard|drop|abandon)\b "
        rf"(?:(?:all|any|of|the|your|these|those|every|everything|and) ){{0,4}}(?:{_EARLIER} )?{_ORDERS}",
        rf"{_NOT_NEGATED}\b(?:ignore|disregard|forget)\b (?:all |everything |anything )"
        r"(?:above|before|previous|prior|you (?:were|have been) (?:told|given))",
        r"忽略(?:之前|以上|上面|前面|先前|所有|你的)(?:的)?(?:所有)?(?:的)?(?:指令|指示|说明|提示|规则|命令)",
        r"无视(?:之前|以上|上面|前面|所有)(?:的)?(?:所有)?(?:的)?(?:指令|指示|规则|命令)",
        r"(?:以前|前|上記|これまで)の(?:指示|命令|指令)を無視",
        r"\bignora (?:todas )?(?:las )?instrucciones (?:anteriores|previas)",
        r"\bignore[zr]? (?:toutes )?(?:les )?instructions (?:précédentes|precedentes|ci-dessus)",
        rf"\b{_EARLIER} {_ORDERS} (?:are|is|have been|has been) (?:now )?(?:cancell?ed|void|revoked|obsolete|"
        r"no longer (?:valid|in effect|apply|applicable))",
        r"\bignoriere (?:alle )?(?:vorherigen|bisherigen|obigen) (?:anweisungen|instruktionen|befehle)",
    ),
    _rule(
        "ignore_previous_instructions",
        True,
        ("ignore", "disregard", "forget"),
        r"(?<!dont)(?<!donot)(?<!never)(?:ignore|disregard|forget)(?:all|any)?(?:of)?(?:the|your)?"
        r"(?:previous|prior|above|earlier|preceding)(?:instructions|prompts|directions|rules)",
        on_compact=True,
    ),
    _rule(
        "system_prompt_exfiltration",
        True,
        (
            "prompt",
            "system message",
            "hidden",
            "instructions",
            "developer",
            "rules you were given",
            "repeat",
            "系统提示",
            "初始指令",
            "隐藏指令",
        ),
        r"\b(?:reveal|print|show|repeat|output|display|dump|leak|recite|echo|spell out|write out|tell|give|"
        r"disclose|share|paste|copy|return|translate)\b (?:(?:me|us|back|all|exactly|verbatim|word for word|of|"
        r"out|everything in) ){0,3}(?:your|the|this conversation's|the hidden|the secret) "
        r"(?:system prompt|system message|initial prompt|original prompt|hidden (?:instructions|prompt|rules)|"
        r"secret instructions|initial instructions|original instructions|pre-?prompt|developer (?:instructions|message)|"
        r"instructions (?:you were given|above|before this))",
        r"\bwhat (?:is|are|was|were) your (?:exact |full |original |initial |hidden )?"
        r"(?:system prompt|instructions|initial instructions|rules you were given)",
        r"\brepeat (?:the |all )?(?:words|text|everything) (?:above|before this)",
        r"(?:显示|输出|告诉我|打印|泄露|重复)(?:你的)?(?:系统提示词?|初始指令|隐藏指令)",
    ),
    _rule(
        "system_prompt_exfiltration",
        True,
        ("systemprompt", "instructions"),
        r"(?:reveal|print|show|repeat|output|display|dump|leak)(?:me|us)?(?:your|the)"
        r"(?:systemprompt|hiddeninstructions|initialinstructions|secretinstructions)",
        on_compact=True,
    ),
    _rule(
        "fake_delimiters",
        True,
        ("<|", "inst]", "sys>>", "</s>", "##", "[system", "[admin", "[developer", "system:", "system :"),
        r"<\|im_start\|>|<\|im_end\|>|<\|system\|>|<\|user\|>|<\|assistant\|>|<\|endoftext\|>|<\|eot_id\|>",
        r"<\|start_header_id\|>|\[/?inst\]|<</?sys>>|</s>",
        r"#{2} ?(?:system|instructions?|new instructions|admin|developer)(?: message| prompt| override)? ?:",
        r"\[(?:system|admin|developer)(?: message| override| prompt)?\]",
        r"(?:^|[\"'] |\bend of (?:user )?(?:input|message|document)\b.{0,20}?)system ?: ?",
    ),
    _rule(
        "secret_exfiltration",
        True,
        (
            "api",
            "secret",
            "credentials",
            "password",
            "token",
            "env",
            "private key",
            "ssh key",
            "passwd",
            "id_rsa",
            "cookie",
        ),
        rf"\b(?:send|forward|email|post|upload|exfiltrate|transmit|leak|reveal|print|output|dump|list|share|"
        rf"disclose|give me|tell me|include)\b (?:(?:me|us|all|of|out|back) ){{0,2}}(?:your|all|the|any) "
        rf"(?:stored |saved |internal |system |server(?:'s)? |user(?:s'|'s)? |admin |secret )?{_SECRETS}"
        r"(?!(?: reset| manager| policy| securely| safely| in (?:python|bash|a|my)))",
        rf"\b(?:send|forward|email|post|upload|exfiltrate|transmit)\b.{{0,60}}?{_SECRETS}.{{0,40}}?"
        r"\b(?:to|at) (?:https?://|[\w.-]{1,64}@|attacker|the following (?:address|url|email))",
    ),
    _rule(
        "do_anything_now",
        True,
        ("do anything now", "bound", "restricted", "limited", "constrained", "without", "have no"),
        r"\bdo anything now\b",
        r"\b(?:not|never|no longer) (?:bound|restricted|limited|constrained) by (?:any |the |your )?"
        r"(?:rules|guidelines|policies|restrictions|filters|openai|anthropic|content policy)",
        r"\bwithout (?:any )?(?:ethical|moral|content|safety) (?:restrictions|guidelines|filters|constraints|limits)",
        r"\byou (?:have|now have) no (?:restrictions|limits|limitations|rules|filters|guidelines|boundaries|"
        r"content policy|safety policy|content filter)",
    ),
    _rule("do_anything_now", True, ("doanythingnow",), r"doanythingnow", on_compact=True),
    _rule(
        "jailbreak_persona",
        True,
        (
            "dan",
            "stan",
            "dude",
            "aim",
            "unrestricted",
            "unfiltered",
            "uncensored",
            "jailbroken",
            "evil",
            "rogue",
            "mode",
        ),
        r"\b(?:you are|you're|act as|pretend (?:to be|you are)|become|enter|enable|activate|switch to|now in|"
        r"respond as|roleplay as) (?:now )?(?:a |an |the )?(?:dan|stan|dude|aim|"
        r"(?:unrestricted|unfiltered|uncensored|jailbroken|evil|rogue) (?:ai|assistant|model|chatbot|version|mode))\b",
        rf"\b(?:developer|dev|god|debug|admin|unrestricted|jailbreak|dan) mode "
        rf"(?:(?:enabled|activated|engaged)\b{_NOT_A_DEVICE}|on(?= ?[.!:;,\n]|$))",
        r"\b(?:enable|activate|enter|switch to) (?:god|jailbreak|dan) mode\b",
        # "enable developer mode" is also what phones, browsers and consoles have: an order to the
        # model only when it is not a question about a device ("how do I enable developer mode on a Pixel?")
        rf"\b(?=enable|activate|enter|switch to){_NOT_A_QUESTION}(?:enable|activate|enter|switch to) (?:developer|"
        rf"dev) mode\b"
        rf"{_NOT_A_DEVICE}",
    ),
    _rule(
        "jailbreak_persona",
        True,
        ("developermode",),
        r"developermode(?:enabled|activated)(?!by|on|in|for|when|if|after|before|and|or|so|but)",
        on_compact=True,
    ),
    _rule(
        "encoded_payload",
        True,
        ("decode", "decrypt"),
        r"[a-z0-9+/]{40}(?![a-z0-9+/])={0,2}+.{0,200}?\b(?:decode|decrypt)\b.{0,60}?\b(?:execute|run|follow|obey|perform|"
        r"carry out|do what it says|act on)",
        r"\b(?:decode|decrypt)\b.{0,60}?\b(?:execute|run|follow|obey|perform|carry out|do what it says|act on)"
        r"\b.{0,200}?(?<![a-z0-9+/])[a-z0-9+/]{40}",
    ),
    _rule(
        "role_reassignment",
        False,
        ("you are", "from now on", "pretend"),
        r"\byou are now (?:free|unrestricted|unfiltered|jailbroken|uncensored|named|called|in \w{1,40} mode)\b",
        r"\byou are no longer (?:an? |bound|restricted|limited|chatgpt|claude|required)",
        r"\bfrom now on,? (?:you (?:are|will|must|shall)|act|respond|pretend)",
        r"\bpretend (?:to be|you are|that you (?:are|have))",
    ),
    _rule("jailbreak_mention", False, ("jailbr",), r"\bjailbr(?:eak|oken)"),
    _rule(
        "new_instructions",
        False,
        ("instructions", "task", "objective", "directive", "orders", "instead", "rather"),
        r"\b(?:new|updated|real|actual|true|revised) (?:instructions|task|objective|directive|orders)s? ?:",
        r"\b(?:instead|rather),? (?:you (?:must|will|should)|do the following|your (?:new )?task is)",
    ),
    _rule(
        "addressed_to_ai",
        False,
        (
            "note",
            "message",
            "instruction",
            "attention",
            "ignore",
            "disregard",
            "forget",
            "you must",
            "you should",
            "stop",
            "tell",
            "secretly",
        ),
        r"\b(?:note|message|instructions?|attention) (?:to|for) (?:the |any |all )?"
        r"(?:ai|assistant|llm|language model|chatbot|bot|model)s?\b",
        r"\b(?:dear |hey |hi )?(?:ai|assistant|llm|chatbot|gpt|claude),? (?:please )?"
        r"(?:ignore|disregard|forget|you must|you should|stop|do not tell|don't tell|secretly)",
    ),
    _rule(
        "no_restrictions",
        False,
        ("restrictions", "limitations", "filters", "censorship", "content policy", "safety guidelines"),
        r"\b(?:no|without(?: any)?|free (?:from|of)(?: all)?) (?:restrictions|limitations|filters|censorship|"
        r"content policy|safety guidelines)\b",
    ),
    _rule(
        "decode_and_execute",
        False,
        ("decode", "decrypt"),
        r"\b(?:decode|decrypt)\b.{0,60}?\b(?:execute|run|follow|obey|carry out|do what it says)\b",
    ),
)


def _folded(text: str) -> str:  # normalise_lowered() of a pattern, spaces kept as they are
    """A pattern or keyword written in its language's own letters, seen as normalise() sees text:
    accents and marks out, casefolded, look-alike letters folded (Russian "предыдущие" has Cyrillic
    letters that become Latin ones). Patterns use no upper-case escapes (casefold would change them)."""
    text = text.casefold()
    return fold(unicodedata.normalize("NFKC", fold(text)).casefold())


def _ml_rule(name: str, keywords: tuple[str, ...], *alternatives: str, requires: tuple[str, ...] = ()) -> Rule:
    """A strong rule written in another language than English: patterns and keywords normalised first.
    `requires`: words one of which every match also contains (the orders an override names)."""
    rule = _rule(name, True, tuple(dict.fromkeys(_folded(k) for k in keywords)), *(_folded(a) for a in alternatives))
    return replace(rule, requires=tuple(dict.fromkeys(_folded(k) for k in requires)), on_lowered=True)


def _alt(*words: str) -> str:
    return "(?:" + "|".join(words) + ")"


# Each language: (1) an order to drop the earlier instructions: a verb, then within a few words a
# word for them, with a word saying which (previous, above, all, yours, the system's); (2) a request
# for the system prompt or hidden instructions; (3) a persona without restrictions, or "developer
# mode" switched on (not a question about a phone's or browser's developer mode).
_FR_VERB = _alt(
    r"ignore[zr]?",
    r"oublie[zr]?",
    r"neglige[zr]?",
    "ne tiens pas compte",
    "ne tenez pas compte",
    "fais abstraction",
    "faites abstraction",
    "abandonne[zr]?",
    "passe[zr]? outre",
    "ecarte[zr]?",
)
_FR_ORDERS = _alt(r"instructions?", r"consignes?", r"regles?", r"directives?", "ordres", "indications", "prompt")
_FR_WHICH = _alt(
    r"precedent",
    r"anterieur",
    "ci-dessus",
    "plus haut",
    r"initial",
    "d'origine",
    "toutes",
    "tous",
    "tes ",
    "vos ",
    "systeme",
    "d'avant",
    "recues",
    "donnees",
)
_ES_VERB = _alt(
    "ignora",
    "ignore",
    "ignoren",
    "ignorad",
    "olvida",
    "olvide",
    "olviden",
    "olvidad",
    "descarta",
    "descarte",
    "omite",
    "omita",
    "no hagas caso",
    "no haga caso",
    "haz caso omiso",
    "pasa por alto",
    "desobedece",
)
_ES_ORDERS = _alt("instrucciones", "reglas", "indicaciones", "directrices", "ordenes", "normas", "prompt")
_ES_WHICH = _alt(
    "anteriores",
    "previas",
    "de arriba",
    "iniciales",
    "originales",
    "todas",
    "todo",
    "tus ",
    "sus ",
    "del sistema",
    "que te dieron",
    "recibidas",
)
_PT_VERB = _alt(
    "ignore",
    "ignora",
    "ignorem",
    "esqueca",
    "esquece",
    "esquecam",
    "desconsidere",
    "desconsidera",
    "descarte",
    "descarta",
    "nao siga",
    "deixe de lado",
    "desobedeca",
)
_PT_ORDERS = _alt("instrucoes", "regras", "diretrizes", "orientacoes", "ordens", "comandos", "prompt")
_PT_WHICH = _alt(
    "anteriores",
    "previas",
    "acima",
    "iniciais",
    "originais",
    "todas",
    "todos",
    "suas ",
    "tuas ",
    "do sistema",
    "que voce recebeu",
    "recebidas",
)
_DE_VERB = _alt(
    "ignoriere",
    "ignorier",
    "ignorieren sie",
    "vergiss",
    "vergessen sie",
    "missachte",
    "missachten sie",
    "verwirf",
    "verwerfen sie",
    "befolge nicht mehr",
    "befolgen sie nicht mehr",
)
_DE_ORDERS = _alt(
    r"anweisung(?:en)?",
    "instruktionen",
    "regeln",
    "vorgaben",
    "befehle",
    "richtlinien",
    "prompt",
    "systemprompt",
    "systemnachricht",
)
_DE_WHICH = _alt(
    "vorherig",
    "vorig",
    "bisherig",
    "obig",
    "fruher",
    "alle ",
    "deine ",
    "ihre ",
    "ursprunglich",
    "oben",
    "erhaltenen",
    "system",
)
_IT_VERB = _alt("ignora", "ignorate", "dimentica", "dimenticate", "trascura", "non seguire", "non rispettare")
_IT_ORDERS = _alt("istruzioni", "regole", "indicazioni", "direttive", "ordini", "prompt")
_IT_WHICH = _alt("precedenti", "sopra", "tutte", "iniziali", "originali", "tue ", "vostre ", "di sistema", "ricevute")
_RU_VERB = _alt(
    r"(?:про)?игнорир\w{0,5}",
    r"забудь(?:те)?",
    r"не обращай(?:те)? внимания на",
    r"отбрось(?:те)?",
    r"пренебреги(?:те)?",
    r"не следуй(?:те)?",
    r"не выполняй(?:те)?",
)
_RU_ORDERS = _alt(
    r"инструкци\w{0,6}",
    r"указани\w{0,6}",
    r"правил\w{0,6}",
    r"установк\w{0,6}",
    r"команд\w{0,6}",
    r"промпт\w{0,6}",
    r"распоряжени\w{0,6}",
)
_RU_WHICH = _alt(
    r"предыдущ",
    r"прежн",
    "все",
    "всё",
    "твои",
    "ваши",
    "свои",
    r"вышеуказанн",
    "выше",
    r"системн",
    r"изначальн",
    r"исходн",
    "полученн",
)
_ZH_VERB = _alt(
    "忽略",
    "无视",
    "無視",
    "忘记",
    "忘記",
    "忘掉",
    "不要理会",
    "不要理會",
    "不要遵守",
    "不再遵守",
    "放弃",
    "放棄",
    "丢弃",
    "丟棄",
    "抛开",
    "拋開",
    "别管",
    "別管",
)
_ZH_WHICH = _alt(
    "之前",
    "以前",
    "先前",
    "上面",
    "以上",
    "前面",
    "上述",
    "所有",
    "全部",
    "原来",
    "原來",
    "原有",
    "你的",
    "系统",
    "系統",
    "一切",
)
_ZH_ORDERS = _alt("指令", "指示", "说明", "說明", "提示", "规则", "規則", "命令", "设定", "設定", "要求", "限制")
_JA_WHICH = _alt(
    "以前",
    "前の",
    "上記",
    "これまで",
    "今まで",
    "先ほど",
    "最初",
    "全て",
    "すべて",
    "あなたの",
    "システム",
    "元の",
    "与えられた",
)
_JA_ORDERS = _alt("指示", "命令", "指令", "ルール", "規則", "設定", "プロンプト", "制約")
_JA_DROP = _alt("無視", "忘れ", "従わな", "破棄", "取り消", "なかったことに")
_AR_VERB = _alt(
    "تجاهل",
    "تجاهلي",
    "تجاهلوا",
    "انس",
    "انسى",
    "انسي",
    "انسوا",
    "لا تلتزم",
    "لا تتبع",
    "اهمل",
    "تخل عن",
    "تخلى عن",
    "الغ",
)
_AR_ORDERS = _alt("التعليمات", "تعليمات", "الاوامر", "اوامر", "القواعد", "قواعد", "الارشادات", "التوجيهات", "توجيهات")
_AR_WHICH = _alt("السابقة", "الماضية", "اعلاه", "الاولى", "الاصلية", "كل", "جميع", "النظام", "التي تلقيتها", "السابق")
_KO_WHICH = _alt("이전", "위의", "모든", "기존", "앞의", "원래", "시스템")
_KO_ORDERS = _alt("지시", "명령", "지침", "규칙", "설정", "프롬프트")


def _override(verb: str, orders: str, which: str, gap: int = 40) -> str:
    """verb, the orders within `gap` chars, and a word saying which within `gap` chars either side."""
    return (
        rf"\b{verb}\b(?=.{{0,{gap}}}?{which})(?:.{{0,{gap}}}?){orders}"
        rf"|\b{verb}\b.{{0,{gap}}}?{orders}(?=.{{0,{gap}}}?{which})"
    )


# One rule per language and family, each with its own keywords: a window around a keyword runs only
# the patterns that can contain it (English text full of "prompt" or "ignored" stays cheap).
_ML = "ignore_previous_instructions", "system_prompt_exfiltration", "jailbreak_persona"
_MULTILINGUAL_RULES: tuple[Rule, ...] = (
    # drop the earlier instructions
    _ml_rule(
        _ML[0],
        (
            "ignor",
            "oubli",
            "neglig",
            "tiens pas",
            "tenez pas",
            "abstraction",
            "abandonn",
            "outre",
            "ecart",
            "precedentes",
            "anterieures",
            "initiales",
        ),
        _override(_FR_VERB, _FR_ORDERS, _FR_WHICH),
        r"\b(?:instructions|consignes|regles) (?:precedentes|anterieures|initiales) (?:sont|ont ete) "
        r"(?:annulees|caduques|revoquees|obsoletes|nulles|abrogees)",
        requires=("instruction", "consigne", "regle", "directive", "ordres", "indications", "prompt"),
    ),
    _ml_rule(
        _ML[0],
        ("ignor", "olvid", "descart", "omit", "caso", "pasa por", "desobedec", "anteriores", "previas", "iniciales"),
        _override(_ES_VERB, _ES_ORDERS, _ES_WHICH),
        r"\b(?:instrucciones|reglas|indicaciones) (?:anteriores|previas|iniciales) (?:estan|quedan|han sido) "
        r"(?:anuladas|canceladas|revocadas|obsoletas|sin efecto)",
        requires=("instrucciones", "reglas", "indicaciones", "directrices", "ordenes", "normas", "prompt"),
    ),
    _ml_rule(
        _ML[0],
        (
            "ignor",
            "esquec",
            "desconsider",
            "descart",
            "nao siga",
            "deixe de",
            "desobedec",
            "anteriores",
            "previas",
            "iniciais",
        ),
        _override(_PT_VERB, _PT_ORDERS, _PT_WHICH),
        r"\b(?:instrucoes|regras|orientacoes) (?:anteriores|previas|iniciais) (?:estao|foram|ficam) "
        r"(?:anuladas|canceladas|revogadas|obsoletas|sem efeito)",
        requires=("instrucoes", "regras", "diretrizes", "orientacoes", "ordens", "comandos", "prompt"),
    ),
    _ml_rule(
        _ML[0],
        (
            "ignorier",
            "vergiss",
            "vergessen",
            "missacht",
            "verwirf",
            "verwerfen",
            "befolge",
            "setze",
            "vorherigen",
            "bisherigen",
            "alten",
        ),
        _override(_DE_VERB, _DE_ORDERS, _DE_WHICH),
        r"\bsetze? (?:alle |deine |ihre )?(?:vorherigen |bisherigen )?(?:anweisungen|regeln) ausser kraft",
        rf"\bbefolge(?:n sie)? (?:deine |ihre |die )?(?:\w{{1,20}} )?{_DE_ORDERS} nicht mehr",
        r"\b(?:vorherigen|bisherigen|alten) (?:anweisungen|regeln|vorgaben) (?:sind|gelten) "
        r"(?:aufgehoben|ungultig|nicht mehr|widerrufen|annulliert)",
        requires=(
            "anweisung",
            "instruktionen",
            "regeln",
            "vorgaben",
            "befehle",
            "richtlinien",
            "prompt",
            "systemnachricht",
        ),
    ),
    _ml_rule(
        _ML[0],
        ("ignora", "dimentic", "trascura", "non seguire", "non rispettare"),
        _override(_IT_VERB, _IT_ORDERS, _IT_WHICH),
        requires=("istruzioni", "regole", "indicazioni", "direttive", "ordini", "prompt"),
    ),
    _ml_rule(
        _ML[0],
        (
            "игнорир",
            "забудь",
            "не обраща",
            "отбрось",
            "пренебреги",
            "не следуй",
            "не выполняй",
            "предыдущие",
            "прежние",
        ),
        _override(_RU_VERB, _RU_ORDERS, _RU_WHICH),
        r"\b(?:предыдущие|прежние) (?:инструкции|указания|правила) (?:отменены|недействительны|"
        r"больше не действуют)",
        requires=("инструкци", "указани", "правил", "установк", "команд", "промпт", "распоряжени"),
    ),
    _ml_rule(
        _ML[0],
        (
            "忽略",
            "无视",
            "無視",
            "忘",
            "不要理",
            "不要遵守",
            "不再遵守",
            "放弃",
            "放棄",
            "丢弃",
            "丟棄",
            "抛开",
            "拋開",
            "别管",
            "別管",
        ),
        rf"{_ZH_VERB}.{{0,10}}?{_ZH_WHICH}.{{0,10}}?{_ZH_ORDERS}",
    ),
    _ml_rule(
        _ML[0],
        ("指示", "命令", "指令", "ルール", "規則", "設定", "プロンプト", "制約"),
        rf"{_JA_WHICH}.{{0,12}}?{_JA_ORDERS}.{{0,12}}?{_JA_DROP}",
        rf"{_JA_ORDERS}(?:は|を)?(?:すべて|全て|全部)(?:無視|忘れ)",
    ),
    _ml_rule(
        _ML[0],
        ("تجاهل", "انس", "لا تلتزم", "لا تتبع", "اهمل", "تخل", "الغ"),
        rf"(?<!\w){_AR_VERB}\b.{{0,40}}?(?:{_AR_ORDERS}.{{0,30}}?{_AR_WHICH}|{_AR_WHICH}.{{0,30}}?{_AR_ORDERS})",
    ),
    _ml_rule(_ML[0], ("무시", "잊어"), rf"{_KO_WHICH}.{{0,12}}?{_KO_ORDERS}.{{0,12}}?(?:무시|잊어)"),
    # "forget everything you were told"
    _ml_rule(
        _ML[0],
        ("oubli", "olvid", "esquec", "vergiss", "забудь", "忘", "忘れ", "انس"),
        r"\boublie[zr]? tout ce (?:qu'on (?:t'a|vous a)|que l'on (?:t'a|vous a)|que tu as|que vous avez) "
        r"(?:dit|donne|appris|demande|recu)",
        r"\bolvida(?:te|d)?(?: de)? todo lo que (?:te|le|les) (?:dijeron|indicaron|ordenaron|han dicho|dieron|"
        r"pidieron)",
        r"\besque(?:ca|ce|cam)(?: de)? tudo o que (?:te|lhe|voce) (?:disseram|falaram|mandaram|ensinaram|deram|"
        r"recebeu)",
        r"\bvergiss alles,? was (?:man )?(?:dir|ihnen) (?:vorher |zuvor |bisher |davor )?"
        r"(?:gesagt|aufgetragen|befohlen|gegeben|beigebracht)",
        r"\bзабудь(?:те)? вс[её],? что (?:тебе|вам) (?:раньше |ранее |до этого )?(?:говорили|сказали|велели|"
        r"приказали|давали)",
        r"(?:告诉|告訴|跟)你(?:说)?的(?:一切|所有|全部).{0,6}?(?:忘掉|忘记|忘記|忘了)",
        r"(?:忘掉|忘记|忘記|忘了)(?:别人|他人|之前|以前)?(?:告诉|告訴|跟)你(?:说)?的(?:一切|所有|全部)",
        r"(?:言われた|教えられた|指示された)(?:こと|内容)(?:は|を)?(?:全部|すべて|全て)?忘れ",
        r"(?<!\w)انس(?:ى|ي)? كل ما (?:قيل لك|طلب منك|اخبروك|تعلمته)",
    ),
    # show the system prompt or the hidden instructions; repeat the text before this message
    _ml_rule(
        _ML[1],
        (
            "prompt systeme",
            "prompt du systeme",
            "invite systeme",
            "message systeme",
            "cachees",
            "secretes",
            "initiales",
            "d'origine",
            "repete",
            "recopie",
            "reecri",
        ),
        r"\b(?:affiche[zr]?|montre[zr]?|revele[zr]?|donne[zr]?-moi|donne[zr]?|repete[zr]?|divulgue[zr]?|"
        r"imprime[zr]?|dis-moi|dites-moi|recopie[zr]?)\b.{0,30}?(?:prompt systeme|prompt du systeme|"
        r"invite systeme|"
        r"message systeme|(?:instructions|consignes) (?:cachees|secretes|initiales|systeme|du systeme|d'origine))",
        r"\b(?:repete[zr]?|recopie[zr]?|reecri[st]|reecrivez)\b.{0,30}?\btexte\b.{0,30}?\b(?:avant|precede|"
        r"au-dessus)",
    ),
    _ml_rule(
        _ML[1],
        ("sistema", "ocultas", "secretas", "iniciales", "originales", "repite", "copia", "reescribe"),
        r"\b(?:muestra(?:me)?|revela(?:me)?|dime|imprime|repite|ensename|comparte|copia)\b.{0,30}?"
        r"(?:prompt (?:del|de) sistema|mensaje del sistema|instrucciones (?:ocultas|secretas|iniciales|"
        r"del sistema|originales))",
        r"\b(?:repite|copia|reescribe)\b.{0,30}?\btexto\b.{0,30}?\b(?:antes|precede|arriba)",
    ),
    _ml_rule(
        _ML[1],
        ("sistema", "ocultas", "secretas", "iniciais", "originais", "repita", "copie", "reescreva"),
        r"\b(?:mostre|mostra|revele|revela|diga|me diga|imprima|repita|compartilhe|exiba|copie)\b.{0,30}?"
        r"(?:prompt (?:do|de) sistema|mensagem do sistema|instrucoes (?:ocultas|secretas|iniciais|do sistema|"
        r"originais))",
        r"\b(?:repita|copie|reescreva)\b.{0,30}?\btexto\b.{0,30}?\b(?:antes|precede|acima)",
    ),
    _ml_rule(
        _ML[1],
        (
            "systemprompt",
            "system-prompt",
            "systemnachricht",
            "versteckten",
            "geheimen",
            "ursprunglichen",
            "anfangsanweisungen",
            "wiederhole",
            "kopiere",
        ),
        r"\b(?:zeig(?:e|en sie)?|gib|geben sie|verrate[n]?|nenne[n]?|wiederhole[n]?|drucke[n]?)\b"
        r".{0,30}?(?:system-?prompt|systemnachricht|(?:versteckten|geheimen|ursprunglichen) (?:anweisungen|"
        r"instruktionen)|"
        r"anfangsanweisungen)",
        r"\b(?:wiederhole[n]?|kopiere[n]?)\b.{0,30}?\btext\b.{0,30}?\b(?:vor|oberhalb|davor)\b",
    ),
    _ml_rule(
        _ML[1],
        ("di sistema", "nascoste", "segrete", "iniziali", "originali", "ripeti", "copia", "riscrivi"),
        r"\b(?:mostra(?:mi)?|rivela(?:mi)?|dimmi|stampa|ripeti)\b.{0,30}?"
        r"(?:prompt di sistema|messaggio di sistema|istruzioni (?:nascoste|segrete|iniziali|di sistema|"
        r"originali))",
        r"\b(?:ripeti|copia|riscrivi)\b.{0,30}?\btesto\b.{0,30}?\b(?:prima|sopra|precede)",
    ),
    _ml_rule(
        _ML[1],
        ("системн", "скрыт", "секретн", "исходн", "повтори", "скопируй", "перепиши"),
        r"\b(?:покажи(?:те)?|выведи(?:те)?|раскрой(?:те)?|расскажи(?:те)?|повтори(?:те)?|"
        r"распечатай(?:те)?|сообщи(?:те)?|дай(?:те)?)\b.{0,30}?"
        r"(?:системн\w{0,6} (?:промпт|подсказк|инструкци|сообщени)|(?:скрыт|секретн|исходн)\w{0,6} инструкци)",
        r"\b(?:повтори(?:те)?|скопируй(?:те)?|перепиши(?:те)?)\b.{0,30}?\bтекст\w{0,3}\b.{0,30}?(?:перед|до |"
        r"выше)",
    ),
    _ml_rule(
        _ML[1],
        (
            "系统",
            "系統",
            "初始指令",
            "隐藏指令",
            "隱藏指令",
            "提示词",
            "提示詞",
            "原始指令",
            "重复",
            "重複",
            "复述",
            "複述",
            "抄写",
            "抄寫",
        ),
        r"(?:显示|顯示|输出|輸出|告诉我|告訴我|打印|泄露|洩露|重复|重複|透露|给我看|給我看|展示|列出|发给我|發給我)"
        r".{0,10}?(?:系统提示|系統提示|系统指令|系統指令|初始指令|隐藏指令|隱藏指令|系统消息|系統訊息|提示词|提示詞|原始指令)",
        r"把.{0,6}?(?:系统提示|系統提示|系统指令|系統指令|初始指令|隐藏指令|隱藏指令|提示词|提示詞).{0,12}?"
        r"(?:显示|顯示|输出|輸出|告诉|告訴|打印|发给|發給|贴出|貼出|列出)",
        r"(?:重复|重複|复述|複述|抄写|抄寫).{0,12}?(?:之前|以前|上面|前面).{0,6}?(?:文字|文本|内容|內容)",
    ),
    _ml_rule(
        _ML[1],
        (
            "システム",
            "隠",
            "初期指示",
            "秘密の指示",
            "内部の指示",
            "最初の指示",
            "繰り返",
            "そのまま書",
            "出力",
            "書き出",
        ),
        r"(?:システムプロンプト|システムメッセージ|隠された指示|隠し指示|初期指示|秘密の指示|内部の指示|最初の指示)"
        r".{0,12}?(?:表示|教え|見せ|出力|明かし|開示|繰り返|書き出|公開|貼り付け)",
        r"(?:前の|以前の|上の|より前の)(?:文章|テキスト|文|内容).{0,20}?(?:繰り返|そのまま書|出力|書き出)",
    ),
    _ml_rule(
        _ML[1],
        ("موجه النظام", "تعليمات النظام", "رسالة النظام", "التعليمات", "البرومبت", "كرر", "انسخ", "اعد كتابة"),
        r"(?<!\w)(?:اعرض|اظهر|اكشف|اطبع|اخبرني|كرر|اكتب|شارك|ارني|انسخ)\b.{0,30}?"
        r"(?:موجه النظام|تعليمات النظام|رسالة النظام|التعليمات المخفية|التعليمات السرية|التعليمات الاولية|"
        r"البرومبت)",
        r"(?<!\w)(?:كرر|انسخ|اعد كتابة)\b.{0,20}?النص.{0,30}?(?:قبل|يسبق|اعلاه)",
    ),
    _ml_rule(
        _ML[1],
        ("프롬프트", "숨겨진", "초기 지시"),
        r"(?:시스템 프롬프트|숨겨진 지시|초기 지시).{0,12}?(?:보여|알려|출력|공개)",
    ),
    # the secret instructions you received
    _ml_rule(
        _ML[1],
        (
            "secretes",
            "cachees",
            "secretas",
            "ocultas",
            "geheimen",
            "versteckten",
            "секретн",
            "скрыт",
            "秘密",
            "隐藏",
            "隱藏",
            "السرية",
            "المخفية",
        ),
        r"\b(?:instructions|consignes) (?:secretes|cachees)\b.{0,40}?\b(?:recues|donnees|que tu as|qu'on t'a)",
        r"\binstrucciones (?:secretas|ocultas)\b.{0,40}?\b(?:recibiste|te dieron|que tienes)",
        r"\binstrucoes (?:secretas|ocultas)\b.{0,40}?\b(?:recebeu|te deram|lhe deram|que voce tem)",
        r"\b(?:geheimen|versteckten) (?:anweisungen|instruktionen)\b.{0,40}?\b(?:bekommen|erhalten|gegeben)",
        r"\b(?:секретн|скрыт)\w{0,4} инструкци\w{0,3}\b.{0,40}?(?:получил|дали|выдали)",
        r"(?:收到|得到|拿到)的(?:秘密|隐藏|隱藏)(?:指令|指示|说明)",
        r"(?:受け取った|与えられた|もらった)(?:秘密の|隠された|隠し)(?:指示|命令)",
        r"التعليمات (?:السرية|المخفية).{0,40}?(?:تلقيتها|اعطيت|تلقيت)",
    ),
    # a persona without restrictions; developer mode switched on
    _ml_rule(
        _ML[2],
        ("tu es", "eres", "voce e", "bist du", "ты", "你是", "あなたは", "انت"),
        r"\b(?:desormais|maintenant|a partir de maintenant|dorenavant),? tu es\b.{0,40}?\bsans (?:aucune |aucun )?"
        r"(?:restrictions?|limites?|filtres?|regles|censure)",
        r"\b(?:desde (?:este momento|ahora)|a partir de ahora|ahora),? eres\b.{0,40}?\bsin (?:ninguna |ningun )?"
        r"(?:restricciones|limites|filtros?|reglas|censura)",
        r"\b(?:de agora em diante|a partir de agora|agora),? voce e\b.{0,40}?\bsem (?:nenhuma |nenhum )?"
        r"(?:restricoes|limites|filtros?|regras|censura)",
        r"\b(?:ab jetzt|ab sofort|von nun an|jetzt|nun) bist du\b.{0,40}?\bohne (?:jegliche |alle |irgendwelche )?"
        r"(?:einschrankungen|beschrankungen|regeln|filter|zensur|grenzen)",
        r"\b(?:с этого момента|с этой минуты) ты\b.{0,40}?\bбез (?:каких-либо |всяких |любых )?"
        r"(?:ограничений|правил|фильтров|цензуры)",
        r"你是.{0,20}?(?:没有过滤|沒有過濾|没有规则|沒有規則|没有任何限制|沒有任何限制|不受任何限制|没有限制|沒有限制|无限制|無限制|没有审查|沒有審查)",
        r"あなたは.{0,30}?(?:フィルター|ルール|制限|制約)(?:も|が)?(?:ない|なし)",
        r"(?<!\w)(?:من هذه اللحظة|من الان|الان) انت\b.{0,40}?(?:بدون|بلا|دون) (?:اي )?(?:قيود|حدود|قواعد|رقابة|"
        r"فلاتر)",
    ),
    _ml_rule(
        _ML[2],
        ("tu es", "vous etes", "mode developpeur"),
        r"\b(?:tu es|vous etes) (?:desormais|maintenant|a present|dorenavant)\b.{0,40}?\bsans (?:aucune |aucun )?"
        r"(?:restrictions?|limites?|filtres?|regles|censure)",
        r"\bmode developpeur (?:est )?(?:active|activee|enclenche)\b(?! ?\?)(?! (?:sur|dans|par)\b)",
    ),
    _ml_rule(
        _ML[2],
        ("eres", "modo desarrollador", "modo de desarrollador"),
        r"\b(?:ahora eres|a partir de ahora eres|eres ahora|desde ahora eres)\b.{0,40}?\bsin (?:ninguna |ningun )?"
        r"(?:restricciones|limites|filtros|reglas|censura)",
        r"\bmodo (?:de )?desarrollador (?:esta )?(?:activado|habilitado)\b(?! ?\?)(?! (?:en|por|de)\b)",
    ),
    _ml_rule(
        _ML[2],
        ("voce", "modo desenvolvedor", "modo de desenvolvedor"),
        r"\b(?:agora voce e|voce agora e|a partir de agora voce e|de agora em diante voce e)\b.{0,40}?\bsem "
        r"(?:nenhuma |nenhum )?(?:restricoes|limites|filtros|regras|censura)",
        r"\bmodo (?:de )?desenvolvedor (?:esta )?(?:ativado|habilitado)\b(?! ?\?)(?! (?:no|na|em|por|de)\b)",
    ),
    _ml_rule(
        _ML[2],
        ("du bist", "entwicklermodus"),
        r"\bdu bist (?:jetzt|nun|ab sofort|ab jetzt)\b.{0,40}?\bohne (?:jegliche |alle |irgendwelche )?"
        r"(?:einschrankungen|beschrankungen|regeln|filter|zensur|grenzen)",
        r"\bentwicklermodus (?:ist )?(?:aktiviert|eingeschaltet)\b(?! ?\?)(?! (?:auf|in|bei|am|im)\b)",
    ),
    _ml_rule(
        _ML[2],
        ("sei ", "modalita sviluppatore", "modalita developer"),
        r"\b(?:ora sei|adesso sei|da ora in poi sei)\b.{0,40}?\bsenza (?:alcuna |nessuna )?"
        r"(?:restrizioni|limiti|filtri|regole|censura)",
        r"\bmodalita (?:sviluppatore|developer) (?:e )?attivata\b(?! ?\?)",
    ),
    _ml_rule(
        _ML[2],
        ("ты", "режим разработчика"),
        r"\b(?:теперь ты|ты теперь|отныне ты)\b.{0,40}?\bбез (?:каких-либо |всяких |любых )?"
        r"(?:ограничений|правил|фильтров|цензуры)",
        r"\bрежим разработчика (?:включен|активирован)\b(?! ?\?)(?! (?:на|в)\b)",
    ),
    _ml_rule(
        _ML[2],
        ("你现在是", "你現在是", "从现在", "從現在", "开发者模式", "開發者模式"),
        r"(?:你现在是|你現在是|从现在起你是|從現在起你是|从现在开始你是|從現在開始你是|从现在起你|從現在起你).{0,30}?"
        r"(?:没有任何限制|沒有任何限制|不受任何限制|没有限制|沒有限制|不受限制|无限制|無限制|不受约束|不受約束|没有任何规则|沒有任何規則)",
        r"(?:开发者模式|開發者模式)(?:已|已经|已經)(?:启用|啟用|开启|開啟|激活)(?![吗嗎?])",
    ),
    _ml_rule(
        _ML[2],
        ("あなたは", "開発者モード"),
        r"あなたは.{0,30}?(?:制限(?:の)?(?:ない|なし|を受けない)|制約(?:の)?ない|フィルターなし|何でもできる)",
        r"開発者モード(?:が|は)?(?:有効|オン)(?:になりました|化されました|です)(?![かね?])",
    ),
    _ml_rule(
        _ML[2],
        ("انت", "اصبحت", "وضع المطور"),
        r"(?<!\w)(?:انت الان|من الان فصاعدا انت|من الان انت|اصبحت الان)\b.{0,40}?(?:بدون|بلا|دون) (?:اي )?"
        r"(?:قيود|حدود|قواعد|رقابة|فلاتر)",
        r"وضع المطور (?:مفعل|تم تفعيله)(?! ?[؟?])",
    ),
    _ml_rule(_ML[2], ("너는", "당신은"), r"(?:너는|당신은) 이제.{0,30}?(?:제한|규칙|필터)(?:이|이나|도)? ?없"),
)
RULES += _MULTILINGUAL_RULES


@dataclass(frozen=True)
class Detection:
    """One text's verdict: the classifier's probability, the combined level and the rules that fired."""

    score: float  # classifier probability of injection, 0..1
    level: RiskLevel
    rules: tuple[str, ...]  # names of the rules that fired, in RULES order, each once

    @property
    def is_high_risk(self) -> bool:
        return self.level == "high"


class HashedFeatures:
    """Signed feature hashing into NUM_BUCKETS buckets; shared by the detector and the trainer."""

    _P = np.uint64(1_000_003)
    _MIX = np.uint64(0x9E3779B97F4A7C15)
    _SHIFT = np.uint64(64 - NUM_BUCKETS_LOG2)
    _SIGN_SHIFT = np.uint64(17)

    def sparse(self, normalised: str) -> tuple[np.ndarray, np.ndarray]:
        """(buckets int64 [n], signed values float64 [n]) for every n-gram occurrence (duplicates kept)."""
        text = _cap(normalised)
        hashes = [self._char_ngrams(text)]
        weights = [np.ones(len(hashes[0]))]
        words = _WORD.findall(text)
        if words:
            # word hashes: [num_words] uint64; bigram hashes combine neighbours
            w = np.array([zlib.crc32(x.encode()) for x in words], dtype=np.uint64) + np.uint64(1 << 40)
            hashes += [w, w[:-1] * self._P + w[1:] + np.uint64(2 << 40)]
            weights += [np.full(len(w), _WORD_WEIGHT), np.full(len(w) - 1, _WORD_WEIGHT)]
        mixed = np.concatenate(hashes) * self._MIX
        signs = ((mixed >> self._SIGN_SHIFT) & np.uint64(1)).astype(np.float64) * 2.0 - 1.0
        return (mixed >> self._SHIFT).astype(np.int64), signs * np.concatenate(weights)

    def dense(self, normalised: str) -> np.ndarray:
        """The L2-normalised feature vector: float64 [NUM_BUCKETS]."""
        buckets, values = self.sparse(normalised)
        vec = np.bincount(buckets, weights=values, minlength=NUM_BUCKETS)
        norm = float(np.sqrt(vec @ vec))
        return vec / norm if norm else vec

    def _char_ngrams(self, text: str) -> np.ndarray:
        # codes: [len] uint64 code points of " text "; hN: [len - N + 1] polynomial hashes of N-grams
        codes = np.frombuffer(f" {text} ".encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        if len(codes) < 3:
            return np.zeros(0, dtype=np.uint64)
        h3 = (codes[:-2] * self._P + codes[1:-1]) * self._P + codes[2:]
        h4 = h3[:-1] * self._P + codes[3:]
        h5 = h4[:-1] * self._P + codes[4:]
        return np.concatenate([h3 + np.uint64(3), h4 + np.uint64(4), h5 + np.uint64(5)])


def _cap(text: str) -> str:
    if len(text) <= 2 * _CLASSIFIER_EDGE_CHARS:
        return text
    return f"{text[:_CLASSIFIER_EDGE_CHARS]} {text[-_CLASSIFIER_EDGE_CHARS:]}"


def load_weights(path: Path) -> tuple[np.ndarray, float]:
    """(weights float32 [NUM_BUCKETS], bias) from the JSON the training script writes."""
    data = json.loads(path.read_text())
    if data["num_buckets"] != NUM_BUCKETS:
        raise ValueError(
            f"{path}: num_buckets={data['num_buckets']} but the detector hashes into {NUM_BUCKETS}; "
            "retrain with scripts/train_injection_classifier.py"
        )
    weights = np.frombuffer(base64.b64decode(data["weights_f16"]), dtype="<f2").astype(np.float32)
    if weights.shape != (NUM_BUCKETS,):
        raise ValueError(f"{path}: {weights.shape=} must be ({NUM_BUCKETS},)")
    return weights, float(data["bias"])


class InjectionDetector:
    """Rules plus a hashed-feature logistic regression; `detect` is pure and safe to share across threads."""

    def __init__(self, model_path: Path | None = None) -> None:
        self._weights, self._bias = load_weights(model_path or DEFAULT_MODEL_PATH)
        self._features = HashedFeatures()

    def score(self, normalised: str) -> float:
        """The classifier's probability of injection for already-normalised text."""
        # The same as dense(normalised) @ weights, over the non-zero buckets only and without BLAS:
        # OpenBLAS ran the 32k-long dot products on a helper thread that then busy-waited, ten
        # times the CPU of the arithmetic (0.21 vs 2.6 ms per prompt in the gateway).
        buckets, values = self._features.sparse(normalised)
        vec = np.bincount(buckets, weights=values, minlength=NUM_BUCKETS)
        hit = np.flatnonzero(vec)
        active = vec[hit]
        norm = math.sqrt(float(np.sum(active * active)))
        logit = (float(np.sum(active * self._weights[hit])) / norm if norm else 0.0) + self._bias
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, logit))))

    def detect(self, text: str) -> Detection:
        """The verdict on one prompt; cost linear in len(text), classifier part bounded."""
        normalised = normalise(text)
        squeezed = compact(normalised)
        lowered = normalised if text.isascii() else normalise_lowered(text)
        fired = [r for r in RULES if r.search(squeezed if r.on_compact else lowered if r.on_lowered else normalised)]
        names = tuple(dict.fromkeys(r.name for r in fired))
        score = self.score(normalised)
        if any(r.is_strong for r in fired) or score >= HIGH_SCORE:
            level: RiskLevel = "high"
        elif fired or score >= MEDIUM_SCORE:
            level = "medium"
        else:
            level = "low"
        return Detection(score=score, level=level, rules=names)


class RiskTracker:
    """High-risk detections per principal within a sliding window; says when a principal crosses the review threshold."""

    def __init__(self, threshold: int = 5, window_s: float = 3600.0, max_principals: int = 100_000) -> None:
        if threshold < 1 or window_s <= 0 or max_principals < 1:
            raise ValueError(f"{threshold=} and {max_principals=} must be >= 1 and {window_s=} > 0")
        self.threshold = threshold
        self.window_s = window_s
        self.max_principals = max_principals
        # principal -> timestamps (s) inside the window, oldest first; dict order = least recently recorded first
        self._events: OrderedDict[str, deque[float]] = OrderedDict()
        self._is_flagged: dict[str, bool] = {}

    def record(self, principal: str, now_s: float) -> bool:
        """Count one high-risk detection; True exactly once when the principal reaches `threshold` within the window (then not again until its count has fallen below the threshold and reached it again)."""
        events = self._events.pop(principal, None)
        if events is None:
            events = deque(maxlen=max(self.threshold, _MAX_EVENTS_PER_PRINCIPAL))
        self._events[principal] = events
        self._expire(principal, events, now_s)
        events.append(now_s)
        while len(self._events) > self.max_principals:
            evicted, _ = self._events.popitem(last=False)
            self._is_flagged.pop(evicted, None)
        if len(events) >= self.threshold and not self._is_flagged.get(principal, False):
            self._is_flagged[principal] = True
            return True
        return False

    def count(self, principal: str, now_s: float) -> int:
        """High-risk detections of `principal` within the window ending at now_s (saturates at 1,024)."""
        events = self._events.get(principal)
        if events is None:
            return 0
        self._expire(principal, events, now_s)
        return len(events)

    def times(self, principal: str, now_s: float) -> list[float]:
        """The times (s) of `principal`'s high-risk detections within the window, oldest first."""
        events = self._events.get(principal)
        if events is None:
            return []
        self._expire(principal, events, now_s)
        return list(events)

    def _expire(self, principal: str, events: deque[float], now_s: float) -> None:
        while events and events[0] <= now_s - self.window_s:
            events.popleft()
        if len(events) < self.threshold:
            self._is_flagged.pop(principal, None)
