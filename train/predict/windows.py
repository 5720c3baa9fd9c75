"""Documents into the token windows the model reads: each at most --max-length tokens.

A document's tokens are what its tokenizer gives by default, special tokens included (BERT's
[CLS] ... [SEP], a Llama-3 tokenizer's <|begin_of_text|>, none for GPT-2's). A longer document is
truncated (--long truncate, the default) or cut into windows every --stride tokens (--long chunk):

- a head that reads each window as a sequence of its own (classification, embeddings) cuts the text's
  tokens without the special ones and gives every window the special tokens again: windows of
  max_length - (special tokens) text tokens, starting every stride tokens;
- a causal LM reads windows of max_length tokens of the document as it is, starting every stride tokens;
  a window scores only the tokens after the ones earlier windows scored, with the tokens before them
  in the window as context (max_length - stride tokens of it), so each token is scored once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TRUNCATE, CHUNK = "truncate", "chunk"
LONG = (TRUNCATE, CHUNK)


@dataclasses.dataclass(frozen=True)
class Window:
    document: int  # the document's index in its shard
    tokens: np.ndarray  # (n,) int64 token ids, 1 <= n <= max_length
    scored_from: int = 1  # a causal LM scores tokens[scored_from:], predicted from the tokens before them


@dataclasses.dataclass(frozen=True)
class Cut:
    """How the tokenizer's special tokens frame a text, read from the tokenizer itself."""

    prefix: list[int]  # special tokens before the text's
    suffix: list[int]  # after

    @classmethod
    def of(cls, tokenizer) -> "Cut":
        """The tokens the tokenizer adds around a probe word (the fast tokenizers of transformers 5 have no
        build_inputs_with_special_tokens). ValueError when its text tokens do not appear whole among them."""
        framed = tokenizer("probe")["input_ids"]
        bare = tokenizer("probe", add_special_tokens=False)["input_ids"]
        at = next((i for i in range(len(framed) - len(bare) + 1) if framed[i:i + len(bare)] == bare), None)
        if at is None:
            raise ValueError(f"tokenizer: its special tokens {framed} do not frame its text tokens {bare}")
        return cls(framed[:at], framed[at + len(bare):])

    @property
    def specials(self) -> int:
        return len(self.prefix) + len(self.suffix)


def starts(length: int, size: int, stride: int) -> range:
    """The starts of windows of ``size`` tokens every ``stride`` tokens over ``length`` tokens: 0, stride, ...,
    up to the first window that reaches the end (one window when ``length`` <= ``size``)."""
    windows = -(-max(length - size, 0) // stride) + 1
    return range(0, windows * stride, stride)


def cut(document: int, text_tokens: list[int], frame: Cut, *, max_length: int, long: str, stride: int | None,
        specials_per_window: bool) -> tuple[int, bool, list[Window]]:
    """(the document's token count, special tokens included; whether --long truncate dropped some; its windows)
    for ``text_tokens``, its tokens without special ones. No window for a document of no tokens at all."""
    whole = frame.prefix + list(text_tokens) + frame.suffix
    if specials_per_window:  # windows of text tokens, each framed again
        size = max_length - frame.specials
        pieces = [(frame.prefix + list(text_tokens[s:s + size]) + frame.suffix, 1)
                  for s in (starts(len(text_tokens), size, stride) if long == CHUNK else [0])]
        truncated = long == TRUNCATE and len(text_tokens) > size
    else:  # stretches of the whole sequence, each scoring what the one before did not reach
        positions = starts(len(whole), max_length, stride) if long == CHUNK else [0]
        pieces = [(whole[s:s + max_length], 1 if i == 0 else max_length - stride) for i, s in enumerate(positions)]
        truncated = long == TRUNCATE and len(whole) > max_length
    windows = [Window(document, np.asarray(tokens, dtype=np.int64), scored_from) for tokens, scored_from in pieces
               if tokens]
    return len(whole), truncated, windows
