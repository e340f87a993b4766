"""Render a Hugging Face chat template with jinja2 as transformers' `apply_chat_template` does.

The same environment (sandboxed, trim_blocks and lstrip_blocks, loop controls, the `generation`
tag), the same globals and filters (`raise_exception`, `strftime_now`, `tojson` without HTML
escaping, `dict`, `namespace`), the special tokens (bos_token, eos_token, ...) in the context with
the caller's kwargs over them, and the same `continue_final_message` cut. Messages are plain
{role, content} dicts (kvbatch's rows), so transformers' object and media conversions have nothing
to do here.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant
    tokens with it; a rendering without the mask only needs the body)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """`dict(...)` without attribute access to the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: one per model)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def render(source: str, messages: list[dict], special_tokens: dict[str, str], *, add_generation_prompt: bool = False,
           continue_final_message: bool = False, tools: Optional[list] = None, documents: Optional[list] = None,
           **kwargs: Any) -> str:
    """The conversation's text; ValueError or a jinja2 error when the template or messages refuse. tools and
    documents: JSON-schema dicts and {title, text} dicts, as transformers passes them to the template."""
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in source:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field in '
                             'the chat_template')
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    text = compile_template(source).render(messages=chat, tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt,
                                           **{**special_tokens, **kwargs})
    if final is not None:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                             "after applying the chat template!")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
