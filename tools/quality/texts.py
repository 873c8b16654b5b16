"""The evaluation texts: three of different kinds to tune on, one kept aside (tools/texts/NOTICE.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ROOT / "tools" / "texts"


@dataclass(frozen=True)
class Text:
    name: str
    path: Path
    held_aside: bool = False


DEFAULT_TEXTS = (
    Text("prose", TEXTS / "prose-genesis-joseph.txt"),
    Text("code", TEXTS / "code-cpython-textwrap.py"),
    Text("technical", ROOT / "rvqstore" / "data" / "python_docs_excerpt.txt"),
    Text("held-aside", TEXTS / "heldaside-idle-news.txt", held_aside=True),
)


def text_from_arg(arg: str) -> Text:
    """``--text`` argument: ``PATH`` or ``NAME=PATH``; a name starting with ``held`` marks it kept aside."""
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = Path(arg).stem, arg
    return Text(name, Path(path), held_aside=name.startswith("held"))


def load_tokens(tokenizer: Any, text: Text, n: int) -> list[int]:
    """The first ``n`` token ids of ``text`` (an error if it is shorter: a short text would be
    scored on fewer tokens than the report says)."""
    ids = list(tokenizer.encode(text.path.read_text(encoding="utf-8")))
    if len(ids) < n:
        raise ValueError(f"{text.path} has only {len(ids)} tokens, {n} asked")
    return ids[:n]
