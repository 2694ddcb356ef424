"""Mistral's tokenizer (vLLM's --tokenizer-mode mistral) on a tiny Mistral-format model: prompts and conversations
(tools included) are encoded exactly as mistral_common encodes them, the tokens are transformers' for those ids, the
text is mistral_common's decoding, streamed text never breaks a UTF-8 character, structured outputs hold under both
grammar backends, and Mistral's recommended vLLM command line serves it over HTTP."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.engine.detokenizer import IncrementalDetokenizer
from raypaged.inputs.limits import InputError
from raypaged.inputs.tokenizer import resolve_tokenizer_mode
from raypaged.sampling_params import StructuredOutputsParams
from tests.conftest import hf_greedy, make_tiny_mistral_format
from tests.reliability.conftest import ServerProcess, free_port

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_dir):
    return make_tiny_mistral_format(tmp_path_factory.mktemp("mistral_tok"), smollm2_dir)


@pytest.fixture(scope="module")
def reference(folders):
    """mistral_common's own tokenizer, and transformers' model of the same weights."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders[0], dtype=torch.float32).eval()
    return MistralTokenizer.from_file(str(folders[1] / "tekken.json")), model


@pytest.fixture(scope="module")
def llm(folders):
    llm = LLM(model=str(folders[1]), num_gpu_blocks_override=64, max_model_len=256)
    yield llm
    llm.shutdown()


def test_auto_picks_mistrals_tokenizer_for_a_folder_without_a_hugging_face_one(folders, llm):
    assert llm.llm_engine.config.resolved_tokenizer_mode == "mistral"
    assert type(llm.get_tokenizer()).__name__ == "MistralCommonBackend"
    assert EngineConfig(model=str(folders[1]), tokenizer_mode="mistral").resolved_tokenizer_mode == "mistral"


def test_a_text_prompt_is_mistral_commons_encoding_and_gives_transformers_tokens(llm, reference):
    tokenizer, model = reference
    text = "Hello, my name is Zoë 🎉"
    [out] = llm.generate([text], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == tokenizer.instruct_tokenizer.tokenizer.encode(text, bos=True, eos=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(model, out.prompt_token_ids, 8)
    assert out.outputs[0].text == tokenizer.decode(list(out.outputs[0].token_ids))


def test_a_conversation_with_tools_is_mistral_commons_request_encoding(llm, reference):
    from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, Tool

    tokenizer, model = reference
    [out] = llm.chat(CONVERSATION, GREEDY, tools=TOOLS, use_tqdm=False)
    function = TOOLS[0]["function"]
    request = ChatCompletionRequest(
        messages=[SystemMessage(content="Be brief."), UserMessage(content="Weather in Paris?")],
        tools=[Tool(function=Function(**function))],
    )
    assert out.prompt_token_ids == tokenizer.encode_chat_completion(request).tokens
    assert list(out.outputs[0].token_ids) == hf_greedy(model, out.prompt_token_ids, 8)


def test_what_mistral_common_does_not_read_is_refused_by_name(llm, folders):
    engine = llm.llm_engine
    for options, message in [
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs does not apply"),
        ({"documents": [{"title": "t", "text": "x"}]}, "documents does not apply"),
        ({"chat_template": "{{ messages }}", "trusted": True}, "chat_template does not apply"),
    ]:
        with pytest.raises(InputError) as refused:
            engine.input_processor.chat_ids(CONVERSATION, **options)
        assert str(refused.value).startswith(message + " with Mistral's tokenizer: mistral_common encodes")
    with pytest.raises(InputError, match=r"^Mistral's encoding refused the conversation: "):
        engine.input_processor.chat_ids([{"role": "assistant", "content": "first"}, *CONVERSATION])
    with pytest.raises(InputError, match=r"^add_special_tokens: Mistral's chat encoding writes its special tokens$"):
        engine.input_processor.chat_ids(CONVERSATION, add_special_tokens=True)
    with pytest.raises(ValueError) as refused:
        EngineConfig(model=str(folders[1]), chat_template="{{ messages }}")
    assert str(refused.value) == (
        "--chat-template does not apply with Mistral's tokenizer (--tokenizer-mode mistral): mistral_common encodes "
        "conversations itself"
    )
    with pytest.raises(ValueError, match=r"^--tokenizer-mode mistral: .* has no Mistral tokenizer \(tekken\.json\)$"):
        EngineConfig(model=str(folders[0]), tokenizer_mode="mistral")
    with pytest.raises(ValueError, match=r"^--tokenizer-mode slow is not supported: hf \(the Hugging Face"):
        EngineConfig(model=str(folders[1]), tokenizer_mode="slow")


def test_streamed_text_never_breaks_a_character_and_keeps_control_tokens_apart(llm, reference):
    tokenizer = llm.get_tokenizer()
    text = "naïve 🎉🎉 你好 — ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens are parts of a character
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detokenizer.add_tokens([i]) for i in ids]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.flush() == text
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    control = [9, *tokenizer.encode("[1]", add_special_tokens=False), 2]  # [TOOL_CALLS] ... </s>
    # spaces between special tokens, the prompt's <s> included (as Hugging Face's slow tokenizers space them)
    assert "".join(kept.add_tokens([i]) for i in control) + kept.flush() == " [TOOL_CALLS] [1] </s>"
    tight = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(tight.add_tokens([i]) for i in control) + tight.flush() == "[TOOL_CALLS][1]</s>"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_outputs_hold_with_mistrals_token_bytes(folders, backend):
    llm = LLM(
        model=str(folders[1]),
        num_gpu_blocks_override=64,
        max_model_len=256,
        structured_outputs_config={"backend": backend},
    )
    try:
        schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}
        outputs = llm.generate(
            ["Pick one", "A colour"],
            [
                SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema)),
                SamplingParams(
                    temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]")
                ),
            ],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert json.loads(outputs[0].outputs[0].text)["c"] in ("red", "blue")
    assert re.fullmatch("[a-c]{3}-[0-9]", outputs[1].outputs[0].text)


