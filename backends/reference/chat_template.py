"""The reference backend's chat template.

Each message renders as ``<{role}>\\n{content}\\n`` and the prompt ends with the assistant
priming ``<assistant>\\n``. Example::

    <system>
    You are helpful.
    <user>
    Hi!
    <assistant>

With cl100k, ``<``, ``{role}`` and ``>\\n`` are one token each and the closing newline is one
more (it may merge with trailing punctuation), so a message costs about 3 tokens + its role +
its content, and the priming costs 3: the same rule the gateway prices chat with (OpenAI's
cookbook counting), so the backend's ``prompt_tokens`` and the gateway's estimate agree within
a token or so per message. Content given as a list of parts uses its text parts, joined.
"""

from __future__ import annotations

from collections.abc import Sequence

ASSISTANT_PRIMING = "<assistant>\n"


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    parts = [f"<{role}>\n{content}\n" for role, content in messages]
    parts.append(ASSISTANT_PRIMING)
    return "".join(parts)
