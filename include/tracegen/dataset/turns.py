"""Which assistant turns of a conversation are generated: the prompt rows one conversation becomes.

- `last`: a conversation ending with an assistant turn is the prompt up to that turn, and that turn is
  generated again; one ending with a user or tool message is the prompt as it is (as tracegen always read it);
- `first`: the conversation up to its first user message;
- `each`: one prompt row per assistant message, its real history as the prompt, and one more for a
  conversation that ends with a user or tool message.
- `chain`: the same prompt rows, cut where `each` cuts them, but turn k is generated after turns 1..k-1 and
  its history holds the model's own answers to them instead of the dataset's (`chained_messages`), as
  SpecForge's `regenerate_train_data.py` regenerates a conversation. The reader hands out the dataset's
  history; the chunk replaces it from the ledger when it sends the turn (`generate.chain`). A conversation
  with a tool call or a tool result cannot be chained: its later turns answer the original call's result,
  which a regenerated call would not get (`request_rules.check_chainable`).

No prompt chosen here may end with an assistant message; that is not enforced here but where every prompt
is checked (`request_rules.check_prompt_end`), so a conversation such as [user, assistant, assistant] gives an
invalid row naming why, whichever mode chose it.

The index pass counts each conversation's prompt rows with `prompt_count` and the reader expands it with
`prompt_messages`: both call `_cuts`, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any

from tracegen.dataset.reading import CHAIN, EACH, FIRST, LAST

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
    assert turns in (EACH, CHAIN)
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
    """A prompt row's id under `each` and `chain`: its conversation's and its turn's (from 1). Every such id ends with
    exactly one mark added to a conversation id, and conversation ids are unique (`dataset.row_ids`), so two
    prompt rows never share one."""
    return f"{conversation_id}{TURN_MARK}{turn}"


def conversation_id(prompt_row_id: str) -> str:
    """The conversation's id of a prompt row's id under `each` and `chain` (`turn_id`'s inverse)."""
    return prompt_row_id.rsplit(TURN_MARK, 1)[0]


def chained_messages(messages: list[dict[str, Any]], answers: list[str | None]) -> list[dict[str, Any]]:
    """Turn k's prompt under `chain`: its dataset prompt (`prompt_messages`, which holds the k-1 earlier
    assistant turns) with the j-th assistant message replaced by the model's own answer to turn j+1,
    `answers[j]` (its committed row's `content`). `answers` is one per earlier turn, in order.

    An answer is written as its content only, without its `reasoning_content`: SpecForge's regeneration sends
    the history so (`build_query_kwargs` drops an assistant message's `reasoning_content` from the request,
    while its output keeps it), and chat templates such as Qwen3's drop an earlier turn's thinking anyway, so
    the prompt the model sees is the same either way where they do and does not grow where a template would
    keep it."""
    earlier = [k for k, m in enumerate(messages) if _role(m) == "assistant"]
    if len(earlier) != len(answers):
        raise ValueError(f"the prompt holds {len(earlier)} earlier assistant turns, {len(answers)} answers given")
    out = list(messages)
    for k, answer in zip(earlier, answers, strict=True):
        out[k] = {"role": "assistant", "content": answer or ""}
    return out
