"""A model's Jinja chat template, rendered as transformers' apply_chat_template renders it.

On the shared floor (docs/design.md, "The floors"): the worker's engine renders a chat's prompt
with it (services/worker/engine/tokenizer.py) and the gateway's POST /tokenize renders the same
chat with the same function (`render_chat`), so the token ids /tokenize gives for a chat are the
ones the engine runs. Pure: the jinja2 sandbox and the model directory's files, no torch.

Templates come with model directories, often from the Hub: they are untrusted code. They run in
Jinja's ImmutableSandboxedEnvironment with the options, globals and filters transformers gives them
(transformers.utils.chat_template_utils._compile_jinja_template): trim_blocks, lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML,
and the restricted `dict` and `namespace`. The variables are transformers' too: `messages`,
`tools` (the request's, as `{"type": "function", "function": {...}}` dicts; None without),
`documents` (None: the wire has none), `add_generation_prompt` and every named special token of the
tokenizer (`bos_token`, `eos_token`, ...). So Weir's prompt is the text
`tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)`
gives, each message a dict of its wire fields (an assistant's `tool_calls` with their `arguments`
as the JSON text the wire carries: the template decides what to make of them).

Tools and templates that do not know them (docs/design.md, "Structured output, tools and
logprobs"). A template that never reads `tools` (ChatML as SmolLM2 ships it, Llama 3.0's, or no
template at all) gets the chat rewritten as plain turns in the Hermes format that schemas/tools.py
parses back (`text_turns`):

- with tools, a system turn lists them and asks for calls as `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` (schemas/tools.py: tools_preamble); it goes before the first system turn's
  content (separated by a blank line), or is a system turn of its own when the chat has none;
- an assistant turn's tool calls follow its content, one per line, each as
  `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` (arguments as a JSON object when
  they are JSON text, else as the string);
- `tool` turns become one user turn per run of them, each result as
  `<tool_response>\n<content>\n</tool_response>`, one per line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from schemas.messages import ChatMessage, ToolDef
from schemas.tools import call_text, response_text, tools_preamble


class ChatTemplateError(ValueError):
    """The template cannot be compiled (at load) or refused to render a chat (that request only)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks assistant
    token indices with it for training; serving only needs the text)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares tags an instance attribute, as here

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # transformers' override: Jinja's own tojson escapes HTML characters, and takes fewer options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` without attribute access to the type (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (transformers' TemplateNamespace)."""

    def __init__(*args, **kwargs) -> None:
        self, args = args[0], args[1:]  # Jinja's signature trick, so that namespace(self=...) works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' sandbox; raises ChatTemplateError on a syntax error."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc


# A conversation whose assistant turn is followed by what ends a turn (user, assistant, user: the
# order every template accepts); its words are ones no template rewrites.
_PROBE_ASSISTANT = "weirprobeassistant"
_PROBE = [
    {"role": "user", "content": "weirprobeuser"},
    {"role": "assistant", "content": _PROBE_ASSISTANT},
    {"role": "user", "content": "weirprobeuser"},
]


