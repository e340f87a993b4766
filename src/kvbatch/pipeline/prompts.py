"""Turn a row's prompt or messages into token ids (chat template on or off, with the job's chat options)."""
from __future__ import annotations

from typing import Any

from kvbatch.pipeline.chat import continues, turns
from kvbatch.pipeline.config import ConfigError, JobConfig


def check_template(tokenizer: Any, chat_template: bool) -> None:
    """Fail at start, not per row, when the job asks for a template the model lacks."""
    if chat_template and not getattr(tokenizer, "has_chat_template", bool(getattr(tokenizer, "chat_template", None))):
        raise ConfigError("job.chat_template=true but the model's tokenizer has no chat template; "
                          "set job.chat_template=false to send prompts as raw text")


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _raw_prompt(payload: dict) -> str:
    """The prompt of a row sent as raw text (no chat template)."""
    if "messages" in payload:
        raise ValueError("a messages row needs job.chat_template=true")
    return payload["prompt"]


def _source(tokenizer: Any, payload: dict, job: JobConfig) -> tuple[str, bool]:
    """(text, raw) for one valid payload: its prompt as is (raw: encoding it adds the tokenizer's special
    tokens, as `encode` does) or its turns through the chat template (the rendered text holds its own)."""
    if turns(payload, job) is None:
        return _raw_prompt(payload), True
    return render(tokenizer, payload, job, tokenize=False), False


def render(tokenizer: Any, payload: dict, job: JobConfig, tokenize: bool = True) -> Any:
    """Token ids (or, tokenize=False, the text) for one valid payload; ValueError (-> invalid_input) when
    it cannot be encoded. A trailing assistant turn is continued under job.continue_final_message."""
    msgs = turns(payload, job)
    if msgs is None:
        prompt = _raw_prompt(payload)
        return _ids(tokenizer.encode(prompt)) if tokenize else prompt
    cont = continues(msgs, job)
    try:
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=not cont, continue_final_message=cont,
                                            tokenize=tokenize, **(job.chat_template_kwargs or {}))
    except Exception as exc:  # jinja/template errors are the row's problem, not the run's
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"chat template failed: {why}") from None
    return _ids(out) if tokenize else out


def encode(tokenizer: Any, payload: dict, job: JobConfig) -> list[int]:
    """A row's prompt token ids (its prompt or messages rendered through the chat template when it has one)."""
    return render(tokenizer, payload, job)


def encode_rows(tokenizer: Any, payloads: list[dict], job: JobConfig) -> list[list[int] | ValueError]:
    """Each row's prompt token ids as `encode` gives them, or the ValueError that row's encoding raises.

    A tokenizer that encodes many texts in one call (`encode_batch`: the `tokenizers` library spreads them
    over the cores) takes every row's text together: a worker encodes the rows it claims before any of them
    can start, and a large batch claims a thousand rows at once."""
    out: list[list[int] | ValueError] = []
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        texts: list[tuple[int, str, bool]] = []
        for i, payload in enumerate(payloads):
            try:
                texts.append((i, *_source(tokenizer, payload, job)))
                out.append([])
            except ValueError as exc:
                out.append(exc)
        for raw in (True, False):
            group = [(i, text) for i, text, r in texts if r == raw]
            for (i, _), ids in zip(group, batch([text for _, text in group], add_special_tokens=raw), strict=True):
                out[i] = ids
        return out
    for payload in payloads:
        try:
            out.append(encode(tokenizer, payload, job))
        except ValueError as exc:
            out.append(exc)
    return out
