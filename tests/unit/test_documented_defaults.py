"""docs/training.md's table of every `naflex-accum train` flag and its default, read back and checked against the
parser: each flag --help shows is in it exactly once, and each documented default is the parser's.

A cell is a value as typed on the command line (`` `64 144 256` ``, parsed here by the flag's own parser
action), ``off`` (a switch not given), or ``unset: what that means`` (the parser's default is None)."""
import argparse
import re
import shlex
from pathlib import Path

from naflex_accum.train.config.params import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"
START, END = "<!-- defaults:start -->", "<!-- defaults:end -->"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| (.+?) \|$")


def documented() -> list:
    text = DOCS.read_text()
    assert START in text and END in text, f"docs/training.md has no {START} ... {END} table"
    rows = text.split(START, 1)[1].split(END, 1)[0].strip().splitlines()[2:]  # after the header and its rule
    parsed = [ROW.match(row) for row in rows]
    assert all(parsed), [row for row, m in zip(rows, parsed) if not m]
    return [(m.group(1), m.group(2).strip()) for m in parsed]


def shown_actions(parser):
    for action in parser._actions:
        if action.help != argparse.SUPPRESS and action.option_strings and action.dest != "help":
            yield next(o for o in action.option_strings if o.startswith("--")), action


def documented_value(parser, flag: str, action, cell: str):
    """What the cell says the default is, in the parser's own terms."""
    if cell == "off":
        assert action.nargs == 0, f"{flag}: 'off' is for switches"
        return False if isinstance(action, argparse.BooleanOptionalAction) else not action.const
    if cell.startswith("unset: "):
        return None
    value = re.fullmatch(r"`([^`]*)`", cell)
    assert value, f"{flag}: the default cell {cell!r} is neither `VALUE`, off nor 'unset: ...'"
    return getattr(parser.parse_args([flag, *shlex.split(value.group(1))]), action.dest)


def test_every_shown_flag_is_documented_once():
    flags = [flag for flag, _ in documented()]
    shown = [flag for flag, _ in shown_actions(build_parser())]
    assert sorted({f for f in flags if flags.count(f) > 1}) == [], "flags documented twice"
    assert sorted(set(shown) - set(flags)) == [], "flags of --help missing from docs/training.md's defaults table"
    assert sorted(set(flags) - set(shown)) == [], "documented flags --help does not show"


def test_documented_defaults_are_the_parsers():
    parser = build_parser()
    actions = dict(shown_actions(parser))
    wrong = {}
    for flag, cell in documented():
        if flag in actions:
            action = actions[flag]
            said = documented_value(parser, flag, action, cell)
            if said != action.default:
                wrong[flag] = f"documented {cell}, parser's default {action.default!r}"
    assert wrong == {}
