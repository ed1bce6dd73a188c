"""The help formatter shared by the ``dflash-train`` and ``dflash-bench`` command lines."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and shows each option's default unless its help names one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
