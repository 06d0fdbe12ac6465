"""The ``guardlint`` command line: ``check`` (the default command), ``explain``, ``rules``, ``diagnose``.

Commands stay thin: the work is in ``commands.py``. Only click is imported at start-up so that
``guardlint --version`` stays fast; libcst loads when a file is actually checked.
"""
from __future__ import annotations

import click

from guardlint._version import __version__

from .findings import FORMATS


class DefaultCommandGroup(click.Group):
    """A group that runs ``check`` when the first argument is not one of its commands, so that
    ``guardlint src/`` means ``guardlint check src/``.

    It is also the last line of defence: an unexpected error of guardlint itself becomes one message
    and exit code 2 (a usage or configuration error is 2 as well), never a traceback."""

    default_command = "check"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except BrokenPipeError:  # ``guardlint src | head``: the reader left; nothing more to say
            _quiet_stdout()
            ctx.exit(1)
        except Exception as e:
            click.echo(f"guardlint: internal error: {type(e).__name__}: {e}", err=True)
            click.echo("guardlint: this is a bug in guardlint; the run was stopped", err=True)
            ctx.exit(2)


def _quiet_stdout() -> None:
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _emit(outcome, color: bool = False) -> None:
    if outcome.stdout:
        # click drops ANSI styles where stdout is no terminal; where colour was asked for, they stay.
        click.echo(outcome.stdout, nl=False, color=True if color else None)
    if outcome.stderr:
        click.echo(outcome.stderr, nl=False, err=True)
    click.get_current_context().exit(outcome.exit_code)


@click.group(cls=DefaultCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="guardlint", message="%(prog)s %(version)s")
def main() -> None:
    """Lint calls of varlen attention and segmented LoRA kernels for metadata they need.

    `guardlint PATHS...` is `guardlint check PATHS...`.
    """


@main.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--select", multiple=True, metavar="RULES",
              help="Only these codes, prefixes or rule names (comma list).")
@click.option("--ignore", multiple=True, metavar="RULES", help="Also ignore these codes, prefixes or rule names.")
@click.option("--output-format", "--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Output format: text (one line a finding, ruff's concise), full (with the source line, "
                   "notes and fix), json, sarif, github.")
@click.option("-o", "--output-file", type=click.Path(dir_okay=False), metavar="PATH",
              help="Write the findings to PATH (atomically) instead of stdout; the summary stays on stderr.")
@click.option("--color", type=click.Choice(("auto", "always", "never")), default="auto", show_default=True,
              help="Colour the text formats: auto on a terminal (not with NO_COLOR; FORCE_COLOR forces it).")
@click.option("--statistics", is_flag=True, help="Counts per code instead of the findings.")
@click.option("--exit-zero", is_flag=True, help="Exit with 0 even when there are findings.")
@click.option("--strict", is_flag=True, help="Also report calls that cannot be checked (*args/**kwargs).")
@click.option("--config", type=click.Path(dir_okay=False), help="Read settings from this file.")
@click.option("--exclude", multiple=True, metavar="PATTERN", help="Also exclude these globs (comma list).")
@click.option("--stdin-filename", metavar="PATH", help="The file name to report for `-` (stdin).")
@click.option("--fix", is_flag=True, help="Apply the fixes (safe ones; unsafe ones too with --unsafe-fixes), "
                                          "then report what remains.")
@click.option("--diff", is_flag=True, help="Print the fixes as a unified diff; write nothing.")
@click.option("--unsafe-fixes", is_flag=True, help="Also apply (and mark with [*]) the unsafe fixes.")
@click.option("--respect-gitignore/--no-respect-gitignore", default=None,
              help="Skip files git ignores when walking folders (default: on; named files are always checked).")
@click.option("--follow-bindings/--no-follow-bindings", default=None,
              help="GL104: follow code bound per layer at run time (impls a typed factory picks, forwards installed "
                   "on layer classes; default: on). Off costs less on large engine trees.")
@click.option("-j", "--jobs", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Check files in N processes; 0: one per CPU when there is enough work to pay for them. "
                   "The output is the same whatever N is.")