def test_reasoning_delimiters_that_are_control_tokens_are_their_ids(folders, tmp_path):
    """Magistral's [THINK] and [/THINK] are control tokens (34 and 35 here, in a Tekken file that names them): a
    thinking_token_budget counts and ends a section by those ids, not by their names' text pieces; a tokenizer
    without them takes the names' text."""
    tekken = json.loads((folders[1] / "tekken.json").read_text())
    names = [f"<SPECIAL_{i}>" for i in range(1000)]
    for rank, name in enumerate(
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]
        + ["[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]"]
        + ["[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]
    ):
        names[rank] = name
    names[34], names[35] = "[THINK]", "[/THINK]"
    tekken["special_tokens"] = [{"rank": i, "token_str": n, "is_control": True} for i, n in enumerate(names)]
    magistral = tmp_path / "magistral"
    shutil.copytree(folders[1], magistral)
    (magistral / "tekken.json").write_text(json.dumps(tekken))
    reasoning = {"reasoning_parser": "mistral"}
    for folder, expected in ((magistral, ([34], [35])), (folders[1], None)):
        llm = LLM(model=str(folder), num_gpu_blocks_override=16, max_model_len=64, structured_outputs_config=reasoning)
        try:
            found = llm.llm_engine.input_processor._reasoning_ids
            tokenizer = llm.get_tokenizer()
        finally:
            llm.shutdown()
        text_ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("[THINK]", "[/THINK]")]
        assert found == (expected or tuple(text_ids))
        assert expected is not None or len(text_ids[0]) > 1  # the plain Tekken file has no such control token


def test_a_sentencepiece_tokenizer_is_refused_in_mistral_mode_and_read_in_hugging_faces(tmp_path, smollm2_dir):
    """tokenizer.model.v3 (Mistral 7B v0.3, Mixtral, Codestral) would load the sentencepiece package, whose wheel maps
    a second OpenMP runtime beside torch's: refused by name in mistral mode, and auto leaves such a folder to
    Hugging Face's tokenizer (which those repositories ship)."""
    _, consolidated = make_tiny_mistral_format(tmp_path, smollm2_dir, "v3")
    with pytest.raises(ValueError) as refused:
        EngineConfig(model=str(consolidated), tokenizer_mode="mistral")
    assert str(refused.value) == (
        f"--tokenizer-mode mistral reads Tekken tokenizers (tekken.json); {consolidated} has SentencePiece's "
        "tokenizer.model.v3, which raypaged reads in Hugging Face's format: serve the repository's tokenizer.json "
        "(--tokenizer-mode hf)"
    )
    assert resolve_tokenizer_mode("auto", consolidated) == "hf"


def test_mistrals_recommended_vllm_command_line_serves_chat_with_tools(folders, tmp_path):
    """``vllm serve ... --tokenizer_mode mistral --config_format mistral --load_format mistral --tool-call-parser
    mistral --enable-auto-tool-choice``, as Mistral's model cards give it (underscores and all)."""
    port, grpc_port = free_port(), free_port()
    process = ServerProcess(
        "serve",
        [
            str(folders[1]),
            "--tokenizer_mode",
            "mistral",
            "--config_format",
            "mistral",
            "--load_format",
            "mistral",
            "--tool-call-parser",
            "mistral",
            "--enable-auto-tool-choice",
            "--max-model-len",
            "256",
            "--num-gpu-blocks-override",
            "64",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        tmp_path / "serve.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        process.wait_http_ready(url)
        body = {
            "model": str(folders[1]),
            "messages": CONVERSATION,
            "tools": TOOLS,
            "max_tokens": 6,
            "temperature": 0,
        }
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        tokenized = httpx.post(
            f"{url}/tokenize", json={"model": body["model"], "messages": CONVERSATION, "tools": TOOLS}
        ).json()
    finally:
        process.close()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 6
    assert answer["usage"]["prompt_tokens"] == tokenized["count"]
