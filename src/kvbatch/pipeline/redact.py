"""A database URL as it may be shown: messages, status lines and summaries never print its password."""
from __future__ import annotations

import re


def redact(url: str) -> str:
    """postgresql://u:secret@h/db -> postgresql://u:***@h/db (also ?password=... in the query)."""
    url = re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)
