"""The context-window policy, in one place: how many reply tokens a prompt may ask for.

A request's prompt plus its reply must fit the served window. A request that names max_tokens
gets it or a WindowError; one that names none gets the default, capped to the room left.
The API turns a WindowError into its 400 (naming its own field); the engine raises it as
ValueError for direct callers.
"""


class WindowError(ValueError):
    def __init__(self, message: str, prompt_too_long: bool):
        super().__init__(message)
        self.prompt_too_long = prompt_too_long   # else: max_tokens asks for too much


def reply_budget(window: int, num_prompt: int, max_tokens: int | None, default: int,
                 max_tokens_field: str = "max_tokens") -> int:
    """The reply's token limit for a prompt of num_prompt tokens in a window of `window`."""
    room = window - num_prompt
    if room < 1:
        raise WindowError(f"the prompt is {num_prompt} tokens, which leaves no room for a reply in "
                          f"this model's {window}-token context window; shorten the prompt", True)
    if max_tokens is None:
        return min(default, room)
    if num_prompt + max_tokens > window:
        raise WindowError(
            f"this model's context window is {window} tokens, but the request asks for "
            f"{num_prompt + max_tokens} ({num_prompt} in the prompt + {max_tokens} for the reply); "
            f"lower {max_tokens_field} to at most {room} or shorten the prompt", False)
    return max_tokens
