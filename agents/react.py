"""A ReAct agent (thought, constrained tool call, observation, ..., final answer) over a small
fact base: `lookup` a fact, `calculate` an arithmetic expression, `finish` with the answer.

    state = react.run(question=..., facts={...}, max_steps=6, backend=backend)
    state["answer"], state.ret_value (a `Session`)
"""

from __future__ import annotations

import ast
import operator
from typing import Annotated

import sglang as sgl
from pydantic import Field

from cedar.frontend.chat import system_text
from cedar.frontend.endpoint import label
from cedar.frontend.session import Session
from cedar.frontend.tools import ToolRegistry

from .steps import finish_tool, run_until_finish

SYSTEM = ("You answer questions about a fact base. Think step by step: each turn write one short "
          "thought and call one tool; call finish with the answer when you know it.")
EXAMPLE_FACTS = {"capital of France": "Paris", "population of Paris": "2102650",
                 "river of Paris": "Seine", "length of the Seine": "777 km"}
EXAMPLE_QUESTION = "How long is the river of the capital of France?"


def react_tools(facts: dict[str, str]) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool
    def lookup(key: Annotated[str, Field(max_length=32)]) -> str:
        """Look a fact up in the fact base by its key.

        Args:
            key: the fact's key, e.g. 'capital of France'
        """
        if key in facts:
            return facts[key]
        close = [k for k in facts if key.lower() in k.lower() or k.lower() in key.lower()]
        raise KeyError(f"no fact {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))

    @registry.tool
    def calculate(expression: Annotated[str, Field(max_length=32)]) -> str:
        """Evaluate an arithmetic expression (+ - * / ** and parentheses).

        Args:
            expression: e.g. '(3 + 4) * 2'
        """
        return str(safe_eval(expression))

    finish_tool(registry)
    return registry


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Mod: operator.mod}


def safe_eval(expression: str) -> float:
    """Arithmetic only: numbers and the operators in _OPS (no names, calls or attributes)."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")
    return ev(ast.parse(expression, mode="eval").body)


@sgl.function
def react(s, question: str, facts: dict, max_steps: int = 6, temperature: float = 0.0, name: str = "react"):
    label(s, name)
    registry = react_tools(facts)
    session = Session(name)
    s += sgl.system(system_text(SYSTEM, registry.openai_tools()))
    s += sgl.user(question)
    run_until_finish(s, registry, session, range(max_steps), temperature=temperature)
    s.set_var("answer", session.answer or "")
    return session
