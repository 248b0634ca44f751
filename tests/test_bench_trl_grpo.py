"""launch/bench/bench_trl_grpo.py: TRL's GRPOTrainer side on a tiny random HF Llama (real TRL, real tokenizer,
real rule reward) and the ratio table over two measured sides."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "launch", "bench", "bench_trl_grpo.py")


def _bench_module():
    sys.path.insert(0, os.path.join(REPO, "launch", "bench"))
    spec = importlib.util.spec_from_file_location("bench_trl_grpo", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_hf_llama(out: str) -> str:
    """A random 2-layer Llama written by transformers, with SmolLM2's tokenizer files."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxrl_hf.models.pretrained import resolve_hf_dir

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    src = resolve_hf_dir("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), out)
    return out


@pytest.mark.slow
def test_trl_side_runs_grpo_steps_and_reports_stage_times(tmp_path):
    pytest.importorskip("trl", reason="TRL is the [bench] extra (pip install -e .[bench])")
    pytest.importorskip("datasets", reason="datasets is the [bench] extra (pip install -e .[bench])")
    model = _tiny_hf_llama(str(tmp_path / "tiny"))
    out = tmp_path / "trl.json"
    steps, prompts, samples, new_tokens = 2, 2, 2, 6
    proc = subprocess.run([sys.executable, BENCH, "--side", "trl", "--model", model, "--steps", str(steps),
                           "--prompts", str(prompts), "--samples", str(samples), "--response-length", str(new_tokens),
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["prompt_rows"] == steps * prompts and "ours" not in result
    trl = result["trl"]
    assert trl["torch_threads"] == os.cpu_count()
    assert [s["step"] for s in trl["steps"]] == [1, 2] and trl["steady"]["steps_measured"] == [2]
    for s in trl["steps"]:
        parts = s["gen_s"] + s["reward_s"] + s["other_s"] + s["update_s"]
        assert 0 < s["gen_s"] < s["step_s"] and s["update_s"] > 0 and s["old_log_prob_s"] == 0.0
        assert parts == pytest.approx(s["step_s"], rel=1e-6)
        # the step's prompts (rows in order, each sampled `samples` times) plus 1..new_tokens per completion
        rollouts = prompts * samples
        prompt_total = samples * sum(trl["prompt_tokens"][(s["step"] - 1) * prompts:s["step"] * prompts])
        assert prompt_total + rollouts <= s["tokens"] <= prompt_total + new_tokens * rollouts
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["step_s"])
        assert 1 <= s["response_length_mean"] <= new_tokens and 0.0 <= s["reward_mean"] <= 1.0


def test_ratios_and_table_follow_the_measured_steps():
    bench = _bench_module()

    def side(step_times, gen_s, update_s, tokens, old=0.0):
        steps = [{"step": i + 1, "step_s": t, "gen_s": gen_s, "reward_s": 0.01, "old_log_prob_s": old,
                  "update_s": update_s, "other_s": t - gen_s - update_s - old - 0.01, "tokens": tokens,
                  "tokens_per_s": tokens / t} for i, t in enumerate(step_times)]
        return {"steps": steps}

    # step 1 is warm-up; step 3 of TRL was slowed by another job on the machine (an outlier)
    ours, theirs = side([30.0, 10.0, 10.0, 10.0], 6.0, 3.0, 1000, old=0.5), side([9.0, 5.0, 25.0, 5.0], 2.0, 2.5, 1000)
    mo, mt = bench.steady_mean(ours), bench.steady_mean(theirs)
    assert mo["steps_measured"] == [2, 3, 4] and mo["step_s"] == pytest.approx(10.0)
    assert mt["step_s"] == pytest.approx(5.0) and mt["mean"]["step_s"] == pytest.approx(35.0 / 3)
    assert mt["mean"]["tokens_per_s"] == pytest.approx(3000 / 35.0) and mt["fastest_step"]["step"] == 2
    ratio = bench.compare(mo, mt)
    assert ratio["step_s"] == pytest.approx(2.0) and ratio["gen_s"] == pytest.approx(3.0)
    assert ratio["tokens_per_s"] == pytest.approx(0.5) and ratio["old_log_prob_s"] is None
    table = bench.format_table({"ours": {"steady": mo}, "trl": {"steady": mt}, "ratio_ours_over_trl": ratio})
    assert ratio["fastest_step_s"] == pytest.approx(2.0) and "| step, fastest steady step | 10.000 | 5.000 | 2.00 |" in table
    assert "| **step** | 10.000 | 5.000 | 2.00 |" in table and "| **tokens/s** | 100.0 | 200.0 | 0.50 |" in table
