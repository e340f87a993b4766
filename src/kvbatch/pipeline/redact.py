"""A database URL as it may be shown or stored: messages, status lines, summaries, config.yaml, results
metadata and a sweep's files never hold its password.

The password of `scheme://user:PASSWORD@host/db` is everything between the user's ':' and the last '@'
before the query, so a password holding a raw '/' or '@' is found whole; `?password=...` in the query
is one too. `split_password` takes it out of a URL (the kvbatch command moves it to PGPASSWORD, which
libpq reads, before Hydra sees the override, so Hydra's files and messages never hold it).
"""
from __future__ import annotations

import re
from typing import Any, Optional
from urllib.parse import unquote

MASK = "***"
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@/?]*):(?P<pw>[^?]*)@(?P<rest>[^@?]*(?:\?.*)?)$",
                       re.DOTALL)
_QUERY = re.compile(r"([?&]password=)([^&]*)")


def split_password(url: str) -> tuple[str, Optional[str]]:
    """(the URL without its password, the password percent-decoded as libpq reads it; None: none)."""
    m = _USERINFO.match(url)
    password = None
    if m:
        url, password = f"{m['head']}@{m['rest']}", unquote(m["pw"])
    q = _QUERY.search(url)
    if q:
        password = unquote(q.group(2))
        url = _QUERY.sub("", url, count=1)
        url = url.replace("&", "?", 1) if "?" not in url else url
    return url, password


def redact(url: str) -> str:
    """postgresql://u:secret@h/db -> postgresql://u:***@h/db (also ?password=... in the query)."""
    m = _USERINFO.match(url)
    if m:
        url = f"{m['head']}:{MASK}@{m['rest']}"
    return _QUERY.sub(rf"\g<1>{MASK}", url)


def redact_override(text: str) -> str:
    """A command-line override as it may be stored (`queue.url=...` with its password hidden)."""
    key, sep, value = text.partition("=")
    if not sep or key.lstrip("+~") != "queue.url":
        return text
    quote = value[0] if len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0] else ""
    inner = value[1:-1] if quote else value
    return f"{key}={quote}{redact(inner)}{quote}"


def redact_config(config: Any) -> Any:
    """A config as plain containers (pipeline/config.py as_dict) with queue.url's password hidden."""
    if isinstance(config, dict) and isinstance(config.get("queue"), dict) and config["queue"].get("url"):
        config = {**config, "queue": {**config["queue"], "url": redact(str(config["queue"]["url"]))}}
    return config


_URL_IN_TEXT = re.compile(r"postgres(?:ql)?://[^\s'\",\]}]+")


def redact_text(text: str) -> str:
    """Every database URL in a text (a YAML file, a message) with its password hidden."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def move_password_to_env(args: list[str], environ: Any) -> list[str]:
    """The command's overrides with `queue.url`'s password taken out and put in PGPASSWORD (libpq reads it
    when the URL has none), so no file or message made from the overrides (Hydra's multirun.yaml, its
    "Error executing job with overrides" line, a sweep's job_status.json) ever holds it."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "queue.url":
            quote = value[0] if len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0] else ""
            url, password = split_password(value[1:-1] if quote else value)
            if password is not None:
                environ["PGPASSWORD"] = password
                arg = f"{key}={quote}{url}{quote}"
        out.append(arg)
    return out
