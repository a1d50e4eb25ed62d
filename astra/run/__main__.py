"""`python -m astra.run` is `astra run`."""

from astra.run.cli import run_command

run_command()
