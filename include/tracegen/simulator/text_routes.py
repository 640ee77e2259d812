"""SGLang's routes over text and ids that generate nothing: `/tokenize` and `/detokenize` (the stand-in's
tokenizer and chat template), `/separate_reasoning` and `/parse_function_call` (the chat route's own parsers,
for a client that splits a continued row's text as the chat route would have)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tracegen.dataset.request_rules import check_tool
from tracegen.simulator import protocol as p
from tracegen.simulator.reasoning import UnmodelledParser, UnsupportedParser, separate_reasoning
from tracegen.simulator.responses import json_response
from tracegen.simulator.tokens import TOKENIZER_MAX_LENGTH, chat_prompt_ids, text_ids, tokenizer
from tracegen.simulator.tool_calls import (
    AdapterToolParser,
    UnmodelledToolParser,
    UnsupportedToolParser,
    parse_function_call,
)


async def tokenize_endpoint(request: web.Request) -> web.Response:
    """POST /tokenize (/v1/tokenize): SGLang's TokenizeRequest -> TokenizeResponse, with the stand-in's
    tokenizer and chat template."""
    req = p.parse_tokenize(p.parse_json_object(await request.read()))
    if req.messages is not None:
        tokens: Any = chat_prompt_ids(req.messages, req.tools, req.enable_thinking,
                                      continue_final_message=req.continue_final_message,
                                      add_generation_prompt=req.add_generation_prompt)
        count: Any = len(tokens)
    elif isinstance(req.prompt, str):
        tokens = text_ids(req.prompt)
        count = len(tokens)
    else:
        tokens = [text_ids(t) for t in req.prompt]
        count = [len(t) for t in tokens]
    return json_response({"tokens": tokens, "count": count, "max_model_len": TOKENIZER_MAX_LENGTH})


async def detokenize_endpoint(request: web.Request) -> web.Response:
    """POST /detokenize (/v1/detokenize): SGLang's DetokenizeRequest -> DetokenizeResponse: the tokenizer's
    decode of the ids as they are (special tokens skipped unless told otherwise; unknown ids decode to
    nothing; U+FFFD where the bytes are not whole characters)."""
    req = p.parse_detokenize(p.parse_json_object(await request.read()))
    tok = tokenizer()
    if req.tokens and isinstance(req.tokens[0], list):
        text: Any = [tok.decode(t, req.skip_special_tokens) for t in req.tokens]
    else:
        text = tok.decode(req.tokens, req.skip_special_tokens)  # type: ignore[arg-type]
    return json_response({"text": text})


async def separate_reasoning_endpoint(request: web.Request) -> web.Response:
    """POST /separate_reasoning: split raw text exactly as the chat route would."""
    body = p.parse_json_object(await request.read())
    text, parser, blocks = body.get("text"), body.get("reasoning_parser"), body.get("return_blocks", False)
    if not isinstance(text, str) or not isinstance(parser, str) or not isinstance(blocks, bool):
        raise p.BadRequest(
            "separate_reasoning needs text (string), reasoning_parser (string), return_blocks (bool)"
        )
    try:
        reasoning_text, normal_text = separate_reasoning(text, parser)
    except UnsupportedParser:
        # SGLang raises ValueError outside any handler here: the server's plain 500.
        return web.Response(status=500, text="Internal Server Error")
    except UnmodelledParser as exc:
        return json_response({"detail": str(exc)}, 501)
    out: dict[str, Any] = {"reasoning_text": reasoning_text, "text": normal_text}
    if blocks:
        parts = ([{"type": "reasoning", "text": reasoning_text}] if reasoning_text else []) + [
            {"type": "text", "text": normal_text}
        ]
        out["reasoning_blocks"] = [b["text"] for b in parts if b["type"] == "reasoning"]
        out["text_blocks"] = [b["text"] for b in parts if b["type"] == "text"]
        out["blocks"] = parts
    return json_response(out)


async def parse_function_call_endpoint(request: web.Request) -> web.Response:
    """POST /parse_function_call: SGLang's tool-call parsing of a text, the chat route's own."""
    body = p.parse_json_object(await request.read())
    text, tools, parser = body.get("text"), body.get("tools", []), body.get("tool_call_parser")
    if not isinstance(text, str):
        raise p.BadRequest("parse_function_call needs text (string)")
    if not isinstance(tools, list):
        raise p.BadRequest("tools must be a list of objects")
    for i, tool in enumerate(tools):
        try:
            check_tool(tool, f"tools[{i}]")
        except ValueError as exc:
            raise p.BadRequest(str(exc)) from None
    for key in ("tool_call_parser", "rid", "http_worker_ipc"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise p.BadRequest(f"{key} must be a string or null")
    try:
        normal_text, calls = parse_function_call(text, tools, parser)
    except AdapterToolParser as exc:
        # An HTTPException(400): SGLang's handler answers it as an ErrorResponse typed by the status code.
        return json_response(p.openai_error(str(exc), 400, "400"), 400)
    except UnsupportedToolParser:
        # SGLang raises ValueError outside any handler here: the server's plain 500.
        return web.Response(status=500, text="Internal Server Error")
    except UnmodelledToolParser as exc:
        return json_response({"detail": str(exc)}, 501)
    return json_response({"normal_text": normal_text, "calls": calls})
