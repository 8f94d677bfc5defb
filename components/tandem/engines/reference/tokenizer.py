"""The tiny model's tokenizer: byte-level BPE trained here on the built-in corpus, its special
tokens, and its ChatML chat template.

Conventions follow Llama 3, so code written against the tiny model also works on a real checkpoint:
plain `encode` prepends `<|begin_of_text|>` (a post-processor does it) and the chat template starts
with `bos_token` too, so a rendered chat prompt must be tokenized with `add_special_tokens=False`.
Byte-level BPE with all 256 bytes in the alphabet encodes any UTF-8 text and decodes it back.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tandem.engines.reference.corpus import CORPUS

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Ids 0..4, in this order: the trainer adds special tokens first.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# ChatML. `content` may be a string or a list of OpenAI content parts (text parts are joined).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train byte-level BPE on CORPUS. Deterministic: same corpus and size give the same file."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok
