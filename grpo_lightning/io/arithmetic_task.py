"""The built-in arithmetic task: word problems in GSM8K's style, for the offline configs and the demo."""

from __future__ import annotations

import random

from grpo_lightning.io.rows import Row


def arithmetic_problems(count: int, seed: int = 0) -> list[Row]:
    """Generated one- and two-step word problems in GSM8K's style, with a `#### N` answer.

    The built-in task of the offline demo: small numbers, so that a small instruct model sometimes gets
    them right before training and GRPO has a signal to work with.
    """
    rng = random.Random(seed)
    names = ["Tom", "Ana", "Lee", "Mia", "Sam", "Zoe", "Raj", "Eva", "Ben", "Ivy"]
    things = ["apples", "books", "coins", "pens", "cards", "shells", "stickers", "marbles"]
    rows = []
    for _ in range(count):
        name, thing = rng.choice(names), rng.choice(things)
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        kind = rng.randrange(4)
        if kind == 0:
            q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
            steps, result = f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}", a + b
        elif kind == 1:
            a, b = a + b, min(a, b)
            q = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
            steps, result = f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b}", a - b
        elif kind == 2:
            a, b = a % 9 + 2, b % 9 + 2
            q = f"{name} buys {a} boxes with {b} {thing} in each box. How many {thing} does {name} buy?"
            steps, result = f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}", a * b
        else:
            c = rng.randint(1, min(a, b))
            q = f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have?"
            s = a + b
            steps = f"{a} + {b} = <<{a}+{b}={s}>>{s}\n{s} - {c} = <<{s}-{c}={s - c}>>{s - c}"
            result = a + b - c
        rows.append({"question": q, "answer": f"{steps}\n#### {result}"})
    return rows
