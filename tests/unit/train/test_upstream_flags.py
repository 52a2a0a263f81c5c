"""The flag table against upstream open_clip main's params.py (the pinned snapshot), the parser and the docs."""
import ast
import tarfile
from pathlib import Path

import pytest

from naflex_accum.errors import UsageError
from naflex_accum.train.config import upstream_flags
from naflex_accum.train.config.params import build_parser, parse_args
from naflex_accum.train.config.upstream_flags import FLAGS

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOT = ROOT.parent / "shared" / "upstream" / "open_clip-89fb801.tar.gz"
DOCS = ROOT / "docs" / "training.md"
BASE = ["--train-data", "x.tar", "--train-num-samples", "8"]


def upstream_options():
    """Every option string upstream main's parser registers, read from its source (nothing of it runs)."""
    if not SNAPSHOT.is_file():
        pytest.skip(f"pinned upstream snapshot not found at {SNAPSHOT}")
    with tarfile.open(SNAPSHOT) as tar:
        source = tar.extractfile("open_clip-89fb801/src/open_clip_train/params.py").read().decode()
    options = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            options.update(a.value for a in node.args if isinstance(a, ast.Constant) and a.value.startswith("--"))
    assert len(options) > 100
    return options


def test_table_covers_exactly_upstreams_flags():
    upstream = upstream_options()
    assert sorted(upstream - FLAGS.keys()) == [], "upstream flags missing from the table"
    assert sorted(FLAGS.keys() - upstream) == [], "table entries upstream does not have"


def test_every_flag_is_registered_with_its_status():
    """A 'works' flag is a real flag of the parser; refused and limited ones are the table's own actions."""
    actions = build_parser()._option_string_actions
    for option, flag in FLAGS.items():
        assert option in actions, f"{option} is not registered: it would be 'unrecognized'"
        table_action = isinstance(actions[option], (upstream_flags._Refuse, upstream_flags._Limited))
        if flag.status == "works":
            assert not table_action, f"{option} is marked 'works' but is refused"
        elif not table_action:  # implemented by the trainer: the table must say it works (or limit it honestly)
            assert flag.status == "limited", f"{option} is implemented by the parser now: mark it 'works'"
        assert flag.status == "works" or flag.note, f"{option}: a refusal needs its reason"


@pytest.mark.parametrize("option", sorted(o for o, f in FLAGS.items() if f.status == "refused"))
def test_refused_flag_says_why(option):
    with pytest.raises(UsageError) as exc:
        parse_args([*BASE, option, "1"])
    message = str(exc.value)
    assert message.startswith(option) and FLAGS[option].note in message and "\n" not in message


@pytest.mark.parametrize("option", sorted(o for o, f in FLAGS.items()
                                          if f.status == "limited" and o != "--report-to"))
def test_limited_flag_takes_upstreams_value_only(option):
    flag = FLAGS[option]
    for value in flag.allowed:
        parse_args([*BASE, option, value])
    with pytest.raises(UsageError, match="valid values here"):
        parse_args([*BASE, option, "something-else"])


def test_refused_flag_exits_2_with_one_line_from_the_cli(capsys):
    from naflex_accum.cli import main

    assert main(["train", *BASE, "--remote-sync", "s3://bucket"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--remote-sync" in err and "copy logs/NAME yourself" in err


def test_refused_flag_in_a_preset_is_refused(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("remote_sync: s3://bucket\n")
    with pytest.raises(UsageError, match=r"--config .*p\.yaml: remote_sync: --remote-sync .*remote sync is not"):
        parse_args(["--config", str(preset), *BASE])
    preset.write_text("opt: sgd\n")
    with pytest.raises(UsageError, match=r"--config .*p\.yaml: opt: --opt 'sgd'"):
        parse_args(["--config", str(preset), *BASE])
    preset.write_text("remote_sync: null\n")  # a null value sets no flag's action: the namespace check catches it
    with pytest.raises(UsageError, match="--config: --remote-sync .*remote sync is not"):
        parse_args(["--config", str(preset), *BASE])


def test_docs_table_is_generated_from_the_module():
    text = DOCS.read_text()
    start, end = "<!-- flag-table:start -->\n", "<!-- flag-table:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == upstream_flags.markdown_table(), \
        "docs/training.md's flag table is stale: paste the output of `python -m naflex_accum.train.config.upstream_flags` " \
        "between its markers"