class ChatTemplate:
    """One model's chat template with the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self._template = compile_template(source)
        self.special_tokens = dict(special_tokens)  # bos_token, eos_token, ... -> text
        # a template that reads `tools` renders them (and, we take it, tool calls and results) itself
        self.knows_tools = "tools" in jinja2.meta.find_undeclared_variables(self._template.environment.parse(source))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The chat as prompt text. Raises ChatTemplateError when the template refuses it
        (raise_exception, e.g. a role order it does not take) or fails on it."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused this chat: {exc}") from exc
        except Exception as exc:  # a template is code: a TypeError in it ends this request only
            raise ChatTemplateError(
                f"the model's chat template failed on this chat: {type(exc).__name__}: {exc}"
            ) from exc

    def end_of_turn(self, special_texts: Iterable[str]) -> str | None:
        """The special token the template closes an assistant turn with (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>, Mistral's </s>), or None when it closes it with none."""
        try:
            text = self.render(_PROBE, add_generation_prompt=False)
        except ChatTemplateError:
            return None
        end = text.find(_PROBE_ASSISTANT)
        if end < 0:
            return None
        after = text[end + len(_PROBE_ASSISTANT) :].lstrip()
        matches = [s for s in special_texts if s and after.startswith(s)]
        return max(matches, key=len, default=None)


def text_turns(messages: list[ChatMessage], tools: list[ToolDef] | None) -> list[dict]:
    """The chat as plain role/content turns, tools and tool turns written in the Hermes format, for
    a template that does not know tools (the module docstring gives the exact rendering)."""
    turns: list[dict] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            result = response_text(message.content)
            if i and messages[i - 1].role == "tool":  # a run of results is one user turn
                turns[-1]["content"] += "\n" + result
            else:
                turns.append({"role": "user", "content": result})
            continue
        content = message.content
        if message.tool_calls:
            content = "\n".join(([content] if content else []) + [call_text(c) for c in message.tool_calls])
        turns.append({"role": message.role, "content": content})
    if tools:
        preamble = tools_preamble(tools)
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{preamble}\n\n{turns[0]['content']}"
        else:
            turns.insert(0, {"role": "system", "content": preamble})
    return turns


def render_chat(
    template: ChatTemplate | None,
    messages: list[ChatMessage],
    tools: list[ToolDef] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Chat turns (and the tools the model may call) as prompt text, through the model's chat
    template when it has one: what the engine runs, and what the gateway's /tokenize counts.

    Raises ChatTemplateError when the template refuses the chat. A template that reads `tools`
    gets every field a message has on the wire (None fields dropped, as transformers drops them)
    and the tools as dicts; any other, and the plain transcript, get the chat as plain turns with
    tools, calls and results written as text (text_turns). Without a template (a base model) the
    chat is a plain transcript that ends where the assistant speaks (when `add_generation_prompt`).
    """
    if template is not None and template.knows_tools:
        turns = [m.model_dump(exclude_none=True) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        return template.render(turns, add_generation_prompt=add_generation_prompt, tools=tool_dicts)
    plain = text_turns(messages, tools)
    if template is not None:
        return template.render(plain, add_generation_prompt=add_generation_prompt)
    lines = [f"{t['role']}: {t['content']}" for t in plain]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def read_json(file: Path) -> dict:
    """A model directory's JSON file, {} when it is absent."""
    return json.loads(file.read_text()) if file.exists() else {}


def special_tokens(config: dict, special_tokens_map: dict) -> dict[str, str]:
    """The special tokens transformers passes a chat template: every `*_token` entry of
    tokenizer_config.json (special_tokens_map.json's override them when the config has no
    added_tokens_decoder, as transformers' legacy loading does) and extra_special_tokens given by name."""
    entries = dict(config)
    if "added_tokens_decoder" not in config:
        entries.update(special_tokens_map)
    extra = entries.get("extra_special_tokens")
    if isinstance(extra, dict):
        entries = {**extra, **entries}
    tokens = {k: _token_text(v) for k, v in entries.items() if k.endswith("_token")}
    return {k: v for k, v in tokens.items() if v is not None}


def template_source(path: Path, config: dict) -> tuple[str | None, str]:
    """The chat template and where it came from: chat_template.jinja wins over tokenizer_config.json
    (as in transformers); a list of named templates there gives the one named "default"."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    origin = str(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(f"{origin}: chat templates {sorted(map(str, named))} include none named 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{origin}: chat_template must be a string, got {type(template).__name__}")
    return template, origin


def load_chat_template(path: str | Path) -> tuple[ChatTemplate | None, dict[str, str]]:
    """A model directory's chat template (None when it has none) and its named special tokens, as
    the engine's tokenizer and the gateway's /tokenize both load them. Raises ChatTemplateError,
    naming the file, for a template that does not compile."""
    path = Path(path)
    config = read_json(path / "tokenizer_config.json")
    specials = special_tokens(config, read_json(path / "special_tokens_map.json"))
    source, origin = template_source(path, config)
    try:
        return (ChatTemplate(source, specials) if source is not None else None), specials
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{origin}: {exc}") from exc


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
