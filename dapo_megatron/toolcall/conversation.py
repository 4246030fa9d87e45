"""One response of a multi-turn rollout: its tokens, which of them the model wrote (the loss
mask), and the tokens the chat template puts between a model turn and the next.

A response is model turn, tool messages, model turn, ... as one token sequence after the prompt.
Tool tokens (the messages and the template tokens around them, up to the next assistant header)
are in the sequence, so old log-probs and the update see the context the model saw, but out of
`loss_mask`, and their rollout log-prob is 0 (the engine never sampled them).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def tool_turn_ids(tokenizer, messages: list[str]) -> list[int]:
    """Token ids the chat template renders after a model turn that ended with its end-of-turn
    token: the tool messages, then the next assistant header.

    Rendered as the difference of two conversations (with and without the tool messages), so
    any template that renders role "tool" works (Qwen2.5 / Qwen3 wrap them in <tool_response>).
    """
    head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    try:
        base = tokenizer.apply_chat_template(head, tokenize=False)
        full = tokenizer.apply_chat_template(head + [{"role": "tool", "content": m} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's errors, or the template's own raise_exception
        raise ValueError(f"the tokenizer's chat template cannot render tool messages ({e}); rollout.multi_turn "
                         f"needs a template with a 'tool' role") from None
    eos = tokenizer.eos_token
    cut = base.rfind(eos) + len(eos)  # the model's turn ends at its eos; the rest is the template's
    if eos not in base or full[:cut] != base[:cut]:
        raise ValueError("the tokenizer's chat template renders an assistant turn differently when tool "
                         "messages follow it; rollout.multi_turn needs a template with a 'tool' role")
    return tokenizer.encode(full[cut:], add_special_tokens=False)


@dataclass
class Conversation:
    """The response so far of one multi-turn request, and its tool accounting."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model wrote it (in the loss), 0: tool / template
    turn_start: int = 0  # where the current model turn began in `tokens`
    turns: int = 1  # model turns started
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls and failed ones (timeouts included)
    tool_timeouts: int = 0
    tool_s: float = 0.0  # seconds its tool calls ran (summed; calls overlap each other and generation)

    def add_model(self, tokens, logprobs) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(tokens))

    def turn_tokens(self) -> list[int]:
        return self.tokens[self.turn_start:]

    def add_tool(self, ids: list[int], budget: int) -> bool:
        """Append tool tokens, cut at `budget` response tokens in all; True when room is left for
        another model turn (the next one starts here)."""
        ids = ids[: max(budget - len(self.tokens), 0)]
        self.tokens.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.mask.extend([0] * len(ids))
        self.turn_start, self.turns = len(self.tokens), self.turns + 1
        return len(self.tokens) < budget
