"""`lookahead serve` with a vision-language model, as its users meet it: OpenAI's ``image_url`` parts
holding data URLs, sent with the real `openai` client to a real uvicorn on a free port of 127.0.0.1.

Two servers run for the module, over tiny random-weight VLMs (tests/tiny_vlms.py) in fp32, each
with a chat template that places every image where the family's processor expects it:

- LLaVA, saved to disk with its processor and served by a `lookahead serve` process;
- Qwen2-VL, whose positions run shifted after an image (M-RoPE), served in this process: its
  processor cannot be saved or loaded without torchvision (its video processor needs it).

Every greedy text equals plain ``model.generate`` on what ``processor.apply_chat_template``
makes of the same messages. Refusals are 400s in OpenAI's shape naming the field at fault.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import struct
import zlib

import httpx
import openai
import pytest
from test_server import Server, _free_port
from threaded_uvicorn import ThreadedUvicorn
from tiny_models import char_tokenizer, tiny_model
from tiny_vlms import PLACEHOLDERS, image, tiny_vlm

from lookahead import models
from lookahead.config import LookaheadConfig
from lookahead.metrics import Metrics
from lookahead.server import ServerSettings, create_app
from lookahead.service import Service

NEW_TOKENS = 12
MAX_PIXELS = 40 * 40  # the servers' limit: the tiny VLMs' 32 px images fit, a 48 px one does not


def chat_template(family: str) -> str:
    """A chat template as real VLMs ship: each message's parts in turn, an image as the family's placeholder."""
    return (
        "{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
        + PLACEHOLDERS[family]
        + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant: "
        "{% endif %}"
    )


def vlm(family: str):
    """(model, processor) of the family, the processor a copy with a chat template."""
    model, processor = tiny_vlm(family)
    processor = copy.deepcopy(processor)
    processor.chat_template = chat_template(family)
    return model, processor


def data_url(picture, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int, size: int | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image(seed, size))}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def reference(model, processor, messages: list[dict], new_tokens: int = NEW_TOKENS) -> str:
    """Plain greedy generate on what the processor makes of OpenAI's messages (their images decoded)."""
    hf_messages, pictures = [], []
    for message in messages:
        content = message["content"]
        parts = [text_part(content)] if isinstance(content, str) else []
        for part in [] if isinstance(content, str) else content:
            if part["type"] == "image_url":
                encoded = part["image_url"]["url"].partition(",")[2]
                pictures.append(_open(base64.b64decode(encoded)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        hf_messages.append({"role": message["role"], "content": parts})
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    special = not text.startswith(processor.tokenizer.bos_token or "\0")  # as processor.apply_chat_template
    if pictures:
        inputs = processor(images=[pictures], text=[text], add_special_tokens=special, return_tensors="pt")
    else:
        inputs = processor.tokenizer([text], add_special_tokens=special, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _open(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


class InProcessServer:
    """uvicorn on a thread of this process, over its own Service of ``model`` (and ``processor``)."""

    def __init__(self, name: str, model, tokenizer, processor=None) -> None:
        self.name, self.metrics = name, Metrics()
        self.service = Service(model, LookaheadConfig(0, 4, 4), max_batch_size=4, on_step=self.metrics.on_step)
        settings = ServerSettings(model_name=name, max_image_pixels=MAX_PIXELS, drain_timeout=5)
        app = create_app(self.service, tokenizer, settings, self.metrics, processor=processor)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.uvicorn = ThreadedUvicorn(app, port)
        self.server = self.uvicorn.server

    def stop(self) -> None:
        self.uvicorn.stop()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    """The tiny LLaVA and its processor (with a chat template), saved as a user's checkpoint."""
    model, processor = vlm("llava")
    folder = tmp_path_factory.mktemp("llava")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(request, llava_dir):
    """(server URL, model name, model, processor) for "llava" (a `lookahead serve` process) and
    "qwen2_vl" (in this process)."""
    family = request.param
    model, processor = vlm(family)
    if family == "llava":
        server = Server("--max-image-pixels", str(MAX_PIXELS), "--max-batch-size", "4", model=str(llava_dir))
        yield server.url, str(llava_dir), model, processor
        assert server.stop() == 0, server.output()
    else:
        server = InProcessServer("tiny-qwen2-vl", model, processor.tokenizer, processor)
        yield server.url, server.name, model, processor
        server.stop()


def client(url: str, cls=openai.OpenAI):
    return cls(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, name: str, messages: list[dict], **kwargs) -> str:
    out = client(url).chat.completions.create(
        model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, **kwargs
    )
    return out.choices[0].message.content


BOTH = pytest.mark.parametrize("served", ["llava", "qwen2_vl"], indirect=True)


def test_load_reads_a_saved_vlm_back(llava_dir):
    model, processor = vlm("llava")
    loaded, tokenizer = models.load(str(llava_dir), dtype="float32")
    read = models.load_processor(str(llava_dir))
    assert type(loaded).__name__ == "LlavaForConditionalGeneration" and read.chat_template == processor.chat_template
    assert tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    messages = [{"role": "user", "content": [image_part(0), text_part("a cat")]}]
    assert reference(loaded, read, messages) == reference(model, processor, messages)


def test_load_processor_is_none_for_a_text_model(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    assert models.load_processor(str(tmp_path)) is None


@BOTH
def test_one_image_two_images_and_text_only_are_plain_generate_s(served):
    url, name, model, processor = served
    conversations = [
        [{"role": "user", "content": [image_part(0), text_part("what is it?")]}],
        [{"role": "user", "content": [text_part("one: "), image_part(1), text_part(" two: "), image_part(2)]}],
        [{"role": "user", "content": "no image here"}],
    ]
    for messages in conversations:
        expected = reference(model, processor, messages)
        assert expected, "the reference text is empty: the test would prove little"
        assert chat(url, name, messages) == expected


@BOTH
def test_streamed_with_an_image(served):
    url, name, model, processor = served
    messages = [{"role": "user", "content": [text_part("describe "), image_part(3)]}]
    chunks = client(url).chat.completions.create(
        model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference(
        model, processor, messages
    )


@BOTH
def test_concurrent_requests_with_and_without_images(served):
    url, name, model, processor = served
    conversations = [
        [{"role": "user", "content": [image_part(4), text_part("first")]}],
        [{"role": "user", "content": "second, text only"}],
        [{"role": "user", "content": [text_part("third "), image_part(5), image_part(6)]}],
        [{"role": "user", "content": [text_part("fourth, text parts"), text_part(" only")]}],
    ]

    async def ask(messages, delay):
        await asyncio.sleep(delay)
        async with client(url, openai.AsyncOpenAI) as api:
            out = await api.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
            return out.choices[0].message.content

    async def run():
        return await asyncio.gather(*(ask(m, 0.1 * i) for i, m in enumerate(conversations)))

    texts = asyncio.run(run())
    assert texts == [reference(model, processor, m) for m in conversations]


def _bomb_png(side: int = 100_000) -> str:
    """A valid PNG header declaring a side x side image, with no pixels behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("served", ["llava"], indirect=True)
def test_refusals_name_the_field_and_the_server_goes_on(served):
    url, name, model, processor = served
    good = [{"role": "user", "content": [image_part(0), text_part("ok")]}]

    def refused(part, param: str, words: str, parts_before: int = 0):
        content = [text_part("look ")] * parts_before + [part]
        body = {"model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error"

    where = "messages[0].content[1].image_url.url"
    refused({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, where, "does not fetch", 1)
    refused({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, where, "does not fetch", 1)
    refused({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, where, "base64", 1)
    not_image = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    refused({"type": "image_url", "image_url": {"url": not_image}}, where, "not an image", 1)
    refused({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, where, "data URL", 1)
    refused(image_part(0, size=48), where, "48x48", 1)  # 2304 pixels, past MAX_PIXELS
    refused({"type": "image_url", "image_url": {"url": _bomb_png()}}, where, "too large", 1)
    refused({"type": "image_url", "image_url": {"url": data_url(image(0)), "detail": "huge"}}, where[:-4] + ".detail",
            "detail", 1)  # fmt: skip
    refused({"type": "input_audio", "input_audio": {}}, "messages[0].content[1]", "image_url", 1)
    too_many = [image_part(0)] * 9  # the default limit is 8
    body = {"model": name, "messages": [{"role": "user", "content": too_many}], "max_tokens": 2}
    error = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["error"]
    assert error["param"] == "messages[0].content[8]" and "at most 8" in error["message"], error
    # an image in an assistant's message; a placeholder typed into the text, with no image
    body = {"model": name, "max_tokens": 2, "messages": [{"role": "assistant", "content": [image_part(0)]}]}
    error = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["error"]
    assert error["param"] == "messages[0].content[0]" and "role 'user'" in error["message"], error
    body = {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "see <image>"}]}
    error = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["error"]
    assert error["param"] == "messages" and "image token" in error["message"], error
    assert chat(url, name, good) == reference(model, processor, good)


def test_an_image_to_a_text_model_is_refused():
    tokenizer = copy.deepcopy(char_tokenizer())
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}assistant:"
    server = InProcessServer("tiny-text", tiny_model("llama"), tokenizer)
    try:
        body = {"model": "tiny-text", "max_tokens": 2,
                "messages": [{"role": "user", "content": [text_part("hi"), image_part(0)]}]}  # fmt: skip
        error = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["error"]
        assert error["param"] == "messages[0].content[1]" and "takes no images" in error["message"], error
        body["messages"] = [{"role": "user", "content": [text_part("hi")]}]
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()


def test_an_image_the_vision_tower_refuses_fails_its_request_alone():
    """A processor whose output the vision tower cannot read (one patch short) for one request: that
    request fails (a 500 in OpenAI's shape), the others in flight finish as plain generate's."""
    model, processor = vlm("qwen2_vl")

    class Breaking:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, text, **kwargs):
            out = self.inner(*args, text=text, **kwargs)
            if "BREAK" in text[0]:
                out["pixel_values"] = out["pixel_values"][:-1]
            return out

    server = InProcessServer("tiny-qwen2-vl", model, processor.tokenizer, Breaking(processor))
    good = [[{"role": "user", "content": [image_part(i), text_part(f"fine {i}")]}] for i in range(2)]
    bad = [{"role": "user", "content": [image_part(7), text_part("BREAK")]}]

    long = 80  # tokens: the good requests are still running when the bad one is admitted

    async def ask(messages, delay):
        await asyncio.sleep(delay)
        async with client(server.url, openai.AsyncOpenAI) as api:
            try:
                out = await api.chat.completions.create(
                    model=server.name, messages=messages, max_tokens=long, temperature=0
                )
            except openai.InternalServerError as err:
                return err.status_code
            return out.choices[0].message.content

    async def run():
        return await asyncio.gather(ask(good[0], 0), ask(bad, 0.1), ask(good[1], 0.1))

    try:
        first, failed, second = asyncio.run(run())
        assert failed == 500
        assert [first, second] == [reference(model, processor, m, long) for m in good]
    finally:
        server.stop()
