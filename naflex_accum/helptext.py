"""``--help`` of the commands: every flag's help ends with its default, said once.

Invariant: a help that says ``(default: ...)`` keeps its words; any other gets ``(default: VALUE)``, the value as
typed on the command line (``shown_default``). Nothing else about argparse's help changes.
"""
import argparse

STATED = "(default:"  # a help text that holds this states its default in its own words


def shown_default(action: argparse.Action) -> str:
    """``action``'s default as a user would type it (a switch not given: ``off``)."""
    value = action.default
    if action.nargs == 0 and isinstance(value, bool):  # store_true/store_false/--x|--no-x: the flag not given
        return "off"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    if value == "":
        return "''"
    return str(value)


class DefaultsFormatter(argparse.HelpFormatter):
    """argparse's ``ArgumentDefaultsHelpFormatter`` without its doubles: see the module docstring."""

    def _get_help_string(self, action):  # the hook argparse's own ArgumentDefaultsHelpFormatter overrides
        text = action.help or ""
        # --help and --version have a suppressed default, as have the hidden upstream flags
        if STATED in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        default = shown_default(action).replace("%", "%%")  # argparse %-formats help strings
        return f"{text} (default: {default})" if text else f"(default: {default})"
