"""Constrained tool calls inside `@sgl.function` programs, in the served model's markup.

A call is written as SGLang's `hermes` structural tag writes it (`CALL_HEAD` + name + `CALL_MID` +
arguments + `CALL_TAIL`, from `cedar.backend.chat_template`), in two constrained generations:

1. the function name, `sgl.gen(regex="(name_1|name_2|...)")` (skipped when one tool is allowed);
2. its arguments, `sgl.gen(json_schema=tool.grammar_parameters)`: bounded strings and numbers, so
   the call ends inside `tool.max_tokens` whatever the model does. With `stated` (an opt-in
   mode, `stated_values.py`) each free value is narrowed to the values the conversation states.

Both gens end where their grammar ends (the server forces the end-of-sequence token there), so
their outputs are carried forward token for token by `CedarEndpoint` and the next request's hit
ends exactly where this one stopped (a restored snapshot, nothing replayed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import sglang as sgl

from .chat import CALL_HEAD, CALL_MID, CALL_TAIL, tool
from .endpoint import executor_of
from .schema import grammar_schema, max_json_chars
from .stated_values import StatedValues
from .tools import Observation, ToolRegistry


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the JSON text the model wrote

    def parsed(self) -> dict | None:
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None


def name_regex(names: list[str]) -> str:
    return "(" + "|".join(re.escape(n) for n in names) + ")"


def gen_call(s, registry: ToolRegistry, var: str, names: list[str] | None = None,
             temperature: float = 0.0, stated: StatedValues | None = None) -> Call:
    """Append one constrained call to the open assistant message of `s`; return it.

    `var` names the gens (`{var}_name`, `{var}_args`); `names` limits the choice of tools;
    `stated`: narrow every free argument value to the values the conversation states.
    """
    names = list(names or registry.names())
    if not names:
        raise ValueError("gen_call needs at least one tool")
    s += CALL_HEAD
    if len(names) == 1:
        name = names[0]
        s += name
    else:
        s += sgl.gen(f"{var}_name", regex=name_regex(names), max_tokens=max(map(len, names)) + 1,
                     temperature=temperature)
        name = _value(s, f"{var}_name")
    spec = registry[name]
    grammar = spec.grammar_parameters if stated is None else grammar_schema(stated.narrow(spec.parameters))
    s += CALL_MID + sgl.gen(f"{var}_args", json_schema=json.dumps(grammar),
                            max_tokens=max_json_chars(grammar) + 1, temperature=temperature) + CALL_TAIL
    return Call(name, _value(s, f"{var}_args"))


class ConstrainedCallError(RuntimeError):
    """The server refused a constrained gen (e.g. a schema its grammar backend cannot compile)."""


def _value(s, var: str) -> str:
    try:
        return s[var]
    except KeyError:
        error = getattr(executor_of(s), "error_", None)
        raise ConstrainedCallError(f"the constrained gen {var!r} failed: {error}") from None


def observe(s, registry: ToolRegistry, call: Call) -> Observation:
    """Run `call` and append its result as a tool message (errors included: the loop goes on)."""
    obs = registry.call(call.name, call.arguments)
    s += tool(obs.text)
    return obs
