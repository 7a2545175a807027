"""Which requests are background work: `priority: "background"`, and session-title requests.

Coding agents and chat front-ends ask the model for a short title of the conversation beside
the real work (OpenCode's "You are a title generator", Open WebUI's "Generate a concise, 3-5
word title ..."). Such a request is recognised by its shape: a system message, or the last user
message, that asks to generate/create/write a title, or that calls the model a title generator.
It then waits behind foreground requests like `priority: "background"` (an explicit
`priority: "foreground"` keeps it in front).
"""
import re

from tensorfold.chat.messages import content_text

FOREGROUND, BACKGROUND = 0, 1

_TITLE_ASK = re.compile(
    r"\btitle[ -]generator\b|\b(generate|create|write|produce|suggest)\b[^.\n]{0,60}\btitle\b",
    re.IGNORECASE)


def is_session_title(messages) -> bool:
    if not messages:
        return False
    texts = [content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    users = [m for m in messages if m.get("role") == "user"]
    if users:
        texts.append(content_text(users[-1].get("content")))
    return any(_TITLE_ASK.search(t[:2000]) for t in texts)


def request_priority(priority: str | None, messages) -> int:
    """priority: the parsed field, "foreground" | "background" | None (unset)."""
    if priority == "background" or (priority is None and is_session_title(messages)):
        return BACKGROUND
    return FOREGROUND
