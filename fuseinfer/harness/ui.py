"""Terminal output while a run goes: progress bars and one-line messages on stderr (results go to stdout)."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


class ConsoleUI:
    """Progress bars (rich.progress) and messages for the runner."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)

    def info(self, message: str) -> None:
        self.console.print(message, style="dim", markup=False, highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        self.console.print(f"warning: {message}", style="yellow", markup=False, highlight=False, soft_wrap=True)

    @contextmanager
    def task(self, description: str, total: int):
        """A progress bar for ``total`` units; yields a function that advances it by one."""
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True,
                      disable=not self.console.is_terminal) as progress:
            task_id = progress.add_task(description, total=total)
            yield lambda: progress.advance(task_id)
