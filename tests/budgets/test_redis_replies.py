"""The scripts' reply parser (budgets/redis/replies.py): it names every code the Lua scripts write,
and a reply it does not know is an error naming the script, never a silent misread."""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest

from budgets.redis import replies

# A reply table's leading code (``{ 'G', ...``) or a wake-up's (``'G' .. SEP``).
_CODE = re.compile(r"\{ '([A-Z]+)'|'([A-Z]+)' \.\. SEP")


def lua_reply_codes() -> set[str]:
    codes: set[str] = set()
    for source in resources.files("budgets.redis").joinpath("lua").iterdir():
        if source.name.endswith(".lua"):
            for table, wake in _CODE.findall(source.read_text(encoding="utf-8")):
                codes.add(table or wake)
    return codes


def test_every_reply_code_the_scripts_write_is_named_in_the_parser() -> None:
    named = {v for k, v in vars(replies).items() if k.isupper() and isinstance(v, str)}
    written = lua_reply_codes()
    assert written, "no reply codes found in the Lua sources"
    assert written <= named, f"codes the parser does not name: {sorted(written - named)}"


@pytest.mark.parametrize(
    ("parse", "script"),
    [(replies.acquire, "acquire"), (replies.status, "status"), (replies.withdraw, "withdraw")],
)
def test_a_reply_code_the_parser_does_not_know_is_an_error_naming_its_script(
    parse: Callable[[list[str]], Any], script: str
) -> None:
    with pytest.raises(ValueError, match=rf"{script}\.lua"):
        parse(["ZZ"])


def test_a_wake_up_names_its_ticket_by_seq_and_lease_id() -> None:
    sep = replies.SEP
    assert replies.wake_up(sep.join(["G", "7", "r1-a", "12.5", "0.25"])) == (
        7,
        "r1-a",
        replies.Granted(12.5, 0.25),
    )
    assert replies.wake_up(sep.join(["F", "8", "r1-b", "never", "backend:p", "100"])) == (
        8,
        "r1-b",
        replies.Invalid("never", "backend:p", 100),
    )


def test_an_older_versions_wake_up_without_a_lease_id_is_still_read() -> None:
    # During a rolling upgrade a replica of the previous version grants this one's tickets and
    # announces them in its own format: seq, then the outcome.
    sep = replies.SEP
    assert replies.wake_up(sep.join(["G", "7", "12.5", "0.25"])) == (7, None, replies.Granted(12.5, 0.25))
    assert replies.wake_up(sep.join(["F", "8", "tenant", "x", ""])) == (
        8,
        None,
        replies.Invalid("tenant", "x", None),
    )
