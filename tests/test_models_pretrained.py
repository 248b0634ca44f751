"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loader.

Loads the real model once per module: converts the GGUF into a fresh cache dir (the real
conversion path), then compares logits, greedy generations, tokenizer and chat template.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl_hf.models import load_pretrained  # noqa: E402
from jaxrl_hf.models.pretrained import KNOWN_MODELS, locate_package_gguf  # noqa: E402
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is 7+5?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 23+19?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count from 1 to 5."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("package gguf not installed")
    return locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)


@pytest.fixture(scope="module")
def lm(tmp_path_factory, gguf_path):
    cache = str(tmp_path_factory.mktemp("jaxrl_hf_cache"))
    return load_pretrained("smollm2-135m-instruct", cache_dir=cache)


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.eval()


def _prompt_ids(lm, chat):
    return lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)


def test_logits_match_transformers_gguf_loader(lm, hf_gguf_model):
    assert type(hf_gguf_model).__name__ == "LlamaForCausalLM"
    for chat in CHATS[:2]:  # each new length compiles the 135M forward: keep CI time low
        ids = np.asarray([_prompt_ids(lm, chat)])
        ours = lm.logits(ids)
        assert ours.dtype == np.float32 and ours.shape == (1, ids.shape[1], 49152)
        with torch.no_grad():
            ref = hf_gguf_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
        assert np.abs(ours - ref).max() <= 1e-3


def test_greedy_generation_token_identical_to_transformers(lm, hf_gguf_model):
    engine = JaxGenerationEngine(lm.config, lm.params, pad_token_id=lm.tokenizer.pad_token_id,
                                 eos_token_ids=lm.config.eos_token_ids)
    prompts = [_prompt_ids(lm, chat) for chat in CHATS[:3]]
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=40))
    eos = lm.config.eos_token_ids[0]
    compared = 0
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_gguf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                         eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].numpy()
        ours = out.response_ids[row][out.response_mask[row] > 0]
        assert list(ours) == list(ref), (row, lm.tokenizer.decode(ours), lm.tokenizer.decode(ref))
        compared += len(ours)
    assert "12" in lm.tokenizer.decode(out.response_ids[0])
    assert max(out.response_mask.sum(1)) >= 32 and compared >= 50


def test_cached_dir_loads_in_transformers_and_tokenizer_matches(lm):
    assert sorted(os.listdir(lm.path)) == ["config.json", "generation_config.json", "model.safetensors",
                                           "tokenizer.json", "tokenizer_config.json"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(lm.path)
    texts = ["Hello world!", "What is 23+19?\n\n  ok", "  leading spaces and 1234567 digits", "émoji 🤖 ünïcode",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert lm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert lm.tokenizer.decode(lm.tokenizer.encode(text), skip_special_tokens=False) == text
    for chat in CHATS:
        for gen in (True, False):
            assert lm.tokenizer.apply_chat_template(chat, add_generation_prompt=gen) == \
                hf_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32).eval()
    ids = np.asarray([_prompt_ids(lm, CHATS[0])])
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(lm.logits(ids) - ref).max() <= 1e-3


def test_tokenizer_matches_transformers_gguf_tokenizer(lm, gguf_path):
    """transformers' GGUF tokenizer lacks SmolLM's digit pre-split (llama.cpp 'smollm'); equal elsewhere."""
    hf_tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                        gguf_file=os.path.basename(gguf_path))
    for text in ["What is 23+19?", "The answer is 42.", "Hello, world!\nNew line.", "x = 3.14 * r ** 2"]:
        assert lm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    for chat in CHATS:
        assert lm.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
            hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    # Where they differ ("  12": two spaces before digits), ours follows llama.cpp's smollm pre-tokenizer:
    # digits split off first, so the two spaces merge into one token.
    assert lm.tokenizer.encode("a  12") == [lm.tokenizer.token_to_id(t) for t in ["a", "ĠĠ", "1", "2"]]


def test_second_load_uses_cache(lm):
    before = os.path.getmtime(os.path.join(lm.path, "model.safetensors"))
    again = load_pretrained("smollm2-135m-instruct", cache_dir=os.path.dirname(lm.path))
    assert again.path == lm.path
    assert os.path.getmtime(os.path.join(lm.path, "model.safetensors")) == before
    assert not [n for n in os.listdir(os.path.dirname(lm.path)) if n.startswith(".tmp-")]


def test_unknown_model_error():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        load_pretrained("no-such-model")
