"""The chat request bodies tracegen sends, judged by SGLang's own request model and handler checks."""

from __future__ import annotations

import json

from fixtures import sglang_reference as sglang_ref

from tracegen.dataset.reader import PromptRow, build_index, read_rows
from tracegen.sample_data import SAMPLE_DATASET
from tracegen.sglang.settings import Sampling
from tracegen.sglang.wire import ChatRequest, build_body


def test_every_sample_row_becomes_a_request_sglang_accepts(tmp_path):
    index = build_index(str(SAMPLE_DATASET), cache_uri=str(tmp_path))
    rows = list(read_rows(index, 0, 300))
    assert all(isinstance(r, PromptRow) for r in rows)
    with_tools = 0
    for row in rows:
        request = ChatRequest(row.index, row.messages, model="qwen3", sampling=Sampling(8192, 0.6, 0.95, 7),
                              tools=row.tools)
        body = json.loads(build_body(request, return_token_ids=True))
        assert sglang_ref.chat_request_refusal(body) is None, row.index
        with_tools += bool(row.tools)
    assert with_tools, "the sample should exercise tools"


def test_the_body_keeps_its_sampling_fields_as_sglang_reads_them():
    body = json.loads(build_body(ChatRequest(0, [{"role": "user", "content": "hi"}], model="qwen3",
                                             sampling=Sampling(4096, 0.6, 0.95, None),
                                             extra={"chat_template_kwargs": {"enable_thinking": False}})))
    read = sglang_ref.sglang().protocol.ChatCompletionRequest.model_validate(body).model_dump()
    assert (read["max_tokens"], read["temperature"], read["top_p"], read["stream"]) == (4096, 0.6, 0.95, False)
    assert read["chat_template_kwargs"] == {"enable_thinking": False} and read["seed"] is None
