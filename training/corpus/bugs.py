"""Bug kinds for the coding agent: each kind writes a small function with one bug, with random
function and variable names and random values, the one-line fix, and a call whose expected value
only the fixed function returns.

`BUG_KINDS` is the pool the splits cut (`common.side`): every 4th kind is held out, so the
held-out coding figure measures fixes of a kind no training task shows.

Every line a fix replaces fits the sandbox's `edit_file` (at most 40 characters, indentation
included: the fix is copied from the file as it is indented there).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

EDIT_CHARS = 40
VARS = ("a", "b", "x", "y", "n", "m", "k", "p", "q", "total", "count", "value", "width", "size", "limit",
        "step", "base", "rate", "score", "acc", "val", "num", "cap", "low", "high")
LISTS = ("items", "xs", "data", "vals", "nums", "seq", "row", "bag")
TEXTS = ("text", "word", "label", "tag", "line")
VERBS = ("calc", "get", "make", "count", "find", "pick", "scale", "merge", "check", "fold", "sum", "norm",
         "clip", "grade", "rank", "mix", "tally", "score", "shift", "trim")
NOUNS = ("total", "area", "span", "level", "price", "width", "limit", "step", "count", "gap", "range",
         "head", "tail", "peak", "bonus", "share", "chunk", "batch", "slot", "mark")


@dataclass(frozen=True)
class BugCase:
    func: str
    params: str  # "a, b"
    body: list[str]  # the function's body lines, indented, the buggy one among them
    bad: str  # the buggy line as it is in the file (indentation included)
    good: str  # the fixed line
    args: tuple
    want: object  # what the fixed function returns for args
    extra: str = ""  # a helper the function calls (defined in the same module)

    def source(self) -> str:
        return f"def {self.func}({self.params}):\n" + "".join(line + "\n" for line in self.body)


def _ret(expr: str) -> str:
    return "    return " + expr


def _ints(rng, n, lo=1, hi=99):
    return rng.sample(range(lo, hi), n)


def wrong_operator(rng, f, v, xs, t) -> BugCase:
    a, b = v[:2]
    good_op, bad_op = rng.choice((("+", "-"), ("*", "+"), ("-", "+"), ("+", "*")))
    x, y = rng.randrange(3, 60), rng.randrange(3, 60)
    return BugCase(f, f"{a}, {b}", [_ret(f"{a} {bad_op} {b}")], _ret(f"{a} {bad_op} {b}"), _ret(f"{a} {good_op} {b}"),
                   (x, y), eval(f"{x} {good_op} {y}"))  # noqa: S307 - two generated integers


def off_by_one_range(rng, f, v, xs, t) -> BugCase:
    n = v[0]
    k = rng.randrange(2, 30)
    return BugCase(f, n, [_ret(f"sum(range(1, {n}))")], _ret(f"sum(range(1, {n}))"), _ret(f"sum(range(1, {n} + 1))"),
                   (k,), sum(range(1, k + 1)))


def off_by_one_slice(rng, f, v, xs, t) -> BugCase:
    k = v[0]
    items = _ints(rng, rng.randrange(4, 7))
    j = rng.randrange(2, len(items))
    return BugCase(f, f"{xs}, {k}", [_ret(f"{xs}[:{k} - 1]")], _ret(f"{xs}[:{k} - 1]"), _ret(f"{xs}[:{k}]"),
                   (items, j), items[:j])


def wrong_comparison(rng, f, v, xs, t) -> BugCase:
    x, lim = v[:2]
    good, bad = rng.choice(((">=", ">"), ("<=", "<")))
    n = rng.randrange(1, 100)
    return BugCase(f, f"{x}, {lim}", [_ret(f"{x} {bad} {lim}")], _ret(f"{x} {bad} {lim}"), _ret(f"{x} {good} {lim}"),
                   (n, n), True)


def swapped_args(rng, f, v, xs, t) -> BugCase:
    a, b = v[:2]
    h = f"{f}_{rng.choice(('core', 'step', 'part'))}"
    x, y = rng.sample(range(2, 90), 2)
    extra = f"def {h}(p, q):\n    return p - q\n"
    return BugCase(f, f"{a}, {b}", [_ret(f"{h}({b}, {a})")], _ret(f"{h}({b}, {a})"), _ret(f"{h}({a}, {b})"),
                   (x, y), x - y, extra)


def wrong_constant(rng, f, v, xs, t) -> BugCase:
    x = v[0]
    c, c2 = rng.sample(range(2, 13), 2)
    n = rng.randrange(2, 50)
    return BugCase(f, x, [_ret(f"{x} * {c2}")], _ret(f"{x} * {c2}"), _ret(f"{x} * {c}"), (n,), n * c)


def wrong_index(rng, f, v, xs, t) -> BugCase:
    items = _ints(rng, rng.randrange(3, 6))
    good, bad = rng.choice((("-1", "0"), ("1", "0"), ("0", "-1"), ("-2", "-1")))
    return BugCase(f, xs, [_ret(f"{xs}[{bad}]")], _ret(f"{xs}[{bad}]"), _ret(f"{xs}[{good}]"),
                   (items,), items[int(good)])


def missing_negation(rng, f, v, xs, t) -> BugCase:
    x = v[0]
    items = _ints(rng, rng.randrange(3, 6))
    n = rng.choice([i for i in range(1, 99) if i not in items])
    return BugCase(f, f"{x}, {xs}", [_ret(f"{x} in {xs}")], _ret(f"{x} in {xs}"), _ret(f"{x} not in {xs}"),
                   (n, items), True)


def wrong_return_var(rng, f, v, xs, t) -> BugCase:
    a, b, s, d = v[:4]
    x, y = rng.randrange(10, 90), rng.randrange(1, 9)
    body = [f"    {s} = {a} + {b}", f"    {d} = {a} - {b}", _ret(d)]
    return BugCase(f, f"{a}, {b}", body, _ret(d), _ret(s), (x, y), x + y)


def wrong_string_method(rng, f, v, xs, t) -> BugCase:
    good, bad = rng.choice((("upper", "lower"), ("lower", "upper"), ("title", "lower"), ("upper", "title")))
    words = " ".join(rng.sample(("amber", "Birch", "cobalt", "Delta", "ember", "fern", "Gale", "hazel"), 2))
    return BugCase(f, t, [_ret(f"{t}.{bad}()")], _ret(f"{t}.{bad}()"), _ret(f"{t}.{good}()"),
                   (words,), getattr(words, good)())


def wrong_boolean_op(rng, f, v, xs, t) -> BugCase:
    a, b = v[:2]
    x, y = rng.randrange(1, 50), -rng.randrange(0, 50)
    return BugCase(f, f"{a}, {b}", [_ret(f"{a} > 0 or {b} > 0")], _ret(f"{a} > 0 or {b} > 0"),
                   _ret(f"{a} > 0 and {b} > 0"), (x, y), False)


def wrong_initial_value(rng, f, v, xs, t) -> BugCase:
    acc, it = v[:2]
    items = _ints(rng, rng.randrange(2, 5))
    body = [f"    {acc} = 1", f"    for {it} in {xs}:", f"        {acc} += {it}", _ret(acc)]
    return BugCase(f, xs, body, f"    {acc} = 1", f"    {acc} = 0", (items,), sum(items))


def wrong_min_max(rng, f, v, xs, t) -> BugCase:
    good, bad = rng.choice((("max", "min"), ("min", "max")))
    items = _ints(rng, rng.randrange(3, 6))
    return BugCase(f, xs, [_ret(f"{bad}({xs})")], _ret(f"{bad}({xs})"), _ret(f"{good}({xs})"),
                   (items,), {"max": max, "min": min}[good](items))


def wrong_accumulate(rng, f, v, xs, t) -> BugCase:
    acc, it = v[:2]
    items = _ints(rng, rng.randrange(2, 5))
    body = [f"    {acc} = 0", f"    for {it} in {xs}:", f"        {acc} = {it}", _ret(acc)]
    return BugCase(f, xs, body, f"        {acc} = {it}", f"        {acc} += {it}", (items,), sum(items))


def wrong_modulo(rng, f, v, xs, t) -> BugCase:
    n = v[0]
    k = 2 * rng.randrange(1, 50)
    return BugCase(f, n, [_ret(f"{n} % 2 == 1")], _ret(f"{n} % 2 == 1"), _ret(f"{n} % 2 == 0"), (k,), True)


def wrong_sort_order(rng, f, v, xs, t) -> BugCase:
    items = _ints(rng, rng.randrange(3, 6))
    return BugCase(f, xs, [_ret(f"sorted({xs}, reverse=True)")], _ret(f"sorted({xs}, reverse=True)"),
                   _ret(f"sorted({xs})"), (items,), sorted(items))


def integer_division(rng, f, v, xs, t) -> BugCase:
    a, b = v[:2]
    y = rng.randrange(2, 9)
    x = y * rng.randrange(2, 20) + rng.randrange(1, y)
    return BugCase(f, f"{a}, {b}", [_ret(f"{a} / {b}")], _ret(f"{a} / {b}"), _ret(f"{a} // {b}"), (x, y), x // y)


def missing_abs(rng, f, v, xs, t) -> BugCase:
    x = v[0]
    n = -rng.randrange(1, 99)
    return BugCase(f, x, [_ret(x)], _ret(x), _ret(f"abs({x})"), (n,), -n)


def wrong_length(rng, f, v, xs, t) -> BugCase:
    items = _ints(rng, rng.randrange(2, 7))
    return BugCase(f, xs, [_ret(f"len({xs}) - 1")], _ret(f"len({xs}) - 1"), _ret(f"len({xs})"), (items,), len(items))


def wrong_power(rng, f, v, xs, t) -> BugCase:
    x = v[0]
    n = rng.randrange(3, 30)
    return BugCase(f, x, [_ret(f"{x} * 2")], _ret(f"{x} * 2"), _ret(f"{x} ** 2"), (n,), n ** 2)


# NOTE: the order fixes which kinds are held out (every 4th: common.side)
BUG_KINDS: dict[str, Callable[..., BugCase]] = {
    "wrong-operator": wrong_operator,
    "off-by-one-range": off_by_one_range,
    "off-by-one-slice": off_by_one_slice,
    "wrong-comparison": wrong_comparison,
    "swapped-args": swapped_args,
    "wrong-constant": wrong_constant,
    "wrong-index": wrong_index,
    "missing-negation": missing_negation,
    "wrong-return-var": wrong_return_var,
    "wrong-min-max": wrong_min_max,
    "wrong-accumulate": wrong_accumulate,
    "wrong-string-method": wrong_string_method,
    "wrong-modulo": wrong_modulo,
    "integer-division": integer_division,
    "missing-abs": missing_abs,
    "wrong-boolean-op": wrong_boolean_op,
    "wrong-initial-value": wrong_initial_value,
    "wrong-length": wrong_length,
    "wrong-power": wrong_power,
    "wrong-sort-order": wrong_sort_order,
}


def make_bug(rng: random.Random, kind: str) -> BugCase:
    """One instance of a bug kind, with fresh names; every edited line fits `edit_file`."""
    for _ in range(100):
        func = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
        case = BUG_KINDS[kind](rng, func, rng.sample(VARS, 4), rng.choice(LISTS), rng.choice(TEXTS))
        if max(len(case.bad), len(case.good)) <= EDIT_CHARS and (case.source() + case.extra).count(case.bad) == 1:
            return case
    raise RuntimeError(f"bug kind {kind}: no instance fits edit_file")  # pragma: no cover
