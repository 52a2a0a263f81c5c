"""Captions -> token ids, a batch at a time.

Invariant: ``BatchTokenizer(tokenizer)(captions)`` is exactly ``tokenizer(captions)``
as an int64 tensor: same ids, same truncation, same shape. For open_clip's
``SimpleTokenizer`` with its default cleaning (lower-case, no reduction) it takes
a shorter road to the same ids: a caption of printable ASCII without ``&`` is
left as it is by ftfy and ``html.unescape``, so it is cleaned by collapsing
white space and lower-casing alone; each word's ids are cached (the BPE of a
word never changes); and the batch tensor is built in one call. Any other
caption, or any other tokenizer, goes through the tokenizer itself.
"""
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

CACHE_LIMIT = 1 << 17  # words; the cache is cleared when full (real captions reuse a small vocabulary)


def _plain(text: str) -> bool:
    return text.isascii() and text.isprintable() and "&" not in text


class BatchTokenizer:
    """Wraps a tokenizer (picklable, for loader workers); see the module docstring."""

    def __init__(self, tokenizer: Callable):
        self.tokenizer = tokenizer
        self._fast = None  # decided on first use, in the process that tokenizes
        self._words: Dict[str, Tuple[int, ...]] = {}

    def __getstate__(self):
        return {"tokenizer": self.tokenizer, "_fast": None, "_words": {}}

    def _fast_path(self) -> bool:
        if self._fast is None:
            try:
                from open_clip import tokenizer as oc  # only when a tokenizer is open_clip's
                tok = self.tokenizer
                self._fast = (type(tok) is oc.SimpleTokenizer and tok.reduction_fn is None
                              and tok.clean_fn is oc.get_clean_fn("lower"))
            except (ImportError, AttributeError):
                self._fast = False
        return self._fast

    def _word_ids(self, word: str) -> Tuple[int, ...]:
        ids = self._words.get(word)
        if ids is None:
            tok = self.tokenizer
            # SimpleTokenizer.encode's inner step: printable ASCII bytes map to themselves in its byte encoder
            ids = tuple(tok.encoder[piece] for piece in tok.bpe(word).split(" "))
            if len(self._words) >= CACHE_LIMIT:
                self._words.clear()
            self._words[word] = ids
        return ids

    def _encode(self, text: str) -> List[int]:
        tok = self.tokenizer
        if not _plain(text):
            return tok.encode(text)
        ids: List[int] = []
        for word in tok.pat.findall(" ".join(text.split()).lower()):
            ids.extend(self._word_ids(word))
        return ids

    def __call__(self, captions: Sequence[str]) -> torch.Tensor:
        if not self._fast_path():
            out = self.tokenizer(list(captions))
            return (out if isinstance(out, torch.Tensor) else torch.as_tensor(out)).long()

        tok = self.tokenizer
        length, sot, eot = tok.context_length, tok.sot_token_id, tok.eot_token_id
        out = np.zeros((len(captions), length), np.int64)  # numpy fills rows from lists far faster than torch
        for i, text in enumerate(captions):
            ids = [sot] + self._encode(text) + [eot]
            if len(ids) > length:
                ids = ids[:length]
                ids[-1] = eot
            out[i, :len(ids)] = ids
        return torch.from_numpy(out)