def check(paths, select, ignore, fmt, output_file, color, statistics, exit_zero, strict, config, exclude,
          stdin_filename, fix, diff, unsafe_fixes, respect_gitignore, follow_bindings, jobs) -> None:
    """Check PATHS (files, folders, or - for stdin); the default command."""
    from .commands import run_check

    stdin = None
    if "-" in paths:
        with click.open_file("-", "rb") as f:
            stdin = f.read()
    import os
    import sys

    progress = Progress() if _is_terminal(sys.stderr) else None
    colored = use_color(color, sys.stdout, os.environ) and not output_file
    try:
        outcome = run_check(paths, select=select, ignore=ignore, exclude=exclude, fmt=fmt,
                            statistics=statistics, exit_zero=exit_zero, strict=strict, config=config,
                            stdin=stdin, stdin_filename=stdin_filename, fix=fix, diff=diff,
                            unsafe_fixes=unsafe_fixes, respect_gitignore=respect_gitignore,
                            follow_bindings=follow_bindings,
                            jobs=jobs or None, progress=progress, color=colored, output_file=output_file)
    finally:
        if progress is not None:
            progress.clear()
    _emit(outcome, colored)


def use_color(choice: str, stream, environ) -> bool:
    """``--color``: ``always`` and ``never`` as said; ``auto`` colours a terminal, unless NO_COLOR is set
    (no-color.org), and FORCE_COLOR colours whatever the stream is (a CI log that renders styles)."""
    if choice != "auto":
        return choice == "always"
    if environ.get("FORCE_COLOR", "") not in ("", "0", "false"):
        return True
    if environ.get("NO_COLOR", ""):
        return False
    return _is_terminal(stream)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """``checked 120/1216 files`` on one rewritten stderr line, for runs that last: nothing during the
    first half second, then at most ten updates a second; cleared before the results are printed."""

    DELAY_S = 0.5
    INTERVAL_S = 0.1

    def __init__(self):
        import time

        self._clock = time.monotonic
        self._start = self._clock()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = self._clock()
        if now - self._start < self.DELAY_S or (now - self._last < self.INTERVAL_S and done < total):
            return
        self._last = now
        self._shown = True
        click.echo(f"\rguardlint: checked {done}/{total} files", nl=False, err=True)

    def clear(self) -> None:
        if self._shown:
            click.echo("\r\033[K", nl=False, err=True)
            self._shown = False


@main.command()
@click.argument("code", metavar="RULE")
@click.option("--config", type=click.Path(dir_okay=False), help="Read user contracts from this file.")
def explain(code, config) -> None:
    """Explain a RULE (a code or a name): what it checks, why, how to fix it, with examples."""
    from .commands import run_explain

    _emit(run_explain(code, config=config))


@main.command()
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True)
@click.option("--config", type=click.Path(dir_okay=False), help="Read user contracts from this file.")
def rules(fmt, config) -> None:
    """List the rule catalog (code, name, kind, summary)."""
    from .commands import run_rules

    _emit(run_rules(fmt=fmt, config=config))


@main.command()
def server() -> None:
    """Run the language server on stdio (for editors): diagnostics as you type, quick fixes, hover.

    Needs pygls: pip install 'guardlint[server]'."""
    try:
        from .server import main as serve
    except ImportError as e:
        click.echo(f"guardlint: error: the language server needs pygls ({e}); install it with "
                   f"pip install 'guardlint[server]'", err=True)
        click.get_current_context().exit(2)
    serve()


# Unknown options are message words: `guardlint diagnose TypeError: ... for -: 'NoneType' and 'int'`.
@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("inputs", nargs=-1, metavar="[FILE | - | MESSAGE...]")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True)
def diagnose(inputs, fmt) -> None:
    """Match an error message or traceback to its rule and fix: read from FILE, from stdin (- or nothing),
    or given as the arguments themselves (the message, in words or lines).

    Exit 0 when a rule matches, 1 when none does, 2 when a FILE cannot be read."""
    from .commands import run_diagnose
    from .tracebacks import InputError, read_arguments

    try:
        data = read_arguments(inputs)
    except InputError as e:
        raise click.UsageError(str(e)) from None
    if data is None:
        with click.open_file("-", "rb") as stdin:
            if _is_terminal(stdin):
                click.echo("Paste the error or traceback, then press Ctrl-D.", err=True)
            data = stdin.read()
    _emit(run_diagnose(data, fmt=fmt))


if __name__ == "__main__":
    main()
