"""The bad requests a soak keeps sending: each must get a 4xx with a message, and nothing else
may change (the server keeps serving everyone else).

Every entry is (name, path, body); ``body`` is a JSON-able payload, or ``bytes`` sent as is (a
malformed body). Built for a model with ``vocab_size`` tokens and ``context`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BadRequest:
    name: str
    path: str
    body: dict | bytes


def _gen(**fields) -> dict:
    body = {"input_ids": [16, 17, 18], "sampling_params": {"max_new_tokens": 2}}
    params = fields.pop("sampling_params", None)
    body.update(fields)
    if params is not None:
        body["sampling_params"] = {"max_new_tokens": 2, **params}
    return body


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _chat(**fields) -> dict:
    return {"model": "cedar", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


def catalogue(vocab_size: int, context: int) -> list[BadRequest]:
    g, c = "/generate", "/v1/chat/completions"
    return [
        BadRequest("invalid regex", g, _gen(sampling_params={"regex": "[a-"})),
        BadRequest("invalid json schema", g, _gen(sampling_params={"json_schema": "{\"type\": 12}"})),
        BadRequest("json schema not json", g, _gen(sampling_params={"json_schema": "{not json"})),
        BadRequest("prompt over the context", g, _gen(input_ids=[16 + i % 500 for i in range(context + 8)])),
        BadRequest("token id out of range", g, _gen(input_ids=[16, vocab_size + 5])),
        BadRequest("negative token id", g, _gen(input_ids=[16, -3])),
        BadRequest("empty prompt", g, _gen(input_ids=[])),
        BadRequest("empty text", g, {"text": "", "sampling_params": {"max_new_tokens": 2}}),
        BadRequest("malformed json body", g, b"{\"input_ids\": [16, 17,"),
        BadRequest("body not an object", g, b"[1, 2, 3]"),
        BadRequest("max_new_tokens a string", g, _gen(sampling_params={"max_new_tokens": "ten"})),
        BadRequest("max_new_tokens negative", g, _gen(sampling_params={"max_new_tokens": -5})),
        BadRequest("temperature negative", g, _gen(sampling_params={"temperature": -1.0})),
        BadRequest("top_p above 1", g, _gen(sampling_params={"top_p": 1.5})),
        BadRequest("top_k zero", g, _gen(sampling_params={"top_k": 0})),
        BadRequest("n zero", g, _gen(sampling_params={"n": 0})),
        BadRequest("top_logprobs_num past the vocabulary", g, _gen(return_logprob=True, top_logprobs_num=10 * vocab_size)),
        BadRequest("token_ids_logprob out of range", g, _gen(return_logprob=True, token_ids_logprob=[16, vocab_size])),
        BadRequest("logprob_start_len below -1", g, _gen(return_logprob=True, logprob_start_len=-7)),
        BadRequest("logprob_start_len past the prompt", g, _gen(return_logprob=True, logprob_start_len=10**6)),
        BadRequest("stop of the wrong type", g, _gen(sampling_params={"stop": 5})),
        BadRequest("input_ids of strings", g, _gen(input_ids=["a", "b"])),
        BadRequest("chat: unknown tool in tool_choice", c,
                   _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "no_such_tool"}})),
        BadRequest("chat: tool_choice required without tools", c, _chat(tool_choice="required")),
        BadRequest("chat: no messages", c, _chat(messages=[])),
        BadRequest("chat: unknown role", c, _chat(messages=[{"role": "wizard", "content": "hi"}])),
        BadRequest("chat: max_tokens negative", c, _chat(max_tokens=-1)),
        BadRequest("chat: invalid response_format schema", c,
                   _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}})),
    ]


def has_message(body) -> bool:
    """A 4xx answer names what was wrong: a non-empty message/detail/error string somewhere."""
    if isinstance(body, str):
        return bool(body.strip())
    if isinstance(body, dict):
        return any(has_message(body.get(k)) for k in ("message", "detail", "error", "raw"))
    if isinstance(body, list):
        return any(has_message(x) for x in body)
    return False
