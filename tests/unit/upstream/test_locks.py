"""The tower locks the runner refuses, read off ``--model``'s config by open_clip's own factory rules.

Upstream's ``main`` crashes on ``--lock-text`` without ``--lock-text-freeze-layer-norm`` for open_clip's own text
towers (not a Hugging Face one) and on a lock a model class lacks (CoCa); the released open_clip's built-in configs
and classes follow the same rules, so they stand in here. The pinned upstreams run in
``integration/test_runner_refusals.py``.
"""
from types import SimpleNamespace

import pytest

from naflex_accum.upstream.locks import refusal


def _args(model, **kw):
    return SimpleNamespace(**{"model": model, "lock_image": False, "lock_image_unlocked_groups": 0, "lock_text": False,
                              "lock_text_freeze_layer_norm": False, "force_custom_text": False, **kw})


@pytest.mark.parametrize("model,kw,said", [
    ("ViT-B-32", dict(lock_text=True), "--lock-text without --lock-text-freeze-layer-norm: the text tower of "
                                        "--model ViT-B-32 (open_clip's own, in a CLIP)"),
    ("ViT-B-32", dict(lock_text=True, force_custom_text=True), "(open_clip's own, in a CustomTextCLIP)"),
    ("coca_ViT-B-32", dict(lock_text=True, lock_text_freeze_layer_norm=True),
     "--lock-text with --model coca_ViT-B-32: upstream builds a CoCa from it, which has no text tower to lock"),
    ("coca_ViT-B-32", dict(lock_image=True), "--lock-image with --model coca_ViT-B-32: upstream builds a CoCa"),
])
def test_a_lock_upstream_would_crash_on_is_refused(model, kw, said):
    line = refusal(_args(model, **kw))
    assert line is not None and said in line, line


@pytest.mark.parametrize("model,kw", [
    ("ViT-B-32", dict(lock_text=True, lock_text_freeze_layer_norm=True, lock_image=True)),
    ("roberta-ViT-B-32", dict(lock_text=True)),  # a Hugging Face text tower keeps its LayerNorms trainable
    ("ViT-B-32", dict(lock_image=True, lock_image_unlocked_groups=2)),
    ("hf-hub:someone/model", dict(lock_text=True)),  # its config would need the network: upstream says
    ("no-such-model", dict(lock_text=True)),  # upstream's factory says
    ("coca_ViT-B-32", dict()),
])
def test_a_lock_upstream_takes_or_cannot_be_known_is_not_refused(model, kw):
    assert refusal(_args(model, **kw)) is None
