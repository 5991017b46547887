"""Chat-template rendering in token ids, for prompts and for the tokens between two assistant turns.

A multi-turn episode must never re-encode the conversation: the assistant turns are the exact ids the
server generated. What the loop adds after a turn (the end-of-turn glue and the tool results, rendered by
the model's own chat template) is computed as a *suffix delta*: render a fixed two-message conversation
with and without the new tool messages and keep only the text after the assistant's end-of-turn token.
The delta starts right after a special token, so tokenising it alone gives the same ids the full
conversation would (no merge can cross a special token).

Worked example (ChatML)::

    r = ChatRenderer(tokenizer, tools=[calculator.schema()])
    r.prompt_ids([{"role": "user", "content": "6*7?"}])   # ids of "<|im_start|>system..." ... "assistant\\n"
    r.tool_turn_ids([{"role": "tool", "content": "42"}], ended_turn=True)
    # ids of "\\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"
"""

from __future__ import annotations

from typing import Any

# Content of the stand-in assistant turn; unlikely to occur in any template's own text.
_MARKER = "SLIPSTREAM_ASSISTANT_TURN_7f3a"
_DUMMY_USER = {"role": "user", "content": "SLIPSTREAM_USER_TURN_7f3a"}


class ChatRenderer:
    """Renders prompts and tool-turn deltas with the tokenizer's chat template (``tools`` in OpenAI form).

    Invariant: ``prompt_ids(messages) + generated + tool_turn_ids(tool_messages, ...)`` equals, token for
    token, what the template gives for the whole conversation when the generated ids are what the
    template would render for the assistant turn (checked in tests/agents/test_chat.py).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.end_of_turn_id, self._prefix_text = self._find_end_of_turn()
        self.stop_ids = self._stop_ids()

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]], *, ended_turn: bool) -> list[int]:
        """Tokens that follow an assistant turn and carry ``tool_messages``, ending with the generation
        prompt of the next assistant turn. ``ended_turn`` says whether the generated ids already end with an
        end-of-turn token; if not (e.g. generation stopped on ``</tool_call>``), one is inserted first."""
        full = self.render(
            [_DUMMY_USER, {"role": "assistant", "content": _MARKER}, *tool_messages],
            add_generation_prompt=True,
        )
        if not full.startswith(self._prefix_text):
            raise ValueError(
                "the chat template renders earlier turns differently once tool messages follow them"
            )
        delta = self.encode(full[len(self._prefix_text) :])
        if not ended_turn and self.end_of_turn_id is not None:
            delta = [self.end_of_turn_id, *delta]
        return delta

    def _find_end_of_turn(self) -> tuple[int | None, str]:
        """The special token that closes an assistant turn, and the rendered text up to and including it."""
        text = self.render(
            [_DUMMY_USER, {"role": "assistant", "content": _MARKER}], add_generation_prompt=False
        )
        start = text.rindex(_MARKER) + len(_MARKER)
        special = {
            tok: self.tokenizer.convert_tokens_to_ids(tok) for tok in self.tokenizer.all_special_tokens
        }
        tail = text[start:]
        best: tuple[int, str] | None = None
        for tok in special:
            pos = tail.find(tok)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, tok)
        if best is None:  # a template without an end-of-turn special token: the delta is everything after
            return None, text[:start]
        pos, tok = best
        return special[tok], text[: start + pos + len(tok)]

    def _stop_ids(self) -> set[int]:
        ids = {self.end_of_turn_id} if self.end_of_turn_id is not None else set()
        eos = self.tokenizer.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids
