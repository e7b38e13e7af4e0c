"""A step's sampled completions as a table: one row per completion with its prompt, its reward per function,
the total and the advantage (`completion_rows`), rendered as Markdown for TensorBoard's text tab
(`completions_table`), as plain text for the console (`console_table`) or with `rich` where it is installed.
"""

from __future__ import annotations

import html
import shutil
import textwrap

from grpo_lightning.training.step_metrics import RolloutRecord

__all__ = ["completion_rows", "completions_table", "console_table", "prompt_text"]


def prompt_text(prompt: list[dict[str, str]] | str) -> str:
    """The question of a prompt: the last message's content for chat prompts."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _markdown_cell(text: str, max_chars: int) -> str:
    """Text that stays inside one Markdown table cell and shows literally (TensorBoard renders Markdown)."""
    if len(text) > max_chars:
        text = text[:max_chars] + " …"
    for char in "\\`*_[]#":  # Markdown's own characters, the backslash first
        text = text.replace(char, "\\" + char)
    # Every line break a decoded completion can hold (\r, \x0b, \x85, \u2028, ... as well as \n) would end
    # the table's row.
    return "<br>".join(html.escape(text, quote=False).replace("|", "&#124;").splitlines())


def completion_rows(record: RolloutRecord, num_prompts: int = 2) -> tuple[list[str], list[list]]:
    """The first `num_prompts` groups as a table: its column names, and a row per completion (prompt,
    completion, each reward function's value, the weighted total, the advantage, the length in tokens,
    whether it was cut at `max_completion_length`, then the columns the reward functions logged with
    `log_extra`). Values are plain Python: text, floats (NaN where a function answered None), ints, bools."""
    columns = ["prompt", "completion", *record.reward_names, "reward", "advantage", "tokens", "cut"]
    columns += list(record.extra)
    rows = []
    G = record.num_generations
    for i in range(min(num_prompts, len(record.prompts))):
        for row in range(i * G, (i + 1) * G):
            rows.append(
                [
                    prompt_text(record.prompts[i]),
                    record.completions[row],
                    *(float(v) for v in record.rewards_per_func[row]),
                    float(record.rewards[row]),
                    float(record.advantages[row]),
                    int(record.completion_lengths[row]),
                    bool(record.truncated[row]),
                    *(values[row] for values in record.extra.values()),
                ]
            )
    return columns, rows


def _shown(column: str, value: object) -> str:
    """A cell's text: numbers to 3 decimals, the advantage signed, the token count and "cut" together."""
    if column == "advantage":
        return f"{value:+.3f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _display(columns: list[str], rows: list[list]) -> tuple[list[str], list[list[str]]]:
    """The columns and cells as shown: the cut flag folded into the token count ("64 (cut)")."""
    cut = columns.index("cut")
    shown = [c for c in columns if c != "cut"]
    cells = []
    for row in rows:
        texts = [_shown(c, v) for c, v in zip(columns, row, strict=True)]
        texts[cut - 1] += " (cut)" if row[cut] else ""
        cells.append(texts[:cut] + texts[cut + 1 :])
    return shown, cells


def completions_table(record: RolloutRecord, num_prompts: int = 2, max_chars: int = 1000) -> str:
    """A Markdown table of the first `num_prompts` groups (`completion_rows`), each prompt shown once, on
    its group's first row."""
    columns, rows = _display(*completion_rows(record, num_prompts))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, cells in enumerate(rows):
        cells[0] = cells[0] if i % record.num_generations == 0 else ""
        lines.append("| " + " | ".join(_markdown_cell(cell, max_chars) for cell in cells) + " |")
    return "\n".join(lines)


def console_table(record: RolloutRecord, step: int, num_prompts: int = 1, max_chars: int = 300) -> str:
    """The first `num_prompts` groups as plain text for a terminal (what `CompletionsPanel` prints where
    `rich` is not installed): each prompt, then one line per completion with its numbers first."""
    columns, rows = _display(*completion_rows(record, num_prompts))
    width = max(60, shutil.get_terminal_size().columns)
    numbers = columns[2:]
    widths = [max(len(c), *(len(r[2 + j]) for r in rows)) for j, c in enumerate(numbers)]
    header = "  ".join(c.rjust(w) for c, w in zip(numbers, widths, strict=True)) + "  completion"
    lines = [f"completions at step {step}"]
    for i, cells in enumerate(rows):
        if i % record.num_generations == 0:
            lines += textwrap.wrap(f"prompt: {' '.join(cells[0].split())[:max_chars]}", width) + [header]
        text = " ".join(cells[1].split())
        text = text[:max_chars] + " …" if len(text) > max_chars else text
        line = "  ".join(v.rjust(w) for v, w in zip(cells[2:], widths, strict=True)) + f"  {text!r}"
        lines.append(line)
    return "\n".join(lines)


def print_rich_table(record: RolloutRecord, step: int, num_prompts: int, max_chars: int) -> bool:
    """Print the groups as a `rich` table, as TRL does; False where rich is not installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    columns, rows = _display(*completion_rows(record, num_prompts))
    table = Table(title=f"completions at step {step}", show_lines=True)
    for column in columns:
        numeric = column not in ("prompt", "completion") and column not in record.extra
        table.add_column(column, justify="right" if numeric else "left", overflow="fold")
    for i, cells in enumerate(rows):
        cells[0] = cells[0][:max_chars] if i % record.num_generations == 0 else ""
        cells[1] = cells[1][:max_chars] + (" …" if len(cells[1]) > max_chars else "")
        table.add_row(*cells)
    Console().print(table)
    return True
