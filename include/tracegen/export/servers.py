"""Whose tokens these are: what a run's SGLang servers say about themselves, kept beside the run as
`runs/<run_id>/servers.json` so an export names the model, tokenizer and chat template of its ids long after
the servers are gone.

SGLang 0.5.23 reports no hash of its tokenizer or chat template; their identity is what it does report:
`/model_info` (model and tokenizer path, served name, weight version, the reasoning and tool-call parsers,
model type and architectures) and `/server_info` (the resolved launch settings: `chat_template` (the flag;
null means the tokenizer's own template), tokenizer mode and revision, context length, and SGLang's
`version`). `record` asks each server (the task that provisions the fleet is the one that should call it);
`identity` picks those fields, pure, so a test can check them against SGLang's own response models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tracegen.common.tls import client_tls
from tracegen.store.root import OutputRoot

SERVERS_FILE = "servers.json"
MODEL_INFO_FIELDS = ("model_path", "served_model_name", "tokenizer_path", "weight_version", "reasoning_parser",
                     "tool_call_parser", "model_type", "architectures", "is_generation")
SERVER_INFO_FIELDS = ("version", "chat_template", "tokenizer_path", "tokenizer_mode", "tokenizer_revision",
                      "revision", "context_length", "skip_tokenizer_init", "completion_template",
                      "speculative_algorithm", "dtype", "quantization")


def identity(model_info: Mapping[str, Any], server_info: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of one server's answers that say which model, tokenizer and template produced its ids."""
    out = {f: model_info.get(f) for f in MODEL_INFO_FIELDS if f in model_info}
    out["sglang_version"] = server_info.get("version")
    out["server_args"] = {f: server_info.get(f) for f in SERVER_INFO_FIELDS if f in server_info and f != "version"}
    return out


def summarise(per_server: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """One identity when every server reports the same (the normal case), each server's otherwise."""
    distinct = {json.dumps(v, sort_keys=True) for v in per_server.values()}
    if len(distinct) == 1:
        return {**next(iter(per_server.values())), "servers": sorted(per_server), "agree": True}
    return {"agree": False, "per_server": dict(per_server)}


def record(root: OutputRoot, run_id: str, urls: Sequence[str], headers: Mapping[str, str] | None = None,
           timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask every server for /model_info and /server_info and keep what they say as runs/<run>/servers.json."""
    import httpx

    per_server: dict[str, dict[str, Any]] = {}
    with httpx.Client(headers=dict(headers or {}), timeout=timeout_s, verify=client_tls()) as client:
        for url in urls:
            base = url.rstrip("/")
            model_info = client.get(f"{base}/model_info").raise_for_status().json()
            server_info = client.get(f"{base}/server_info").raise_for_status().json()
            per_server[base] = identity(model_info, server_info)
    doc = summarise(per_server)
    root.run_files.put(run_id, SERVERS_FILE, json.dumps(doc, indent=2).encode())
    return doc
