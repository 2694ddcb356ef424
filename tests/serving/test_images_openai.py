"""Images over the OpenAI chat API on a real gateway and engine server (a tiny random LLaVA and Qwen2-VL):
``image_url`` content parts, as data URLs and fetched over HTTP, answer as ``LLM.chat`` and transformers do on the
same rendered conversation; bad images and image parts where they cannot go are refused by name."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_llava, make_tiny_qwen_vl
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)

MAX_TOKENS = 10


def png(seed: int, size: tuple[int, int] = (40, 52)) -> bytes:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def conversation(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava_http"), smollm2_dir)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl_http"), smollm2_dir)


@pytest.fixture(scope="module")
def stack(llava_dir, qwen_dir, tiny_model_dir):
    stack = Stack(
        [
            tiny_config(qwen_dir, "qwen-vl", max_model_len=128),
            tiny_config(
                llava_dir,
                "llava",
                max_model_len=128,
                limit_mm_per_prompt={"image": 2},
                allowed_media_domains=["127.0.0.1"],  # the test's image server: loopback, fetched only when named
            ),
            tiny_config(tiny_model_dir, "text"),
        ]
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def image_server():
    """A real HTTP server of two PNG images (and a 404 for anything else)."""
    images = {"/a.png": png(1), "/b.png": png(2, (30, 64))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = images.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", images
    server.shutdown()


def chat(client, messages: list[dict], **fields):
    body = {"model": "llava", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json={**body, "ignore_eos": True})


def hf_answer(llava_dir: Path, messages: list[dict], images: list[bytes]) -> str:
    """transformers' greedy answer to the conversation as the chat template renders it, one ``<image>`` line per
    image before the message's text (vLLM's string content format)."""
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    text = "\n".join(["<image>"] * len(images) + [messages[0]["content"][0]["text"]])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    processor = AutoProcessor.from_pretrained(llava_dir)
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = processor(text=prompt, images=pil, return_tensors="pt", add_special_tokens=False)
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def test_data_url_and_fetched_images_answer_as_transformers_and_llm_chat(stack, llava_dir, image_server):
    base, images = image_server
    with stack.client() as client:
        one = chat(client, conversation(data_url(images["/a.png"])))
        two = chat(client, conversation(f"{base}/a.png", f"{base}/b.png"))
        fetched = chat(client, conversation(f"{base}/a.png"))
    assert one.status_code == 200, one.text
    answers = [r.json()["choices"][0]["message"]["content"] for r in (one, two, fetched)]
    assert answers[0] == answers[2]  # the same image, from a data URL or over HTTP
    assert answers[0] == hf_answer(llava_dir, conversation("x"), [images["/a.png"]])
    assert answers[1] == hf_answer(llava_dir, conversation("x", "y"), [images["/a.png"], images["/b.png"]])
    assert one.json()["usage"]["prompt_tokens"] > 4  # the image's 4 tokens are the prompt's
    llm = LLM(model=str(llava_dir), num_gpu_blocks_override=32, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [offline] = llm.chat(conversation(data_url(images["/a.png"])), params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert offline.outputs[0].text == answers[0]


def test_qwen2_vl_answers_as_llm_chat(stack, qwen_dir, image_server):
    """Qwen2-VL's images (each its own number of tokens, by its size) over HTTP, streamed, as ``LLM.chat`` answers
    (whose tokens equal transformers', tests/model/test_qwen2_vl_vs_hf.py)."""
    _, images = image_server
    messages = conversation(data_url(images["/a.png"]), data_url(images["/b.png"]))
    with stack.client() as client:
        whole = chat(client, messages, model="qwen-vl")
        streamed = client.post(
            "/v1/chat/completions",
            json={
                "model": "qwen-vl",
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert whole.status_code == 200, whole.text
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    llm = LLM(model=str(qwen_dir), num_gpu_blocks_override=32, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [offline] = llm.chat(messages, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert whole.json()["choices"][0]["message"]["content"] == text == offline.outputs[0].text
    usage = whole.json()["usage"]["prompt_tokens"]
    assert usage == chunks[-1]["usage"]["prompt_tokens"] == len(offline.prompt_token_ids) > 20


def test_a_requests_mm_processor_kwargs_resize_its_images(stack, qwen_dir, image_server):
    """vLLM's ``mm_processor_kwargs`` in a chat request (Qwen-VL's pixel bounds): the answer ``LLM.chat`` gives with
    the same option, more prompt tokens (a larger least size); one without images, or with a key the model does not
    take, is a 400."""
    _, images = image_server
    messages = conversation(data_url(images["/a.png"]))
    bounds = {"min_pixels": 16 * 28 * 28}  # 16 tokens at least: the image is 40 x 52 pixels
    with stack.client() as client:
        plain = chat(client, messages, model="qwen-vl")
        bounded = chat(client, messages, model="qwen-vl", mm_processor_kwargs=bounds)
        no_image = chat(client, conversation(), model="qwen-vl", mm_processor_kwargs=bounds)
        bad = chat(client, messages, model="qwen-vl", mm_processor_kwargs={"do_pan_and_scan": True})
    assert bounded.status_code == 200, bounded.text
    assert bounded.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    llm = LLM(model=str(qwen_dir), num_gpu_blocks_override=32, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [offline] = llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs=bounds)
    finally:
        llm.shutdown()
    assert bounded.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert bounded.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert error(no_image) == (
        400,
        "mm_processor_kwargs applies to a request with images",
        "mm_processor_kwargs",
    )
    assert error(bad) == (
        400,
        "mm_processor_kwargs 'do_pan_and_scan' is not supported for Qwen2VLForConditionalGeneration (supported: "
        "min_pixels, max_pixels for Qwen2-VL, Qwen2.5-VL and Qwen3-VL; do_pan_and_scan, pan_and_scan_min_crop_size, "
        "pan_and_scan_max_num_crops, pan_and_scan_min_ratio_to_activate for Gemma 3)",
        "mm_processor_kwargs",
    )


def test_the_responses_and_messages_apis_take_images_as_chat_does(stack, image_server):
    base, images = image_server
    url = data_url(images["/a.png"])
    with stack.client() as client:
        answer = chat(client, conversation(url)).json()["choices"][0]["message"]["content"]
        response = client.post(
            "/v1/responses",
            json={
                "model": "llava",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is in the picture?"},
                            {"type": "input_image", "image_url": url, "detail": "auto"},
                        ],
                    }
                ],
                "max_output_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200, response.text
        assert response.json()["output"][0]["content"][0]["text"] == answer
        plain = {"model": "llava", "messages": conversation(url), "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
        source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
        message = client.post(
            "/v1/messages",
            json={
                "model": "llava",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in the picture?"},
                            {"type": "image", "source": source},
                        ],
                    }
                ],
            },
        )
        assert message.status_code == 200, message.text
        assert message.json()["content"][0]["text"] == answer


def error(response) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["message"], body["param"]


def test_bad_images_are_refused_by_name(stack, image_server):
    base, images = image_server
    with stack.client() as client:
        assert error(chat(client, conversation(f"{base}/missing.png"))) == (
            400,
            f"messages: cannot fetch {base}/missing.png: HTTP 404",
            "messages",
        )
        assert error(chat(client, conversation("data:image/png;base64,@@@"))) == (
            400,
            "messages: the data URL's base64 data is invalid",
            "messages",
        )
        three = conversation(*[data_url(images["/a.png"])] * 3)
        assert error(chat(client, three)) == (
            400,
            "3 images in one prompt; --limit-mm-per-prompt allows 2",
            "multi_modal_data",
        )
        high = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "high"}}]}]
        assert error(chat(client, high)) == (
            400,
            "image_url.detail 'high' is not supported: images are read at the model's own resolution (detail 'auto')",
            "messages",
        )
        text_only = chat(client, conversation(data_url(images["/a.png"])), model="text")
        assert error(text_only) == (400, "the model text reads text only (no images)", "messages")
        tokenized = client.post(
            "/tokenize", json={"model": "llava", "messages": conversation(data_url(images["/a.png"]))}
        )
        assert error(tokenized) == (
            400,
            "messages with images are read by generation only (not tokenized or rendered)",
            "messages",
        )
