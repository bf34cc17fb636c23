"""The ampdoctor command line: a fixed table of subcommands, each a module of ``ampdoctor.commands``.

Each command opens the trace, calls the library and formats the result. Bad input (a missing or corrupt trace,
a wrong argument) is one line on stderr and exit code 2, never a traceback. Only the command that runs is
imported, so ``ampdoctor --help`` and ``--version`` load neither pandas nor the rules; a command module that
fails to import fails loudly (a traceback), it never drops out of ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands.common import EXIT_OK, EXIT_USAGE, Printable, UsageError, printable

# name -> help; the module is ampdoctor.commands.<name>, with add_arguments(parser) and run(args)
COMMANDS = {
    "info": "summary of a trace: steps, sites, precision, loss scale, first non-finite",
    "layers": "per-layer statistics of one step, the way one prints gradients layer by layer",
    "diagnose": "rules over a trace: what is wrong, where, and the fix",
    "replay": "simulate the dynamic loss scaler over a recorded trace",
    "serve": "the dashboard (Dash), live while training or offline",
    "report": "one self-contained HTML report",
    "export": "health figures and findings to TensorBoard event files, Parquet or CSV",
}


def command_module(name: str):
    """The module of command ``name`` (imported now)."""
    return importlib.import_module(f"ampdoctor.commands.{name}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser; the arguments of the command named in ``argv`` (of every command when ``argv`` is None)."""
    p = _Parser(prog="ampdoctor", description="Diagnose mixed-precision (FP16/BF16) training from a trace file.")
    p.add_argument("--version", action="version", version=f"ampdoctor {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # the top level has no option taking a value: the first word that is not an option names the command
    chosen = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for name, help_ in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if argv is None or name == chosen:
            mod = command_module(name)
            mod.add_arguments(sp)
            sp.set_defaults(func=mod.run)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    stdout, sys.stdout = sys.stdout, Printable(sys.stdout)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_OK
        if isinstance(getattr(args, "trace", None), list) and len(args.trace) == 1:
            args.trace = args.trace[0]  # one file, directory or quoted glob; several: one run's ranks
        return int(args.func(args) or EXIT_OK)
    except UsageError as exc:
        print(printable(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        from .trace import TraceError  # a command ran: the trace reader is loaded already

        if not isinstance(exc, TraceError):
            raise
        print(printable(f"ampdoctor: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
