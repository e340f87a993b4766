"""Turn a row's prompt or messages into token ids (chat template on or off)."""
from __future__ import annotations

from typing import Any

from kvbatch.pipeline.config import ConfigError


def check_template(tokenizer: Any, chat_template: bool) -> None:
    """Fail at start, not per row, when the job asks for a template the model lacks."""
    if chat_template and not getattr(tokenizer, "has_chat_template", bool(getattr(tokenizer, "chat_template", None))):
        raise ConfigError("job.chat_template=true but the model's tokenizer has no chat template; "
                          "set job.chat_template=false to send prompts as raw text")


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def encode(tokenizer: Any, payload: dict, chat_template: bool) -> list[int]:
    """Token ids for one valid payload; ValueError (-> invalid_input) when it cannot be encoded."""
    messages = payload.get("messages")
    if messages is None:
        if not chat_template:
            return _ids(tokenizer.encode(payload["prompt"]))
        messages = [{"role": "user", "content": payload["prompt"]}]
    elif not chat_template:
        raise ValueError("a messages row needs job.chat_template=true")
    try:
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    except Exception as exc:  # jinja/template errors are the row's problem, not the run's
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"chat template failed: {why}") from None
