"""The flags of train, verify and demo: each --help entry says what the flag does and its default once; the
checks that refuse a sequence-length list with repeats (and sort one out of order) and a `--resume latest` no
later start could find again."""
import argparse

import pytest

from naflex_accum import cli
from naflex_accum.commands import demo, verify
from naflex_accum.errors import UsageError
from naflex_accum.train.config.params import build_parser, parse_args

BASE = ["--train-data", "x-{000000..000001}.tar"]
PARSERS = {"train": build_parser, "verify": verify.build_parser, "demo": demo.build_parser}


def shown_flags(parser: argparse.ArgumentParser):
    """``(flag, its help as printed)`` for each flag --help lists."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
            continue
        yield action.option_strings[-1], formatter._expand_help(action)


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_and_its_default_once(command):
    parser = PARSERS[command]()
    flags = list(shown_flags(parser))
    assert len(flags) > 3
    missing = [flag for flag, text in flags if not text.split("(default:")[0].strip()]
    assert missing == [], f"{command}: flags --help shows without saying what they do"
    counts = {flag: text.count("default:") for flag, text in flags}
    assert {flag: n for flag, n in counts.items() if n != 1} == {}, f"{command}: defaults not shown exactly once"
    parser.format_help()  # every help string formats (no stray %)


def test_help_shows_defaults_as_typed():
    shown = dict(shown_flags(build_parser()))
    assert shown["--naflex-seq-lens"].endswith("(default: 64 144 256)")
    assert shown["--lr"].endswith("(default: 0.0005)")
    assert shown["--report-to"].endswith("(default: '')")
    assert shown["--torchcompile"].endswith("(default: off)")
    assert shown["--device"].count("cuda if available") == 1


@pytest.mark.parametrize("given, taken, probs", [
    (["64", "16", "36"], [16, 36, 64], None),
    (["16", "36", "64"], [16, 36, 64], None),
    (["64", "16"], [16, 64], [0.25, 0.75]),  # each weight stays with its length
])
def test_seq_lens_are_sorted_ascending(given, taken, probs):
    extra = ["--naflex-seq-len-probs", "0.75", "0.25"] if probs else []
    args = parse_args([*BASE, "--naflex-seq-lens", *given, *extra])
    assert args.naflex_seq_lens == taken
    assert args.naflex_seq_len_probs == probs
    sorted_note = [note for note in args.notes if "--naflex-seq-lens" in note]
    assert len(sorted_note) == (given != [str(s) for s in taken])
    if sorted_note:
        assert f"{' '.join(given)}" in sorted_note[0] and " ".join(map(str, taken)) in sorted_note[0]


def test_the_same_run_whatever_the_order():
    one = vars(parse_args([*BASE, "--naflex-seq-lens", "64", "16", "36"]))
    other = vars(parse_args([*BASE, "--naflex-seq-lens", "16", "36", "64"]))
    assert {k: v for k, v in one.items() if k != "notes"} == {k: v for k, v in other.items() if k != "notes"}


def test_repeated_seq_len_is_refused():
    with pytest.raises(UsageError) as exc:
        parse_args([*BASE, "--naflex-seq-lens", "16", "64", "16"])
    message = str(exc.value)
    assert message.startswith("--naflex-seq-lens 16 64 16") and "16" in message and "once" in message
    assert "\n" not in message


def test_resume_latest_needs_a_name(capsys):
    with pytest.raises(UsageError, match=r"--resume latest needs --name: "):
        parse_args([*BASE, "--resume", "latest"])
    parse_args([*BASE, "--resume", "latest", "--name", "run"])
    parse_args([*BASE, "--resume", "some/epoch_1.pt"])  # a path: a new folder that branches from it
    assert cli.main(["train", *BASE, "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "add --name NAME" in err
    for empty in ("", " "):  # was read as the current folder: "--resume .: ..."
        with pytest.raises(UsageError, match=r"^--resume is empty; give a checkpoint path, or 'latest' with --name$"):
            parse_args([*BASE, "--resume", empty])


def test_verify_help_does_not_say_coca_needs_upstream():
    shown = dict(shown_flags(verify.build_parser()))
    assert "needs upstream" not in shown["--loss"]
