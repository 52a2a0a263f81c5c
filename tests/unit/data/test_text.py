"""data.text: BatchTokenizer gives the wrapped tokenizer's ids; its fast road only for open_clip's default cleaning.

(The fast road's ids against SimpleTokenizer's on many captions: tests/unit/data/test_images.py.)
"""
import pickle

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer

from naflex_accum.data import text
from naflex_accum.data.text import BatchTokenizer

CAPTIONS = ["A  Cat\tON a mat", "Ünïcode &amp; stuff", "word " * 40, ""]


@pytest.fixture(scope="module")
def simple():
    return SimpleTokenizer(context_length=16)


def test_other_cleaning_goes_through_the_tokenizer_itself():
    tokenizer = SimpleTokenizer(context_length=16, clean="whitespace")
    wrapped = BatchTokenizer(tokenizer)
    assert not wrapped._fast_path()
    assert torch.equal(wrapped(CAPTIONS), tokenizer(CAPTIONS))


def test_fast_road_truncates_to_the_context_ending_in_eot(simple):
    wrapped = BatchTokenizer(simple)
    out = wrapped(CAPTIONS)
    assert wrapped._fast_path() and out.dtype == torch.int64 and out.shape == (4, 16)
    assert torch.equal(out, simple(CAPTIONS))
    assert out[2, -1] == simple.eot_token_id and out[3, :2].tolist() == [simple.sot_token_id, simple.eot_token_id]


def test_a_pickled_copy_starts_with_an_empty_cache_and_gives_the_same_ids(simple):
    wrapped = BatchTokenizer(simple)
    first = wrapped(CAPTIONS)
    assert wrapped._words
    copy = pickle.loads(pickle.dumps(wrapped))
    assert copy._words == {} and copy._fast is None
    assert torch.equal(copy(CAPTIONS), first)


def test_the_word_cache_is_cleared_when_full(simple, monkeypatch):
    monkeypatch.setattr(text, "CACHE_LIMIT", 3)
    wrapped = BatchTokenizer(simple)
    out = wrapped(["one two three four five"])
    assert len(wrapped._words) <= 3 and torch.equal(out, simple(["one two three four five"]))


@pytest.mark.parametrize("kind", [list, lambda rows: torch.tensor(rows, dtype=torch.int32)])
def test_another_tokenizers_ids_come_as_int64(kind):
    wrapped = BatchTokenizer(lambda texts: kind([[len(t), 0] for t in texts]))
    out = wrapped(["abc", ""])
    assert out.dtype == torch.int64 and out.tolist() == [[3, 0], [0, 0]]
