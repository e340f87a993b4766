"""Input files and result reading shared by the pipeline tests."""
from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(tmp_path: Path, lines: list, name: str = "in.jsonl") -> Path:
    """A JSONL file of `lines` under tmp_path: a str is written as it is (a broken line on purpose), anything else
    as its JSON."""
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def error_codes(rows: dict[str, dict]) -> dict[str, object]:
    """row_key -> error_code (None: ok) of results read as {row_key: row}."""
    return {k: r["error_code"] for k, r in rows.items()}
