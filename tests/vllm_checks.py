"""The vLLM side of tests/test_vllm.py: run inside vLLM's environment (``.venv-vllm/bin/python``),
one check per call, printing ``RESULT {json}`` for the test to judge. Not collected by pytest.

    .venv-vllm/bin/python tests/vllm_checks.py exactness '{"model": "/path/to/smollm2"}'

vLLM spawns its engine in another process, so everything that builds an ``LLM`` runs under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PROPOSER = "lookahead.vllm.LookaheadProposer"

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import math\n\n\ndef area_of_circle(radius):",
    "# Sort a list of numbers with bubble sort\ndef bubble_sort(numbers):",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
    "Write a list of the first ten prime numbers, one per line:\n",
    "The three primary colours are",
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, COUNT(*) FROM orders",
    "Explain in two sentences why the sky is blue.",
]


def speculative(k: int = 5) -> dict:
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


def make_llm(model: str, spec: dict | None, **kwargs):
    from vllm import LLM

    options = dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0, max_num_seqs=8)
    options.update(kwargs)
    return LLM(model=model, speculative_config=spec, disable_log_stats=False, **options)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm


def greedy_tokens(llm, prompts: list[str], lengths: list[int]) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def accepted_tokens(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"))


def exactness(model: str) -> dict:
    """Greedy tokens with and without the proposer: each prompt alone, then 8 at once with
    staggered lengths; then sampled requests with seeds, mixed with greedy ones."""
    from vllm import SamplingParams

    staggered = [16 + 8 * i for i in range(8)]  # rows finish one by one: the batch is condensed
    result: dict = {"prompts": len(PROMPTS), "alone": {}, "batched": {}}
    for name, spec in (("plain", None), ("lookahead", speculative())):
        llm = make_llm(model, spec)
        result["alone"][name] = [greedy_tokens(llm, [p], [40])[0] for p in PROMPTS]
        result["batched"][name] = greedy_tokens(llm, PROMPTS[:8], staggered)
        # 6 sampled requests with seeds beside 2 greedy ones, every row 32 tokens (the same batch in both)
        sampled = [
            SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=32, ignore_eos=True) for s in range(6)
        ]
        greedy = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) for _ in range(2)]
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:8], sampled + greedy, use_tqdm=False)]
        result.setdefault("mixed_greedy", {})[name] = tokens[6:]
        if spec is not None:
            result["accepted_tokens"] = accepted_tokens(llm)
            result["sampled"] = {"tokens": tokens[:6], "lengths": [32] * 6}
            result["sampled"]["vocab"] = llm.llm_engine.model_config.get_vocab_size()
        close(llm)
    return result


def tensor_parallel(model: str) -> dict:
    """The proposer's greedy tokens at tensor_parallel_size 1 and 2 (run with
    VLLM_CPU_OMP_THREADS_BIND="0|1": one core per rank)."""
    tokens = {}
    for tp in (1, 2):
        llm = make_llm(model, speculative(), tensor_parallel_size=tp, max_num_seqs=4)
        tokens[tp] = greedy_tokens(llm, PROMPTS[:4], [32] * 4)
        accepted = accepted_tokens(llm)
        close(llm)
    return {"tp1": tokens[1], "tp2": tokens[2], "accepted_tokens_tp2": accepted}


def imports() -> dict:
    import transformers

    import lookahead.vllm

    cls = lookahead.vllm.LookaheadProposer
    return {
        "proposer": f"{cls.__module__}.{cls.__name__}",
        "decoding_loaded": "lookahead.decoding" in sys.modules,
        "transformers": transformers.__version__,
    }


def serve(model: str, port: int, spec: dict | None, extra: list[str] = ()) -> subprocess.Popen:
    """vLLM's OpenAI server on 127.0.0.1:port, by its module path (``vllm serve`` of the vllm-cpu
    distribution fails: its CLI looks up a distribution named ``vllm``); returns once it answers."""
    import httpx

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024"]
    command += ["--enforce-eager", "--max-num-seqs", "8", "--seed", "0", *extra]
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("the server did not answer within 600 s")


def stop(server: subprocess.Popen) -> bool:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    return server.returncode is not None


def server_check(model: str, port: int) -> dict:
    """8 concurrent completions through the openai client, one streamed chat against the same
    unstreamed, then the server is stopped."""
    import openai

    server = serve(model, port, speculative())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

        def complete(prompt: str) -> str:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
            return out.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, PROMPTS[:8]))
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        stopped = stop(server)
    return {
        "completions": len(texts),
        "lengths": [len(t) for t in texts],
        "streamed_equals_unstreamed": streamed == whole.choices[0].message.content and bool(streamed),
        "stopped": stopped,
    }


CHECKS = {
    "imports": imports,
    "exactness": exactness,
    "server": server_check,
    "tensor_parallel": tensor_parallel,
}

if __name__ == "__main__":
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print("RESULT " + json.dumps(CHECKS[name](**args)), flush=True)
