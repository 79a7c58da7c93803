"""A tool registry: plain typed Python functions with docstrings become JSON-schema tools.

    registry = ToolRegistry()

    @registry.tool(timeout_s=5)
    def read_file(path: Annotated[str, Field(max_length=40)]) -> str:
        '''Read a text file of the sandbox.

        Args:
            path: file path, relative to the sandbox root
        '''

- The parameter schema comes from pydantic (`signatures.py`); the first docstring paragraph is
  the tool's description, `Args:` lines describe the parameters.
- Every parameter is bounded (see `schema.py`): a `str` without `max_length` gets
  `DEFAULT_MAX_STR`, an `int` / `float` without a range gets `DEFAULT_NUMBER_RANGE`, a `list`
  without `max_length` gets `DEFAULT_MAX_ITEMS`; `tool.max_tokens` bounds the tokens of any call
  the grammar admits, so a constrained call always ends inside it.
- `registry.call(name, arguments)` never raises: an unknown tool, arguments that fail validation,
  a tool that raises and a tool that runs past its timeout all come back as an `Observation` with
  `ok=False` and a message the model can read.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from .schema import grammar_schema, max_json_chars, with_default_bounds
from .signatures import function_schema
DEFAULT_TIMEOUT_S = 10.0
MAX_OBSERVATION_CHARS = 600  # long tool output is cut: it is prompt for every later turn


@dataclass(frozen=True)
class Observation:
    """What a tool call returns to the model: `text` (always set) and whether it succeeded."""

    text: str
    ok: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: Callable[..., Any] | None  # None: a schema-only tool (see `schema_tool`), never run
    params: type[BaseModel] | None  # validates and coerces arguments (None: JSON-schema validation)
    parameters: dict  # the JSON schema shown to the model (OpenAI `function.parameters`)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def grammar_parameters(self) -> dict:
        """The schema sent to the grammar backend (bounded ASCII strings)."""
        return grammar_schema(self.parameters)

    @property
    def max_tokens(self) -> int:
        """Tokens that any admitted arguments object fits in (+ the end-of-sequence token)."""
        return max_json_chars(self.grammar_parameters) + 1

    def validate(self, arguments: dict) -> dict:
        """Validated (and, for function tools, coerced) arguments; ValueError otherwise."""
        if self.params is not None:
            try:
                return self.params.model_validate(arguments).model_dump()
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'arguments'}: {x['msg']}" for x in e.errors())
                raise ValueError(f"invalid arguments for {self.name}: {problems}") from None
        import jsonschema

        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as e:
            where = "/".join(map(str, e.absolute_path)) or "arguments"
            raise ValueError(f"invalid arguments for {self.name}: {where}: {e.message}") from None
        return arguments

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)

    def tool(self, fn: Callable | None = None, *, name: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Decorator (bare or with options) that registers `fn` and returns it unchanged."""
        def register(f: Callable) -> Callable:
            self.add(f, name=name, timeout_s=timeout_s)
            return f
        return register(fn) if fn is not None else register

    def add(self, fn: Callable, *, name: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Tool:
        tool = tool_from_function(fn, name=name, timeout_s=timeout_s)
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool
        return tool

    def names(self) -> list[str]:
        return list(self.tools)

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def subset(self, names: list[str]) -> "ToolRegistry":
        return ToolRegistry({n: self.tools[n] for n in names})

    def openai_tools(self) -> list[dict]:
        return [t.openai() for t in self.tools.values()]

    @classmethod
    def from_openai(cls, tools: list[dict]) -> "ToolRegistry":
        """Schema-only tools from an OpenAI `tools` list (default bounds added)."""
        registry = cls()
        for spec in tools:
            tool = schema_tool(spec)
            if tool.name in registry.tools:
                raise ValueError(f"tool {tool.name!r} is listed twice")
            registry.tools[tool.name] = tool
        return registry

    def validate(self, name: str, arguments: dict | str) -> dict:
        """Parsed, validated arguments; raises ValueError with a readable message otherwise."""
        if name not in self.tools:
            raise ValueError(f"unknown tool {name!r}; tools: {', '.join(self.tools)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments are not JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return self.tools[name].validate(arguments)

    def call(self, name: str, arguments: dict | str) -> Observation:
        """Run a tool; every failure is an observation, never an exception."""
        try:
            args = self.validate(name, arguments)
        except ValueError as e:
            return Observation(f"error: {e}", ok=False)
        tool = self.tools[name]
        if tool.fn is None:
            return Observation(f"error: {name} has no implementation here", ok=False)
        # NOTE: a daemon-like worker per call: a tool past its timeout is abandoned, not joined
        # (Python cannot kill a thread; tools that run code use subprocesses with their own limit).
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{name}")
        future = pool.submit(tool.fn, **args)
        pool.shutdown(wait=False)
        try:
            result = future.result(timeout=tool.timeout_s)
        except cf.TimeoutError:
            return Observation(f"error: {name} timed out after {tool.timeout_s:g} s", ok=False)
        except Exception as e:  # noqa: BLE001 - any tool failure goes back to the model
            return Observation(f"error: {name} raised {type(e).__name__}: {e}", ok=False)
        return Observation(_as_text(result))


def _as_text(result: Any) -> str:
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + f"... [{len(text) - MAX_OBSERVATION_CHARS} more chars]"
    return text


# ------------------------------------------------------------------ building tools
def schema_tool(spec: dict) -> Tool:
    """A schema-only Tool from an OpenAI tool (`{"type": "function", "function": {...}}` or the
    inner function dict), its parameters bounded by `with_default_bounds`."""
    f = spec.get("function", spec)
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"a tool needs a name: {json.dumps(spec)[:80]}")
    params = with_default_bounds(f.get("parameters") or {"type": "object", "properties": {}})
    tool = Tool(f["name"], f.get("description", ""), None, None, params)
    tool.max_tokens  # noqa: B018 - raises UnboundedSchemaError now
    return tool


def tool_from_function(fn: Callable, *, name: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Tool:
    description, model, parameters = function_schema(fn)
    tool = Tool(name or fn.__name__, description, fn, model, parameters, timeout_s)
    tool.max_tokens  # noqa: B018 - raises UnboundedSchemaError now, not at the first call
    return tool
