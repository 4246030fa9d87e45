"""A small byte-level BPE tokenizer with Qwen's ChatML conventions, trained locally (no download).

It mirrors Qwen2's tokenizer where code paths care: the same pre-tokenizer regex (every digit is
its own token), the same special tokens and chat template, pad = <|endoftext|>, eos = <|im_end|>.
Only the vocabulary is small (512), learnt from a generated corpus, so tiny models stay tiny.
"""
from __future__ import annotations

import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dapo_megatron.data import synthetic

VOCAB_SIZE = 512
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2's split regex: `\p{N}` alone makes each digit a separate pre-token, so no merge can glue
# digits together and "12" is always two tokens ("1", "2"), as in the real Qwen vocabulary.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen2-Instruct's template: a default system message when the conversation has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same, plus Qwen2.5's rendering of role "tool": consecutive tool messages share one user
# turn, each wrapped in <tool_response>. Used by the tool task's tokenizer (assets/tools.py).
TOOLS_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen-VL's vision tokens, in the id order of assets.models.TINY_VL_MOE (image_token_id 500,
# video 501, vision_start 502, vision_end 503): a VL tokenizer learns 500 tokens, then adds these.
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
VL_BASE_VOCAB_SIZE = 500

# Qwen2-VL's rendering of list content on top of the tiny ChatML template: an image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, a text part its text, a string content itself.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

GENERIC_TEXT = """\
The quick brown fox jumps over the lazy dog. A model learns from rewards, not from labels.
Reinforcement learning improves a policy by sampling answers and scoring them with a verifier.
Please reason step by step, and put your final answer within a box. What is the sum of two numbers?
The answer is correct when it matches the ground truth. Training runs on a single machine today.
Experts route each token to the two best matching feed forward networks in a mixture of experts.
Let x be a number such that x plus three equals seven. Then x is four, because seven minus three
is four. Compute the value of the expression, simplify the fraction, and check your work.
Numbers: zero one two three four five six seven eight nine ten eleven twelve hundred thousand.
Questions and answers: who, what, where, when, why, how. It is, it was, there are, there were.
""".split("\n")


def tokenizer_corpus() -> list[str]:
    """The training text: the task in its chat scaffolding, plus a little generic prose.

    Special tokens are left out on purpose: the trainer does not treat them atomically and would
    spend merges on fragments like "<|im". They are added as whole tokens afterwards.
    """
    lines = ["system\n" + DEFAULT_SYSTEM_PROMPT, "system\n" + synthetic.SYSTEM_PROMPT, "user\n", "assistant\n"]
    for a, b in synthetic.addition_pairs():
        lines += [f"user\n{a}+{b}=", "assistant\n" + synthetic.response_text(a, b),
                  f"{a} + {b} = {a + b}", f"The sum of {a} and {b} is {a + b}."]
    return lines + [line for line in GENERIC_TEXT if line]


def train_tokenizer(vocab_size: int = VOCAB_SIZE, corpus: list[str] | None = None,
                    chat_template: str = CHAT_TEMPLATE, added_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Train the BPE (deterministic: fixed corpus, full byte alphabet) and wrap it for transformers.
    corpus: the training lines (default: `tokenizer_corpus()`). added_tokens: special tokens
    appended after the learnt vocabulary, in order, at ids vocab_size, vocab_size + 1, ..."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus() if corpus is None else corpus, trainer)
    # GPT2TokenizerFast(vocab_file=...) silently builds an empty tokenizer; wrapping the trained
    # object is the reliable way to get a dir that AutoTokenizer reloads offline.
    if added_tokens:
        if tok.get_vocab_size() != vocab_size:
            raise ValueError(f"the corpus yields {tok.get_vocab_size()} tokens, not {vocab_size}: "
                             f"added tokens would not land at ids {vocab_size}..")
        tok.add_special_tokens(list(added_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   unk_token=None, additional_special_tokens=[IM_START, IM_END, *added_tokens],
                                   chat_template=chat_template, model_max_length=1024,
                                   clean_up_tokenization_spaces=False)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Token ids for the model config, as Qwen2.5-Instruct sets them (bos = <|endoftext|>)."""
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in
            (("bos_token_id", ENDOFTEXT), ("eos_token_id", IM_END), ("pad_token_id", ENDOFTEXT))}


def build_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE, **kwargs) -> PreTrainedTokenizerFast:
    """Train and save as a HF fast-tokenizer dir (tokenizer.json + config + chat template);
    kwargs: `train_tokenizer`'s corpus, chat_template and added_tokens."""
    tokenizer = train_tokenizer(vocab_size, **kwargs)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
