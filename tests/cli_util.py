"""`mlxrs ARGS` run in this process through `mlxrs.cli.main` (what `python -m mlxrs` calls), for the CLI
tests where no process boundary is under test: the same exit status, stdout and stderr as the
subprocess, without starting Python and loading MLX again (about a second each on CI's 2 cores).
Keep a real-process test per command for the entry point itself."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """(returncode, stdout, stderr) of `mlxrs ARGS`; `env`, as subprocess.run's, is the whole
    environment it sees (os.environ is restored after)."""
    from mlxrs import cli

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as e:  # argparse's usage errors, --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["mlxrs", *args], code, out.getvalue(), err.getvalue())
