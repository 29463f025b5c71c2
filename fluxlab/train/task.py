"""The embedded model's synthetic task: arithmetic and short word problems in chat form.

Every problem is one or two additions/subtractions of small whole numbers; the reply shows each
step and ends with "The answer is N." (two-step replies need the first result before the second,
which is what makes parallel decoding at a low threshold lose accuracy). The held-out split is by
the arithmetic itself (the operation and its numbers), not by wording: no test sum appears in
training under any template. Pure Python, seeded, no torch.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivy", "Jay", "Kim", "Leo", "Mia", "Noah",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tom"]
OBJECTS = ["apples", "books", "coins", "eggs", "pens", "shells", "stamps", "cards", "marbles", "cookies"]
ASK = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Calculate {a} {op} {b}."]
ADD_STORY = [
    "{n} has {a} {o}. {m} gives {n} {b} more {o}. How many {o} does {n} have now?",
    "There are {a} {o} in a box and {b} {o} on the table. How many {o} are there in total?",
    "{n} found {a} {o} on Monday and {b} {o} on Tuesday. How many {o} did {n} find?",
]
SUB_STORY = [
    "{n} has {a} {o} and gives {b} of them to {m}. How many {o} does {n} have left?",
    "A shelf holds {a} {o}. {n} takes {b} {o} away. How many {o} are on the shelf now?",
]
# (first op, second op) stories: the reply needs the first result to get the second.
TWO_STEP_STORY = {
    ("+", "-"): "{n} has {a} {o}, buys {b} more and then gives {c} to {m}. How many {o} does {n} have now?",
    ("-", "+"): "{n} has {a} {o}, loses {b} and then finds {c}. How many {o} does {n} have now?",
    ("+", "+"): "{n} has {a} {o}. {m} gives {n} {b} and then {c} more. How many {o} does {n} have now?",
}
TEST_PERCENT = 10  # share of arithmetic keys held out for the test split


@dataclass(frozen=True)
class Problem:
    question: str
    reply: str
    answer: int
    key: str  # the arithmetic alone, e.g. "23+45" or "12+7-5": what the split is decided on

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.question}]


def split_of(key: str) -> str:
    """'test' for a fixed TEST_PERCENT of arithmetic keys (a hash, the same on every machine), else 'train'."""
    digest = hashlib.sha256(key.encode()).digest()
    return "test" if int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT else "train"


def _step(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _one_step(rng: random.Random, story: bool) -> Problem:
    op = rng.choice("+-")
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if op == "-" and b > a:
        a, b = b, a  # whole numbers only: no negative results
    c = _step(a, op, b)
    if story:
        n, m = rng.sample(NAMES, 2)
        question = rng.choice(ADD_STORY if op == "+" else SUB_STORY).format(n=n, m=m, a=a, b=b, o=rng.choice(OBJECTS))
    else:
        question = rng.choice(ASK).format(a=a, b=b, op=op)
    return Problem(question, f"{a} {op} {b} = {c}. The answer is {c}.", c, f"{a}{op}{b}")


def _two_step(rng: random.Random) -> Problem:
    ops = rng.choice(sorted(TWO_STEP_STORY))
    while True:
        a, b, c = rng.randint(1, 50), rng.randint(1, 49), rng.randint(1, 49)
        d = _step(a, ops[0], b)
        e = _step(d, ops[1], c)
        if 0 <= d <= 99 and 0 <= e <= 99:
            break
    n, m = rng.sample(NAMES, 2)
    question = TWO_STEP_STORY[ops].format(n=n, m=m, a=a, b=b, c=c, o=rng.choice(OBJECTS))
    reply = f"{a} {ops[0]} {b} = {d}. {d} {ops[1]} {c} = {e}. The answer is {e}."
    return Problem(question, reply, e, f"{a}{ops[0]}{b}{ops[1]}{c}")


def sample_problem(rng: random.Random) -> Problem:
    """One problem: 40% bare arithmetic, 35% one-step stories, 25% two-step stories."""
    u = rng.random()
    if u < 0.40:
        return _one_step(rng, story=False)
    if u < 0.75:
        return _one_step(rng, story=True)
    return _two_step(rng)


def problems(seed: int, split: str):
    """Endless problems of one split ('train' or 'test'), the same sequence for the same seed."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: use train or test")
    rng = random.Random(seed)
    while True:
        p = sample_problem(rng)
        if split_of(p.key) == split:
            yield p


def held_out_set(num: int, seed: int = 1234) -> list[Problem]:
    """`num` held-out problems with distinct arithmetic keys (so each test sum counts once)."""
    seen, out = set(), []
    if num <= 0:
        return out
    for p in problems(seed, "test"):
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
            if len(out) == num:
                return out
    raise AssertionError("unreachable: problems() is endless")


def write_jsonl(path: Path, items: list[Problem], max_tokens: int = 64) -> None:
    """The bench workload shape: {"messages", "max_tokens", "metadata": {"answer", "task_id"}} per line."""
    lines = [json.dumps({"messages": p.messages(), "max_tokens": max_tokens,
                         "metadata": {"task_id": f"fluxlab_arith/{i}", "answer": str(p.answer), "key": p.key}},
                        sort_keys=True)
             for i, p in enumerate(items)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
