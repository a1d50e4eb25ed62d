"""`python -m astra.trainer ...` (what torchrun runs on every rank): see astra.trainer.cli."""

from astra.trainer.cli import trainer_command

if __name__ == "__main__":
    trainer_command()
