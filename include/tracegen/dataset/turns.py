"""Which assistant turns of a conversation are generated: the prompt rows one conversation becomes.

- `last`: a conversation ending with an assistant turn is the prompt up to that turn, and that turn is
  generated again; one ending with a user or tool message is the prompt as it is (as tracegen always read it);
- `first`: the conversation up to its first user message;
- `each`: one prompt row per assistant message, its real history as the prompt, and one more for a
  conversation that ends with a user or tool message.

No prompt chosen here may end with an assistant message; that is not enforced here but where every prompt
is checked (`request_rules.check_prompt_end`), so a conversation such as [user, assistant, assistant] gives an
invalid row naming why, whichever mode chose it.

The index pass counts each conversation's prompt rows with `prompt_count` and the reader expands it with
`prompt_messages`: both call `_cuts`, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any

from tracegen.dataset.reading import EACH, FIRST, LAST

TURN_MARK = "#turn-"


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _cuts(messages: list[Any], turns: str) -> list[int]:
    """Where each prompt row of the conversation ends (its messages are messages[:cut])."""
    n = len(messages)
    ends_with_assistant = n > 0 and _role(messages[-1]) == "assistant"
    if turns == LAST:
        return [n - 1 if ends_with_assistant else n]
    if turns == FIRST:
        first_user = next((k for k, m in enumerate(messages) if _role(m) == "user"), None)
        return [n if first_user is None else first_user + 1]
    assert turns == EACH
    cuts = [k for k, m in enumerate(messages) if _role(m) == "assistant"]
    if not ends_with_assistant:
        cuts.append(n)
    return cuts


def prompt_messages(messages: Any, turns: str) -> list[Any]:
    """The prompt rows' messages, one list each; anything but a list is one row (for the checks to refuse)."""
    if not isinstance(messages, list):
        return [messages]
    return [messages[:cut] for cut in _cuts(messages, turns)]


def prompt_count(messages: Any, turns: str) -> int:
    return len(_cuts(messages, turns)) if isinstance(messages, list) else 1


def turn_id(conversation_id: str, turn: int) -> str:
    """A prompt row's id under `each`: its conversation's and its turn's (from 1). Every such id ends with
    exactly one mark added to a conversation id, and conversation ids are unique (`dataset.row_ids`), so two
    prompt rows never share one."""
    return f"{conversation_id}{TURN_MARK}{turn}"
