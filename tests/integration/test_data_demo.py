"""make-demo-data: captions say what is drawn, sizes and aspects in range, deterministic, held-out split; val loader."""

from collections import Counter

import torch
from data_common import CharTokenizer, decode_text
from unit.data.test_demo import data, samples  # noqa: F401 (fixtures)

from naflex_accum.data import make_val_loader

torch.set_num_threads(1)


def test_cli_writes_and_refuses_non_empty(tmp_path, capsys):
    from naflex_accum.cli import main
    out = tmp_path / "d"
    assert main(["make-demo-data", str(out), "--num-samples", "30", "--val-samples", "10", "--shard-size", "10",
                 "--processes", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"--train-data '{out}/train/shard-{{000000..000002}}.tar'" in printed
    assert f"--val-data '{out}/val/shard-{{000000..000000}}.tar'" in printed
    assert len(samples(f"{out}/train/shard-{{000000..000002}}.tar")) == 30
    assert main(["make-demo-data", str(out), "--num-samples", "30"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["make-demo-data", str(out), "--num-samples", "20", "--val-samples", "0", "--force"]) == 0


def test_val_loader_every_sample_once_in_fixed_order(data):
    expected = Counter(s["txt"].decode() for s in samples(data.val).values())
    for workers in (0, 2):
        val = make_val_loader(data.val + "::" + data.train, CharTokenizer(), seq_len=36, batch_size=16,
                              workers=workers)
        assert val.num_samples == 160
        runs = [list(val), list(val)]
        for batches in runs:
            assert sum(b["text"].shape[0] for b in batches) == 160
            assert all(set(b) == {"image", "text"} and b["image"]["patches"].shape[1:] == (36, 768)
                       for b in batches)
        assert all(torch.equal(x["text"], y["text"]) and torch.equal(x["image"]["patches"], y["image"]["patches"])
                   for x, y in zip(*runs))
        captions = Counter(c for b in runs[0] for c in decode_text(b["text"]))
        assert captions - Counter(s["txt"].decode() for s in samples(data.train).values()) == expected
        assert val.stats["samples"] == 160 and val.stats["corrupt"] == 0
